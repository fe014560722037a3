package scenarios

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/node"
)

// awaitVersion waits until every live gateway applies config version v
// and returns when that happened.
func awaitVersion(t *testing.T, c *cluster.Cluster, v uint64) time.Time {
	t.Helper()
	require.Eventually(t, func() bool {
		for _, g := range c.Gateways() {
			if g.Node.ConfigVersion() < v {
				return false
			}
		}
		return true
	}, 10*time.Second, time.Millisecond, "config v%d applied everywhere: %s", v, c.ConfigVersions())
	return time.Now()
}

// TestScaleOutAndIn (scenario 5): under a steady streaming load over the
// live gateways, the gateway tier grows 3 → 5 and shrinks back to 3
// (graceful stops), an engine is added through the raft config (it gets
// traffic and every gateway's index of it fills) and an original engine is
// removed (its in-flight streams finish; nothing is routed to it once the
// removal is applied). No request fails or is lost; the cluster ends exact
// with one config version.
func TestScaleOutAndIn(t *testing.T) {
	c := startClusterMode(t, 3, 2, nil)
	ctx := context.Background()
	n := scale(300, 2000)
	lc := loadConfig(c, "scale", n)
	lc.Target = liveTarget(c)
	lc.MaxTokens = 100
	lc.Concurrency = 8
	// least-request, so that an added engine gets traffic at once (with
	// prefix-cache every tenant already has a home).
	lc.Header = func(_ int, h http.Header) { h.Set(node.HeaderStrategy, "least-request") }
	load, err := cluster.StartLoad(ctx, lc)
	require.NoError(t, err)
	defer load.Stop()
	step := func(k int) {
		require.Eventually(t, func() bool { return load.Completed() >= k*n/6 }, 60*time.Second, 5*time.Millisecond)
	}
	var catch time.Duration

	// Gateways 3 → 5.
	step(1)
	var added []*cluster.Gateway
	for range 2 {
		g, err := c.AddGateway(ctx)
		require.NoError(t, err)
		added = append(added, g)
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	require.NoError(t, c.WaitReady(rctx))
	cancel()
	for _, g := range added {
		start := time.Now()
		awaitWithin1pct(t, c, g.Name, start.Add(5*time.Second))
		catch = max(catch, time.Since(start))
	}

	// Engine scale-out through the raft config.
	step(2)
	ne, err := c.AddEngine(ctx)
	require.NoError(t, err)
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	v, err := c.AddReplicaToConfig(wctx, ne)
	cancel()
	require.NoError(t, err)
	awaitVersion(t, c, v)
	// Every gateway routes to it: a few random-strategy requests through
	// each until one lands there (the load may already be past its middle
	// on a fast machine).
	for _, g := range c.Gateways() {
		got := false
		for k := 0; k < 60 && !got; k++ {
			h := http.Header{}
			h.Set(node.HeaderStrategy, "random")
			rep, err := c.CompleteWithHeader(ctx, g.URL(), prompt("probe-"+g.Name, k), 1, h)
			require.NoError(t, err)
			got = rep == ne.Name
		}
		require.True(t, got, "gateway %s routes to the added engine %s", g.Name, ne.Name)
	}

	// Gateways 5 → 3: the two added ones leave gracefully (the first
	// three are the raft voters).
	step(3)
	for _, g := range added {
		sctx, cancel := context.WithTimeout(ctx, 15*time.Second) // see TestGatewayKillAndRestart
		require.NoError(t, c.StopGateway(sctx, g))
		cancel()
	}

	// Engine scale-in: e0 leaves the config; its streams finish.
	step(4)
	gone := c.Engines()[0]
	wctx, cancel = context.WithTimeout(ctx, 20*time.Second)
	v, err = c.RemoveReplicaFromConfig(wctx, gone)
	cancel()
	require.NoError(t, err)
	removedAt := awaitVersion(t, c, v)

	res := load.Wait()
	require.Zero(t, res.Lost, res.String())
	require.Equal(t, res.Sent, res.OK, "scale-out and scale-in break no request: %s", res)
	toNew, toGoneAfter, drained := 0, 0, 0
	for _, r := range res.Results {
		if r.Replica == gone.Name && r.Start.Before(removedAt) && r.Start.Add(r.Duration).After(removedAt) {
			drained++ // in flight when the removal applied, and ended ok
		}
		if r.Replica == ne.Name {
			toNew++
		}
		if r.Replica == gone.Name && r.Start.After(removedAt) {
			toGoneAfter++
		}
	}
	require.Zero(t, toGoneAfter, "no request routed to the removed engine after the removal applied")

	settleWithin(t, c, "after scaling", 20*time.Second)
	s, took := awaitWithin(t, c, "after scaling", 5*time.Second, c.Exact)
	require.Eventually(t, c.ConfigConverged, 10*time.Second, 5*time.Millisecond, c.ConfigVersions())
	row(t, cluster.Row{
		Scenario: "5 scale-out/in", Load: res, Precision: s.MinPrecision, Recall: s.MinRecall, Converge: max(took, catch),
		ConfigVersions: c.ConfigVersions(),
		Note: fmt.Sprintf("gateways 3->5->3, engine %s added (%d load requests; every gateway routes to it), %s removed (%d streams in flight finished, 0 routed after); new gateways within 1%% of peers after <= %v",
			ne.Name, toNew, gone.Name, drained, catch.Round(time.Millisecond)),
	})
}
