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
