package des

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
)

// runStudy runs cfg on DES engines built from o and returns the results
// and results.json's bytes.
func runStudy(t testing.TB, cfg study.Config, o Options) (*study.Results, []byte) {
	t.Helper()
	return runStudyWorkers(t, cfg, o, 1)
}

// runStudyWorkers is runStudy with cells on workers goroutines.
func runStudyWorkers(t testing.TB, cfg study.Config, o Options, workers int) (*study.Results, []byte) {
	t.Helper()
	cfg = StudyConfig(cfg, o)
	require.NoError(t, cfg.Validate())
	rn := &study.Runner{Config: cfg, Factory: Factory(o), Workers: workers}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	res, err := rn.Run(ctx)
	require.NoError(t, err)
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetIndent("", "  ")
	require.NoError(t, enc.Encode(res))
	return res, b.Bytes()
}

// tinyConfig is a CI-fast grid: two scenarios, three strategies, one round
// of 32 arrivals.
func tinyConfig() study.Config {
	c := study.DefaultConfig()
	c.Scenarios = []string{study.ScenarioWarm, study.ScenarioHot50}
	c.Strategies = []string{"least-request", "prefix-cache", "cost"}
	c.Modes = []string{"history", "hybrid"}
	c.Rounds = 1
	c.Arrivals = 32
	return c
}

func TestTinyGridThroughRunner(t *testing.T) {
	res, _ := runStudy(t, tinyConfig(), DefaultOptions())
	require.Len(t, res.Runs, 2*3*2)
	for _, r := range res.Runs {
		require.Equal(t, 32, r.Arrivals, r.Key().PhaseName())
		require.Equal(t, 32, r.Succeeded, r.Key().PhaseName())
		n := 0
		for _, c := range r.PerReplica {
			n += c
		}
		require.Equal(t, 32, n)
		require.NotEmpty(t, r.Selection)
		t.Logf("%-40s pass=%2d ttft95=%.2fs tpot95=%.1fms hit=%.2f per=%v sel=%v", r.Key().PhaseName(), r.SLOPass,
			float64(r.TTFTP95), float64(r.TPOTP95), float64(r.TokenHitRate), r.PerReplica, r.Selection)
	}
}

func TestSameSeedByteIdenticalResults(t *testing.T) {
	cfg := tinyConfig()
	cfg.Scenarios = []string{study.ScenarioCold, study.ScenarioHot50, study.ScenarioMultiturn}
	cfg.Strategies = []string{"random", "prefix-cache", "cost"}
	cfg.Modes = []string{"hybrid"}
	cfg.Gateways = []int{3}
	cfg.Replicas = 3
	cfg.Arrivals = 30
	cfg.Turns = 3
	o := DefaultOptions()
	res1, a := runStudy(t, cfg, o)
	_, b := runStudy(t, cfg, o)
	require.Equal(t, string(a), string(b), "results.json must be byte-identical for the same seed")
	var r1, r2 bytes.Buffer
	require.NoError(t, study.WriteRequests(&r1, res1.Requests))
	res2, _ := runStudy(t, cfg, o)
	require.NoError(t, study.WriteRequests(&r2, res2.Requests))
	require.Equal(t, r1.String(), r2.String(), "requests.jsonl must be identical too")

	// The engine's seed reaches the routing tie-breaks: random routes
	// differently under another seed.
	o.Seed++
	_, c := runStudy(t, cfg, o)
	require.NotEqual(t, string(a), string(c))
}

// TestParallelCellsByteIdentical: cells on two workers (each its own
// World) give the same results.json and requests.jsonl as one after
// another.
func TestParallelCellsByteIdentical(t *testing.T) {
	cfg := tinyConfig()
	cfg.Scenarios = []string{study.ScenarioHot50, study.ScenarioMultiturn}
	cfg.Gateways = []int{1, 2}
	cfg.Replicas = 3
	cfg.Arrivals = 24
	cfg.Turns = 3
	o := DefaultOptions()
	res1, a := runStudyWorkers(t, cfg, o, 1)
	res2, b := runStudyWorkers(t, cfg, o, 2)
	require.Len(t, res1.Runs, 2*3*4)
	require.Equal(t, string(a), string(b), "results.json must not depend on the number of workers")
	var r1, r2 bytes.Buffer
	require.NoError(t, study.WriteRequests(&r1, res1.Requests))
	require.NoError(t, study.WriteRequests(&r2, res2.Requests))
	require.Equal(t, r1.String(), r2.String(), "requests.jsonl must not depend on the number of workers")
}

// plainEngine hides World's SendPrefixed: the driver then joins every
// prompt and calls Send.
type plainEngine struct{ study.Engine }

// TestPrefixSenderSameResults runs a grid with prompts passed as prefix and
// tail (SendPrefixed) and joined (Send): results.json and requests.jsonl
// must be byte-identical.
func TestPrefixSenderSameResults(t *testing.T) {
	cfg := tinyConfig()
	cfg.Scenarios = []string{study.ScenarioCold, study.ScenarioWarm, study.ScenarioHot50, study.ScenarioMultiturn}
	cfg.Gateways = []int{2}
	cfg.Replicas = 3
	cfg.Arrivals = 30
	cfg.Turns = 3
	o := DefaultOptions()
	res1, a := runStudy(t, cfg, o)
	c := StudyConfig(cfg, o)
	rn := &study.Runner{Config: c, Factory: func(ctx context.Context, cell study.Cell) (study.Engine, error) {
		e, err := Factory(o)(ctx, cell)
		return plainEngine{e}, err
	}}
	res2, err := rn.Run(t.Context())
	require.NoError(t, err)
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetIndent("", "  ")
	require.NoError(t, enc.Encode(res2))
	require.Equal(t, string(a), b.String())
	var r1, r2 bytes.Buffer
	require.NoError(t, study.WriteRequests(&r1, res1.Requests))
	require.NoError(t, study.WriteRequests(&r2, res2.Requests))
	require.Equal(t, r1.String(), r2.String())
}

// hitRate runs one phase of prefix-cache in history mode on 4 replicas
// behind 4 gateways and returns its token hit rate.
func hitRate(t *testing.T, noSync bool) float64 {
	cfg := tinyConfig()
	cfg.Scenarios = []string{study.ScenarioCold}
	cfg.Strategies = []string{"prefix-cache"}
	cfg.Modes = []string{"history"}
	cfg.Gateways = []int{4}
	cfg.Replicas = 4
	cfg.Groups = 16
	cfg.Arrivals = 64
	o := DefaultOptions()
	o.NoSync = noSync
	res, _ := runStudy(t, cfg, o)
	return float64(res.Runs[0].TokenHitRate)
}

func TestNoSyncLowersPrefixCacheHitRate(t *testing.T) {
	synced, isolated := hitRate(t, false), hitRate(t, true)
	t.Logf("token hit rate: synced %.3f, isolated %.3f", synced, isolated)
	// Isolated gateways each place every group once on their own, so
	// each group is prefilled cold up to four times instead of once:
	// 16 groups over 64 arrivals cost about 16 vs up to 64 cold prefills.
	require.Greater(t, synced-isolated, 0.1)
}

func TestSweepWritesOneTablePerSetting(t *testing.T) {
	cfg := tinyConfig()
	cfg.Scenarios = []string{study.ScenarioHot50}
	cfg.Strategies = []string{"least-request", "cost"}
	cfg.Modes = []string{"hybrid"}
	cfg.Arrivals = 24
	dir := t.TempDir()
	var log bytes.Buffer
	res, err := Sweep(t.Context(), cfg, DefaultOptions(), SweepAxes{Replicas: []int{2, 4}, Gateways: []int{1, 2}, RPS: []float64{1.6}, ScaleInflightCap: true}, dir, &log)
	require.NoError(t, err)
	require.Len(t, res, 4)
	md, err := os.ReadFile(filepath.Join(dir, "sweep.md"))
	require.NoError(t, err)
	require.Equal(t, 4, strings.Count(string(md), "\n### "), string(md))
	require.Contains(t, string(md), "4 replicas × 2 gateways (synced) @ 1.6 RPS")
	for _, sr := range res {
		require.FileExists(t, filepath.Join(dir, sr.Setting.Name(), study.FileResults))
		require.Equal(t, sr.Setting.Replicas, sr.Results.Config.Replicas)
		require.Len(t, sr.Results.Runs, 2)
	}
	require.Equal(t, 4, strings.Count(log.String(), "sweep r"))
}
