package live_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/chaos/study/live"
	"github.com/kvmesh/kvmesh/index"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Idle keep-alive connections close asynchronously after Close.
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		// zmq4 v0.17.0's PUB socket never stops its writer goroutine on
		// Close (the simulators' publishers; kvevents and node ignore it too).
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
	)
}

// tinyConfig is a grid small enough for CI: the fast profile at a high
// speed, few arrivals, every scenario.
func tinyConfig() (study.Config, live.Config) {
	c := study.DefaultConfig()
	c.Scenarios = study.Scenarios
	c.Strategies = []string{"least-request", "prefix-cache", "cost"}
	c.Modes = []string{"history", "kv-events"}
	c.Rounds = 1
	c.Arrivals = 12
	c.RPS = 4
	c.Speed = 20
	c.Profile = "fast"
	c.MaxTokens = 16
	c.InitMaxTokens = 2
	lc := live.DefaultConfig()
	lc.Profile = c.Profile
	lc.Speed = c.Speed
	return c, lc
}

// TestLiveTinyGrid runs the study end to end on simulators and gateways
// and checks results.json's schema and invariants.
func TestLiveTinyGrid(t *testing.T) {
	if testing.Short() && raceEnabled {
		t.Skip("~15 s normally but ~80 s under the race detector; skipped under -race -short")
	}
	cfg, lc := tinyConfig()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rn := &study.Runner{Config: cfg, Factory: live.Factory(lc)}
	start := time.Now()
	res, err := rn.Run(ctx)
	require.NoError(t, err)
	t.Logf("tiny grid: %d runs in %s", len(res.Runs), time.Since(start).Round(time.Millisecond))

	for _, p := range res.Phases {
		require.True(t, p.Measured, "%s: %s", p.Name, p.Error)
	}
	require.Len(t, res.Config.HostChecks, len(cfg.Modes), "one host check per cell")
	for _, hc := range res.Config.HostChecks {
		t.Log(study.HostCheckLine(hc))
		assert.Greater(t, hc.MeasuredTPOTms, 0.0)
	}
	require.Len(t, res.Runs, len(cfg.Scenarios)*len(cfg.Strategies)*len(cfg.Modes))
	for _, r := range res.Runs {
		name := r.Key().PhaseName()
		assert.Equal(t, r.Arrivals, r.Succeeded+r.Failed, name)
		assert.Equal(t, r.Arrivals, r.Succeeded, "%s: nothing fails on an idle fast engine", name)
		sum := 0
		for _, c := range r.PerReplica {
			sum += c
		}
		assert.Equal(t, r.Succeeded, sum, "%s: per_replica sums to the successes", name)
		assert.Len(t, r.PerReplica, 2, name)
		assert.Len(t, r.MaxWaiting, 2, name)
		assert.False(t, math.IsNaN(float64(r.TTFTP95)), name)
		assert.False(t, math.IsNaN(float64(r.TokenHitRate)), name)
		assert.NotNil(t, r.Selection, "%s: the gateway exposes kvmesh_route_decisions_total", name)
		if r.Scenario == study.ScenarioWarm {
			assert.Greater(t, float64(r.TokenHitRate), 0.5, "%s: both engines are warm", name)
		}
	}

	dir := t.TempDir()
	require.NoError(t, study.WriteFiles(dir, res))
	raw, err := os.ReadFile(filepath.Join(dir, study.FileResults))
	require.NoError(t, err)
	var doc struct {
		Runs   []map[string]any `json:"runs"`
		Config map[string]any   `json:"config"`
	}
	require.NoError(t, json.Unmarshal(raw, &doc))
	require.Len(t, doc.Runs, len(res.Runs))
	for _, r := range doc.Runs {
		assert.Len(t, r, 18, "exactly the issue's fields and sync (schema 2)")
		assert.Contains(t, []any{study.SyncSingle, study.SyncSynced}, r["sync"])
		for _, k := range []string{"per_replica", "selection", "max_waiting"} {
			assert.IsType(t, map[string]any{}, r[k], k)
		}
	}
	assert.Equal(t, "fast", doc.Config["profile"])
}

func TestWorldStartsAndClosesCleanly(t *testing.T) {
	lc := live.DefaultConfig()
	lc.Profile = "fast"
	lc.Speed = 50
	lc.Mode = "hybrid"
	lc.Gateways = 2
	w, err := live.Start(context.Background(), lc)
	require.NoError(t, err)
	assert.Equal(t, []string{"A", "B"}, w.Replicas())
	assert.Equal(t, 2, w.Gateways())
	d := study.Document{Number: 0, Salt: study.Salt(1, "t", 0, 0)}
	outs, err := study.Do(context.Background(), w,
		study.Request{Prompt: d.Prompt(1), MaxTokens: 4, Target: study.Target{Gateway: 1, Strategy: "cost"}},
		study.Request{Prompt: d.Prompt(2), MaxTokens: 4, Target: study.Target{Direct: true, Replica: 1}})
	require.NoError(t, err)
	for _, o := range outs {
		require.True(t, study.Complete(o, 4), o.Err)
		assert.Greater(t, o.PromptTokens, 1000, "tiktoken counts the seed prompt in thousands")
	}
	require.NoError(t, w.WaitIdle(context.Background()))
	require.NoError(t, w.ResetCaches(context.Background()))
	require.NoError(t, w.Close())
	require.NoError(t, w.Close())

	bad := live.DefaultConfig()
	bad.Mode = "gossip"
	_, err = live.Start(context.Background(), bad)
	assert.ErrorIs(t, err, live.ErrInvalidConfig)
}

// startHybridCluster starts gateways clustered gateways in hybrid mode
// on fast engines, closed when the test ends.
func startHybridCluster(t *testing.T, gateways int) *live.World {
	t.Helper()
	lc := live.DefaultConfig()
	lc.Profile = "fast"
	lc.Speed = 50
	lc.Mode = "hybrid"
	lc.Gateways = gateways
	w, err := live.Start(context.Background(), lc)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, w.Close()) })
	return w
}

// TestClusterSettle starts three clustered gateways in hybrid mode, lets a
// routed request through gateway 0 and direct engine traffic establish
// state, and checks that Settle returns only once every gateway's index
// holds the same history and confirmed entries.
func TestClusterSettle(t *testing.T) {
	ctx := context.Background()
	w := startHybridCluster(t, 3)
	for _, n := range w.Nodes() {
		require.NotNil(t, n.Cluster(), "clustered gateways run sync")
		assert.Len(t, n.Cluster().Members(), 3)
	}
	d := study.Document{Number: 0, Salt: study.Salt(7, "settle", 0, 0)}
	outs, err := study.Do(ctx, w,
		study.Request{Prompt: d.Prompt(1), MaxTokens: 2, Target: study.Target{Gateway: 0, Strategy: "prefix-cache"}},
		study.Request{Prompt: d.Prompt(2), MaxTokens: 2, Target: study.Target{Direct: true, Replica: 0}},
		study.Request{Prompt: d.Prompt(3), MaxTokens: 2, Target: study.Target{Direct: true, Replica: 1}})
	require.NoError(t, err)
	for _, o := range outs {
		require.True(t, study.Complete(o, 2), o.Err)
	}
	require.NoError(t, w.WaitIdle(ctx))
	require.NoError(t, w.Settle(ctx))
	for _, name := range w.Replicas() {
		var want []index.BlockKey
		for i, n := range w.Nodes() {
			id, ok := n.ReplicaID(name)
			require.True(t, ok)
			got := n.Index().AppendReplicaKeys(nil, id, index.Confirmed)
			slices.Sort(got)
			if i == 0 {
				want = got
				assert.NotEmpty(t, want, "engine %s's KV events reached gateway 0", name)
				continue
			}
			assert.Equal(t, want, got, "gateway %d's confirmed entries for %s", i, name)
		}
	}
}

// TestIsolatedGatewaysShareNothing: with Isolated, several gateways run
// standalone and Settle has nothing to wait for.
func TestIsolatedGatewaysShareNothing(t *testing.T) {
	lc := live.DefaultConfig()
	lc.Profile = "fast"
	lc.Speed = 50
	lc.Gateways = 2
	lc.Isolated = true
	w, err := live.Start(context.Background(), lc)
	require.NoError(t, err)
	defer func() { require.NoError(t, w.Close()) }()
	for _, n := range w.Nodes() {
		assert.Nil(t, n.Cluster())
	}
	require.NoError(t, w.Settle(context.Background()))
}

// TestLiveClusterGrid runs a small grid with one gateway, three synced
// gateways and three isolated gateways, and checks results.json's
// invariants and the cells' labels.
func TestLiveClusterGrid(t *testing.T) {
	if testing.Short() && raceEnabled {
		t.Skip("three clusters of three gateways under the race detector; skipped under -race -short")
	}
	cfg, lc := tinyConfig()
	cfg.Scenarios = []string{study.ScenarioWarm, study.ScenarioHot50}
	cfg.Strategies = []string{"prefix-cache", "cost"}
	cfg.Modes = []string{"hybrid"}
	cfg.Gateways = []int{1, 3}
	cfg.Sync = []string{study.SyncSynced, study.SyncIsolated}
	cfg.Arrivals = 8
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rn := &study.Runner{Config: cfg, Factory: live.Factory(lc)}
	start := time.Now()
	res, err := rn.Run(ctx)
	require.NoError(t, err)
	t.Logf("cluster grid: %d runs in %s", len(res.Runs), time.Since(start).Round(time.Millisecond))

	cells := map[string]int{}
	for _, p := range res.Phases {
		require.True(t, p.Measured, "%s: %s", p.Name, p.Error)
		if p.Gateways == 3 && !p.Isolated {
			assert.Greater(t, p.SettleMS, 0.0, "%s: synced phases wait for the peers", p.Name)
		} else {
			assert.Zero(t, p.SettleMS, "%s: nothing to settle", p.Name)
		}
	}
	require.Len(t, res.Runs, 3*len(cfg.Scenarios)*len(cfg.Strategies), "three cells: g1, g3 synced, g3 isolated")
	for _, r := range res.Runs {
		name := r.Key().PhaseName()
		cells[fmt.Sprintf("g%d isolated=%v", r.Gateways, r.Isolated)]++
		assert.Equal(t, r.Arrivals, r.Succeeded+r.Failed, name)
		assert.Equal(t, r.Arrivals, r.Succeeded, "%s: nothing fails on an idle fast engine", name)
		assert.False(t, math.IsNaN(float64(r.TokenHitRate)), name)
		sum := 0
		for _, c := range r.PerReplica {
			sum += c
		}
		assert.Equal(t, r.Succeeded, sum, name)
		if r.Gateways == 3 {
			assert.Equal(t, r.Isolated, strings.HasSuffix(name, "-isolated"), name)
		}
	}
	assert.Equal(t, map[string]int{"g1 isolated=false": 4, "g3 isolated=false": 4, "g3 isolated=true": 4}, cells)
	// Gateways are used round-robin: every gateway served arrivals.
	gws := map[string]map[int]bool{}
	for _, rec := range res.Requests {
		k := fmt.Sprintf("g%d/%v", rec.Gateways, rec.Isolated)
		if gws[k] == nil {
			gws[k] = map[int]bool{}
		}
		gws[k][rec.Gateway] = true
	}
	assert.Len(t, gws["g3/false"], 3)
	assert.Len(t, gws["g3/true"], 3)

	var md strings.Builder
	study.WriteTables(&md, res)
	out := md.String()
	assert.Contains(t, out, "hot50 — hybrid · 1 gateway")
	assert.Contains(t, out, "hot50 — hybrid · 3 gateways, synced (shared index)")
	assert.Contains(t, out, "hot50 — hybrid · 3 gateways, isolated (no shared index)")

	dir := t.TempDir()
	require.NoError(t, study.WriteFiles(dir, res))
	f, err := os.Open(filepath.Join(dir, study.FileRequests))
	require.NoError(t, err)
	recs, err := study.ReadRequests(f)
	require.NoError(t, f.Close())
	require.NoError(t, err)
	back, diffs := study.Recompute(recs, cfg.SLO, res)
	assert.Empty(t, diffs)
	assert.Len(t, back.Runs, len(res.Runs), "isolated and synced phases stay apart offline")
}

// TestSettleSaysWhyItWaits: when the gateways' indexes disagree past the
// timeout, Settle's error names the entries that differ and, for each
// gateway, whether its NATS connection is up and which engines' KV
// streams it owns: what a stalled replication needs to be diagnosed.
func TestSettleSaysWhyItWaits(t *testing.T) {
	ctx := context.Background()
	w := startHybridCluster(t, 2)
	// An entry only gateway 1 holds: recorded in its index directly, so
	// nothing replicates it and the indexes cannot agree.
	g1 := w.Nodes()[1]
	name := w.Replicas()[0]
	id, ok := g1.ReplicaID(name)
	require.True(t, ok)
	require.NoError(t, g1.Index().Record([]index.BlockKey{42}, id, index.History, time.Now().UnixNano()))

	short, cancel := context.WithTimeout(ctx, 2*time.Second) // it cannot converge
	defer cancel()
	err := w.Settle(short)
	require.ErrorIs(t, err, live.ErrNotConverged)
	msg := err.Error()
	assert.Contains(t, msg, g1.NodeID()+" "+name+"/history: 1 entries, gateway 0 has 0")
	for _, n := range w.Nodes() {
		assert.Contains(t, msg, n.NodeID()+": NATS up, owns KV of [", "each gateway's bus state")
	}
}
