package suite

import (
	"context"
	"fmt"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	kvsync "github.com/kvmesh/kvmesh/sync"
)

func natsConnected(c *cluster.Cluster) int {
	n := 0
	for _, g := range c.Gateways() {
		if g.Node.Cluster().NATSConnected() {
			n++
		}
	}
	return n
}

// NATSOutage (scenario 7): three clustered gateways share one NATS
// server behind a fault proxy. NATS goes away (connections cut, new ones
// refused) while clients keep sending: every request still gets a
// complete answer (gateways route on their own view; each engine's owner
// keeps ingesting its events). Without NATS the non-owners' views of the
// engines go stale. When NATS comes back, every gateway reconnects and
// every gateway's index converges to exactly each engine's cached set.
func natsOutage(t *R) {
	cfg := cluster.DefaultConfig()
	cfg.Gateways, cfg.Engines = 3, 2
	cfg.ClusterMode = true
	cfg.ExternalNATS = true
	cfg.DataDir = t.TempDir()
	c := startCluster(t, cfg)
	ctx := context.Background()
	require.Eventually(t, func() bool { return natsConnected(c) == 3 }, 10*time.Second, 5*time.Millisecond)

	var total cluster.LoadResult
	var worst time.Duration
	var during, last cluster.Summary
	var failed error
	rounds := t.Scale(1, 3)
	for round := range rounds {
		res, err := cluster.RunLoad(ctx, loadConfig(c, fmt.Sprintf("nats-before-%d", round), t.Scale(60, 300)))
		require.NoError(t, err)
		total.Add(res)
		settle(t, c, "before the outage")

		// Outage: NATS refuses and every connection is cut.
		require.NoError(t, c.NATS.SetRefuse(true))
		c.NATS.Cut()
		require.Eventually(t, func() bool { return natsConnected(c) == 0 }, 10*time.Second, 5*time.Millisecond,
			"gateways notice the outage")
		res, err = cluster.RunLoad(ctx, loadConfig(c, fmt.Sprintf("nats-during-%d", round), t.Scale(120, 600)))
		require.NoError(t, err)
		total.Add(res)
		require.Equal(t, res.Sent, res.OK, "gateways serve through a NATS outage: %s", res)
		ps, err := c.Compare()
		require.NoError(t, err)
		during = cluster.Summarize(ps)
		// Each engine's owner ingests it directly: its view stays exact,
		// once the engine's last events (published after the last
		// response) arrived over ZMQ; NATS is still down meanwhile.
		var members []string
		for _, g := range c.Gateways() {
			members = append(members, g.Node.NodeID())
		}
		ownersExact := func() (bool, string) {
			ps, err := c.Compare()
			if err != nil {
				return false, err.Error()
			}
			for _, p := range ps {
				if p.Gateway == kvsync.Owner(p.Engine, members) && !c.Exact(p) {
					return false, fmt.Sprintf("owner %s of %s: %s", p.Gateway, p.Engine, p.Comparison)
				}
			}
			return true, ""
		}
		tick := time.NewTicker(5 * time.Millisecond)
		ok, why := ownersExact()
		for deadline := time.Now().Add(2 * time.Second); !ok && time.Now().Before(deadline); ok, why = ownersExact() {
			<-tick.C
		}
		tick.Stop()
		require.True(t, ok, "during the outage: %s", why)
		require.Zero(t, natsConnected(c), "still during the outage")

		// Recovery.
		healed := time.Now()
		require.NoError(t, c.NATS.SetRefuse(false))
		require.Eventually(t, func() bool { return natsConnected(c) == 3 }, 20*time.Second, 5*time.Millisecond,
			"gateways reconnect to NATS")
		// Converge: every gateway exact for every engine (engines keep
		// publishing), within 10 s of the heal.
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		var convErr error
		for _, e := range c.Engines() {
			if err := c.WaitHeard(wctx, e, func() bool { return c.EngineExact(e) }); err != nil && convErr == nil {
				convErr = fmt.Errorf("engine %s: %w", e.Name, err)
			}
		}
		cancel()
		ps, err = c.Compare()
		require.NoError(t, err)
		last = cluster.Summarize(ps)
		worst = max(worst, time.Since(healed))
		if convErr != nil {
			for _, p := range ps {
				t.Logf("after the heal %s/%s: %s", p.Gateway, p.Engine, p.Comparison)
			}
			failed = fmt.Errorf("round %d: not converged 10 s after NATS came back (%s): %w", round, last, convErr)
			break
		}
	}
	res := cluster.Row{
		Scenario: "7 nats-outage", Load: total, Precision: last.MinPrecision, Recall: last.MinRecall, Converge: worst,
		ConfigVersions: c.ConfigVersions(),
		Note: fmt.Sprintf("%d outages; during the outage the worst view was precision %.4f recall %.4f; converge = heal to exact on every gateway",
			rounds, during.MinPrecision, during.MinRecall),
	}
	if failed != nil {
		res.Note = "NOT CONVERGED after the heal; " + res.Note
	}
	require.Eventually(t, c.ConfigConverged, 10*time.Second, 5*time.Millisecond, c.ConfigVersions())
	res.ConfigVersions = c.ConfigVersions()
	t.Row(res)
	require.NoError(t, failed, "gateways did not converge to the engines' true block sets after the heal")
}
