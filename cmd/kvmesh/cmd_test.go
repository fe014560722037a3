package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node"
	"github.com/kvmesh/kvmesh/route"
	"github.com/kvmesh/kvmesh/sync/config"
	"github.com/kvmesh/kvmesh/sync/trust"
)

func parseServe(t *testing.T, args ...string) (node.Config, error) {
	t.Helper()
	cmd, f := newServeCmdFlags()
	require.NoError(t, cmd.ParseFlags(args))
	return f.config(cmd.Flags())
}

func TestServeOneLineStart(t *testing.T) {
	// The exact one-line start from the issue.
	line := "--http-addr 127.0.0.1:8080 --model M --replica a=http://127.0.0.1:8001 " +
		"--replica b=http://127.0.0.1:8002,kv=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558 " +
		"--index-mode hybrid --strategy cost"
	cfg, err := parseServe(t, strings.Fields(line)...)
	require.NoError(t, err)
	assert.Equal(t, "127.0.0.1:8080", cfg.HTTPAddr)
	assert.Equal(t, "hybrid", cfg.IndexMode)
	assert.Equal(t, "cost", cfg.Strategy)
	require.Len(t, cfg.Models, 1)
	assert.Equal(t, "M", cfg.Models[0].Name)
	assert.Equal(t, []node.ReplicaConfig{
		{Name: "a", URL: "http://127.0.0.1:8001"},
		{Name: "b", URL: "http://127.0.0.1:8002", KVEndpoint: "tcp://127.0.0.1:5557", ReplayEndpoint: "tcp://127.0.0.1:5558"},
	}, cfg.Models[0].Replicas)
	assert.Equal(t, node.TokenizerTiktoken, cfg.EffectiveTokenizer(), "hybrid keys live in token space")
	_, err = node.New(cfg, nil)
	require.NoError(t, err, "the one-line config builds a Node")
}

func TestServeFlagsOverrideFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "kvmesh.yaml")
	require.NoError(t, os.WriteFile(path, []byte(`
http_addr: 127.0.0.1:9000
strategy: random
idle_timeout: 7s
models:
  - name: M
    replicas: [{name: a, url: "http://127.0.0.1:8001"}]
`), 0o600))
	cfg, err := parseServe(t, "--config", path, "--strategy", "least-request", "--replica", "z=http://h:1,model=other")
	require.NoError(t, err)
	assert.Equal(t, "127.0.0.1:9000", cfg.HTTPAddr, "file value kept when the flag is not given")
	assert.Equal(t, "least-request", cfg.Strategy, "a given flag wins over the file")
	assert.Equal(t, 7*time.Second, cfg.IdleTimeout)
	require.Len(t, cfg.Models, 2)
	assert.Equal(t, "other", cfg.Models[1].Name)
}

// TestHealthPollFlags: both health-poll intervals have flags, and the one
// for a failed replica keeps its default when only the other is given.
func TestHealthPollFlags(t *testing.T) {
	base := strings.Fields("--model M --replica a=http://127.0.0.1:1")
	cfg, err := parseServe(t, append(base, "--health-interval", "5s", "--unhealthy-interval", "100ms")...)
	require.NoError(t, err)
	assert.Equal(t, 5*time.Second, cfg.HealthInterval)
	assert.Equal(t, 100*time.Millisecond, cfg.UnhealthyInterval)

	cfg, err = parseServe(t, append(base, "--health-interval", "5s")...)
	require.NoError(t, err)
	assert.Equal(t, node.DefaultConfig().UnhealthyInterval, cfg.UnhealthyInterval)

	_, err = parseServe(t, append(base, "--unhealthy-interval", "-1s")...)
	require.Error(t, err, "a negative interval is refused")
}

func TestServeFlagErrors(t *testing.T) {
	_, err := parseServe(t, "--replica", "a=http://h:1")
	assert.ErrorIs(t, err, node.ErrBadReplicaSpec, "a replica needs a model")
	_, err = parseServe(t, "--model", "M", "--replica", "a=http://h:1", "--strategy", "nope")
	assert.ErrorIs(t, err, node.ErrInvalidConfig)
	_, err = parseServe(t, "--model", "M")
	assert.ErrorIs(t, err, node.ErrInvalidConfig)
}

func TestExplainAgainstAGateway(t *testing.T) {
	// Nothing running beyond the gateway's own requests at first: cost
	// sees every request there, so its TTFT target applies.
	var running atomic.Int32
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			_, _ = fmt.Fprintf(w, "vllm:num_requests_running %d\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.5\n", running.Load())
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer engine.Close()
	cfg := node.LocalConfig()
	cfg.Models = []node.ModelConfig{{Name: "M", Replicas: []node.ReplicaConfig{{Name: "a", URL: engine.URL}, {Name: "b", URL: engine.URL}}}}
	cfg.DebugPublic = false // the production default: /debug/route needs the admin token
	cfg.AdminToken = "explain-token"
	// One sequence at a time: cost prices a slot wait on every replica.
	cfg.Route.Cost.MaxRunning = 1
	// A target no estimate meets: every replica is charged and marked.
	cfg.Route.Cost.TTFTTargetSeconds = 0.01
	n, err := node.New(cfg, nil)
	require.NoError(t, err)
	require.NoError(t, n.Start(context.Background()))
	defer func() { require.NoError(t, n.Shutdown(context.Background())) }()

	var out bytes.Buffer
	err = explain(context.Background(), &out, n.HTTPAddr(), "M", "hi", "", "", "", false)
	assert.ErrorContains(t, err, "unauthorized", "no token, no debug view")
	err = explain(context.Background(), &out, n.HTTPAddr(), "M", "hi", "", "", "wrong", false)
	assert.ErrorContains(t, err, "unauthorized")
	const tok = "explain-token"
	require.NoError(t, explain(context.Background(), &out, n.HTTPAddr(), "M", strings.Repeat("p", 300), "least-request", "", tok, false))
	s := out.String()
	assert.Contains(t, s, "strategy least-request")
	assert.Contains(t, s, "prompt 300 tokens = 2 blocks of 128")
	assert.Contains(t, s, "REPLICA")
	assert.Regexp(t, `pick [ab] \(least_request\)`, s)

	// cost shows the prompt's prefix share of the requests the gateway
	// routed with it lately (all of them here).
	prompt := strings.Repeat("q", 600)
	for range 3 {
		resp, err := http.Post("http://"+n.HTTPAddr()+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"M","prompt":"`+prompt+`","max_tokens":1}`))
		require.NoError(t, err)
		_ = resp.Body.Close()
	}
	out.Reset()
	require.NoError(t, explain(context.Background(), &out, n.HTTPAddr(), "M", prompt, "cost", "", tok, false))
	assert.Contains(t, out.String(), "strategy cost")
	assert.Contains(t, out.String(), "prefix share 100.0% of this gateway's recent requests")
	// Character keys, and no usage from this engine to learn the ratio
	// from: the rule of thumb.
	assert.Contains(t, out.String(), "keys are characters, 4.00 a token (as the engines' usage shows; 4 until one reports it)")
	// cost's own view per replica: the running-set size it assumed, the
	// slot wait that puts on the request, its TTFT estimate.
	assert.Regexp(t, `STEP-ENDS\s+SLOTS\s+SLOT-WAIT\s+TTFT\s+SCORE\(estimated_cost_seconds\)`, out.String())
	assert.Regexp(t, `(?m)^a\s.*\s1\s+\d+\.\d{3}s\s+\d+\.\d{3}s>\s`, out.String())
	assert.Contains(t, out.String(), "TTFT target 0.01s: a TTFT marked > misses it and adds 0.00125s to the score")
	// Another sender's requests in the engines' scrapes: no charge.
	running.Store(3)
	deadline := time.Now().Add(30 * time.Second)
	for {
		out.Reset()
		require.NoError(t, explain(context.Background(), &out, n.HTTPAddr(), "M", prompt, "cost", "", tok, false))
		if strings.Contains(out.String(), "TTFT target 0.01s: not charged (other senders' requests are on these replicas)") {
			break
		}
		require.True(t, time.Now().Before(deadline), "no scrape showed the other sender's requests:\n%s", out.String())
		time.Sleep(50 * time.Millisecond)
	}
	assert.NotRegexp(t, `\d{3}s>`, out.String(), "no TTFT is marked when nothing is charged")
	running.Store(0)

	out.Reset()
	require.NoError(t, explain(context.Background(), &out, "http://"+n.HTTPAddr(), "M", "hi", "", "", tok, true))
	assert.Contains(t, out.String(), `"pick"`)

	err = explain(context.Background(), &out, n.HTTPAddr(), "nope", "hi", "", "", tok, false)
	assert.ErrorContains(t, err, "model_not_found")

	// Any routable path: an embeddings request is routed by load.
	out.Reset()
	require.NoError(t, explainRequest(context.Background(), &out, n.HTTPAddr(), "?path=/v1/embeddings",
		[]byte(`{"model":"M","input":"hi"}`), "", "", tok, false))
	assert.Contains(t, out.String(), "path /v1/embeddings")
	assert.Contains(t, out.String(), "strategy least-request")
	assert.Regexp(t, `pick [ab] `, out.String())
	cmd := newRootCmd()
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"explain", "--addr", n.HTTPAddr(), "--token", tok, "--path", "/v1/audio/transcriptions", "--model", "M"})
	out.Reset()
	require.NoError(t, cmd.Execute())
	assert.Contains(t, out.String(), "path /v1/audio/transcriptions")
}

func TestVersion(t *testing.T) {
	cmd := newRootCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"version"})
	require.NoError(t, cmd.Execute())
	assert.True(t, strings.HasPrefix(out.String(), "kvmesh dev (revision "), out.String())
	var flagOut bytes.Buffer
	cmd = newRootCmd()
	cmd.SetOut(&flagOut)
	cmd.SetArgs([]string{"--version"})
	require.NoError(t, cmd.Execute())
	assert.Equal(t, out.String(), flagOut.String(), "kvmesh --version = kvmesh version")
}

func TestServeRunsUntilCancelled(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	cfg := node.LocalConfig()
	cfg.HTTPAddr = addr
	cfg.Models = []node.ModelConfig{{Name: "M", Replicas: []node.ReplicaConfig{{Name: "a", URL: "http://127.0.0.1:1"}}}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serve(ctx, cfg, slog.New(slog.DiscardHandler)) }()
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + addr + "/health")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 5*time.Second, 10*time.Millisecond)
	cancel() // what SIGTERM does through signal.NotifyContext
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not return after cancellation")
	}
	_, err = http.Get("http://" + addr + "/health")
	assert.Error(t, err, "the gateway stopped listening")
}

func TestServeClusterFlags(t *testing.T) {
	cfg, err := parseServe(t, "--model", "M", "--replica", "a=http://h:1")
	require.NoError(t, err)
	assert.False(t, cfg.Cluster.Active(), "no cluster flag: standalone")

	cfg, err = parseServe(t, "--model", "M", "--replica", "a=http://h:1", "--node-id", "gw1",
		"--join", "10.0.0.1:7946,10.0.0.2:7946", "--join", "10.0.0.3:7946", "--data-dir", "/tmp/x",
		"--admin-token", "t", "--raft-addr", "127.0.0.1:9301", "--nats-url", "nats://n:4222",
		"--peer-tls-cert", "p.pem", "--peer-tls-key", "pk.pem", "--peer-tls-ca", "ca.pem", "--peer-tls-server-name", "gw.internal")
	require.NoError(t, err)
	assert.True(t, cfg.Cluster.Active(), "--join implies --cluster")
	assert.Equal(t, []string{"10.0.0.1:7946", "10.0.0.2:7946", "10.0.0.3:7946"}, cfg.Cluster.Join)
	assert.Equal(t, "gw1", cfg.Cluster.NodeID)
	assert.Equal(t, "/tmp/x", cfg.Cluster.DataDir)
	assert.Equal(t, "127.0.0.1:9301", cfg.Cluster.RaftAddr)
	assert.Equal(t, "nats://n:4222", cfg.Cluster.NATSURL)
	assert.Equal(t, 3, cfg.Cluster.BootstrapExpect, "default")
	assert.Equal(t, config.TLSFiles{CertFile: "p.pem", KeyFile: "pk.pem", CAFile: "ca.pem"}, cfg.Cluster.PeerTLS)
	assert.Equal(t, "gw.internal", cfg.Cluster.PeerTLSServerName)

	cfg, err = parseServe(t, "--model", "M", "--replica", "a=http://h:1", "--bootstrap-expect", "1", "--no-sync")
	require.NoError(t, err)
	assert.True(t, cfg.Cluster.Enabled)
	assert.False(t, cfg.Cluster.Active(), "--no-sync keeps the gateway isolated")

	_, err = parseServe(t, "--model", "M", "--replica", "a=http://h:1", "--cluster", "--cluster-name", "bad name")
	assert.ErrorIs(t, err, node.ErrInvalidConfig)
}

// TestClusterAdminCommands serves a one-gateway cluster through serve and
// drives it with the admin commands: members, config get and config patch.
func TestClusterAdminCommands(t *testing.T) {
	if testing.Short() {
		t.Skip("starts raft, memberlist and NATS: skipped with -short")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	adminAddr := ln.Addr().String()
	require.NoError(t, ln.Close())
	cfg := node.LocalConfig()
	cfg.Models = []node.ModelConfig{{Name: "M", Replicas: []node.ReplicaConfig{{Name: "a", URL: "http://127.0.0.1:1"}}}}
	cfg.Cluster.Enabled = true
	cfg.Cluster.NodeID = "solo"
	cfg.Cluster.DataDir = t.TempDir()
	cfg.Cluster.BootstrapExpect = 1
	cfg.Cluster.AdminToken = "tok"
	cfg.Cluster.AdminAddr = adminAddr
	cfg.Cluster.ClusterKey = mustKey(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serve(ctx, cfg, slog.New(slog.DiscardHandler)) }()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()

	run := func(args ...string) (string, error) {
		cmd := newRootCmd()
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetErr(&out)
		cmd.SetArgs(append(args, "--admin-addr", adminAddr, "--token", "tok"))
		err := cmd.Execute()
		return out.String(), err
	}
	require.Eventually(t, func() bool {
		out, err := run("config", "get")
		return err == nil && strings.Contains(out, `"strategy"`) && !strings.Contains(out, `"version": 0`)
	}, 20*time.Second, 20*time.Millisecond, "the seed config is applied")
	out, err := run("members")
	require.NoError(t, err, out)
	assert.Contains(t, out, "solo")
	out, err = run("config", "patch", `{"strategy":"cost"}`)
	require.NoError(t, err, out)
	assert.Contains(t, out, "applied version")
	out, err = run("config", "get")
	require.NoError(t, err)
	assert.Contains(t, out, `"strategy": "cost"`)
}

// The admin commands reach a gateway started with default flags without
// --admin-addr or KVMESH_ADMIN_ADDR: their default is the loopback form of
// the gateway's default admin listen address.
func TestAdminCommandsDefaultToGatewayAdminAddr(t *testing.T) {
	t.Setenv("KVMESH_ADMIN_ADDR", "")
	_, listenPort, err := net.SplitHostPort(node.DefaultClusterConfig().AdminAddr)
	require.NoError(t, err)
	root := newRootCmd()
	for _, path := range [][]string{{"config", "get"}, {"config", "set"}, {"members"}} {
		cmd, _, err := root.Find(path)
		require.NoError(t, err)
		f := cmd.Flags().Lookup("admin-addr")
		require.NotNil(t, f, "%v", path)
		assert.Equal(t, net.JoinHostPort("127.0.0.1", listenPort), f.DefValue, "%v", path)
	}
}

func mustKey(t *testing.T) string {
	t.Helper()
	var out bytes.Buffer
	cmd := newRootCmd()
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"keygen"})
	require.NoError(t, cmd.Execute())
	return strings.TrimSpace(out.String())
}

// TestServeClusterNeedsKey: kvmesh serve in cluster mode without a key and
// without --insecure exits with a message that says how to make a key;
// keygen's keys parse and --cluster-key-file and --insecure reach the
// config.
func TestServeClusterNeedsKey(t *testing.T) {
	t.Setenv(node.ClusterKeyEnv, "")
	t.Setenv("KVMESH_ADMIN_TOKEN", "tok")
	cmd := newRootCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs([]string{"serve", "--model", "M", "--replica", "a=http://127.0.0.1:1", "--cluster", "--node-id", "gw",
		"--data-dir", t.TempDir(), "--http-addr", "127.0.0.1:0", "--cluster-profile", "local", "--bootstrap-expect", "1",
		"--gossip-addr", "127.0.0.1:0", "--peer-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--raft-addr", "127.0.0.1:0",
		"--nats-client-addr", "127.0.0.1:0", "--nats-cluster-addr", "127.0.0.1:0"})
	done := make(chan error, 1)
	go func() { done <- cmd.Execute() }()
	select {
	case err := <-done:
		require.ErrorIs(t, err, node.ErrNoClusterKey)
		assert.Contains(t, err.Error(), "kvmesh keygen > cluster.key")
		assert.Contains(t, err.Error(), "--cluster-key-file cluster.key")
	case <-time.After(20 * time.Second):
		t.Fatal("serve without a cluster key did not exit")
	}

	k1, k2 := mustKey(t), mustKey(t)
	assert.NotEqual(t, k1, k2)
	keys, err := trust.ParseKeys(k1)
	require.NoError(t, err)
	assert.Len(t, keys[0], 32)

	cfg, err := parseServe(t, "--model", "M", "--replica", "a=http://h:1", "--cluster", "--cluster-key-file", "/k",
		"--insecure", "--nats-url", "nats://n:4222", "--nats-credentials-file", "n.creds", "--nats-tls-ca", "ca.pem")
	require.NoError(t, err)
	assert.Equal(t, "/k", cfg.Cluster.ClusterKeyFile)
	assert.True(t, cfg.Cluster.Insecure)
	assert.Equal(t, "n.creds", cfg.Cluster.NATSCredentialsFile)
	assert.Equal(t, "ca.pem", cfg.Cluster.NATSTLS.CAFile)
}

// TestConfigReferenceCurrent fails when docs/config.md is not what
// `kvmesh config reference` generates from the config types; regenerate
// with: go run ./cmd/kvmesh config reference -o docs/config.md
func TestConfigReferenceCurrent(t *testing.T) {
	var b bytes.Buffer
	require.NoError(t, writeConfigReference(&b))
	got, err := os.ReadFile("../../docs/config.md")
	require.NoError(t, err)
	if !bytes.Equal(got, b.Bytes()) {
		t.Fatal("docs/config.md is stale: run go run ./cmd/kvmesh config reference -o docs/config.md")
	}
	// Every knob is there, with its default and its flag.
	for _, row := range []string{
		"| `strategy` | string | `cost` | `--strategy` |",
		"| `index_mode` | string | `auto` | `--index-mode` |",
		"| `cluster.admin_addr` | string | `0.0.0.0:7948` | `--admin-addr` |",
		"| `cost.alpha` | float64 | `0.2` | `cost.alpha`, `--cost-alpha` |",
		"| `cost.alpha` | float64 | `0.2` | `--cost-alpha` |",
		"| `cluster.admin_tls.cert_file` | string | \"\" | `--admin-tls-cert` |",
	} {
		assert.Contains(t, b.String(), row)
	}
}

// TestRouteKnobFlags: every strategy parameter has a flag named after its
// key, which the gateway YAML and the cluster document share; a flag given
// wins over the YAML file's value, one not given leaves it; the old
// route: section is refused by name.
func TestRouteKnobFlags(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "kvmesh.yaml")
	require.NoError(t, os.WriteFile(path, []byte(`
cost:
  alpha: 0.4
  chunk_tokens: 1024
models:
  - name: M
    replicas: [{name: a, url: "http://127.0.0.1:8001"}]
`), 0o600))
	cfg, err := parseServe(t, "--config", path, "--cost-alpha", "0.5", "--prefix-cache-stddev-factor", "3",
		"--consistent-hash-virtual-nodes", "50", "--prefix-cache-local-load")
	require.NoError(t, err)
	assert.Equal(t, 0.5, cfg.Route.Cost.Alpha, "the flag wins over the file")
	assert.Equal(t, 1024, cfg.Route.Cost.ChunkTokens, "the file's value stays")
	assert.Equal(t, 3.0, cfg.Route.PrefixCache.StdDevFactor)
	assert.True(t, cfg.Route.PrefixCache.LocalLoad)
	assert.Equal(t, 50, cfg.Route.ConsistentHash.VirtualNodes)

	// One flag per field of each section of the cluster document.
	cmd, f := newServeCmdFlags()
	doc := reflect.TypeOf(config.RoutingConfig{})
	n := 0
	for _, sec := range routeSections {
		sf, _ := doc.FieldByName(sec)
		for _, field := range reflect.VisibleFields(sf.Type) {
			if key := field.Tag.Get("json"); !field.Anonymous && key != "block_size" && key != "tokenizer" {
				n++ // prefix_cache.block_size and .tokenizer: --block-size, --tokenizer
			}
		}
	}
	assert.Len(t, f.route, n)
	for _, rf := range f.route {
		assert.NotNil(t, cmd.Flags().Lookup(rf.name))
	}

	require.NoError(t, os.WriteFile(path, []byte("route:\n  cost:\n    alpha: 0.4\nmodels: [{name: M, replicas: [{name: a, url: \"http://127.0.0.1:8001\"}]}]\n"), 0o600))
	_, err = parseServe(t, "--config", path)
	assert.ErrorContains(t, err, "the route: section is gone")
}

// TestExplainShowsAHeldRequest: a decision cost held with the prefix's
// holders names the replica its scores ranked first, and why: the
// recompute's estimate past the target, or, within it, the replicas
// with requests waiting. The gateway here is an httptest server
// answering /debug/route with the report of a real cost decision: a node
// shows it only where other senders fill the engines and the prompt
// spans several prefill chunks, which a test engine cannot arrange on
// cue.
func TestExplainShowsAHeldRequest(t *testing.T) {
	req := route.Request{TotalBlocks: 64, BlockTokens: 128, PromptTokens: 8192, MaxTokens: 128, Now: 1e12}
	// The holder is full, with other senders' requests waiting in its
	// scrape; b must recompute four chunks, estimated past 1 s.
	cands := []route.Candidate{
		{ID: 0, Name: "a", Matched: 64, InFlight: 8, LocalInFlight: 8, Running: 8, Waiting: 12, ScrapedInFlight: 8, ScrapedInFlightKnown: true},
		{ID: 1, Name: "b", InFlight: 2, LocalInFlight: 2, Running: 2, ScrapedInFlight: 2, ScrapedInFlightKnown: true},
	}
	// held is what kvmesh explain prints of cost's decision with a TTFT
	// target of target seconds, which must hold the request on a.
	held := func(target float64) string {
		t.Helper()
		cfg := route.DefaultCostConfig()
		cfg.MaxRunning = 8
		cfg.TTFTTargetSeconds = target
		m, err := route.NewModel(cfg)
		require.NoError(t, err)
		var ex route.Explanation
		rng := route.NewRand(1)
		d := route.NewCost(m).Pick(&req, cands, &rng, &ex)
		require.Equal(t, route.SelectionCostHeld, d.Selection)
		require.Equal(t, "a", ex.PickedName)
		return explainOutput(t, d, &ex)
	}
	out := held(1)
	assert.Contains(t, out, "pick a (cost_held)")
	assert.Contains(t, out, "held: b scored cheapest but would recompute the prompt and misses the TTFT target too")

	// A target b meets: held because half the replicas (a) queue.
	out = held(30)
	assert.Contains(t, out, "held: b scored cheapest but would recompute the prompt and requests wait at 1 of 2 replicas, so prefill is what they lack;")
	assert.NotContains(t, out, "misses the TTFT target")
}

// TestExplainShowsUnseenRequests: where other senders show only in the
// engines' scrapes, cost estimates the requests they sent that no figure
// shows yet and spreads over as many placements; kvmesh explain says how
// many. As in TestExplainShowsAHeldRequest the gateway is an httptest
// server answering with a real cost decision's report: the estimate
// needs a stream of this gateway's own decisions and other senders in
// the scrapes, which a node test cannot time.
func TestExplainShowsUnseenRequests(t *testing.T) {
	c, req, cands := explainedCost(t, 4, route.Candidate{LocalInFlight: 1, InFlight: 1,
		Running: 7, KVUsage: 0.3, ScrapedInFlight: 1, ScrapedInFlightKnown: true, EventsFed: true})
	rng := route.NewRand(2)
	for k := range 40 { // this gateway's own decisions, 5 ms apart
		req.Now = int64(k) * 5e6
		c.Pick(&req, cands, &rng, nil)
	}
	var ex route.Explanation
	d := c.Pick(&req, cands, &rng, &ex)
	require.Positive(t, ex.UnseenPeerRequests)
	assert.Contains(t, explainOutput(t, d, &ex), fmt.Sprintf("spread: %d requests of other senders estimated unseen (their load shows here late); this one took a random place of %d placed alike",
		ex.UnseenPeerRequests, ex.UnseenPeerRequests+1))
}

// TestExplainShowsACopyByNeed: where cost, on a gateway that sees other
// senders only in the engines' scrapes, finds a hot prefix on fewer
// replicas than its traffic needs, the text view says so, and whether the
// request started a copy or stayed with the holders.
func TestExplainShowsACopyByNeed(t *testing.T) {
	// One holder of 16 replicas, each running one request of another
	// sender; every recent request of this gateway shares the prompt.
	c, req, cands := explainedCost(t, 16, route.Candidate{Running: 1, KVUsage: 0.1, EventsFed: true})
	cands[0].Matched = 40
	keys := make([]index.BlockKey, req.TotalBlocks)
	for i := range keys {
		keys[i] = index.BlockKey(1 + i)
	}
	req.Prefixes = route.NewPrefixes(keys)
	rng := route.NewRand(4)
	for k := range 20 {
		req.Now = int64(k) * 5e7
		c.Pick(&req, cands, &rng, nil)
	}
	seen := map[bool]bool{} // by whether the request started a copy
	for range 200 {
		var ex route.Explanation
		d := c.Pick(&req, cands, &rng, &ex)
		copied := d.Index != 0
		if seen[copied] {
			continue
		}
		seen[copied] = true
		out := explainOutput(t, d, &ex)
		want := "copy: the hot prefix is held by 1 replica, fewer than the 16.0 its share of the traffic needs; this request stayed with them (a copy had a 94% chance)"
		if copied {
			want = "copy: the hot prefix is held by 1 replica, fewer than the 16.0 its share of the traffic needs; this request started a copy instead of joining r0 (chance 94%)"
		}
		assert.Contains(t, out, want)
	}
	require.True(t, seen[true] && seen[false], "200 requests: some started copies, some stayed")
}

// explainedCost returns a cost strategy on a fresh default model, a
// request of 40 blocks of 128 tokens, and n candidates like cand named
// r0, r1, … with their positions as IDs: the set-up of the tests above
// that serve a real cost decision's report.
func explainedCost(t *testing.T, n int, cand route.Candidate) (*route.Cost, route.Request, []route.Candidate) {
	t.Helper()
	m, err := route.NewModel(route.DefaultCostConfig())
	require.NoError(t, err)
	cands := make([]route.Candidate, n)
	for i := range cands {
		cands[i] = cand
		cands[i].ID, cands[i].Name = index.ReplicaID(i), fmt.Sprint("r", i)
	}
	return route.NewCost(m), route.Request{TotalBlocks: 40, BlockTokens: 128, PromptTokens: 5200, MaxTokens: 128}, cands
}

// explainOutput serves the report of cost's decision d, explained in ex,
// from an httptest gateway's /debug/route and returns what kvmesh explain
// prints of it: the tests above build real decisions that a node test
// cannot time.
func explainOutput(t *testing.T, d route.Decision, ex *route.Explanation) string {
	t.Helper()
	report, err := json.Marshal(node.RouteReport{Model: "M", Strategy: "cost", Pick: ex.PickedName, Selection: d.Selection.String(), Explanation: ex})
	require.NoError(t, err)
	gw := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/debug/route" {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write(report)
	}))
	defer gw.Close()
	var out bytes.Buffer
	require.NoError(t, explain(context.Background(), &out, gw.URL, "M", "p", "cost", "", "", false))
	return out.String()
}
