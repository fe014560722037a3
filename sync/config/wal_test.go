package config

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A leader cut off from the others appends a write it cannot commit; once
// healed, the new leader's entries conflict with it and raft truncates the
// old leader's log tail. raft-wal v0.4.0 then marks the active segment
// sealed without writing its index block (hashicorp/raft-wal#31), so a
// restart that reads those entries panics ("sealed segment has no index
// block"). The store snapshots and compacts past such a segment as soon as
// it has applied through it, so the node restarts cleanly.
func TestRestartAfterLogTailTruncation(t *testing.T) {
	c := newCluster(t, 3, 3, true, func(cfg *StoreConfig) { cfg.ApplyTimeout = time.Second })
	v1 := writeEventually(t, 10*time.Second, func() (uint64, error) {
		return c.waitLeader(10*time.Second).store.Set(ctxT(t, 5*time.Second), testConfig(), nil)
	})
	c.waitVersion(v1, c.nodes...)

	old := c.waitLeader(10 * time.Second)
	c.partition(old)
	_, err := old.store.Patch(context.Background(), []byte(`{"strategy":"random"}`), nil)
	require.ErrorIs(t, err, ErrNoQuorum, "appended on the old leader, never committed")
	var majority []*testNode
	for _, nd := range c.nodes {
		if nd != old {
			majority = append(majority, nd)
		}
	}
	v2 := writeEventually(t, 10*time.Second, func() (uint64, error) {
		return majority[0].store.Patch(ctxT(t, 2*time.Second), []byte(`{"strategy":"least-request"}`), nil)
	})
	c.heal()
	c.waitVersion(v2, c.nodes...)
	require.Equal(t, "least-request", old.store.Current().Config.Strategy)
	require.Equal(t, 1.0, metricValue(t, old.store.metrics.tailTruncations), "the old leader's uncommitted tail was deleted")
	require.Eventually(t, func() bool { return old.store.walRepairPending() == 0 }, 10*time.Second, 5*time.Millisecond,
		"the truncated segment is compacted away")

	c.stop(old)
	func() {
		defer func() {
			if r := recover(); r != nil {
				require.Fail(t, "restart panicked", fmt.Sprint(r))
			}
		}()
		c.start(old)
	}()
	c.heal()
	v3 := writeEventually(t, 10*time.Second, func() (uint64, error) {
		return c.waitLeader(10*time.Second).store.Patch(ctxT(t, 5*time.Second), []byte(`{"strategy":"cost"}`), nil)
	})
	c.waitVersion(v3, c.nodes...)
}

// A truncation usually arrives before the entries it kept are committed:
// a new leader commits its predecessors' entries only with its own first
// one, so the repair has to wait for the apply. It must not then wait for
// the next reconcile tick (5 s by default), which widens the window in
// which a crash leaves an unreadable log. The truncation is signalled
// directly here (the test above drives a real one) so that it comes
// before the entry it needs.
func TestWALRepairRunsOnceApplied(t *testing.T) {
	s := quietStore(t)
	need := s.raft.LastIndex() + 1
	s.tailTruncated(need)
	require.Eventually(t, func() bool { return len(s.walRepairCh) == 0 }, 5*time.Second, time.Millisecond,
		"the repair loop took the wake-up, before the entry it waits for exists")
	_, err := s.Patch(ctxT(t, 5*time.Second), []byte(`{"strategy":"random"}`), nil)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return s.walRepairPending() == 0 }, 5*time.Second, 5*time.Millisecond,
		"repaired as soon as the entry is applied, not at the next reconcile")
}

// Every entry after a truncation point is gone, so a later, deeper
// truncation leaves every sealed segment without an index at or below its
// own point: the repair then needs that, not the earlier, higher index,
// which a quiet cluster may not write again for a long time.
func TestWALRepairFollowsDeeperTruncation(t *testing.T) {
	s := quietStore(t)
	last := s.raft.LastIndex()
	s.tailTruncated(last + 100)
	s.tailTruncated(last)
	require.Equal(t, 2.0, metricValue(t, s.metrics.tailTruncations))
	require.Eventually(t, func() bool { return s.walRepairPending() == 0 }, 5*time.Second, 5*time.Millisecond,
		"repaired with what is already applied")
}

// quietStore is the leader of a one-node cluster holding one config, whose
// run loop wakes only every hour: nothing but the repair loop itself can
// run a repair soon.
func quietStore(t *testing.T) *Store {
	c := newCluster(t, 1, 1, true, func(cfg *StoreConfig) { cfg.ReconcileInterval = time.Hour })
	s := c.waitLeader(10 * time.Second).store
	_, err := s.Set(ctxT(t, 5*time.Second), testConfig(), nil)
	require.NoError(t, err)
	return s
}
