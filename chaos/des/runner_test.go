package des

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
)

// runStudy runs cfg on DES engines built from o and returns the results
// and results.json's bytes.
func runStudy(t testing.TB, cfg study.Config, o Options) (*study.Results, []byte) {
	t.Helper()
	cfg = StudyConfig(cfg, o)
	require.NoError(t, cfg.Validate())
	rn := &study.Runner{Config: cfg, Factory: Factory(o)}
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
