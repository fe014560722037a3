package index

import "testing"

// ConfirmedRun counts only the engine's own claims: speculative and history
// entries of the same blocks do not extend it, and another replica's
// confirmed entries do not count.
func TestConfirmedRun(t *testing.T) {
	x := newTestIndex(t, nil)
	h := x.Hasher()
	root := h.Root("m", "", "")
	toks := seqTokens(6*4, 1)
	keys := h.AppendKeys(nil, root, toks)
	x.SetReplicaRoot(1, root)
	x.SetReplicaRoot(2, root)
	must(t, x.Record(keys, 1, Speculative, t0))
	must(t, x.Record(keys, 1, History, t0))
	if n := x.ConfirmedRun(keys, 1); n != 0 {
		t.Fatalf("speculative and history counted: %d", n)
	}
	must(t, x.ApplyStored(1, stored([]uint64{10, 11, 12}, 0, false, toks[:12], 4)))
	must(t, x.ApplyStored(2, stored([]uint64{10, 11, 12, 13, 14}, 0, false, toks[:20], 4)))
	if n := x.ConfirmedRun(keys, 1); n != 3 {
		t.Fatalf("replica 1: %d, want 3", n)
	}
	if n := x.ConfirmedRun(keys, 2); n != 5 {
		t.Fatalf("replica 2: %d, want 5", n)
	}
	if n := x.ConfirmedRun(keys[:2], 2); n != 2 {
		t.Fatalf("short keys: %d, want 2", n)
	}
	if n := x.ConfirmedRun(keys, 3); n != 0 {
		t.Fatalf("unknown replica: %d", n)
	}
	// A replica id past the inline masks (overflow entries).
	x.SetReplicaRoot(70, root)
	must(t, x.ApplyStored(70, stored([]uint64{10, 11}, 0, false, toks[:8], 4)))
	if n := x.ConfirmedRun(keys, 70); n != 2 {
		t.Fatalf("overflow replica: %d, want 2", n)
	}
	x.ApplyRemoved(2, []uint64{11})
	if n := x.ConfirmedRun(keys, 2); n != 1 {
		t.Fatalf("after remove: %d, want 1", n)
	}
}
