package suite

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/chaos/faultproxy"
	"github.com/kvmesh/kvmesh/chaos/sim"
)

// pct spreads seqs pseudo-randomly over 0..99.
func pct(seq uint64) uint64 { return (seq * 2654435761) % 100 }

// settle keeps each engine publishing until every gateway agrees with it
// exactly (a fault on the last batch of a burst is only noticed when the
// next one arrives), then checks the whole cluster within 1 s.
func settle(t *R, c *cluster.Cluster, step string) (cluster.Summary, time.Duration) {
	return settleWithin(t, c, step, 10*time.Second)
}

// settleWithin is settle with a deadline d; on failure it logs every pair.
func settleWithin(t *R, c *cluster.Cluster, step string, d time.Duration) (cluster.Summary, time.Duration) {
	t.Helper()
	s, took, err := trySettle(t, c, d)
	require.NoError(t, err, step)
	return s, took
}

// trySettle keeps every engine publishing until every gateway agrees with
// it exactly, for at most d. On failure it logs every pair and returns the
// last summary with the error.
func trySettle(t *R, c *cluster.Cluster, d time.Duration) (cluster.Summary, time.Duration, error) {
	t.Helper()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	for _, e := range c.Engines() {
		if err := c.WaitHeard(ctx, e, func() bool { return c.EngineExact(e) }); err != nil {
			ps, cerr := c.Compare()
			for _, p := range ps {
				t.Logf("%s/%s: %s", p.Gateway, p.Engine, p.Comparison)
			}
			return cluster.Summarize(ps), time.Since(start), errors.Join(err, cerr)
		}
	}
	s, took, err := c.AwaitTruth(ctx, 5*time.Millisecond, c.Exact)
	return s, max(took, time.Since(start)), err
}

func relayTotals(c *cluster.Cluster) faultproxy.RelayStats {
	var t faultproxy.RelayStats
	for _, e := range c.Engines() {
		s := e.Relay.Stats()
		t.Received += s.Received
		t.Dropped += s.Dropped
		t.Duplicated += s.Duplicated
		t.Swapped += s.Swapped
		t.Garbled += s.Garbled
	}
	return t
}

// ZMQBatchFaults (scenario 3): KV-event batches lost, duplicated and
// reordered on the wire (a ZMQ relay between each engine's PUB and the
// gateways; replay goes to the engine directly). Lost batches are replayed,
// duplicates dropped, a reorder is taken for a rewind and resynchronised
// by the join replay; after each phase every gateway holds exactly each
// engine's cached set.
func zmqBatchFaults(t *R) {
	cfg := cluster.DefaultConfig()
	cfg.Gateways, cfg.Engines = 2, 2
	cfg.NumGPUBlocks = 128
	cfg.KVLink = cluster.KVRelay
	c := startCluster(t, cfg)
	ctx := context.Background()

	phases := []struct {
		name  string
		fault faultproxy.Fault
	}{
		{"drop 15%", func(seq, _ uint64) faultproxy.Action {
			if pct(seq) < 15 {
				return faultproxy.Drop
			}
			return faultproxy.Forward
		}},
		{"duplicate 15%", func(seq, _ uint64) faultproxy.Action {
			if pct(seq) < 15 {
				return faultproxy.Duplicate
			}
			return faultproxy.Forward
		}},
		{"reorder 5%", func(seq, _ uint64) faultproxy.Action {
			if pct(seq) < 5 {
				return faultproxy.Swap
			}
			return faultproxy.Forward
		}},
		{"mixed", func(seq, _ uint64) faultproxy.Action {
			switch p := pct(seq); {
			case p < 10:
				return faultproxy.Drop
			case p < 20:
				return faultproxy.Duplicate
			case p < 23:
				return faultproxy.Swap
			}
			return faultproxy.Forward
		}},
	}
	var total cluster.LoadResult
	var worst time.Duration
	var last cluster.Summary
	for round := range t.Scale(1, 4) {
		for _, ph := range phases {
			for _, e := range c.Engines() {
				e.Relay.SetFault(ph.fault)
			}
			res, err := cluster.RunLoad(ctx, loadConfig(c, fmt.Sprintf("zmq-%d-%s", round, ph.name), t.Scale(60, 250)))
			require.NoError(t, err)
			total.Add(res)
			for _, e := range c.Engines() {
				e.Relay.SetFault(nil)
			}
			s, took := settle(t, c, ph.name)
			last, worst = s, max(worst, took)
		}
	}
	rs := relayTotals(c)
	require.Positive(t, rs.Dropped)
	require.Positive(t, rs.Duplicated)
	require.Positive(t, rs.Swapped)
	gaps := c.GatewayCounter("kvmesh_kvevents_gaps_total", nil)
	replays := c.GatewayCounter("kvmesh_kvevents_replays_total", map[string]string{"result": "complete"})
	dups := c.GatewayCounter("kvmesh_kvevents_duplicates_total", nil)
	rewinds := c.GatewayCounter("kvmesh_kvevents_resets_total", map[string]string{"reason": "rewind"})
	require.Positive(t, replays, "lost batches were replayed")
	require.Equal(t, total.Sent, total.OK, total.String())
	t.Row(cluster.Row{
		Scenario: "3 zmq-lost/dup/reorder", Load: total, Precision: last.MinPrecision, Recall: last.MinRecall, Converge: worst,
		Note: fmt.Sprintf("relay dropped %d duplicated %d swapped %d of %d; gateways saw %.0f gaps, %.0f complete replays, %.0f duplicates, %.0f rewind resets",
			rs.Dropped, rs.Duplicated, rs.Swapped, rs.Received, gaps, replays, dups, rewinds),
	})
}

// ZMQGapBeyondReplay (scenario 3, second half): a burst of lost batches
// longer than the engine's replay buffer cannot be replayed, so the
// gateways reset that engine's entries. They must then hold nothing false
// (precision 1; what they missed lowers recall), and converge exactly again
// once the engine's cache is reset.
func zmqGapBeyondReplay(t *R) {
	cfg := cluster.DefaultConfig()
	cfg.Gateways, cfg.Engines = 2, 2
	cfg.NumGPUBlocks = 128
	cfg.KVLink = cluster.KVRelay
	cfg.Sim = func(_ int, sc *sim.Config) { sc.KVEvents.BufferSteps = 4 }
	c := startCluster(t, cfg)
	ctx := context.Background()

	var total cluster.LoadResult
	var worst time.Duration
	var afterGap cluster.Summary
	for round := range t.Scale(1, 3) {
		// Lose 30 consecutive batches of every engine.
		for _, e := range c.Engines() {
			start := e.Relay.Stats().Received
			e.Relay.SetFault(func(_, n uint64) faultproxy.Action {
				if n >= start && n < start+30 {
					return faultproxy.Drop
				}
				return faultproxy.Forward
			})
		}
		res, err := cluster.RunLoad(ctx, loadConfig(c, fmt.Sprintf("gap-%d", round), t.Scale(60, 200)))
		require.NoError(t, err)
		total.Add(res)
		for _, e := range c.Engines() {
			e.Relay.SetFault(nil)
		}
		// The gap is seen at the next batch; once it is, precision is 1.
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		for _, e := range c.Engines() {
			require.NoError(t, c.WaitHeard(wctx, e, func() bool {
				ps, err := c.Compare()
				if err != nil {
					return false
				}
				for _, p := range ps {
					if p.Engine == e.Name && p.Precision() < 1 {
						return false
					}
				}
				return true
			}))
		}
		cancel()
		s, took := awaitWithin(t, c, "after an unrecoverable gap", time.Second, precisionAtLeast(1))
		afterGap, worst = s, max(worst, took)

		// A cache reset brings every gateway back to exact.
		for _, e := range c.Engines() {
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			require.NoError(t, e.ResetCache(rctx))
			cancel()
		}
		_, took = settle(t, c, "after reset")
		worst = max(worst, took)
	}
	unrecoverable := c.GatewayCounter("kvmesh_kvevents_resets_total", map[string]string{"reason": "gap_unrecoverable"})
	require.Positive(t, unrecoverable, "the gateways reset on a gap replay could not cover")
	require.Equal(t, total.Sent, total.OK, total.String())
	t.Row(cluster.Row{
		Scenario: "3 zmq-gap>replay-buffer", Load: total, Precision: afterGap.MinPrecision, Recall: afterGap.MinRecall, Converge: worst,
		Note: fmt.Sprintf("30-batch bursts lost with a 4-batch replay buffer: %.0f gap_unrecoverable resets; recall shown right after the gap, exact after engine reset", unrecoverable),
	})
}
