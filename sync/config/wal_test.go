package config

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	wal "github.com/hashicorp/raft-wal"
	"github.com/hashicorp/raft-wal/metadb"
	"github.com/stretchr/testify/require"
)

// A leader cut off from the others appends a write it cannot commit; once
// healed, the new leader's entries conflict with it and raft truncates the
// old leader's log tail. raft-wal v0.4.0 then sealed the segment without
// its index block (hashicorp/raft-wal#31, fixed in v0.4.1), and a restart
// panicked. The old leader stops at once (ci1218 stopped one 1.8 s after
// its truncation) and must restart and rejoin.
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

// A log that raft-wal v0.4.0 left behind: entries 1-10, the tail from 6
// deleted and 6-7 written again in a later term, then the sealed
// segment's IndexStart cleared in the metadata, as v0.4.0 sealed a
// truncated segment. v0.4.1 writes the index (the first reopen checks our
// pin has the fix); with the index gone raft-wal's own reader fails every
// entry in the segment, and openWAL's reads each one as written.
func TestTruncatedSegmentReadAfterReopen(t *testing.T) {
	dir := t.TempDir()
	// open returns the log and its closer (WAL.Close leaves the meta
	// store open, and its file locked).
	open := func(scan bool) (*wal.WAL, func()) {
		t.Helper()
		meta := &metadb.BoltMetaDB{}
		var w *wal.WAL
		var err error
		if scan {
			w, err = openWAL(dir, meta)
		} else {
			w, err = wal.Open(dir, wal.WithMetaStore(meta))
		}
		require.NoError(t, err)
		return w, func() {
			require.NoError(t, w.Close())
			require.NoError(t, meta.Close())
		}
	}
	entries := func(term, from, to uint64) []*raft.Log {
		var ls []*raft.Log
		for i := from; i <= to; i++ {
			ls = append(ls, &raft.Log{Index: i, Term: term, Type: raft.LogCommand, Data: []byte(fmt.Sprintf("t%d-e%d-%s", term, i, strings.Repeat("x", int(i))))})
		}
		return ls
	}
	want := append(entries(1, 1, 5), entries(2, 6, 7)...)
	readAll := func(w *wal.WAL) error {
		var l raft.Log
		for _, e := range want {
			if err := w.GetLog(e.Index, &l); err != nil {
				return fmt.Errorf("entry %d: %w", e.Index, err)
			}
			require.Equal(t, e.Term, l.Term, "entry %d", e.Index)
			require.Equal(t, string(e.Data), string(l.Data), "entry %d", e.Index)
		}
		return nil
	}
	w, closeLog := open(true)
	require.NoError(t, w.StoreLogs(entries(1, 1, 10)))
	require.NoError(t, walLog{WAL: w, truncated: func(uint64) {}}.DeleteRange(6, 10))
	require.NoError(t, w.StoreLogs(entries(2, 6, 7)))
	closeLog()

	w, closeLog = open(false)
	require.NoError(t, readAll(w), "raft-wal ≥ v0.4.1 indexes a truncated segment (hashicorp/raft-wal#31)")
	closeLog()

	meta := &metadb.BoltMetaDB{}
	state, err := meta.Load(dir)
	require.NoError(t, err)
	sealed := 0
	for i := range state.Segments {
		if !state.Segments[i].SealTime.IsZero() {
			state.Segments[i].IndexStart = 0
			sealed++
		}
	}
	require.Equal(t, 1, sealed, "entries 1-5 in a sealed segment, 6-7 in the tail")
	require.NoError(t, meta.CommitState(state))
	require.NoError(t, meta.Close())

	w, closeLog = open(false)
	require.ErrorContains(t, readAll(w), "sealed segment has no index block", "what v0.4.0 left cannot be read by raft-wal")
	closeLog()

	w, closeLog = open(true)
	defer closeLog()
	require.NoError(t, readAll(w))
	var l raft.Log
	require.ErrorIs(t, w.GetLog(8, &l), raft.ErrLogNotFound)
	last, err := w.LastIndex()
	require.NoError(t, err)
	require.EqualValues(t, 7, last)
	require.NoError(t, w.StoreLogs(entries(2, 8, 8)), "the log takes appends after the scanned segment")
}
