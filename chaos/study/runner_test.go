package study_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/chaos/study/studytest"
)

func toyFactory(mod func(*studytest.Toy)) study.EngineFactory {
	return func(_ context.Context, c study.Cell) (study.Engine, error) {
		t := studytest.NewToy(c.Replicas, c.Gateways, 7)
		if mod != nil {
			mod(t)
		}
		return t, nil
	}
}

func smallConfig() study.Config {
	c := study.DefaultConfig()
	c.Engine = "toy"
	c.Scenarios = study.Scenarios
	c.Strategies = []string{"random", "least-request", "prefix-cache"}
	c.Modes = []string{"history"}
	return c
}

// checkInvariants asserts what every results.json must satisfy.
func checkInvariants(t *testing.T, res *study.Results) {
	t.Helper()
	for _, r := range res.Runs {
		name := r.Key().PhaseName()
		assert.Equal(t, r.Arrivals, r.Succeeded+r.Failed, name)
		assert.LessOrEqual(t, r.SLOPass, r.Succeeded, name)
		sum := 0
		for _, c := range r.PerReplica {
			sum += c
		}
		assert.GreaterOrEqual(t, sum, r.Succeeded, "%s: every success has a replica", name)
		assert.LessOrEqual(t, sum, r.Arrivals, name)
		assert.Len(t, r.MaxWaiting, r.Replicas, name)
	}
}

func TestRunnerToyGrid(t *testing.T) {
	cfg := smallConfig()
	var prog bytes.Buffer
	rn := &study.Runner{Config: cfg, Factory: toyFactory(nil), Progress: study.NewProgress(&prog)}
	res, err := rn.Run(context.Background())
	require.NoError(t, err)
	require.Len(t, res.Runs, 2*len(cfg.Scenarios)*3)
	checkInvariants(t, res)

	// Round 2 runs the strategies in reverse.
	var order []string
	for _, r := range res.Runs {
		if r.Round == 2 && r.Scenario == study.ScenarioCold {
			order = append(order, r.Strategy)
		}
	}
	assert.Equal(t, []string{"prefix-cache", "least-request", "random"}, order)

	for _, r := range res.Runs {
		name := r.Key().PhaseName()
		switch r.Scenario {
		case study.ScenarioMultiturn:
			assert.Equal(t, 100, r.Arrivals, "96 arrivals → 20 sessions × 5 turns")
		default:
			assert.Equal(t, 96, r.Arrivals, name)
		}
		assert.False(t, r.TokenHitRate != r.TokenHitRate, "%s: hit rate computed", name)
		if r.Strategy == "prefix-cache" && r.Scenario == study.ScenarioHot90 {
			// The toy's history routing keeps the hot group on B.
			assert.GreaterOrEqual(t, r.PerReplica["B"], 86, name)
			assert.NotEmpty(t, r.Selection, name)
		}
	}
	for _, p := range res.Phases {
		require.True(t, p.Measured, p.Name)
		switch p.Scenario {
		case study.ScenarioHot50, study.ScenarioHot90:
			require.Len(t, p.Init.Home, 8)
			assert.Equal(t, "B", p.Init.Home[0], "hot group lives on B")
			nb := strings.Count(strings.Join(p.Init.Home, ""), "B")
			assert.Equal(t, 4, nb, "four groups per side")
			assert.Len(t, p.Init.Candidates, 16)
		case study.ScenarioWarm:
			assert.Len(t, p.Init.Bootstrap, 8)
		}
		assert.NotEmpty(t, p.Samples, p.Name)
	}
	assert.Contains(t, prog.String(), "phase r1-cold-random@history/g1")

	dir := t.TempDir()
	require.NoError(t, study.WriteFiles(dir, res))

	// results.json has exactly the keys.
	raw, err := os.ReadFile(filepath.Join(dir, study.FileResults))
	require.NoError(t, err)
	var generic struct {
		SchemaVersion int                          `json:"schema_version"`
		Runs          []map[string]json.RawMessage `json:"runs"`
		Config        map[string]json.RawMessage   `json:"config"`
	}
	require.NoError(t, json.Unmarshal(raw, &generic))
	require.Equal(t, study.ResultsSchemaVersion, generic.SchemaVersion)
	// The keys plus "sync" (schema 2: every axis of a run).
	want := []string{"scenario", "round", "strategy", "mode", "gateways", "replicas", "arrivals", "succeeded",
		"failed", "slo_pass", "ttft_p95_s", "tpot_p95_ms", "e2e_p95_s", "token_hit_rate", "per_replica",
		"selection", "max_waiting", "sync"}
	for _, r := range generic.Runs {
		var keys []string
		for k := range r {
			keys = append(keys, k)
		}
		assert.ElementsMatch(t, want, keys)
	}
	assert.NotEmpty(t, generic.Config)

	// recompute from requests.jsonl reproduces results.json.
	f, err := os.Open(filepath.Join(dir, study.FileRequests))
	require.NoError(t, err)
	defer f.Close()
	recs, err := study.ReadRequests(f)
	require.NoError(t, err)
	assert.Len(t, recs, len(res.Requests))
	again, diffs := study.Recompute(recs, cfg.SLO, res)
	assert.Empty(t, diffs)
	assert.Len(t, again.Runs, len(res.Runs))

	md, err := os.ReadFile(filepath.Join(dir, study.FileReport))
	require.NoError(t, err)
	assert.Contains(t, string(md), "## Calibration")
	assert.Contains(t, string(md), "**hot50**: best")
	h, err := os.ReadFile(filepath.Join(dir, study.FileHTML))
	require.NoError(t, err)
	assert.Contains(t, string(h), "<svg")
	assert.NotContains(t, string(h), "<script")
	assert.NotContains(t, strings.ReplaceAll(string(h), `xmlns="http://www.w3.org/2000/svg"`, ""), "http",
		"the report must not reference anything online")
}

func TestInflightCapMakesUnsentFailures(t *testing.T) {
	cfg := smallConfig()
	cfg.Scenarios = []string{study.ScenarioCold}
	cfg.Strategies = []string{"least-request"}
	cfg.Rounds = 1
	cfg.Arrivals = 20
	cfg.InflightCap = 3
	rn := &study.Runner{Config: cfg, Factory: toyFactory(func(t *studytest.Toy) {
		t.Slots = 1
		t.TokenTime = 100 * time.Millisecond // 12.7 s per request: the cap fills up
	})}
	res, err := rn.Run(context.Background())
	require.NoError(t, err)
	require.Len(t, res.Runs, 1)
	r := res.Runs[0]
	unsent := 0
	for _, rec := range res.Requests {
		if !rec.Sent {
			unsent++
			assert.False(t, rec.Pass)
		}
	}
	assert.Greater(t, unsent, 0)
	assert.Equal(t, 20, r.Arrivals)
	assert.Equal(t, 20-unsent, r.Succeeded)
	assert.Equal(t, unsent, r.Failed)
	assert.Equal(t, unsent, res.Phases[0].Unsent)
}

func TestHotInitRetriesWithFreshSalts(t *testing.T) {
	cfg := smallConfig()
	cfg.Scenarios = []string{study.ScenarioHot50}
	cfg.Strategies = []string{"least-request"}
	cfg.Rounds = 1
	calls := 0
	var firstSalts, laterSalts []string
	rn := &study.Runner{Config: cfg, Factory: toyFactory(func(t *studytest.Toy) {
		t.Route = func(t *studytest.Toy, req study.Request) int {
			calls++
			if calls <= 32 { // attempt 1: every candidate on A (16 / 0)
				firstSalts = append(firstSalts, req.Prompt[:256])
				return 0
			}
			if calls <= 64 {
				laterSalts = append(laterSalts, req.Prompt[:256])
				return ((calls - 33) / 2) % 2 // attempt 2: alternate pairs
			}
			return t.InflightOf(0) % 2
		}
	})}
	res, err := rn.Run(context.Background())
	require.NoError(t, err)
	require.Len(t, res.Runs, 1)
	p := res.Phases[0]
	assert.Equal(t, 2, p.Init.Attempts)
	assert.NotEqual(t, firstSalts[0], laterSalts[0], "a retry uses fresh salts")
	assert.Equal(t, "B", p.Init.Home[0])
}

func TestHotInitGivesUpAfterRetries(t *testing.T) {
	cfg := smallConfig()
	cfg.Scenarios = []string{study.ScenarioHot90, study.ScenarioCold}
	cfg.Strategies = []string{"random"}
	cfg.Rounds = 1
	var toy *studytest.Toy
	rn := &study.Runner{Config: cfg, Factory: toyFactory(func(t *studytest.Toy) {
		toy = t
		t.Route = func(*studytest.Toy, study.Request) int { return 0 }
	})}
	res, err := rn.Run(context.Background())
	require.NoError(t, err, "an initialisation failure skips the phase, not the study")
	require.Len(t, res.Phases, 2)
	assert.False(t, res.Phases[0].Measured)
	assert.Equal(t, 4, res.Phases[0].Init.Attempts, "one try and three retries")
	assert.Contains(t, res.Phases[0].Error, "study: scenario initialisation failed")
	assert.True(t, res.Phases[1].Measured)
	require.Len(t, res.Runs, 1)
	assert.Equal(t, study.ScenarioCold, res.Runs[0].Scenario)
	assert.Equal(t, 4+1, toy.Resets, "reset per attempt, then per phase")
	var md bytes.Buffer
	require.NoError(t, study.WriteMarkdown(&md, res))
	assert.Contains(t, md.String(), "Not measured")
}

func TestMultiturnAbortsSessionAfterFailedTurn(t *testing.T) {
	cfg := smallConfig()
	cfg.Scenarios = []string{study.ScenarioMultiturn}
	cfg.Strategies = []string{"prefix-cache"}
	cfg.Rounds = 1
	cfg.Arrivals = 10 // 2 sessions × 5 turns
	var prompts []string
	rn := &study.Runner{Config: cfg, Factory: toyFactory(func(t *studytest.Toy) {
		t.Drop = func(req study.Request) bool {
			prompts = append(prompts, req.Prompt)
			// Turn 3 of session 1 fails.
			return strings.Contains(req.Prompt, "Session 000001.") && strings.Count(req.Prompt, "User:") == 3
		}
	})}
	res, err := rn.Run(context.Background())
	require.NoError(t, err)
	r := res.Runs[0]
	assert.Equal(t, 10, r.Arrivals)
	assert.Equal(t, 7, r.Succeeded, "session 1: 2 ok + 1 failed + 2 aborted; session 2: 5 ok")
	assert.Equal(t, 3, r.Failed)
	var s1 []study.RequestRecord
	for _, rec := range res.Requests {
		if rec.Session == 1 {
			s1 = append(s1, rec)
		}
	}
	require.Len(t, s1, 5)
	assert.True(t, s1[2].Sent)
	assert.False(t, s1[3].Sent)
	assert.False(t, s1[4].Sent)
	// Each turn's prompt extends the previous one.
	var sess2 []string
	for _, p := range prompts {
		if strings.Contains(p, "Session 000002.") {
			sess2 = append(sess2, p)
		}
	}
	require.Len(t, sess2, 5)
	for i := 1; i < 5; i++ {
		assert.True(t, strings.HasPrefix(sess2[i], sess2[i-1]), "turn %d grows turn %d", i+1, i)
	}
}

// checkedToy is a Toy that reports a host check.
type checkedToy struct {
	*studytest.Toy
	ratio float64
}

func (c checkedToy) HostCheck(context.Context) (study.HostCheck, error) {
	return study.HostCheck{ModelledTPOTms: 40, MeasuredTPOTms: 40 * c.ratio, Ratio: c.ratio,
		OK: c.ratio <= study.HostCheckTolerance}, nil
}

func TestRunnerRecordsHostChecks(t *testing.T) {
	cfg := smallConfig()
	cfg.Scenarios = []string{study.ScenarioCold}
	cfg.Strategies = []string{"random"}
	cfg.Modes = []string{"history", "hybrid"}
	cfg.Rounds = 1
	cfg.Arrivals = 4
	ratios := []float64{1.02, 1.6}
	var prog bytes.Buffer
	rn := &study.Runner{Config: cfg, Progress: study.NewProgress(&prog),
		Factory: func(_ context.Context, c study.Cell) (study.Engine, error) {
			r := ratios[0]
			ratios = ratios[1:]
			return checkedToy{studytest.NewToy(c.Replicas, c.Gateways, 1), r}, nil
		}}
	res, err := rn.Run(context.Background())
	require.NoError(t, err)
	require.Len(t, res.Config.HostChecks, 2)
	assert.Equal(t, "history/g1", res.Config.HostChecks[0].Cell)
	assert.True(t, res.Config.HostChecks[0].OK)
	assert.False(t, res.Config.HostChecks[1].OK)
	assert.Contains(t, prog.String(), "host check hybrid/g1: probe TPOT 64.0 ms measured vs 40.0 ms modelled (×1.60): TOO SLOW")
	var md bytes.Buffer
	require.NoError(t, study.WriteMarkdown(&md, res))
	assert.Contains(t, md.String(), "TOO SLOW")
}

// TestRunnerWorkersSameResults runs a grid of four cells one at a time and
// on three workers: results.json, requests.jsonl and phases.json must be
// byte-identical, and the cells must come out in cell order.
func TestRunnerWorkersSameResults(t *testing.T) {
	cfg := smallConfig()
	cfg.Scenarios = []string{study.ScenarioCold, study.ScenarioHot50, study.ScenarioMultiturn}
	cfg.Modes = []string{"history", "hybrid"}
	cfg.Gateways = []int{1, 2}
	cfg.Rounds = 1
	cfg.Arrivals = 40
	run := func(workers int) (string, []string) {
		var prog bytes.Buffer
		rn := &study.Runner{Config: cfg, Factory: toyFactory(nil), Progress: study.NewLineProgress(&prog), Workers: workers}
		res, err := rn.Run(context.Background())
		require.NoError(t, err)
		var cells []string
		for _, r := range res.Runs {
			c := study.Cell{Mode: r.Mode, Gateways: r.Gateways, Isolated: r.Isolated}.Name()
			if len(cells) == 0 || cells[len(cells)-1] != c {
				cells = append(cells, c)
			}
		}
		dir := t.TempDir()
		require.NoError(t, study.WriteFiles(dir, res))
		var all strings.Builder
		for _, f := range []string{study.FileResults, study.FileRequests, study.FilePhases} {
			b, err := os.ReadFile(filepath.Join(dir, f))
			require.NoError(t, err)
			all.Write(b)
		}
		require.Equal(t, len(res.Runs), strings.Count(prog.String(), "pass "), "one done line per phase")
		return all.String(), cells
	}
	one, cells := run(1)
	require.Equal(t, []string{"history/g1", "history/g2", "hybrid/g1", "hybrid/g2"}, cells)
	three, cells3 := run(3)
	require.Equal(t, cells, cells3)
	require.Equal(t, one, three, "outputs must not depend on the number of workers")
}

// TestRunnerWorkersStopAtFirstFailingCell: a cell that cannot start stops
// the parallel run as it stops the sequential one: the cells before it are
// kept, none after it.
func TestRunnerWorkersStopAtFirstFailingCell(t *testing.T) {
	cfg := smallConfig()
	cfg.Scenarios = []string{study.ScenarioCold}
	cfg.Modes = []string{"history", "hybrid", "kv-events"}
	cfg.Rounds = 1
	cfg.Arrivals = 20
	errBoom := errors.New("boom")
	factory := func(ctx context.Context, c study.Cell) (study.Engine, error) {
		if c.Mode == "hybrid" {
			return nil, errBoom
		}
		return toyFactory(nil)(ctx, c)
	}
	for _, workers := range []int{1, 2} {
		rn := &study.Runner{Config: cfg, Factory: factory, Workers: workers}
		res, err := rn.Run(context.Background())
		require.ErrorIs(t, err, study.ErrEngine, "workers %d", workers)
		require.Len(t, res.Runs, 3, "workers %d: only the history cell's phases", workers)
		for _, r := range res.Runs {
			require.Equal(t, "history", r.Mode)
		}
	}
}

// TestRunJSONSyncSetting: every run names its sync setting, so the synced
// and isolated runs of one strategy and mode differ in a field, not only
// in their order.
func TestRunJSONSyncSetting(t *testing.T) {
	for _, c := range []struct {
		run  study.Run
		want string
	}{
		{study.Run{Gateways: 1}, "single"},
		{study.Run{Gateways: 8}, "synced"},
		{study.Run{Gateways: 8, Isolated: true}, "isolated"},
	} {
		b, err := json.Marshal(c.run)
		require.NoError(t, err)
		var got struct {
			Sync     string `json:"sync"`
			Gateways int    `json:"gateways"`
		}
		require.NoError(t, json.Unmarshal(b, &got))
		assert.Equal(t, c.want, got.Sync)
		assert.Equal(t, c.run.Gateways, got.Gateways)
	}
}
