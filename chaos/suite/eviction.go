package suite

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/cluster"
)

// EvictionPressure (scenario 1): small KV pools and many distinct
// prompts keep every engine evicting. While the load runs, the suite checks
// at regular steps that every gateway's confirmed entries are true
// (precision >= 0.99) within 1 s; after the load, every gateway holds
// exactly each engine's cached set.
func evictionPressure(t *R) {
	cfg := cluster.DefaultConfig()
	cfg.Gateways, cfg.Engines = 2, 3
	cfg.NumGPUBlocks = 64 // 1,024 tokens: a handful of prompts fill it
	c := startCluster(t, cfg)

	n := t.Scale(240, 2400)
	lc := loadConfig(c, "evict", n)
	var (
		mu       sync.Mutex
		worst    time.Duration
		instant  = 1.0 // lowest precision seen at the moment of a check
		checks   int
		checkErr error
	)
	step := 40
	lc.Pace = func(ctx context.Context, i int) {
		if i == 0 || i%step != 0 {
			return
		}
		// A check while requests are in flight: the index may lag the
		// engine by a step or two, but must be back above 0.99 within 1 s.
		var first float64 = 1
		if ps, err := c.Compare(); err == nil {
			first = cluster.Summarize(ps).MinPrecision
		}
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		_, took, err := c.AwaitTruth(cctx, 5*time.Millisecond, precisionAtLeast(0.99))
		mu.Lock()
		defer mu.Unlock()
		checks++
		worst = max(worst, took)
		instant = min(instant, first)
		if err != nil && checkErr == nil {
			checkErr = fmt.Errorf("check after %d requests: %w", i, err)
		}
	}
	res, err := cluster.RunLoad(context.Background(), lc)
	require.NoError(t, err)
	mu.Lock()
	require.NoError(t, checkErr)
	mu.Unlock()

	s, took := awaitWithin(t, c, "after the load", time.Second, c.Exact)
	worst = max(worst, took)
	removed := c.GatewayCounter("kvmesh_kvevents_events_total", map[string]string{"type": "BlockRemoved"})
	require.Positive(t, removed, "the engines evicted (BlockRemoved events reached the gateways)")
	require.Equal(t, n, res.OK, res.String())
	t.Row(cluster.Row{
		Scenario: "1 eviction-pressure", Load: res, Precision: s.MinPrecision, Recall: s.MinRecall, Converge: worst,
		Note: fmt.Sprintf("%d checks under load (lowest instantaneous precision %.4f), %.0f BlockRemoved events, 3 engines x 64 blocks, 2 gateways",
			checks+1, instant, removed),
	})
}
