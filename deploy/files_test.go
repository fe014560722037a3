package deploy_test

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/node"
	"github.com/kvmesh/kvmesh/sync/trust"
)

// overlays are the kustomize overlays under kubernetes/overlays.
var overlays = []string{"dev", "prod"}

// gatewayConfigs are every gateway YAML config the deploy files mount.
var gatewayConfigs = []string{
	"compose/kvmesh.yaml",
	"kubernetes/base/kvmesh.yaml",
	"kubernetes/overlays/dev/kvmesh.yaml",
	"kubernetes/overlays/prod/kvmesh.yaml",
	"kubernetes/overlays/gie/kvmesh.yaml",
}

func TestYAMLAndJSONFilesParse(t *testing.T) {
	n := 0
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		switch filepath.Ext(path) {
		case ".yaml", ".yml":
			if len(readYAMLFile(t, path)) == 0 {
				t.Errorf("%s: no YAML document", path)
			}
			n++
		case ".json":
			data, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			if !json.Valid(data) {
				t.Errorf("%s: invalid JSON", path)
			}
			n++
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n < 20 {
		t.Fatalf("found only %d YAML/JSON files under deploy/", n)
	}
}

// composeArgvs returns, per compose service running the kvmesh image, its
// command.
func composeArgvs(t *testing.T) map[string][]string {
	t.Helper()
	doc := readYAMLFile(t, "compose.yaml")[0]
	services, _ := doc["services"].(map[string]any)
	if len(services) == 0 {
		t.Fatal("compose.yaml: no services")
	}
	out := map[string][]string{}
	for name, v := range services {
		svc, _ := v.(map[string]any)
		image, _ := svc["image"].(string)
		if !strings.Contains(image, "kvmesh") {
			continue
		}
		switch cmd := svc["command"].(type) {
		case []any:
			out[name] = toStrings(t, "compose "+name, cmd)
		default:
			t.Errorf("compose service %s: command must be a list (the image has no shell), got %T", name, cmd)
		}
	}
	return out
}

func toStrings(t *testing.T, where string, v []any) []string {
	t.Helper()
	out := make([]string, 0, len(v))
	for _, x := range v {
		s, ok := x.(string)
		if !ok {
			t.Errorf("%s: %v is a %T, want a string", where, x, x)
		}
		out = append(out, s)
	}
	return out
}

// containers walks any YAML tree and returns every container (maps under
// "containers" or "initContainers" lists).
func containers(v any) []map[string]any {
	var out []map[string]any
	switch x := v.(type) {
	case map[string]any:
		for k, c := range x {
			if list, ok := c.([]any); ok && (k == "containers" || k == "initContainers") {
				for _, e := range list {
					if m, ok := e.(map[string]any); ok {
						out = append(out, m)
					}
				}
				continue
			}
			out = append(out, containers(c)...)
		}
	case []any:
		for _, c := range x {
			out = append(out, containers(c)...)
		}
	}
	return out
}

// containerArgvs returns command+args of every container in docs that runs
// one of our binaries or the kvmesh image.
func containerArgvs(t *testing.T, source string, docs []map[string]any) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, doc := range docs {
		for _, c := range containers(doc) {
			name, _ := c["name"].(string)
			cmd, _ := c["command"].([]any)
			args, _ := c["args"].([]any)
			image, _ := c["image"].(string)
			if cmd == nil && args == nil {
				if image != "" && strings.Contains(image, "kvmesh") {
					t.Errorf("%s: container %s runs the kvmesh image without a command", source, name)
				}
				continue // a strategic-merge patch of resources only
			}
			where := source + " container " + name
			out[where] = append(toStrings(t, where, cmd), toStrings(t, where, args)...)
		}
	}
	return out
}

// kustomize renders a kustomization with kubectl's built-in kustomize, or
// skips when kubectl is not installed.
func kustomize(t *testing.T, dir string) []map[string]any {
	t.Helper()
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Skip("kubectl not installed: kustomize overlays not rendered (apt-get install kubectl, or any kubectl >= 1.27)")
	}
	out, err := exec.Command(kubectl, "kustomize", dir).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("kubectl kustomize %s: %v\n%s", dir, err, stderr)
	}
	return readYAMLDocs(t, dir, out)
}

func TestManifestFlagsExist(t *testing.T) {
	flags := flagsOf(t)
	if len(flags["kvmesh serve"]) < 10 || len(flags["vllmsim"]) < 10 {
		t.Fatalf("help parsing found too few flags: %v", flags)
	}
	all := composeArgvs(t)
	if len(all) < 5 {
		t.Fatalf("compose.yaml: %d services run our image, want gateways and engines", len(all))
	}
	err := filepath.WalkDir("kubernetes", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || filepath.Ext(path) != ".yaml" || filepath.Base(path) == "kvmesh.yaml" {
			return err
		}
		for k, v := range containerArgvs(t, path, readYAMLFile(t, path)) {
			all[k] = v
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := exec.LookPath("kubectl"); err == nil {
		for _, o := range overlays {
			dir := filepath.Join("kubernetes", "overlays", o)
			for k, v := range containerArgvs(t, "rendered "+dir, kustomize(t, dir)) {
				all[k] = v
			}
		}
	} else {
		t.Log("kubectl not installed: rendered overlays not checked (raw manifests are)")
	}
	bins := map[string]int{}
	for where, argv := range all {
		if err := checkArgv(flags, argv); err != nil {
			t.Errorf("%s: %v", where, err)
		}
		if len(argv) > 0 {
			bins[filepath.Base(argv[0])]++
		}
	}
	if bins["kvmesh"] < 4 || bins["vllmsim"] < 3 {
		t.Errorf("commands checked per binary = %v: expected compose and Kubernetes gateways and engines", bins)
	}
}

// TestREADMECommandsExist: every command of our binaries that README.md
// shows in a code block parses (flags exist, subcommands exist).
func TestREADMECommandsExist(t *testing.T) {
	flags := flagsOf(t)
	data, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	inCode := false
	for line := range strings.Lines(string(data)) {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inCode = !inCode
			continue
		}
		i := strings.Index(line, "/usr/local/bin/")
		if !inCode || i < 0 {
			continue
		}
		argv := strings.Fields(strings.TrimSuffix(strings.TrimSpace(line[i:]), "\\"))
		if err := checkArgv(flags, argv); err != nil {
			t.Errorf("README.md: %s: %v", strings.TrimSpace(line), err)
		}
		n++
	}
	if n < 4 {
		t.Errorf("checked %d README commands, want the compose and kubectl admin commands", n)
	}
}

// TestCheckArgvCatchesMistakes proves the flag check can fail.
func TestCheckArgvCatchesMistakes(t *testing.T) {
	flags := flagsOf(t)
	good := [][]string{
		{"/usr/local/bin/kvmesh", "serve", "--config=/etc/kvmesh/kvmesh.yaml", "--log-format", "json"},
		{"/usr/local/bin/kvmesh", "serve", "--retry-connect-failures", "--strategy=cost"},
		{"/usr/local/bin/vllmsim", "qwen", "--port=8000", "--enable-reset-endpoint", "--kv-events-config", "{}"},
		{"/usr/local/bin/kvmesh", "config", "get", "--token-file", "/t"},
	}
	for _, argv := range good {
		if err := checkArgv(flags, argv); err != nil {
			t.Errorf("checkArgv(%q) = %v, want nil", argv, err)
		}
	}
	bad := [][]string{
		{"/usr/local/bin/kvmesh", "serve", "--no-such-flag=1"},
		{"/usr/local/bin/kvmesh", "serve", "--config"},
		{"/usr/local/bin/kvmesh", "serve", "extra"},
		{"/usr/local/bin/kvmesh", "--config=x"},
		{"/usr/local/bin/kvmesh", "launch"},
		{"kvmesh", "serve"},
		{"/usr/local/bin/vllmsim", "--kv-events", "{}"},
		{"/usr/local/bin/vllmsim", "-port", "8000"},
		{"/usr/local/bin/vllmsim", "model", "other"},
		{"/usr/local/bin/nats-server", "-js"},
		{"/usr/local/bin/kvmesh", "config", "get", "--no-such-flag"},
		{"/usr/local/bin/kvmesh", "config", "drop"},
	}
	for _, argv := range bad {
		if err := checkArgv(flags, argv); err == nil {
			t.Errorf("checkArgv(%q) = nil, want an error", argv)
		}
	}
}

func TestGatewayConfigsValidate(t *testing.T) {
	for _, path := range gatewayConfigs {
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := node.ParseConfigYAML(data, node.DefaultConfig())
		if err != nil {
			t.Errorf("%s: %v", path, err)
			continue
		}
		if err := cfg.Validate(); err != nil {
			t.Errorf("%s: %v", path, err)
		}
		if cfg.HTTPAddr != ":8080" {
			t.Errorf("%s: http_addr %q, the manifests expose 8080", path, cfg.HTTPAddr)
		}
	}
}

// TestGatewayConfigKeysInReference: every key the example gateway files
// use is a row of the generated reference (docs/config.md), so the files'
// comments can send readers there and a renamed knob fails here.
func TestGatewayConfigKeysInReference(t *testing.T) {
	ref, err := os.ReadFile("../docs/config.md")
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]bool{}
	for line := range strings.Lines(string(ref)) {
		if k, ok := strings.CutPrefix(line, "| `"); ok {
			k, _, _ = strings.Cut(k, "`")
			keys[k] = true
		}
	}
	if !keys["strategy"] || !keys["models[].replicas[].url"] {
		t.Fatalf("docs/config.md has no gateway key table (%d keys)", len(keys))
	}
	var walk func(path, prefix string, v any)
	walk = func(path, prefix string, v any) {
		switch x := v.(type) {
		case map[string]any:
			for k, sub := range x {
				key := prefix + k
				if !keys[key] && !keys[key+"[]"] {
					t.Errorf("%s: key %q is not in docs/config.md", path, key)
					continue
				}
				walk(path, key+".", sub)
			}
		case []any:
			for _, e := range x {
				walk(path, strings.TrimSuffix(prefix, ".")+"[].", e)
			}
		}
	}
	for _, path := range gatewayConfigs {
		for _, doc := range readYAMLFile(t, path) {
			walk(path, "", doc)
		}
	}
}

// replicaNames lists a gateway config's replica names in order.
func replicaNames(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := node.ParseConfigYAML(data, node.DefaultConfig())
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	var names []string
	for _, m := range cfg.Models {
		for _, r := range m.Replicas {
			names = append(names, r.Name)
		}
	}
	return names
}

// TestReplicaLabelsMatchGatewayConfig: engine series carry replica=<the
// gateway's replica name>, or the dashboard's per-replica panels split.
func TestReplicaLabelsMatchGatewayConfig(t *testing.T) {
	prom := readYAMLFile(t, "prometheus/prometheus.yml")[0]
	var labels []string
	jobs := map[string]bool{}
	for _, sc := range prom["scrape_configs"].([]any) {
		sc := sc.(map[string]any)
		jobs[sc["job_name"].(string)] = true
		if sc["job_name"] != "vllm" {
			continue
		}
		for _, st := range sc["static_configs"].([]any) {
			l, _ := st.(map[string]any)["labels"].(map[string]any)
			r, _ := l["replica"].(string)
			labels = append(labels, r)
		}
	}
	if !jobs["kvmesh"] {
		t.Error(`prometheus.yml: no job "kvmesh" (the KvmeshGatewayDown alert selects up{job="kvmesh"})`)
	}
	if want := replicaNames(t, "compose/kvmesh.yaml"); !slices.Equal(labels, want) {
		t.Errorf("prometheus.yml engine replica labels %q, compose gateway replicas %q", labels, want)
	}
	composeServices := readYAMLFile(t, "compose.yaml")[0]["services"].(map[string]any)
	for _, r := range replicaNames(t, "compose/kvmesh.yaml") {
		if _, ok := composeServices[r]; !ok {
			t.Errorf("compose gateway replica %q has no compose service", r)
		}
	}
	// Dev: replica names are the vllmsim pod names (the PodMonitor copies the
	// pod name into the replica label).
	var engines map[string]any
	for _, d := range readYAMLFile(t, "kubernetes/overlays/dev/engines.yaml") {
		if d["kind"] == "StatefulSet" {
			engines = d
		}
	}
	if engines == nil {
		t.Fatal("dev engines.yaml: no StatefulSet")
	}
	n := engines["spec"].(map[string]any)["replicas"].(int)
	var pods []string
	for i := range n {
		pods = append(pods, fmt.Sprintf("%s-%d", engines["metadata"].(map[string]any)["name"], i))
	}
	if got := replicaNames(t, "kubernetes/overlays/dev/kvmesh.yaml"); !slices.Equal(got, pods) {
		t.Errorf("dev gateway replicas %q, engine pods %q", got, pods)
	}
}

// TestEngineKVEventsConfigDecodes: the --kv-events-config JSON given to
// vllmsim is what the simulator accepts (unknown fields are refused).
func TestEngineKVEventsConfigDecodes(t *testing.T) {
	argvs := composeArgvs(t)
	for k, v := range containerArgvs(t, "dev engines", readYAMLFile(t, "kubernetes/overlays/dev/engines.yaml")) {
		argvs[k] = v
	}
	n := 0
	for where, argv := range argvs {
		for i, a := range argv {
			val, ok := "", false
			switch {
			case strings.HasPrefix(a, "--kv-events-config="):
				val, ok = strings.TrimPrefix(a, "--kv-events-config="), true
			case a == "--kv-events-config" && i+1 < len(argv):
				val, ok = argv[i+1], true
			}
			if !ok {
				continue
			}
			n++
			cfg := sim.DefaultConfig()
			dec := json.NewDecoder(bytes.NewReader([]byte(val)))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&cfg.KVEvents); err != nil {
				t.Errorf("%s: --kv-events-config: %v", where, err)
				continue
			}
			if err := cfg.Validate(); err != nil {
				t.Errorf("%s: %v", where, err)
			}
			if !cfg.KVEvents.EnableKVCacheEvents || !strings.HasSuffix(cfg.KVEvents.Endpoint, ":5557") ||
				!strings.HasSuffix(cfg.KVEvents.ReplayEndpoint, ":5558") {
				t.Errorf("%s: KV events %+v: want enabled on :5557 with replay on :5558 (the gateway configs use those ports)", where, cfg.KVEvents)
			}
		}
	}
	if n < 3 {
		t.Errorf("found %d --kv-events-config values, want compose engine-a, engine-b and the dev engines", n)
	}
}

// flagValue returns the value of --name=v or --name v in argv.
func flagValue(argv []string, name string) (string, bool) {
	for i, a := range argv {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
		if a == "--"+name && i+1 < len(argv) {
			return argv[i+1], true
		}
	}
	return "", false
}

// shutdownGrace is the longest a gateway takes to exit after SIGTERM for
// argv and its config file: the drain grace plus, in cluster mode, the
// bounded gossip leave.
func shutdownGrace(t *testing.T, argv []string, configPath string) time.Duration {
	t.Helper()
	data, err := os.ReadFile(configPath)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := node.ParseConfigYAML(data, node.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	grace := cfg.ShutdownGrace
	if v, ok := flagValue(argv, "shutdown-grace"); ok {
		if grace, err = time.ParseDuration(v); err != nil {
			t.Fatalf("--shutdown-grace %q: %v", v, err)
		}
	}
	if cfg.Cluster.Active() {
		grace += cfg.Cluster.LeaveTimeout
	}
	return grace
}

func TestComposeShutdownTiming(t *testing.T) {
	services := readYAMLFile(t, "compose.yaml")[0]["services"].(map[string]any)
	for name, argv := range composeArgvs(t) {
		if filepath.Base(argv[0]) != "kvmesh" {
			continue
		}
		grace := shutdownGrace(t, argv, composeGatewayConfig(t, services[name].(map[string]any)))
		sgp, _ := services[name].(map[string]any)["stop_grace_period"].(string)
		stop, err := time.ParseDuration(sgp)
		if err != nil {
			t.Errorf("compose %s: stop_grace_period %q: %v", name, sgp, err)
			continue
		}
		if stop < grace+5*time.Second {
			t.Errorf("compose %s: stop_grace_period %v < shutdown grace (+ leave timeout) %v + 5s: docker would SIGKILL draining streams", name, stop, grace)
		}
	}
}

// composeGatewayConfig returns the host path of the file a compose
// gateway service mounts at /etc/kvmesh/kvmesh.yaml (relative to deploy/).
func composeGatewayConfig(t *testing.T, svc map[string]any) string {
	t.Helper()
	for _, v := range svc["volumes"].([]any) {
		src, dst, _ := strings.Cut(v.(string), ":")
		if strings.HasPrefix(dst, "/etc/kvmesh/kvmesh.yaml") {
			return filepath.Clean(src)
		}
	}
	t.Fatalf("compose service mounts no /etc/kvmesh/kvmesh.yaml: %v", svc["volumes"])
	return ""
}

// TestComposeCluster: the three compose gateways form one cluster. Each
// has its service name as host name (its node id: the config sets none),
// the config joins all gateways, uses the compose NATS, finds the token and
// gossip key where compose mounts its secrets and keeps raft data on a
// volume of its own.
func TestComposeCluster(t *testing.T) {
	doc := readYAMLFile(t, "compose.yaml")[0]
	services := doc["services"].(map[string]any)
	var gateways []string
	for name, argv := range composeArgvs(t) {
		if filepath.Base(argv[0]) == "kvmesh" {
			gateways = append(gateways, name)
		}
	}
	slices.Sort(gateways)
	if len(gateways) != 3 {
		t.Fatalf("compose gateways %q, want 3", gateways)
	}
	var wantJoin []string
	for _, g := range gateways {
		wantJoin = append(wantJoin, g+":7946")
	}
	dataVolumes := map[string]string{}
	for _, name := range gateways {
		svc := services[name].(map[string]any)
		path := composeGatewayConfig(t, svc)
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := node.ParseConfigYAML(data, node.DefaultConfig())
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		c := cfg.Cluster
		if !c.Enabled || c.NoSync {
			t.Errorf("%s: cluster mode off", path)
		}
		if c.NodeID != "" || c.AdvertiseAddr != "" || svc["hostname"] != name {
			t.Errorf("%s: node_id %q, advertise_addr %q, hostname %v: want the host name %q as node id and the container IP advertised",
				path, c.NodeID, c.AdvertiseAddr, svc["hostname"], name)
		}
		join := slices.Clone(c.Join)
		slices.Sort(join)
		if !slices.Equal(join, wantJoin) {
			t.Errorf("%s: join %q, want %q", path, c.Join, wantJoin)
		}
		if c.BootstrapExpect != len(gateways) {
			t.Errorf("%s: bootstrap_expect %d, want %d", path, c.BootstrapExpect, len(gateways))
		}
		if c.NATSURL != "" { // "" = embedded NATS, authenticated by the cluster key
			u, err := url.Parse(c.NATSURL)
			if err != nil || u.Scheme != "nats" || services[u.Hostname()] == nil {
				t.Errorf("%s: nats_url %q names no compose service", path, c.NATSURL)
			}
		}
		for _, v := range svc["volumes"].([]any) {
			src, dst, _ := strings.Cut(v.(string), ":")
			if dst == c.DataDir {
				if other, ok := dataVolumes[src]; ok {
					t.Errorf("%s and %s share the raft volume %s", name, other, src)
				}
				dataVolumes[src] = name
				if _, ok := get(doc, "volumes").(map[string]any)[src]; !ok {
					t.Errorf("%s: data volume %q is not a named volume", name, src)
				}
			}
		}
		for file, check := range map[string]func([]byte) error{
			c.AdminTokenFile: func(b []byte) error {
				if strings.TrimSpace(string(b)) == "" {
					return errors.New("empty token")
				}
				return nil
			},
			c.ClusterKeyFile: func(b []byte) error {
				_, err := trust.ParseKeys(string(b))
				return err
			},
		} {
			secret, ok := strings.CutPrefix(file, "/run/secrets/")
			if !ok || !slices.Contains(svc["secrets"].([]any), any(secret)) {
				t.Errorf("%s: %q is not a secret compose mounts for %s", path, file, name)
				continue
			}
			src, _ := get(doc, "secrets", secret, "file").(string)
			b, err := os.ReadFile(src)
			if err != nil {
				t.Errorf("secret %s: %v", secret, err)
				continue
			}
			if err := check(b); err != nil {
				t.Errorf("secret %s (%s): %v", secret, src, err)
			}
		}
	}
	if len(dataVolumes) != len(gateways) {
		t.Errorf("raft data volumes %v: want one per gateway at cluster.data_dir", dataVolumes)
	}
}

// byKind indexes rendered objects by kind and name.
func byKind(docs []map[string]any) map[string]map[string]map[string]any {
	out := map[string]map[string]map[string]any{}
	for _, d := range docs {
		kind, _ := d["kind"].(string)
		name, _ := d["metadata"].(map[string]any)["name"].(string)
		if out[kind] == nil {
			out[kind] = map[string]map[string]any{}
		}
		out[kind][name] = d
	}
	return out
}

// get walks a YAML tree by map keys.
func get(v any, keys ...string) any {
	for _, k := range keys {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[k]
	}
	return v
}

// selects reports whether selector (matchLabels or a Service selector)
// matches labels.
func selects(selector, labels any) bool {
	sel, _ := selector.(map[string]any)
	lab, _ := labels.(map[string]any)
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if lab[k] != v {
			return false
		}
	}
	return true
}

func TestKubernetesOverlays(t *testing.T) {
	for _, o := range overlays {
		t.Run(o, func(t *testing.T) {
			docs := kustomize(t, filepath.Join("kubernetes", "overlays", o))
			objs := byKind(docs)
			sts := objs["StatefulSet"]["kvmesh"]
			if sts == nil {
				t.Fatal("no StatefulSet kvmesh")
			}
			podLabels := get(sts, "spec", "template", "metadata", "labels")
			if !selects(get(sts, "spec", "selector", "matchLabels"), podLabels) {
				t.Error("StatefulSet selector does not match its pod labels")
			}
			// Peers: the headless Service named by serviceName.
			peers := objs["Service"][get(sts, "spec", "serviceName").(string)]
			if peers == nil {
				t.Fatalf("serviceName %v: no such Service", get(sts, "spec", "serviceName"))
			}
			if get(peers, "spec", "clusterIP") != "None" || get(peers, "spec", "publishNotReadyAddresses") != true {
				t.Error("peers Service must be headless and publish not-ready addresses")
			}
			// Client Service, PDB and ServiceMonitor select the gateways.
			client := objs["Service"]["kvmesh"]
			if client == nil || !selects(get(client, "spec", "selector"), podLabels) {
				t.Error("client Service kvmesh does not select the gateway pods")
			}
			pdb := objs["PodDisruptionBudget"]["kvmesh"]
			if pdb == nil || !selects(get(pdb, "spec", "selector", "matchLabels"), podLabels) {
				t.Error("PodDisruptionBudget does not select the gateway pods")
			}
			sm := objs["ServiceMonitor"]["kvmesh"]
			if sm == nil {
				t.Fatal("no ServiceMonitor kvmesh")
			}
			var monitored []string
			for name, svc := range objs["Service"] {
				if selects(get(sm, "spec", "selector", "matchLabels"), get(svc, "metadata", "labels")) {
					monitored = append(monitored, name)
				}
			}
			if !slices.Equal(monitored, []string{"kvmesh"}) {
				t.Errorf("ServiceMonitor selects Services %q, want only the client Service (job=kvmesh, each pod once)", monitored)
			}
			// The gateway container: config volume, ports, probes, shutdown timing.
			pod := get(sts, "spec", "template", "spec").(map[string]any)
			var gw map[string]any
			for _, c := range pod["containers"].([]any) {
				if c.(map[string]any)["name"] == "kvmesh" {
					gw = c.(map[string]any)
				}
			}
			if gw == nil {
				t.Fatal("no container kvmesh")
			}
			argv := append(toStrings(t, "gateway", gw["command"].([]any)), toStrings(t, "gateway", gw["args"].([]any))...)
			cfgPath, _ := flagValue(argv, "config")
			var cmName string
			for _, v := range pod["volumes"].([]any) {
				if n := get(v, "configMap", "name"); n != nil {
					cmName = n.(string)
				}
			}
			cm := objs["ConfigMap"][cmName]
			if cm == nil {
				t.Fatalf("config volume names ConfigMap %q, not rendered", cmName)
			}
			cfgText, _ := get(cm, "data", filepath.Base(cfgPath)).(string)
			cfg, err := node.ParseConfigYAML([]byte(cfgText), node.DefaultConfig())
			if err != nil {
				t.Fatalf("ConfigMap %s key %s: %v", cmName, filepath.Base(cfgPath), err)
			}
			if err := cfg.Validate(); err != nil {
				t.Errorf("rendered config: %v", err)
			}
			grace := cfg.ShutdownGrace
			if v, ok := flagValue(argv, "shutdown-grace"); ok {
				if grace, err = time.ParseDuration(v); err != nil {
					t.Fatal(err)
				}
			}
			sleep := 0
			if s, ok := get(gw, "lifecycle", "preStop", "sleep", "seconds").(int); ok {
				sleep = s
			}
			tgp, _ := pod["terminationGracePeriodSeconds"].(int)
			leave := time.Duration(0)
			if cfg.Cluster.Active() {
				leave = cfg.Cluster.LeaveTimeout
			}
			if need := time.Duration(sleep)*time.Second + grace + leave + 5*time.Second; time.Duration(tgp)*time.Second < need {
				t.Errorf("terminationGracePeriodSeconds %d < preStop %ds + shutdown grace %v + leave timeout %v + 5s", tgp, sleep, grace, leave)
			}
			ports := map[string]bool{}
			for _, p := range gw["ports"].([]any) {
				ports[get(p, "name").(string)] = true
			}
			for _, svc := range []map[string]any{client, peers} {
				for _, p := range get(svc, "spec", "ports").([]any) {
					if tp, ok := get(p, "targetPort").(string); ok && !ports[tp] {
						t.Errorf("Service %v targets port %q the container does not name", get(svc, "metadata", "name"), tp)
					}
				}
			}
			for _, probe := range []string{"startupProbe", "readinessProbe", "livenessProbe"} {
				path, _ := get(gw, probe, "httpGet", "path").(string)
				if !slices.Contains(probePathsServed, path) {
					t.Errorf("%s path %q: the live test only proves %q", probe, path, probePathsServed)
				}
			}
			if get(gw, "securityContext", "readOnlyRootFilesystem") != true || get(pod, "securityContext", "runAsNonRoot") != true {
				t.Error("gateway must run as non-root on a read-only root filesystem")
			}
			checkClusterWiring(t, objs, sts, gw, pod, cfg)
			// Engine scrapes label their series replica=<pod name>.
			if len(objs["PodMonitor"]) == 0 {
				t.Error("no PodMonitor for the engines: the dashboard's vllm:* panels would be empty")
			}
			for name, pm := range objs["PodMonitor"] {
				for _, ep := range get(pm, "spec", "podMetricsEndpoints").([]any) {
					ok := false
					for _, r := range get(ep, "relabelings").([]any) {
						src, _ := get(r, "sourceLabels").([]any)
						ok = ok || (get(r, "targetLabel") == "replica" && len(src) == 1 && src[0] == "__meta_kubernetes_pod_name")
					}
					if !ok {
						t.Errorf("PodMonitor %s: an endpoint does not set replica from the pod name", name)
					}
				}
			}
		})
	}
}

// checkClusterWiring checks the rendered StatefulSet against the cluster
// section of its config: every listener has a named container port the
// peers Service exposes, the join list is the StatefulSet's own pod names,
// the voters survive the PDB, raft data is on a claim, and the token and
// gossip key are files of the mounted Secret (rendered in dev, created by
// the operator in prod).
func checkClusterWiring(t *testing.T, objs map[string]map[string]map[string]any, sts, gw, pod map[string]any, cfg node.Config) {
	t.Helper()
	c := cfg.Cluster
	if !c.Enabled || c.NoSync {
		t.Fatal("cluster mode is off in the gateway config")
	}
	if c.NodeID != "" {
		t.Errorf("cluster.node_id %q: leave it empty so each pod uses its host name", c.NodeID)
	}
	containerPorts := map[string]string{} // "7946/TCP" → name
	for _, p := range gw["ports"].([]any) {
		proto, _ := get(p, "protocol").(string)
		if proto == "" {
			proto = "TCP"
		}
		containerPorts[fmt.Sprintf("%v/%s", get(p, "containerPort"), proto)] = get(p, "name").(string)
	}
	listeners := map[string]string{"gossip_addr": c.GossipAddr, "peer_addr": c.PeerAddr, "admin_addr": c.AdminAddr, "raft_addr": c.RaftAddr}
	if c.NATSURL == "" {
		listeners["nats_cluster_addr"] = c.NATSClusterAddr
	}
	peers := objs["Service"][get(sts, "spec", "serviceName").(string)]
	exposed := map[string]bool{}
	for _, p := range get(peers, "spec", "ports").([]any) {
		if tp, ok := get(p, "targetPort").(string); ok {
			exposed[tp] = true
		}
	}
	for key, addr := range listeners {
		host, port, err := net.SplitHostPort(addr)
		if err != nil {
			t.Errorf("cluster.%s %q: %v", key, addr, err)
			continue
		}
		if ip := net.ParseIP(host); ip == nil || !ip.IsUnspecified() {
			t.Errorf("cluster.%s %q must listen on every interface in a pod", key, addr)
		}
		protos := []string{"TCP"}
		if key == "gossip_addr" {
			protos = append(protos, "UDP") // memberlist probes over UDP
		}
		for _, proto := range protos {
			name, ok := containerPorts[port+"/"+proto]
			if !ok {
				t.Errorf("cluster.%s port %s/%s is not a container port", key, port, proto)
				continue
			}
			if !exposed[name] {
				t.Errorf("cluster.%s: the peers Service does not expose port %q", key, name)
			}
		}
	}
	replicas, _ := get(sts, "spec", "replicas").(int)
	var want []string
	for i := range replicas {
		want = append(want, fmt.Sprintf("%s-%d.%s:%s", get(sts, "metadata", "name"), i, get(sts, "spec", "serviceName"), gossipPort(t, c.GossipAddr)))
	}
	if !slices.Equal(c.Join, want) {
		t.Errorf("cluster.join %q, want the StatefulSet's pods %q", c.Join, want)
	}
	if c.BootstrapExpect > replicas {
		t.Errorf("bootstrap_expect %d > %d replicas: raft would never form", c.BootstrapExpect, replicas)
	}
	if pdb := objs["PodDisruptionBudget"]["kvmesh"]; pdb != nil {
		maxUnavailable, _ := get(pdb, "spec", "maxUnavailable").(int)
		if quorum := c.BootstrapExpect/2 + 1; c.BootstrapExpect-maxUnavailable < quorum {
			t.Errorf("PDB maxUnavailable %d can take the %d voters below quorum %d", maxUnavailable, c.BootstrapExpect, quorum)
		}
	}
	mounts := map[string]string{} // volume name → mount path
	for _, m := range gw["volumeMounts"].([]any) {
		mounts[get(m, "name").(string)] = get(m, "mountPath").(string)
	}
	claims := map[string]bool{}
	for _, vct := range get(sts, "spec", "volumeClaimTemplates").([]any) {
		claims[get(vct, "metadata", "name").(string)] = true
	}
	dataOnClaim := false
	for name, path := range mounts {
		dataOnClaim = dataOnClaim || (claims[name] && path == c.DataDir)
	}
	if !dataOnClaim {
		t.Errorf("cluster.data_dir %q is not a volumeClaimTemplate mount (mounts %v, claims %v)", c.DataDir, mounts, claims)
	}
	var secretName, secretPath string
	for _, v := range pod["volumes"].([]any) {
		if n, ok := get(v, "secret", "secretName").(string); ok {
			secretName, secretPath = n, mounts[get(v, "name").(string)]
		}
	}
	if secretName == "" || secretPath == "" {
		t.Fatal("no mounted Secret volume")
	}
	secret := objs["Secret"][secretName]
	if c.ClusterKeyFile == "" || c.Insecure {
		t.Error("cluster mode without cluster.cluster_key_file (or with insecure): the cluster ports would be open")
	}
	files := []string{c.AdminTokenFile, c.ClusterKeyFile}
	for _, f := range []string{c.NATSCredentialsFile, c.NATSTLS.CAFile, c.NATSTLS.CertFile, c.NATSTLS.KeyFile} {
		if f != "" {
			files = append(files, f)
		}
	}
	if c.NATSURL != "" && (c.NATSCredentialsFile == "" || !c.NATSTLS.Enabled()) {
		t.Errorf("external NATS %q without nats_credentials_file and nats_tls: anyone on it could feed the gateways deltas", c.NATSURL)
	}
	for _, file := range files {
		if filepath.Dir(file) != secretPath {
			t.Errorf("%q is not a file of the Secret volume mounted at %q", file, secretPath)
			continue
		}
		if secret == nil {
			continue // created by the operator (prod)
		}
		v, ok := get(secret, "data", filepath.Base(file)).(string)
		if !ok {
			t.Errorf("Secret %s has no key %q", secretName, filepath.Base(file))
			continue
		}
		raw, err := base64.StdEncoding.DecodeString(v)
		if err != nil {
			t.Fatal(err)
		}
		if file == c.ClusterKeyFile {
			if _, err := trust.ParseKeys(string(raw)); err != nil {
				t.Errorf("Secret %s cluster-key: %v", secretName, err)
			}
		}
	}
	if secret == nil && secretName != "kvmesh-secrets" {
		t.Errorf("Secret %q is neither rendered nor the documented kvmesh-secrets", secretName)
	}
	checkNetworkPolicy(t, objs, get(sts, "spec", "template", "metadata", "labels"))
}

// clusterPortNames are the gateway container ports only gateways may reach.
var clusterPortNames = []string{"gossip", "gossip-udp", "peer", "raft", "nats-route"}

// checkNetworkPolicy checks that a NetworkPolicy isolates the gateway pods
// (podLabels) and lets in, on each cluster port, only gateway pods, while
// the http port stays open.
func checkNetworkPolicy(t *testing.T, objs map[string]map[string]map[string]any, podLabels any) {
	t.Helper()
	var pol map[string]any
	for _, np := range objs["NetworkPolicy"] {
		if selects(get(np, "spec", "podSelector", "matchLabels"), podLabels) {
			pol = np
		}
	}
	if pol == nil {
		t.Error("no NetworkPolicy selects the gateway pods: any pod can reach their cluster ports")
		return
	}
	types, _ := get(pol, "spec", "policyTypes").([]any)
	if !slices.Contains(types, any("Ingress")) {
		t.Error("the gateways' NetworkPolicy does not restrict ingress")
	}
	allowed := map[string][]any{} // port name -> from lists (nil entry = from anywhere)
	for _, rule := range get(pol, "spec", "ingress").([]any) {
		from, _ := get(rule, "from").([]any)
		ports, _ := get(rule, "ports").([]any)
		if len(ports) == 0 {
			t.Error("an ingress rule without ports opens every port")
		}
		for _, p := range ports {
			name, ok := get(p, "port").(string)
			if !ok {
				t.Errorf("ingress port %v: use the container's port names", get(p, "port"))
				continue
			}
			allowed[name] = append(allowed[name], any(from))
		}
	}
	if len(allowed["http"]) == 0 {
		t.Error("the NetworkPolicy does not let clients reach the http port")
	}
	for _, port := range clusterPortNames {
		if len(allowed[port]) == 0 {
			t.Errorf("cluster port %s: gateways cannot reach each other", port)
		}
		for _, f := range allowed[port] {
			from, _ := f.([]any)
			if len(from) == 0 {
				t.Errorf("cluster port %s is open to every pod", port)
			}
			for _, peer := range from {
				if len(peer.(map[string]any)) != 1 || !selects(get(peer, "podSelector", "matchLabels"), podLabels) {
					t.Errorf("cluster port %s admits %v, not only gateway pods", port, peer)
				}
			}
		}
	}
}

func gossipPort(t *testing.T, addr string) string {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	return port
}

// probePathsServed are the probe paths TestLiveMetrics proves a running
// gateway answers with 200.
var probePathsServed = []string{"/health", "/ready"}

// promtool returns promtool's path or skips.
func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool not installed (Debian: apt-get install -y --no-install-recommends prometheus): rules not checked by promtool")
	}
	return p
}

func TestPromtool(t *testing.T) {
	bin := promtool(t)
	for _, args := range [][]string{
		{"check", "rules", "rules.yaml"},
		{"test", "rules", "rules_test.yaml"},
		{"check", "config", "prometheus.yml"},
	} {
		cmd := exec.Command(bin, args...)
		cmd.Dir = "prometheus"
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// dashboard is the parts of a Grafana dashboard the tests read.
type dashboard struct {
	UID        string `json:"uid"`
	Templating struct {
		List []struct {
			Name       string `json:"name"`
			Type       string `json:"type"`
			Query      any    `json:"query"`
			Definition string `json:"definition"`
		} `json:"list"`
	} `json:"templating"`
	Panels []dashPanel `json:"panels"`
}

type dashPanel struct {
	ID         int    `json:"id"`
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource *struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	GridPos struct{ H, W, X, Y int } `json:"gridPos"`
	Targets []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
}

func readDashboard(t *testing.T) dashboard {
	t.Helper()
	data, err := os.ReadFile("grafana/kvmesh.json")
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("grafana/kvmesh.json: %v", err)
	}
	return d
}

var labelValuesQuery = regexp.MustCompile(`^label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*[a-zA-Z_][a-zA-Z0-9_]*\s*\)$`)

// dashboardQueries returns every PromQL expression of the dashboard, keyed
// by panel title and refId, plus the metrics its variables read.
func dashboardQueries(t *testing.T) (map[string]string, []string) {
	t.Helper()
	d := readDashboard(t)
	exprs := map[string]string{}
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			exprs[p.Title+" / "+tg.RefID] = tg.Expr
		}
	}
	var varMetrics []string
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		m := labelValuesQuery.FindStringSubmatch(v.Definition)
		if m == nil {
			t.Fatalf("variable %s: definition %q is not label_values(metric, label)", v.Name, v.Definition)
		}
		varMetrics = append(varMetrics, m[1])
	}
	return exprs, varMetrics
}

// TestDashboardVariablesAndTiles: an operator filters by model, gateway and
// replica and sets the SLO; the first row holds stat tiles; no panel
// hard-codes the SLO; the series issue 19 added, cost's estimate series
// and the gateway's scheduling latency each have a panel.
func TestDashboardVariablesAndTiles(t *testing.T) {
	d := readDashboard(t)
	vars := map[string]string{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v.Type
	}
	for name, typ := range map[string]string{"datasource": "datasource", "model": "query", "gateway": "query", "replica": "query", "slo": "custom"} {
		if vars[name] != typ {
			t.Errorf("variable %s: type %q, want %q", name, vars[name], typ)
		}
	}
	if len(d.Panels) == 0 || d.Panels[0].Type != "row" || d.Panels[0].GridPos.Y != 0 {
		t.Fatal("the dashboard does not start with a row")
	}
	tiles, width := 0, 0
	for _, p := range d.Panels[1:] {
		if p.Type != "stat" || p.GridPos.Y != 1 {
			break
		}
		tiles++
		width += p.GridPos.W
	}
	if tiles < 4 || width != 24 {
		t.Errorf("first row: %d stat tiles %d columns wide, want at least 4 filling the 24 columns", tiles, width)
	}
	all := ""
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			all += tg.Expr + "\n"
			if strings.Contains(tg.Expr, "ttft_seconds_bucket") && strings.Contains(tg.Expr, `le="2"`) {
				t.Errorf("panel %q hard-codes a 2 s SLO instead of $slo", p.Title)
			}
		}
	}
	for _, m := range []string{"kvmesh_route_replica_decisions_total", "kvmesh_http_request_duration_seconds_bucket",
		"kvmesh_http_added_latency_seconds_bucket", "kvmesh_route_queued_prefill_tokens",
		"kvmesh_route_estimated_past_target_total", "kvmesh_route_ttft_estimate_ratio_bucket",
		"go_sched_latencies_seconds_bucket", "$gateway", "$replica", "$slo"} {
		if !strings.Contains(all, m) {
			t.Errorf("no panel reads %s", m)
		}
	}
}

func TestDashboardLayout(t *testing.T) {
	d := readDashboard(t)
	if d.UID != "kvmesh" {
		t.Errorf("uid %q, want kvmesh (links and provisioning use it)", d.UID)
	}
	ids := map[int]bool{}
	var study []dashPanel
	for i, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d twice", p.ID)
		}
		ids[p.ID] = true
		g := p.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.X+g.W > 24 {
			t.Errorf("panel %q: gridPos %+v outside the 24-column grid", p.Title, g)
		}
		for _, q := range d.Panels[:i] {
			h := q.GridPos
			if g.X < h.X+h.W && h.X < g.X+g.W && g.Y < h.Y+h.H && h.Y < g.Y+g.H {
				t.Errorf("panels %q and %q overlap", p.Title, q.Title)
			}
		}
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
			t.Errorf("panel %q: datasource must be the ${datasource} variable", p.Title)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			if _, err := metricNames(tg.Expr); err != nil {
				t.Errorf("panel %q: %v", p.Title, err)
			}
		}
		if len(p.Title) > 2 && p.Title[0] >= '1' && p.Title[0] <= '6' && p.Title[1] == '.' {
			study = append(study, p)
		}
	}
	// The seed's six panels, in reading order, full width and stacked: one
	// time axis from routing selection down to SLO pass.
	want := []string{"Routing selection", "Per-replica distribution", "Real KV hits", "Waiting queue", "TTFT", "SLO pass"}
	if len(study) != len(want) {
		t.Fatalf("%d study panels, want %d", len(study), len(want))
	}
	for i, p := range study {
		if !strings.HasPrefix(p.Title, fmt.Sprintf("%d. %s", i+1, want[i])) {
			t.Errorf("study panel %d is %q, want %q", i+1, p.Title, want[i])
		}
		if p.GridPos.W != 24 || p.GridPos.X != 0 {
			t.Errorf("study panel %q is not full width", p.Title)
		}
		if i > 0 && p.GridPos.Y <= study[i-1].GridPos.Y {
			t.Errorf("study panel %q is not below %q", p.Title, study[i-1].Title)
		}
	}
}

// rule is one entry of rules.yaml.
type rule struct {
	Record, Alert, Expr string
}

func readRules(t *testing.T) []rule {
	t.Helper()
	doc := readYAMLFile(t, "prometheus/rules.yaml")[0]
	var out []rule
	for _, g := range doc["groups"].([]any) {
		for _, r := range g.(map[string]any)["rules"].([]any) {
			m := r.(map[string]any)
			var x rule
			x.Record, _ = m["record"].(string)
			x.Alert, _ = m["alert"].(string)
			x.Expr, _ = m["expr"].(string)
			out = append(out, x)
		}
	}
	return out
}

// prometheusSynthesized are series Prometheus makes itself.
var prometheusSynthesized = map[string]bool{
	"up": true, "scrape_duration_seconds": true, "scrape_samples_scraped": true,
	"ALERTS": true, "ALERTS_FOR_STATE": true,
}

// queriedMetrics returns every metric the dashboard and the rules read that
// a binary must export (recording-rule outputs and Prometheus's own series
// removed), each with the places that read it.
func queriedMetrics(t *testing.T) map[string][]string {
	t.Helper()
	recorded := map[string]bool{}
	rules := readRules(t)
	for _, r := range rules {
		if r.Record != "" {
			recorded[r.Record] = true
		}
	}
	out := map[string][]string{}
	add := func(where, expr string) {
		names, err := metricNames(expr)
		if err != nil {
			t.Errorf("%s: %v", where, err)
			return
		}
		if len(names) == 0 {
			t.Errorf("%s: %q reads no metric", where, expr)
		}
		for _, n := range names {
			switch {
			case prometheusSynthesized[n]:
			case recorded[n]:
			case strings.Contains(n, ":") && !strings.HasPrefix(n, "vllm:"):
				t.Errorf("%s: %s looks like a recording rule but rules.yaml records no such series", where, n)
			default:
				out[n] = append(out[n], where)
			}
		}
	}
	for _, r := range rules {
		add("rules.yaml "+r.Record+r.Alert, r.Expr)
	}
	exprs, varMetrics := dashboardQueries(t)
	for where, e := range exprs {
		add("dashboard "+where, e)
	}
	for _, m := range varMetrics {
		out[m] = append(out[m], "dashboard variable")
	}
	return out
}

// TestDockerfile keeps the Dockerfile in step with the module and the
// manifests: the Go version of go.mod, every binary built static
// (CGO_ENABLED=0, which needs every dependency to build without cgo:
// cgoFreeProblems) and copied to /usr/local/bin, a non-root user.
func TestDockerfile(t *testing.T) {
	data, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	df := string(data)
	gomod, err := os.ReadFile(filepath.Join(repoRoot, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	goLine := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindStringSubmatch(string(gomod))
	if goLine == nil {
		t.Fatal("go.mod: no go directive")
	}
	if !strings.Contains(df, "ARG GO_VERSION="+goLine[1]+"\n") {
		t.Errorf("Dockerfile: want ARG GO_VERSION=%s (go.mod's go directive)", goLine[1])
	}
	var pkgs []string
	for _, b := range ourBinaries {
		pkgs = append(pkgs, "./cmd/"+b)
	}
	for _, want := range []string{
		"CGO_ENABLED=0",
		strings.Join(pkgs, " "),
		"COPY --from=build /out/kvmesh /out/vllmsim /out/kvbench /usr/local/bin/",
		"USER 65532:65532",
		"FROM gcr.io/distroless/static",
	} {
		if !strings.Contains(df, want) {
			t.Errorf("Dockerfile: missing %q", want)
		}
	}
	if regexp.MustCompile(`(?m)^ENTRYPOINT`).MatchString(df) {
		t.Error("Dockerfile: the manifests name the binary in command:, so the image must set no ENTRYPOINT")
	}
	for _, p := range cgoFreeProblems(t, repoRoot, pkgs...) {
		t.Errorf("CGO_ENABLED=0 (the distroless/static image): %s", p)
	}
}

// cgoFreeProblems lists what stops pkgs (in the module at dir) from
// building with CGO_ENABLED=0, by go list, which compiles nothing: a
// dependency with no Go files left once cgo is off (it imports "C" alone),
// or any other load error. With cgo off the Go linker links internally, so
// a build that loads is static: no ELF interpreter, what
// distroless/static needs.
func cgoFreeProblems(t *testing.T, dir string, pkgs ...string) []string {
	t.Helper()
	args := append([]string{"list", "-deps", "-e", "-f", `{{if .Error}}{{.ImportPath}}: {{.Error}}{{"\n"}}{{end}}{{if .CgoFiles}}{{.ImportPath}}: cgo files {{.CgoFiles}}{{"\n"}}{{end}}`}, pkgs...)
	cmd := exec.Command(goTool(), args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.Bytes())
	}
	var problems []string
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			problems = append(problems, l)
		}
	}
	return problems
}

// TestCgoFreeProblemsFindsACgoOnlyDependency: the check behind
// TestDockerfile's static build names a dependency that needs cgo.
func TestCgoFreeProblemsFindsACgoOnlyDependency(t *testing.T) {
	dir := t.TempDir()
	for name, src := range map[string]string{
		"go.mod":        "module example.com/m\n\ngo 1.22\n",
		"main.go":       "package main\n\nimport _ \"example.com/m/needc\"\n\nfunc main() {}\n",
		"needc/c.go":    "package needc\n\n// int one(void) { return 1; }\nimport \"C\"\n\nvar One = C.one()\n",
		"pure/pure.go":  "package pure\n\nconst X = 1\n",
		"clean/main.go": "package main\n\nimport _ \"example.com/m/pure\"\n\nfunc main() {}\n",
	} {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if got := cgoFreeProblems(t, dir, "."); !strings.Contains(strings.Join(got, "\n"), "example.com/m/needc") {
		t.Errorf("a dependency that imports \"C\" alone cannot build with CGO_ENABLED=0, yet the check found %q", got)
	}
	if got := cgoFreeProblems(t, dir, "./clean"); len(got) > 0 {
		t.Errorf("a pure-Go program: %q", got)
	}
}
