package index

import (
	"errors"
	"testing"
)

// TestParentZeroChainStart: llm-d-inference-sim's legacy array format sends
// parent_block_hash 0 instead of nil for a chain's first block. When 0
// names no block the replica stored, the event is a chain start (confirmed
// under the replica's root, counted); when the replica did store a block
// whose engine hash is 0, the parent keeps its meaning.
func TestParentZeroChainStart(t *testing.T) {
	x := newTestIndex(t, nil)
	h := x.Hasher()
	root := h.Root("m", "", "")
	x.SetReplicaRoot(1, root)
	x.SetReplicaRoot(2, root)
	toks := seqTokens(3*4, 7)
	keys := h.AppendKeys(nil, root, toks)

	// Replica 1: a parent-0 chain start, then its child by engine hash.
	tol, err := x.ApplyStoredReport(1, stored([]uint64{11, 12}, 0, true, toks[:8], 4))
	if err != nil || tol != TolParentZero {
		t.Fatalf("parent-0 start: tol %v err %v", tol, err)
	}
	if tol.String() != "parent_zero" {
		t.Fatalf("label %q", tol.String())
	}
	tol, err = x.ApplyStoredReport(1, stored([]uint64{13}, 12, true, toks[8:], 4))
	if err != nil || tol != TolNone {
		t.Fatalf("child: tol %v err %v", tol, err)
	}
	got, _ := match(x, keys, []ReplicaID{1}, ModeKVEvents, t0)
	if !eq(got, []int32{3}) {
		t.Fatalf("parent-0 chain matched %v, want 3", got)
	}
	if s := x.Stats(); s.ParentZeroStarts != 1 || s.UnknownParentBlocks != 0 {
		t.Fatalf("stats %+v", s)
	}

	// Replica 2 stores a block whose engine hash is 0: parent 0 is that
	// block, so the child's keys chain from it and do not match the child's
	// tokens as a prompt of their own.
	must(t, x.ApplyStored(2, stored([]uint64{0}, 0, false, toks[:4], 4)))
	tol, err = x.ApplyStoredReport(2, stored([]uint64{21}, 0, true, toks[4:8], 4))
	if err != nil || tol != TolNone {
		t.Fatalf("known hash 0: tol %v err %v", tol, err)
	}
	got, _ = match(x, keys[:2], []ReplicaID{2}, ModeKVEvents, t0)
	if !eq(got, []int32{2}) {
		t.Fatalf("chained from engine hash 0: matched %v, want 2", got)
	}
	alone := h.AppendKeys(nil, root, toks[4:8])
	got, _ = match(x, alone, []ReplicaID{2}, ModeKVEvents, t0)
	if !eq(got, []int32{0}) {
		t.Fatalf("child taken as a chain start: matched %v", got)
	}
	if s := x.Stats(); s.ParentZeroStarts != 1 {
		t.Fatalf("stats %+v", s)
	}

	// A nonzero unknown parent is still rejected.
	tol, err = x.ApplyStoredReport(1, stored([]uint64{31}, 999, true, toks[:4], 4))
	if !errors.Is(err, ErrUnknownParent) || tol != TolNone {
		t.Fatalf("unknown parent: tol %v err %v", tol, err)
	}
}
