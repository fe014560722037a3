package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
	studytarget "github.com/kvmesh/kvmesh/chaos/study/target"
	"github.com/kvmesh/kvmesh/internal/freeport"
)

// startProc starts a separately running process whose output goes to a log
// file in dir; the test's cleanup kills it (by its own pid) and waits.
func startProc(t *testing.T, dir, name string, env []string, bin string, args ...string) {
	t.Helper()
	logf, err := os.Create(filepath.Join(dir, name+".log"))
	require.NoError(t, err)
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	require.NoError(t, cmd.Start(), name)
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		_ = logf.Close()
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			t.Logf("%s log (last 2 KB):\n%s", name, b[max(0, len(b)-2048):])
		}
	})
}

// waitOK polls url until it answers 200 or the deadline passes.
func waitOK(t *testing.T, deadline time.Time, url string) {
	t.Helper()
	for {
		resp, err := http.Get(url)
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not ready in time (last error %v)", url, err)
		}
		time.Sleep(100 * time.Millisecond) // polling a separate process, with a deadline
	}
}

// waitHealthy polls a gateway's /metrics until it reports want replicas
// healthy (kvmesh_proxy_replica_healthy 1) or the deadline passes.
func waitHealthy(t *testing.T, deadline time.Time, url string, want int) {
	t.Helper()
	var last string
	for {
		resp, err := http.Get(url)
		if err == nil {
			b, rerr := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if rerr == nil {
				healthy := 0
				last = ""
				for _, l := range strings.Split(string(b), "\n") {
					if strings.HasPrefix(l, "kvmesh_proxy_replica_healthy{") {
						last += l + "; "
						if strings.HasSuffix(l, " 1") {
							healthy++
						}
					}
				}
				if healthy >= want {
					return
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d replicas not healthy in time (last: %s; error %v)", url, want, last, err)
		}
		time.Sleep(100 * time.Millisecond) // polling a separate process, with a deadline
	}
}

// validateResults checks results.json against docs/results.md's schema 2:
// the top-level keys, every run's exact keys and their JSON types.
func validateResults(t *testing.T, raw []byte) {
	t.Helper()
	var top map[string]json.RawMessage
	require.NoError(t, json.Unmarshal(raw, &top))
	assert.ElementsMatch(t, []string{"schema_version", "runs", "config"}, keysOf(top))
	var v int
	require.NoError(t, json.Unmarshal(top["schema_version"], &v))
	require.Equal(t, study.ResultsSchemaVersion, v)
	var runs []map[string]any
	require.NoError(t, json.Unmarshal(top["runs"], &runs))
	require.NotEmpty(t, runs)
	types := map[string]string{
		"scenario": "string", "round": "number", "strategy": "string", "mode": "string", "gateways": "number",
		"sync": "string", "replicas": "number", "arrivals": "number", "succeeded": "number", "failed": "number",
		"slo_pass": "number", "ttft_p95_s": "number|null", "tpot_p95_ms": "number|null", "e2e_p95_s": "number|null",
		"token_hit_rate": "number|null", "per_replica": "object", "selection": "object", "max_waiting": "object",
	}
	for _, r := range runs {
		assert.ElementsMatch(t, keysOf(types), keysOf(r))
		for k, want := range types {
			got := "null"
			switch r[k].(type) {
			case string:
				got = "string"
			case float64:
				got = "number"
			case map[string]any:
				got = "object"
			}
			assert.Contains(t, strings.Split(want, "|"), got, "run key %s", k)
		}
		assert.Contains(t, []string{"single", "synced", "isolated"}, r["sync"])
	}
}

func keysOf[V any](m map[string]V) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}

// TestTargetAgainstCluster is issue 17's CI acceptance: two vllmsim
// engines and a three-gateway kvmesh cluster, built with go build and
// started as separate processes with the README's cluster flags on
// loopback, and a short --target study over them in history and hybrid
// mode: results.json validates, the hybrid switch is applied through the
// admin API and verified on all three gateways, and requests.jsonl
// recomputes to the same tables.
func TestTargetAgainstCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and starts five processes; skipped in -short")
	}
	if raceEnabled {
		t.Skip("the processes are built without -race; nothing here needs the detector")
	}
	tmp := t.TempDir()
	bin := filepath.Join(tmp, "bin")
	build := exec.Command("go", "build", "-o", bin+string(os.PathSeparator), "./cmd/kvmesh", "./cmd/vllmsim")
	build.Dir = filepath.Join("..", "..")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	kvmesh, vllmsim := filepath.Join(bin, "kvmesh"), filepath.Join(bin, "vllmsim")

	keyOut, err := exec.Command(kvmesh, "keygen").Output()
	require.NoError(t, err)
	env := []string{"KVMESH_ADMIN_TOKEN=testtoken", "KVMESH_CLUSTER_KEY=" + strings.TrimSpace(string(keyOut))}
	t.Setenv("KVMESH_ADMIN_TOKEN", "testtoken") // kvbench reads it

	// The studies (the seed grid, the example workload, two separate
	// clusters) and their gateways get 150 s from here, whatever the load.
	start := time.Now()
	deadline := start.Add(150 * time.Second)

	// Engines: HTTP, KV events and replay ports; gateways: HTTP, gossip,
	// peer, admin, raft, NATS client and cluster ports.
	p := freeport.Ports(t, 2*3+3*7)
	eng := func(i int) (http, kv, replay int) { return p[3*i], p[3*i+1], p[3*i+2] }
	gwp := func(i, k int) int { return p[6+7*i+k] }
	var reps []string
	var engines []string
	for i := range 2 {
		h, kv, rp := eng(i)
		startProc(t, tmp, fmt.Sprintf("sim%d", i+1), nil, vllmsim, "--host", "127.0.0.1", "--port", fmt.Sprint(h),
			"--served-model-name", "M", "--profile", "fast", "--enable-reset-endpoint", "--log-level", "warn",
			"--kv-events-config", fmt.Sprintf(`{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:%d","replay_endpoint":"tcp://127.0.0.1:%d"}`, kv, rp))
		reps = append(reps, "--replica", fmt.Sprintf("r%d=http://127.0.0.1:%d,kv=tcp://127.0.0.1:%d,replay=tcp://127.0.0.1:%d", i+1, h, kv, rp))
		engines = append(engines, fmt.Sprintf("r%d=http://127.0.0.1:%d", i+1, h))
	}
	var targets []string
	for i := range 3 {
		a := func(k int) string { return fmt.Sprintf("127.0.0.1:%d", gwp(i, k)) }
		args := []string{"serve", "--node-id", fmt.Sprintf("gw-%d", i), "--cluster-profile", "local", "--bootstrap-expect", "3",
			"--data-dir", filepath.Join(tmp, fmt.Sprintf("raft%d", i)), "--http-addr", a(0), "--gossip-addr", a(1),
			"--peer-addr", a(2), "--admin-addr", a(3), "--raft-addr", a(4), "--nats-client-addr", a(5),
			"--nats-cluster-addr", a(6), "--index-mode", "history", "--log-level", "warn", "--model", "M"}
		args = append(args, reps...)
		if i > 0 {
			args = append(args, "--join", fmt.Sprintf("127.0.0.1:%d", gwp(0, 1)))
		}
		startProc(t, tmp, fmt.Sprintf("gw%d", i), env, kvmesh, args...)
		targets = append(targets, "--target", "http://"+a(0))
	}
	for i := range 2 {
		h, _, _ := eng(i)
		waitOK(t, deadline, fmt.Sprintf("http://127.0.0.1:%d/health", h))
	}
	for i := range 3 {
		waitOK(t, deadline, fmt.Sprintf("http://127.0.0.1:%d/ready", gwp(i, 0)))
	}
	// A gateway that polled the engines before they listened holds them
	// down until its next health poll passes (2 s apart), and answers 503
	// meanwhile: the study's warm-up would fail. /ready does not wait for
	// replicas (an engine outage must not take the ingress down).
	for i := range 3 {
		waitHealthy(t, deadline, fmt.Sprintf("http://127.0.0.1:%d/metrics", gwp(i, 0)), 2)
	}
	t.Logf("cluster ready in %v", time.Since(start).Round(time.Millisecond))

	outDir := filepath.Join(tmp, "out")
	args := append(append([]string{}, targets...),
		"--engines", strings.Join(engines, ","), "--admin-addr", fmt.Sprintf("127.0.0.1:%d", gwp(2, 3)),
		"--scenarios", "warm", "--strategies", "least-request,prefix-cache", "--modes", "history,hybrid",
		"--rounds", "1", "--arrivals", "12", "--rps", "8", "--max-tokens", "32", "--out", outDir,
		"--tokenizer", "engine", "--prompt-tokens", "3000",
		"--timeout", time.Until(deadline).Round(time.Second).String())

	planOut, stderr, err := run(t, append(append([]string{}, args...), "--plan")...)
	require.NoError(t, err, stderr)
	assert.Contains(t, planOut, "plan: 4 phases")
	assert.Contains(t, planOut, fmt.Sprintf("plan: seed prompts sized to 3000 tokens with engine http://127.0.0.1:%d/tokenize: ", p[0]))
	assert.Contains(t, planOut, "switches index_mode history,history,history -> hybrid through the admin API of 1 cluster(s) (--mode-scope auto)")
	_, err = os.Stat(outDir)
	assert.True(t, os.IsNotExist(err), "--plan writes nothing")

	stdout, stderr, err := run(t, args...)
	require.NoError(t, err, stderr)
	t.Logf("study done %v after start", time.Since(start).Round(time.Millisecond))
	assert.Contains(t, stderr, "overall: 4/4 phases done")
	assert.Contains(t, stdout, "== warm — hybrid · 3 gateways, synced (shared index) ==", stderr)

	raw, err := os.ReadFile(filepath.Join(outDir, study.FileResults))
	require.NoError(t, err)
	validateResults(t, raw)
	var res study.Results
	require.NoError(t, json.Unmarshal(raw, &res))
	require.Len(t, res.Runs, 4)
	rf, err := os.Open(filepath.Join(outDir, study.FileRequests))
	require.NoError(t, err)
	recs, err := study.ReadRequests(rf)
	_ = rf.Close()
	require.NoError(t, err)
	var failures []string // what a failed request said, for the messages below
	for _, r := range recs {
		if r.Err != "" || r.Status != http.StatusOK {
			failures = append(failures, fmt.Sprintf("%s #%d: status %d: %s", r.Phase, r.Seq, r.Status, r.Err))
		}
	}
	for _, r := range res.Runs {
		assert.Equal(t, 3, r.Gateways)
		assert.Equal(t, 12, r.Arrivals)
		assert.Equal(t, 12, r.Succeeded, "%s/%s/%s; failed requests: %v", r.Scenario, r.Strategy, r.Mode, failures)
		assert.Equal(t, 12, r.PerReplica["r1"]+r.PerReplica["r2"], "the gateways' replica names")
	}
	// The prompts were sized with the engines' /tokenize: the measured
	// requests' usage (the engine's count) is 3,000 tokens give or take
	// the salts' and numbers' variation and half a sentence.
	require.NotNil(t, res.Config.PromptSizing)
	assert.Equal(t, res.Config.PromptSizing.Repeats, res.Config.BodyRepeats)
	require.Len(t, recs, 48)
	for _, r := range recs {
		require.NotNil(t, r.Usage)
		assert.InDelta(t, 3000, r.Usage.PromptTokens, 40, "%s #%d", r.Phase, r.Seq)
	}
	// The client's schedule lag is measured per phase, as in process, so
	// a lagging client would be flagged ("Client lagged").
	praw, err := os.ReadFile(filepath.Join(outDir, study.FilePhases))
	require.NoError(t, err)
	var phases []study.PhaseDetail
	require.NoError(t, json.Unmarshal(praw, &phases))
	require.Len(t, phases, 4)
	for _, ph := range phases {
		assert.False(t, math.IsNaN(float64(ph.LagP95S)), "%s: lag measured", ph.Name)
		assert.GreaterOrEqual(t, float64(ph.LagMaxS), float64(ph.LagP95S), ph.Name)
	}
	tg := res.Config.Target
	require.NotNil(t, tg)
	assert.Equal(t, "target", res.Config.Engine)
	assert.Equal(t, "M", tg.Model)
	assert.True(t, tg.Clustered)
	assert.Equal(t, study.IsolationReset, tg.Isolation)
	assert.Len(t, tg.GatewayVersions, 3)
	require.Len(t, tg.ModeSwitches, 2)
	assert.Equal(t, study.ModeSwitch{Mode: "history", Verified: 3}, tg.ModeSwitches[0], "already in history")
	hy := tg.ModeSwitches[1]
	assert.Equal(t, "hybrid", hy.Mode)
	assert.Positive(t, hy.ConfigVersion, "applied through the admin API")
	assert.Equal(t, 3, hy.Verified, "every gateway verified routing in hybrid")

	// Each gateway now routes in hybrid, as the run verified.
	for i := range 3 {
		req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet,
			fmt.Sprintf("http://127.0.0.1:%d/debug/route?model=M&prompt=x", gwp(i, 0)), nil)
		req.Header.Set("Authorization", "Bearer testtoken")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		var rep struct {
			IndexMode string `json:"index_mode"`
		}
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&rep))
		_ = resp.Body.Close()
		assert.Equal(t, "hybrid", rep.IndexMode, "gateway %d", i)
	}

	md, err := os.ReadFile(filepath.Join(outDir, study.FileReport))
	require.NoError(t, err)
	assert.Contains(t, string(md), "## Deployment")
	assert.Contains(t, string(md), "all 3 gateways verified routing in it")

	rc, stderr, err := run(t, "recompute", filepath.Join(outDir, study.FileRequests))
	require.NoError(t, err, stderr)
	assert.Contains(t, rc, "every field matches")

	// The documented example workload through the same cluster, which now
	// routes in hybrid: every line one request, through the gateways.
	wlDir := filepath.Join(tmp, "wl")
	_, stderr, err = run(t, append(append([]string{}, targets...),
		"--engines", strings.Join(engines, ","), "--workload", exampleWorkload, "--strategies", "prefix-cache",
		"--modes", "hybrid", "--rounds", "1", "--max-tokens", "16", "--out", wlDir,
		"--timeout", time.Until(deadline).Round(time.Second).String())...)
	require.NoError(t, err, stderr)
	raw, err = os.ReadFile(filepath.Join(wlDir, study.FileResults))
	require.NoError(t, err)
	validateResults(t, raw)
	var wl study.Results
	require.NoError(t, json.Unmarshal(raw, &wl))
	require.Len(t, wl.Runs, 1)
	assert.Equal(t, study.ScenarioWorkload, wl.Runs[0].Scenario)
	assert.Equal(t, 14, wl.Runs[0].Succeeded)
	assert.Equal(t, 14, wl.Runs[0].PerReplica["r1"]+wl.Runs[0].PerReplica["r2"])
	require.NotNil(t, wl.Config.Workload)
	assert.Equal(t, 14, wl.Config.Workload.Requests)
	require.NotNil(t, wl.Config.Target)
	assert.Equal(t, []study.ModeSwitch{{Mode: "hybrid", Verified: 3}}, wl.Config.Target.ModeSwitches)

	// Two more gateways over the same engines, each its own one-node
	// cluster: not one cluster, so their cells are isolated, and a mode
	// switch writes each cluster through its own admin API.
	q := freeport.Ports(t, 2*7)
	var solo []string
	for i := range 2 {
		a := func(k int) string { return fmt.Sprintf("127.0.0.1:%d", q[7*i+k]) }
		args := []string{"serve", "--node-id", "solo", "--cluster-profile", "local", "--bootstrap-expect", "1",
			"--data-dir", filepath.Join(tmp, fmt.Sprintf("solo%d", i)), "--http-addr", a(0), "--gossip-addr", a(1),
			"--peer-addr", a(2), "--admin-addr", a(3), "--raft-addr", a(4), "--nats-client-addr", a(5),
			"--nats-cluster-addr", a(6), "--index-mode", "history", "--log-level", "warn", "--model", "M"}
		startProc(t, tmp, fmt.Sprintf("solo%d", i), env, kvmesh, append(args, reps...)...)
		solo = append(solo, "--target", "http://"+a(0))
	}
	for i := range 2 {
		waitOK(t, deadline, fmt.Sprintf("http://127.0.0.1:%d/ready", q[7*i]))
	}
	soloDir := filepath.Join(tmp, "solo")
	_, stderr, err = run(t, append(append([]string{}, solo...),
		"--engines", strings.Join(engines, ","), "--scenarios", "cold", "--strategies", "least-request",
		"--modes", "history,hybrid", "--rounds", "1", "--arrivals", "4", "--rps", "8", "--max-tokens", "8",
		"--out", soloDir, "--timeout", time.Until(deadline).Round(time.Second).String())...)
	require.NoError(t, err, stderr)
	raw, err = os.ReadFile(filepath.Join(soloDir, study.FileResults))
	require.NoError(t, err)
	var so study.Results
	require.NoError(t, json.Unmarshal(raw, &so))
	require.Len(t, so.Runs, 2)
	for _, r := range so.Runs {
		assert.True(t, r.Isolated, "separate clusters share no index")
		assert.Equal(t, 4, r.Succeeded)
	}
	st := so.Config.Target
	require.NotNil(t, st)
	assert.False(t, st.Clustered)
	assert.Equal(t, 2, st.Clusters)
	require.Len(t, st.ModeSwitches, 2)
	sw := st.ModeSwitches[1]
	assert.Equal(t, "hybrid", sw.Mode)
	assert.Equal(t, "cluster", sw.Scope)
	assert.Len(t, sw.ConfigVersions, 2, "one write per cluster")
	assert.Equal(t, 2, sw.Verified)
	md, err = os.ReadFile(filepath.Join(soloDir, study.FileReport))
	require.NoError(t, err)
	assert.Contains(t, string(md), "2 separate clusters")
	t.Logf("all three studies done %v after start", time.Since(start).Round(time.Millisecond))
	assert.Less(t, time.Since(start), 150*time.Second)
}

// TestTargetFlags: flags the deployment decides are refused with --target,
// --engines entries must be name=URL, and --plan of an in-process grid
// prints the phases without running anything.
func TestTargetFlags(t *testing.T) {
	_, _, err := run(t, "--target", "http://127.0.0.1:1", "--replicas", "3")
	require.ErrorIs(t, err, study.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "--replicas does not apply to --target")
	_, _, err = run(t, "--target", "http://127.0.0.1:1", "--engine", "des")
	require.ErrorIs(t, err, study.ErrInvalidConfig)
	_, _, err = run(t, "--engines", "r1=127.0.0.1:8001")
	require.ErrorIs(t, err, study.ErrInvalidConfig)
	_, _, err = run(t, "--engines", "r1=http://127.0.0.1:1", "--modes", "history")
	require.ErrorIs(t, err, study.ErrInvalidConfig, "no gateway, no index mode")
	_, _, err = run(t, "--target", "http://127.0.0.1:1", "--mode-scope", "everything")
	require.ErrorIs(t, err, studytarget.ErrInvalidConfig)
	assert.Contains(t, err.Error(), `mode scope "everything"`)

	dir := filepath.Join(t.TempDir(), "out")
	out, stderr, err := run(t, "--quick", "--plan", "--out", dir)
	require.NoError(t, err, stderr)
	assert.Contains(t, out, "plan: 6 phases, 48 scheduled arrivals each at 1.6 RPS: at least 30s of arrivals per phase (model time), 3s wall at speed 10")
	assert.Contains(t, out, "r1-hot50-cost@history/g1")
	_, err = os.Stat(dir)
	assert.True(t, os.IsNotExist(err), "--plan runs nothing")
}
