package live_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/chaos/study/live"
	"github.com/kvmesh/kvmesh/node"
	"github.com/kvmesh/kvmesh/route"
)

// TestEPPRoutesLikeTheProxy runs the seed's hot50 workload through two
// clustered kvmesh gateways twice: as proxies, and as endpoint pickers
// behind Envoy-style data planes (chaos/extproc over real ext_proc gRPC
// streams). The routing quality must be the same within the run-to-run
// noise of a live study.
func TestEPPRoutesLikeTheProxy(t *testing.T) {
	if testing.Short() && raceEnabled {
		t.Skip("two clusters of two gateways under the race detector; skipped under -race -short")
	}
	cfg, lc := tinyConfig()
	cfg.Scenarios = []string{study.ScenarioHot50}
	cfg.Strategies = []string{"prefix-cache", "cost"}
	cfg.Modes = []string{"history"}
	cfg.Gateways = []int{2}
	cfg.Sync = []string{study.SyncSynced}
	cfg.Arrivals = 48
	// At speed 20 the TTFT SLO is 100 ms of wall time, which a busy host's
	// scheduling hiccups alone can miss; at 5 it is 400 ms, so that the
	// comparison measures routing, not the host.
	cfg.Speed, lc.Speed = 5, 5
	// prefix-cache's imbalance gate trips on in-flight requests, and how
	// many are in flight is the host's speed. An oversubscribed CI run's
	// proxy pass split A:21 B:27 against the EPP pass's A:12 B:36: more
	// than 16 apart in flight, the gate sends a hot request to the other
	// replica, and from then on both hold the hot prefix. Engines slowed
	// 1,250× (simulator speed 0.004 against the study's 5) give the same
	// A:21 B:27. Out of reach, the gate leaves prefix-cache picking by the
	// index alone, which is what the two passes must share; cost still
	// weighs load.
	lc.TuneNode = func(c *node.Config) { c.Route.PrefixCache.ImbalanceAbsCount = cfg.Arrivals }
	run := func(epp bool) map[string]study.Run {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		l := lc
		l.EPP = epp
		res, err := (&study.Runner{Config: cfg, Factory: live.Factory(l)}).Run(ctx)
		require.NoError(t, err)
		out := map[string]study.Run{}
		for _, r := range res.Runs {
			require.Equal(t, r.Arrivals, r.Succeeded, "%s epp=%v: nothing fails on an idle fast engine", r.Strategy, epp)
			out[r.Strategy] = r
		}
		return out
	}
	proxy, epp := run(false), run(true)
	for _, s := range cfg.Strategies {
		p, e := proxy[s], epp[s]
		t.Logf("%s: proxy pass %d hit %.3f per replica %v sel %v wait %v | epp pass %d hit %.3f per replica %v sel %v wait %v", s,
			p.SLOPass, float64(p.TokenHitRate), p.PerReplica, p.Selection, p.MaxWaiting, e.SLOPass, float64(e.TokenHitRate), e.PerReplica, e.Selection, e.MaxWaiting)
		assert.InDelta(t, float64(p.TokenHitRate), float64(e.TokenHitRate), 0.1, "%s: token hit rate", s)
		// SLO passes are logged, not compared: the TTFT SLO is wall time,
		// and on a busy host (an oversubscribed CI run: proxy 48, EPP 34
		// of 48 with equal hit rates) the extra data-plane hop misses it
		// for the host's sake, not the picker's. How the requests spread
		// over the replicas is the picker's, as long as the host left
		// the engines fast enough that load moved nothing: cost spreads a
		// hot prefix once requests pile up (engines slowed 250×: A:24
		// B:24), and only one pass may have been slowed.
		label := s + "/" + route.SelectionCostSpread.String()
		spread := p.Selection[label] + e.Selection[label]
		if spread > 0 {
			t.Logf("%s: %d requests spread for load; the busiest replicas are not compared", s, spread)
			continue
		}
		assert.InDelta(t, busiest(p.PerReplica), busiest(e.PerReplica), float64(cfg.Arrivals)/8, "%s: requests on the busiest replica", s)
	}
}

// busiest is the most requests any replica served.
func busiest(perReplica map[string]int) int {
	most := 0
	for _, n := range perReplica {
		most = max(most, n)
	}
	return most
}
