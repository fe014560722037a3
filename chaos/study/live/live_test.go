package live_test

import (
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/chaos/study/live"
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
		assert.Len(t, r, 17, "exactly the issue's fields")
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
