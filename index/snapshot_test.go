package index

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"testing"

	"github.com/zeebo/xxh3"
)

func buildSnapshotIndex(t testing.TB) (*Index, [][]BlockKey) {
	x := newTestIndex(t, nil)
	h := x.Hasher()
	root := h.Root("m", "", "")
	var prompts [][]BlockKey
	for p := range 5 {
		prompts = append(prompts, promptKeys(x, 10+p, uint32(p%2)))
	}
	for i, r := range []ReplicaID{0, 5, 63, 64, 4000} {
		x.SetReplicaRoot(r, root)
		x.SetPublishesEvents(r, i%2 == 0)
		must(t, x.Record(prompts[i][:8], r, History, t0))
		must(t, x.Record(prompts[(i+1)%5][:3], r, Speculative, t0))
		toks := seqTokens(12*4, uint32(i%2))
		must(t, x.ApplyStored(r, stored([]uint64{uint64(i), 100}, 0, false, toks[:24], 12)))
		must(t, x.ApplyStored(r, stored([]uint64{200 + uint64(i)}, 100, true, toks[24:], 4*6)))
	}
	return x, prompts
}

func TestSnapshotRoundTrip(t *testing.T) {
	x, prompts := buildSnapshotIndex(t)
	wm := map[string]uint64{"gw-a/replica-0": 17, "": 0, "b": 1 << 63}
	name := func(r ReplicaID) (string, bool) { return "replica-" + strconv.Itoa(int(r)), true }
	snap := x.AppendSnapshot([]byte("prefix"), wm, name)
	if string(snap[:6]) != "prefix" {
		t.Fatal("AppendSnapshot did not append")
	}
	snap = snap[6:]

	// Restore on another gateway whose local ids differ: id+1.
	y := newTestIndex(t, nil)
	resolve := func(s string) (ReplicaID, bool) {
		var r int
		if _, err := fmt.Sscanf(s, "replica-%d", &r); err != nil {
			return 0, false
		}
		return ReplicaID(r + 1), true
	}
	got, err := y.Restore(snap, resolve)
	if err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(got, wm) {
		t.Fatalf("watermarks %v, want %v", got, wm)
	}
	xs, ys := x.Stats(), y.Stats()
	if xs.Entries != ys.Entries || xs.Blocks != ys.Blocks || xs.EngineHashes != ys.EngineHashes {
		t.Fatalf("stats differ: %+v vs %+v", xs, ys)
	}
	ids := []ReplicaID{0, 5, 63, 64, 4000}
	for _, keys := range prompts {
		for _, mode := range []Mode{ModeHistory, ModeKVEvents, ModeHybrid} {
			for _, now := range []int64{t0, t0 + 3*sec} {
				ya := make([]ReplicaID, len(ids))
				for i, r := range ids {
					ya[i] = r + 1
				}
				a, _ := match(x, keys, ids, mode, now)
				b, _ := match(y, keys, ya, mode, now)
				if !eq(a, b) {
					t.Fatalf("%v: original %v, restored %v", mode, a, b)
				}
			}
		}
	}
	// Engine maps and roots came along: removal and chained stores work.
	if n := y.ApplyRemoved(6, []uint64{100}); n != 3 {
		t.Fatalf("removed %d via restored engine map, want 3", n)
	}
	must(t, y.ApplyStored(6, stored([]uint64{300}, 201, true, seqTokens(4, 9), 4)))
	must(t, y.ApplyStored(6, stored([]uint64{301}, 0, false, seqTokens(4, 9), 4)))

	// A resolver that knows only some replicas drops the others' entries.
	z := newTestIndex(t, nil)
	_, err = z.Restore(snap, func(s string) (ReplicaID, bool) { return 1, s == "replica-5" })
	if err != nil {
		t.Fatal(err)
	}
	b, _ := match(z, prompts[1], []ReplicaID{1}, ModeHistory, t0)
	a, _ := match(x, prompts[1], []ReplicaID{5}, ModeHistory, t0)
	if !eq(a, b) || z.Stats().TotalEntries() >= xs.TotalEntries() {
		t.Fatalf("partial restore: %v vs %v, entries %d", a, b, z.Stats().TotalEntries())
	}
}

func TestRestoreRejectsCorruption(t *testing.T) {
	x, prompts := buildSnapshotIndex(t)
	snap := x.AppendSnapshot(nil, map[string]uint64{"s": 3}, nil)
	before, _ := match(x, prompts[0], []ReplicaID{0}, ModeHistory, t0)
	for name, data := range map[string][]byte{
		"empty":     nil,
		"magic":     append([]byte("XXXX"), snap[4:]...),
		"version":   append(append([]byte("KVMI"), 2), snap[5:]...),
		"truncated": snap[:len(snap)-1],
		"bit flip":  flip(snap, len(snap)/2),
		"checksum":  flip(snap, len(snap)-1),
	} {
		if _, err := x.Restore(data, nil); !errors.Is(err, ErrBadSnapshot) {
			t.Errorf("%s: err %v", name, err)
		}
	}
	for name, mut := range map[string]func(*Config){
		"seed":       func(c *Config) { c.Seed++ },
		"block size": func(c *Config) { c.BlockTokens = 8 },
	} {
		other := newTestIndex(t, mut)
		if _, err := other.Restore(snap, nil); !errors.Is(err, ErrBadSnapshot) {
			t.Errorf("%s mismatch: err %v", name, err)
		}
	}
	after, _ := match(x, prompts[0], []ReplicaID{0}, ModeHistory, t0)
	if !eq(before, after) || after[0] != 8 {
		t.Fatalf("failed restores changed the index: %v -> %v", before, after)
	}
}

func flip(b []byte, i int) []byte {
	c := append([]byte(nil), b...)
	c[i] ^= 0x40
	return c
}

// FuzzRestore feeds arbitrary bytes to Restore. Because of the checksum,
// most mutations fail early; the fuzzer also gets inputs with a valid
// checksum recomputed over the mutated body, so the decoder itself is
// exercised. Run: go test -run=^$ -fuzz=FuzzRestore -fuzzminimizetime=2s ./index/
// (minimising the large snapshot inputs otherwise stalls progress for ~60 s).
func FuzzRestore(f *testing.F) {
	x, _ := buildSnapshotIndex(f)
	f.Add(x.AppendSnapshot(nil, map[string]uint64{"a": 1}, nil), false)
	f.Add(x.AppendSnapshot(nil, nil, nil), true)
	empty := newTestIndex(f, nil)
	f.Add(empty.AppendSnapshot(nil, nil, nil), true)
	f.Add([]byte("KVMI\x01\x00\x00\x00"), true)
	f.Add([]byte("KVMI\x01\x63\x00\x00\x00\x00\x00\x00\x00\x04\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"), true)
	f.Fuzz(func(t *testing.T, data []byte, fixSum bool) {
		if fixSum && len(data) >= 13 {
			data = resum(data[:len(data)-8])
		}
		y := newTestIndex(t, nil)
		if _, err := y.Restore(data, nil); err != nil {
			if !errors.Is(err, ErrBadSnapshot) {
				t.Fatalf("error not wrapping ErrBadSnapshot: %v", err)
			}
			if y.Stats().Blocks != 0 {
				t.Fatal("failed restore changed the index")
			}
			return
		}
		// Whatever was accepted must be a usable, self-consistent index.
		s := y.Stats()
		if s.TotalEntries() > y.cfg.Capacity || (s.Blocks == 0) != (s.TotalEntries() == 0) {
			t.Fatalf("inconsistent stats %+v", s)
		}
		again := y.AppendSnapshot(nil, nil, nil)
		z := newTestIndex(t, nil)
		if _, err := z.Restore(again, nil); err != nil {
			t.Fatalf("re-snapshot of an accepted snapshot fails: %v", err)
		}
		if z.Stats().Entries != s.Entries {
			t.Fatalf("re-snapshot entries %v, want %v", z.Stats().Entries, s.Entries)
		}
		y.Expire(t0, 0)
		y.DropReplica(0)
	})
}

// resum returns body followed by its checksum.
func resum(body []byte) []byte {
	out := append([]byte(nil), body...)
	return binary.LittleEndian.AppendUint64(out, xxh3.Hash(out))
}

// TestRestoreKeepReplicaSettings: by default a restore takes the peer's
// replica roots and publisher flags; with KeepReplicaSettings the local
// ones stay, for replicas in the snapshot and for those it lacks.
func TestRestoreKeepReplicaSettings(t *testing.T) {
	peer := newTestIndex(t, nil)
	h := peer.Hasher()
	peerRoot, myRoot := h.Root("m", "", ""), h.Root("m", "mine", "")
	toks := seqTokens(8, 3)
	// Peer: replica 1 publishes, root peerRoot, holds a history entry.
	peer.SetReplicaRoot(1, peerRoot)
	peer.SetPublishesEvents(1, true)
	hist := h.AppendKeys(nil, peerRoot, toks)
	must(t, peer.Record(hist, 1, History, t0))
	snap := peer.AppendSnapshot(nil, nil, nil)

	local := func() *Index {
		x := newTestIndex(t, nil)
		x.SetReplicaRoot(1, myRoot) // does not publish here
		x.SetReplicaRoot(2, myRoot) // not in the snapshot
		x.SetPublishesEvents(2, true)
		return x
	}
	// confirmedUnder stores a parentless event on r and reports whether it
	// was keyed under root; hybrid reads r's history iff r does not publish.
	confirmedUnder := func(x *Index, r ReplicaID, root BlockKey) bool {
		must(t, x.ApplyStored(r, stored([]uint64{uint64(r)}, 0, false, toks[:4], 4)))
		out, _ := match(x, h.AppendKeys(nil, root, toks[:4]), []ReplicaID{r}, ModeKVEvents, t0)
		return out[0] == 1
	}
	hybridHistory := func(x *Index) int32 {
		out, _ := match(x, hist, []ReplicaID{1}, ModeHybrid, t0)
		return out[0]
	}

	x := local()
	_, err := x.Restore(snap, nil)
	must(t, err)
	if hybridHistory(x) != 0 || !confirmedUnder(x, 1, peerRoot) {
		t.Fatal("default Restore did not take the snapshot's root and publisher flag")
	}
	if err := x.ApplyStored(2, stored([]uint64{9}, 0, false, toks[:4], 4)); !errors.Is(err, ErrNoRoot) {
		t.Fatalf("default Restore kept a root the snapshot lacks: %v", err)
	}

	x = local()
	_, err = x.Restore(snap, nil, KeepReplicaSettings())
	must(t, err)
	if hybridHistory(x) != 2 {
		t.Fatal("KeepReplicaSettings: replica 1 took the peer's publisher flag (hybrid ignored its history)")
	}
	if !confirmedUnder(x, 1, myRoot) || !confirmedUnder(x, 2, myRoot) {
		t.Fatal("KeepReplicaSettings: local roots not kept")
	}
	out, _ := match(x, h.AppendKeys(nil, myRoot, toks[:4]), []ReplicaID{2}, ModeHybrid, t0)
	if out[0] != 1 {
		t.Fatal("KeepReplicaSettings: replica 2 lost its publisher flag")
	}
}

// keySet returns r's keys in ledger l as a set.
func keySet(x *Index, r ReplicaID, l Ledger) map[BlockKey]bool {
	out := make(map[BlockKey]bool)
	for _, k := range x.AppendReplicaKeys(nil, r, l) {
		out[k] = true
	}
	return out
}

func hashSet(x *Index, r ReplicaID) map[uint64]bool {
	out := make(map[uint64]bool)
	for _, h := range x.AppendEngineHashes(nil, r) {
		out[h] = true
	}
	return out
}

// TestRestoreOnly: a selective restore takes only the selected (replica,
// ledger) pairs from the snapshot and keeps every other entry and engine
// mapping as it is locally, even where the snapshot holds a superset (a
// peer that missed removals).
func TestRestoreOnly(t *testing.T) {
	build := func(seed uint32, engHashes []uint64, hist int) *Index {
		x := newTestIndex(t, nil)
		root := x.Hasher().Root("m", "", "")
		for _, r := range []ReplicaID{1, 2, 70} {
			x.SetReplicaRoot(r, root)
			toks := seqTokens(4*len(engHashes), seed+uint32(r))
			must(t, x.ApplyStored(r, stored(engHashes, 0, false, toks, 4)))
		}
		must(t, x.Record(promptKeys(x, hist, seed), 1, History, t0))
		must(t, x.Record(promptKeys(x, 3, seed+7), 2, Speculative, t0))
		return x
	}
	// The peer knows 8 blocks of each replica; locally 1 and 70 already
	// removed the last 4 (exact), and 2 holds an older, different set.
	peer := build(10, []uint64{1, 2, 3, 4, 5, 6, 7, 8}, 5)
	local := build(10, []uint64{1, 2, 3, 4, 5, 6, 7, 8}, 2)
	for _, r := range []ReplicaID{1, 70} {
		if n := local.ApplyRemoved(r, []uint64{5, 6, 7, 8}); n != 4 {
			t.Fatalf("removed %d", n)
		}
	}
	local.ClearReplica(2)
	root := local.Hasher().Root("m", "", "")
	must(t, local.ApplyStored(2, stored([]uint64{90, 91}, 0, false, seqTokens(8, 500), 4)))
	must(t, local.Record(promptKeys(local, 2, 10), 2, History, t0))
	must(t, local.Record(promptKeys(local, 3, 17), 2, Speculative, t0)) // the reset dropped them

	want := map[ReplicaID]map[BlockKey]bool{1: keySet(local, 1, Confirmed), 2: keySet(peer, 2, Confirmed), 70: keySet(local, 70, Confirmed)}
	wantHashes := map[ReplicaID]map[uint64]bool{1: hashSet(local, 1), 2: hashSet(peer, 2), 70: hashSet(local, 70)}
	wantHist := map[ReplicaID]map[BlockKey]bool{1: keySet(local, 1, History), 2: keySet(local, 2, History)}
	if len(want[1]) != 4 || len(want[2]) != 8 || len(wantHashes[2]) != 8 || len(wantHist[1]) != 2 {
		t.Fatalf("setup: %d %d %d %d", len(want[1]), len(want[2]), len(wantHashes[2]), len(wantHist[1]))
	}

	wm := map[string]uint64{"kv/2": 9}
	snap := peer.AppendSnapshot(nil, wm, nil)
	peek, err := SnapshotWatermarks(snap)
	if err != nil || !maps.Equal(peek, wm) {
		t.Fatalf("SnapshotWatermarks %v %v", peek, err)
	}
	got, err := local.Restore(snap, nil, KeepReplicaSettings(),
		RestoreOnly(func(r ReplicaID, l Ledger) bool { return r == 2 && l == Confirmed }))
	if err != nil || !maps.Equal(got, wm) {
		t.Fatalf("restore: %v %v", got, err)
	}
	for r, ks := range want {
		if g := keySet(local, r, Confirmed); !maps.Equal(g, ks) {
			t.Errorf("replica %d confirmed: %d keys, want %d", r, len(g), len(ks))
		}
		if g := hashSet(local, r); !maps.Equal(g, wantHashes[r]) {
			t.Errorf("replica %d engine hashes %v, want %v", r, g, wantHashes[r])
		}
	}
	for r, ks := range wantHist {
		if g := keySet(local, r, History); !maps.Equal(g, ks) {
			t.Errorf("replica %d history: %d keys, want %d (kept local)", r, len(g), len(ks))
		}
	}
	if g := keySet(local, 2, Speculative); len(g) != 3 {
		t.Errorf("replica 2 speculative: %d keys, want 3 (kept local)", len(g))
	}
	s := local.Stats()
	if s.Entries[Confirmed] != 4+8+4 || s.Entries[History] != 4 || s.Entries[Speculative] != 3 {
		t.Errorf("entries %v", s.Entries)
	}
	// Engine maps work for both sides: a kept mapping chains and removes,
	// and so does a taken one.
	must(t, local.ApplyStored(1, stored([]uint64{40}, 4, true, seqTokens(4, 77), 4)))
	if n := local.ApplyRemoved(1, []uint64{40, 1}); n != 2 {
		t.Errorf("kept map removed %d, want 2", n)
	}
	if n := local.ApplyRemoved(2, []uint64{8, 90}); n != 1 {
		t.Errorf("taken map removed %d, want 1 (90 was the local view's)", n)
	}
	if n := local.ApplyRemoved(70, []uint64{5, 4}); n != 1 {
		t.Errorf("overflow replica's kept map removed %d, want 1", n)
	}
	// The result matches an index built from the merged entries: match
	// sees replica 1's four kept blocks.
	keys1 := local.Hasher().AppendKeys(nil, root, seqTokens(32, 11))
	if m, _ := match(local, keys1, []ReplicaID{1}, ModeKVEvents, t0); m[0] != 0 {
		t.Errorf("replica 1 matches %d blocks after removing its first", m[0])
	}
	keys2 := local.Hasher().AppendKeys(nil, root, seqTokens(32, 12))
	if m, _ := match(local, keys2, []ReplicaID{2}, ModeKVEvents, t0); m[0] != 7 {
		t.Errorf("replica 2 matches %d blocks, want 7 (the peer's 8, last removed)", m[0])
	}
}
