package deploy_test

import (
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kvmesh/kvmesh/node"
)

// TestGIEOverlayWiring checks the endpoint-picker overlay's files as
// written (schema level; no cluster or kubectl needed): the InferencePool
// selects the engine pods on their serving port and names a picker
// Service that selects the gateway pods on the port the gateway config
// listens on; the HTTPRoute sends to the pool; the discovery RBAC lets the
// gateways' service account read exactly pods and pools; the gateway
// config discovers that pool with KV templates on the engines' ports.
func TestGIEOverlayWiring(t *testing.T) {
	dir := filepath.Join("kubernetes", "overlays", "gie")
	var docs []map[string]any
	for _, f := range []string{"engines.yaml", "inferencepool.yaml", "service-epp.yaml", "rbac.yaml", "gateway.yaml", "gateway-picker.yaml"} {
		docs = append(docs, readYAMLFile(t, filepath.Join(dir, f))...)
	}
	base := byKind(readYAMLFile(t, filepath.Join("kubernetes", "base", "statefulset.yaml")))
	objs := byKind(docs)

	pool := objs["InferencePool"]["vllm-qwen"]
	if pool == nil || get(pool, "apiVersion") != "inference.networking.k8s.io/v1" {
		t.Fatal("no InferencePool vllm-qwen (inference.networking.k8s.io/v1)")
	}
	engines := objs["Deployment"]["vllm-qwen"]
	if engines == nil {
		t.Fatal("no engine Deployment vllm-qwen")
	}
	engineLabels := get(engines, "spec", "template", "metadata", "labels")
	if !selects(get(pool, "spec", "selector", "matchLabels"), engineLabels) {
		t.Error("the InferencePool's selector does not select the engine pods")
	}
	enginePorts := map[string]int{}
	for _, p := range get(engines, "spec", "template", "spec", "containers").([]any)[0].(map[string]any)["ports"].([]any) {
		enginePorts[p.(map[string]any)["name"].(string)] = p.(map[string]any)["containerPort"].(int)
	}
	ports := get(pool, "spec", "targetPorts").([]any)
	if n := get(ports[0], "number"); n != enginePorts["http"] {
		t.Errorf("targetPorts[0] = %v, engines serve on %d", n, enginePorts["http"])
	}

	// The picker: a Service selecting the gateway pods, on the picker port.
	ref := get(pool, "spec", "endpointPickerRef")
	svc := objs["Service"][get(ref, "name").(string)]
	if svc == nil {
		t.Fatalf("endpointPickerRef names Service %v, not in the overlay", get(ref, "name"))
	}
	sts := base["StatefulSet"]["kvmesh"]
	if !selects(get(svc, "spec", "selector"), get(sts, "spec", "template", "metadata", "labels")) {
		t.Error("the picker Service does not select the gateway pods")
	}
	svcPort := get(svc, "spec", "ports").([]any)[0]
	if get(svcPort, "port") != get(ref, "port", "number") {
		t.Errorf("endpointPickerRef port %v, Service port %v", get(ref, "port", "number"), get(svcPort, "port"))
	}
	patch := objs["StatefulSet"]["kvmesh"]
	var eppPort any
	for _, p := range get(patch, "spec", "template", "spec", "containers").([]any)[0].(map[string]any)["ports"].([]any) {
		if get(p, "name") == get(svcPort, "targetPort") {
			eppPort = get(p, "containerPort")
		}
	}
	cfg, err := node.LoadConfigFile(filepath.Join(dir, "kvmesh.yaml"), node.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	_, p, _ := net.SplitHostPort(cfg.EPP.Addr)
	if fmt.Sprint(eppPort) != p {
		t.Errorf("the gateway container's %v port is %v, the config's epp.addr %q", get(svcPort, "targetPort"), eppPort, cfg.EPP.Addr)
	}

	// The route sends to the pool.
	route := objs["HTTPRoute"]["qwen"]
	backend := get(route, "spec", "rules").([]any)[0].(map[string]any)["backendRefs"].([]any)[0]
	if get(backend, "kind") != "InferencePool" || get(backend, "name") != "vllm-qwen" || get(backend, "group") != "inference.networking.k8s.io" {
		t.Errorf("HTTPRoute backend %v is not the InferencePool", backend)
	}

	// Discovery: the pool, with KV and replay templates on the engines' ports.
	d := cfg.Discovery
	if d.Source != node.DiscoverySourceKubernetes || d.Kubernetes.InferencePool != "vllm-qwen" {
		t.Errorf("discovery %+v does not follow the InferencePool", d)
	}
	if d.KV != fmt.Sprintf("tcp://{ip}:%d", enginePorts["kv-events"]) || d.Replay != fmt.Sprintf("tcp://{ip}:%d", enginePorts["kv-replay"]) {
		t.Errorf("discovery templates kv=%q replay=%q do not match the engines' ports %v", d.KV, d.Replay, enginePorts)
	}

	// RBAC: the gateways' service account may read pods and pools, only.
	sa := get(patch, "spec", "template", "spec", "serviceAccountName")
	if objs["ServiceAccount"][fmt.Sprint(sa)] == nil {
		t.Fatalf("the gateways run as %v, not defined in the overlay", sa)
	}
	if get(patch, "spec", "template", "spec", "automountServiceAccountToken") != true {
		t.Error("the gateways need their service account token mounted for discovery")
	}
	binding := objs["RoleBinding"]["kvmesh-discovery"]
	subj := get(binding, "subjects").([]any)[0]
	if get(subj, "name") != sa || get(subj, "kind") != "ServiceAccount" {
		t.Errorf("RoleBinding subject %v is not the gateways' service account", subj)
	}
	role := objs["Role"][get(binding, "roleRef", "name").(string)]
	granted := map[string][]string{}
	for _, r := range get(role, "rules").([]any) {
		for _, res := range get(r, "resources").([]any) {
			for _, v := range get(r, "verbs").([]any) {
				granted[res.(string)] = append(granted[res.(string)], v.(string))
			}
		}
	}
	for _, res := range []string{"pods", "inferencepools"} {
		for _, v := range []string{"list", "watch"} {
			if !slices.Contains(granted[res], v) {
				t.Errorf("the Role does not grant %s on %s", v, res)
			}
		}
	}
	for res, verbs := range granted {
		for _, v := range verbs {
			if v != "get" && v != "list" && v != "watch" {
				t.Errorf("the Role grants %s on %s: discovery only reads", v, res)
			}
		}
	}
}
