package config

import (
	"errors"

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
// The guard: walLog notices a tail truncation, and the store's run loop,
// once the FSM has applied through the truncation point, takes a snapshot
// with TrailingLogs 0 for that one compaction, so the broken segment lies
// wholly below the snapshot and is deleted. A process that dies between
// the truncation and that snapshot (normally well under a second) still
// cannot restart; node turns the panic into ErrRaftLog, and moving the
// data dir's raft directory away lets it rejoin and catch up.

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

// tailTruncated records that entries up to newLast sit in a segment
// without an index block; it runs on raft's goroutine and never blocks.
func (s *Store) tailTruncated(newLast uint64) {
	for {
		cur := s.walRepair.Load()
		if cur >= newLast || s.walRepair.CompareAndSwap(cur, newLast) {
			break
		}
	}
	s.metrics.tailTruncations.Inc()
	s.log.Warn("raft log tail truncated; compacting past it once applied (raft-wal#31)", "last_kept", newLast)
	select {
	case s.walRepairCh <- struct{}{}:
	default:
	}
}

// walRepairPending is the index a snapshot must still cover, 0 if none.
func (s *Store) walRepairPending() uint64 { return s.walRepair.Load() }

// repairWAL snapshots and compacts past a truncated segment once the FSM
// has applied through it; until then the run loop retries on its ticker.
func (s *Store) repairWAL() {
	need := s.walRepair.Load()
	if need == 0 || s.raft.AppliedIndex() < need {
		return
	}
	rc := s.raft.ReloadableConfig()
	keep := rc.TrailingLogs
	rc.TrailingLogs = 0
	if err := s.raft.ReloadConfig(rc); err != nil {
		s.log.Warn("raft log repair: reload config", "err", err)
		return
	}
	f := s.raft.Snapshot()
	err := f.Error()
	rc.TrailingLogs = keep
	if rerr := s.raft.ReloadConfig(rc); rerr != nil {
		s.log.Warn("raft log repair: restore trailing logs", "err", rerr)
	}
	if err != nil {
		// ErrNothingNewToSnapshot: the last snapshot was compacted with
		// trailing logs kept; the next applied entry allows a new one.
		if !errors.Is(err, raft.ErrNothingNewToSnapshot) {
			s.log.Warn("raft log repair: snapshot", "err", err)
		}
		return
	}
	meta, rd, err := f.Open()
	if err != nil {
		s.log.Warn("raft log repair: open snapshot", "err", err)
		return
	}
	_ = rd.Close()
	if meta.Index >= need {
		s.walRepair.CompareAndSwap(need, 0)
		s.log.Info("raft log compacted past the truncated segment", "snapshot_index", meta.Index)
	}
}
