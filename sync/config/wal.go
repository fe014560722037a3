package config

import (
	"errors"
	"time"

	"github.com/hashicorp/raft"
	wal "github.com/hashicorp/raft-wal"
)

// raft-wal v0.4.0 and log tail truncation (hashicorp/raft-wal#31).
//
// raft deletes a suffix of its log in one place only: a follower whose
// entries conflict with the leader's (raft.go, "clearing log suffix"),
// which happens to a leader that appended entries it could not commit (a
// write during a partition, or just before it stepped down) once it
// rejoins under a new leader. Compaction after a snapshot deletes a prefix,
// which is safe. For a suffix raft-wal marks the active segment sealed in
// its metadata but never writes the segment's index block; the running
// process keeps reading it through the in-memory index, but after a
// restart every read of an entry in that segment fails with "sealed
// segment has no index block", and raft panics in NewRaft while scanning
// the entries after its last snapshot (or later, applying them).
//
// The guard: walLog notices a tail truncation, and the store's repair
// loop, as soon as the FSM has applied through the truncation point, takes
// a snapshot with TrailingLogs 0 for that one compaction, so the broken
// segment lies wholly below the snapshot and is deleted. A process that
// dies between the truncation and that snapshot (normally well under a
// second) still cannot restart; node turns the panic into ErrRaftLog, and
// moving the data dir's raft directory away lets it rejoin and catch up.

// walLog is the raft LogStore: raft-wal, reporting tail truncations.
type walLog struct {
	*wal.WAL
	truncated func(newLast uint64)
}

// DeleteRange implements raft.LogStore.
func (l walLog) DeleteRange(lo, hi uint64) error {
	first, err := l.FirstIndex()
	if err != nil {
		return err
	}
	last, err := l.LastIndex()
	if err != nil {
		return err
	}
	if err := l.WAL.DeleteRange(lo, hi); err != nil {
		return err
	}
	if lo > first && lo <= last && hi >= last {
		l.truncated(lo - 1)
	}
	return nil
}

// tailTruncated records that the entries up to newLast now end a segment
// without an index block; it runs on raft's goroutine and never blocks.
// Every entry after newLast is gone, so every such segment, this one or
// one an earlier truncation left, lies at or below newLast: the pending
// repair becomes newLast even if an earlier truncation asked for more (an
// index a quiet cluster may not write again for a long time).
func (s *Store) tailTruncated(newLast uint64) {
	s.walRepair.Store(newLast)
	s.metrics.tailTruncations.Inc()
	s.log.Warn("raft log tail truncated; compacting past it once applied (raft-wal#31)", "last_kept", newLast)
	select {
	case s.walRepairCh <- struct{}{}:
	default:
	}
}

// walRepairPending is the index a snapshot must still cover, 0 if none.
func (s *Store) walRepairPending() uint64 { return s.walRepair.Load() }

// walRepairPoll is how often repairLoop looks at the applied index while
// a repair waits for it. A truncation usually comes before the entries it
// kept are committed (a new leader commits its predecessors' entries only
// with its own first one), and nothing else wakes the loop when they are.
const walRepairPoll = 20 * time.Millisecond

// repairLoop snapshots and compacts past a truncated segment once the FSM
// has applied through it: at once when a truncation is signalled, then
// every walRepairPoll until done. An attempt that fails (the FSM has taken
// nothing at or after the segment's last entry, which happens when that
// entry is a no-op and nothing follows it yet, or raft refuses the
// snapshot) is retried once more entries are applied or after a
// ReconcileInterval, not on every poll.
func (s *Store) repairLoop() {
	defer s.wg.Done()
	var poll <-chan time.Time
	var tried uint64    // the applied index at the last failed attempt
	var retry time.Time // when to try again without more applied
	for {
		select {
		case <-s.stop:
			return
		case <-s.walRepairCh:
		case <-poll:
		}
		need, applied := s.walRepair.Load(), s.raft.AppliedIndex()
		switch {
		case need == 0 || applied < need:
		case applied <= tried && time.Now().Before(retry):
		case s.snapshotPast(need):
			s.walRepair.CompareAndSwap(need, 0)
		default:
			tried, retry = applied, time.Now().Add(s.cfg.ReconcileInterval)
		}
		poll = nil
		if s.walRepairPending() != 0 {
			poll = time.After(walRepairPoll)
		}
	}
}

// snapshotPast takes a snapshot with TrailingLogs 0, so raft compacts the
// whole log it covers, and reports whether it covers index need.
func (s *Store) snapshotPast(need uint64) bool {
	rc := s.raft.ReloadableConfig()
	keep := rc.TrailingLogs
	rc.TrailingLogs = 0
	if err := s.raft.ReloadConfig(rc); err != nil {
		s.log.Warn("raft log repair: reload config", "err", err)
		return false
	}
	f := s.raft.Snapshot()
	err := f.Error()
	rc.TrailingLogs = keep
	if rerr := s.raft.ReloadConfig(rc); rerr != nil {
		s.log.Warn("raft log repair: restore trailing logs", "err", rerr)
	}
	if err != nil {
		if !errors.Is(err, raft.ErrNothingNewToSnapshot) {
			s.log.Warn("raft log repair: snapshot", "err", err)
		}
		return false
	}
	meta, rd, err := f.Open()
	if err != nil {
		s.log.Warn("raft log repair: open snapshot", "err", err)
		return false
	}
	_ = rd.Close()
	if meta.Index < need {
		s.log.Info("raft log repair waits for an entry the FSM takes", "snapshot_index", meta.Index, "need", need)
		return false
	}
	s.log.Info("raft log compacted past the truncated segment", "snapshot_index", meta.Index)
	return true
}
