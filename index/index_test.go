package index

import (
	"errors"
	"strconv"
	"testing"
	"time"
)

const sec = int64(time.Second)

// t0 is a realistic Unix time in nanoseconds.
const t0 = int64(1_795_000_000) * sec

func newTestIndex(t testing.TB, mut func(*Config)) *Index {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Seed = 99
	cfg.BlockTokens = 4
	cfg.HistoryTTL = 60 * time.Second
	cfg.SpeculativeTTL = 2 * time.Second
	if mut != nil {
		mut(&cfg)
	}
	x, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return x
}

func match(x *Index, keys []BlockKey, cands []ReplicaID, mode Mode, now int64) ([]int32, int) {
	out := make([]int32, len(cands))
	l := x.Match(keys, cands, mode, now, out)
	return out, l
}

func eq(a, b []int32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func promptKeys(x *Index, n int, base uint32) []BlockKey {
	h := x.Hasher()
	return h.AppendKeys(nil, h.Root("m", "", ""), seqTokens(n*h.BlockTokens(), base))
}

func TestConfigValidate(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	for name, mut := range map[string]func(*Config){
		"block 0":      func(c *Config) { c.BlockTokens = 0 },
		"block big":    func(c *Config) { c.BlockTokens = MaxBlockTokens + 1 },
		"capacity 0":   func(c *Config) { c.Capacity = 0 },
		"history 0":    func(c *Config) { c.HistoryTTL = 0 },
		"spec tiny":    func(c *Config) { c.SpeculativeTTL = time.Millisecond },
		"history huge": func(c *Config) { c.HistoryTTL = 400 * 24 * time.Hour },
	} {
		c := DefaultConfig()
		mut(&c)
		if _, err := New(c); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("%s: err %v", name, err)
		}
	}
}

func TestMatchModes(t *testing.T) {
	x := newTestIndex(t, nil)
	keys := promptKeys(x, 10, 1)
	// Replica 1: history for 6 blocks. Replica 2: confirmed-like via speculative 4 blocks.
	// Replica 3: speculative 8 blocks. Replica 4 publishes events and has history 9.
	must(t, x.Record(keys[:6], 1, History, t0))
	must(t, x.Record(keys[:4], 2, Speculative, t0))
	must(t, x.Record(keys[:8], 3, Speculative, t0))
	must(t, x.Record(keys[:9], 4, History, t0))
	x.SetPublishesEvents(3, true)
	x.SetPublishesEvents(4, true)
	cands := []ReplicaID{1, 2, 3, 4, 5}
	for _, tc := range []struct {
		name    string
		mode    Mode
		now     int64
		want    []int32
		longest int
	}{
		{"history", ModeHistory, t0, []int32{6, 0, 0, 9, 0}, 9},
		{"kv-events", ModeKVEvents, t0, []int32{0, 4, 8, 0, 0}, 8},
		{"hybrid", ModeHybrid, t0, []int32{6, 0, 8, 0, 0}, 8},
		{"kv-events after spec TTL", ModeKVEvents, t0 + 3*sec, []int32{0, 0, 0, 0, 0}, 0},
		{"history before TTL", ModeHistory, t0 + 59*sec, []int32{6, 0, 0, 9, 0}, 9},
		{"history after TTL", ModeHistory, t0 + 61*sec, []int32{0, 0, 0, 0, 0}, 0},
		{"clock went back", ModeKVEvents, t0 - 100*sec, []int32{0, 4, 8, 0, 0}, 8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, l := match(x, keys, cands, tc.mode, tc.now)
			if !eq(got, tc.want) || l != tc.longest {
				t.Fatalf("got %v longest %d, want %v %d", got, l, tc.want, tc.longest)
			}
		})
	}
}

func TestMatchRunsAreConsecutive(t *testing.T) {
	x := newTestIndex(t, nil)
	keys := promptKeys(x, 8, 1)
	// Replica 1 holds blocks 0,1,2 and 5,6 (a hole at 3): it matches 3.
	must(t, x.Record(keys[:3], 1, History, t0))
	must(t, x.Record(keys[5:7], 1, History, t0))
	// Replica 2 holds 0..7 except block 1.
	must(t, x.Record(keys[:1], 2, History, t0))
	must(t, x.Record(keys[2:], 2, History, t0))
	got, l := match(x, keys, []ReplicaID{1, 2, 2, 9}, ModeHistory, t0)
	if !eq(got, []int32{3, 1, 1, 0}) || l != 3 {
		t.Fatalf("got %v %d", got, l)
	}
	// A prompt that diverges after block 2 only matches the common blocks.
	other := append(append([]BlockKey(nil), keys[:2]...), promptKeys(x, 4, 777)...)
	got, _ = match(x, other, []ReplicaID{1}, ModeHistory, t0)
	if got[0] != 2 {
		t.Fatalf("diverging prompt matched %d, want 2", got[0])
	}
	if got, l := match(x, nil, []ReplicaID{1}, ModeHistory, t0); got[0] != 0 || l != 0 {
		t.Fatal("empty prompt matched")
	}
	if got, l := match(x, keys, nil, ModeHistory, t0); len(got) != 0 || l != 0 {
		t.Fatal("no candidates matched")
	}
}

func TestRecordRejectsConfirmed(t *testing.T) {
	x := newTestIndex(t, nil)
	if err := x.Record(promptKeys(x, 2, 1), 1, Confirmed, t0); !errors.Is(err, ErrInvalidLedger) {
		t.Fatalf("err %v", err)
	}
	if s := x.Stats(); s.TotalEntries() != 0 {
		t.Fatalf("entries %v", s.Entries)
	}
}

func TestRecordExpiredLedgerDropsStaleEntries(t *testing.T) {
	x := newTestIndex(t, nil)
	keys := promptKeys(x, 3, 1)
	must(t, x.Record(keys, 1, Speculative, t0))
	must(t, x.Record(keys, 2, Speculative, t0+5*sec)) // replica 1's entries had expired
	got, _ := match(x, keys, []ReplicaID{1, 2}, ModeKVEvents, t0+5*sec)
	if !eq(got, []int32{0, 3}) {
		t.Fatalf("got %v", got)
	}
	if s := x.Stats(); s.Entries[Speculative] != 3 {
		t.Fatalf("speculative entries %d, want 3", s.Entries[Speculative])
	}
	// Within the TTL a record refreshes the clock for all holders.
	must(t, x.Record(keys, 3, Speculative, t0+6*sec))
	got, _ = match(x, keys, []ReplicaID{2, 3}, ModeKVEvents, t0+7*sec+500*int64(time.Millisecond))
	if !eq(got, []int32{3, 3}) {
		t.Fatalf("got %v", got)
	}
}

func TestExpire(t *testing.T) {
	x := newTestIndex(t, nil)
	a := promptKeys(x, 5, 1)
	b := promptKeys(x, 5, 2)
	must(t, x.Record(a, 1, History, t0))
	must(t, x.Record(b, 1, Speculative, t0))
	must(t, x.Record(b, 2, History, t0))
	if n, _ := x.Expire(t0+sec, 0); n != 0 {
		t.Fatalf("expired %d too early", n)
	}
	// Bounded: at most 3 blocks per call.
	total := 0
	for range 10 {
		n, scanned := x.Expire(t0+3*sec, 3)
		if scanned > 3 {
			t.Fatalf("scanned %d > 3", scanned)
		}
		total += n
	}
	if total != 5 {
		t.Fatalf("expired %d speculative entries, want 5", total)
	}
	s := x.Stats()
	if s.Entries != [3]int{10, 0, 0} || s.Expired != 5 || s.Blocks != 10 {
		t.Fatalf("stats %+v", s)
	}
	n, _ := x.Expire(t0+61*sec, 0)
	if s := x.Stats(); n != 10 || s.TotalEntries() != 0 || s.Blocks != 0 {
		t.Fatalf("expired %d, stats %+v", n, s)
	}
}

func stored(hashes []uint64, parent uint64, hasParent bool, tokens []uint32, bs int) StoredBlocks {
	return StoredBlocks{Hashes: hashes, ParentHash: parent, HasParent: hasParent, Tokens: tokens, BlockTokens: bs}
}

func TestApplyStoredAndRemoved(t *testing.T) {
	x := newTestIndex(t, nil)
	h := x.Hasher()
	root := h.Root("m", "", "")
	toks := seqTokens(6*4, 1)
	keys := h.AppendKeys(nil, root, toks)
	if err := x.ApplyStored(1, stored([]uint64{10, 11}, 0, false, toks[:8], 4)); !errors.Is(err, ErrNoRoot) {
		t.Fatalf("err %v", err)
	}
	x.SetReplicaRoot(1, root)
	x.SetReplicaRoot(2, root)
	must(t, x.Record(keys[:2], 1, Speculative, t0))
	// Two events, the second chained on the first's last engine hash.
	must(t, x.ApplyStored(1, stored([]uint64{10, 11}, 0, false, toks[:8], 4)))
	must(t, x.ApplyStored(1, stored([]uint64{12, 13, 14, 15}, 11, true, toks[8:], 4)))
	// Replica 2 stores the same blocks with the same engine hashes.
	must(t, x.ApplyStored(2, stored([]uint64{10, 11, 12}, 0, false, toks[:12], 4)))
	s := x.Stats()
	if s.Entries != [3]int{0, 0, 9} || s.Promoted != 2 || s.EngineHashes != 9 {
		t.Fatalf("stats %+v", s)
	}
	got, _ := match(x, keys, []ReplicaID{1, 2}, ModeKVEvents, t0+100*sec)
	if !eq(got, []int32{6, 3}) {
		t.Fatalf("got %v", got)
	}
	// Removal is scoped to the replica that sent it.
	if n := x.ApplyRemoved(1, []uint64{12, 99}); n != 1 {
		t.Fatalf("removed %d", n)
	}
	got, _ = match(x, keys, []ReplicaID{1, 2}, ModeKVEvents, t0)
	if !eq(got, []int32{2, 3}) {
		t.Fatalf("after remove: %v", got)
	}
	if s := x.Stats(); s.UnknownRemoved != 1 {
		t.Fatalf("unknown removed %d", s.UnknownRemoved)
	}
	// Unknown parent: skipped, counted, never guessed.
	err := x.ApplyStored(2, stored([]uint64{20}, 12345, true, toks[:4], 4))
	if !errors.Is(err, ErrUnknownParent) || x.Stats().UnknownParentBlocks != 1 {
		t.Fatalf("err %v stats %+v", err, x.Stats())
	}
	// Clear replica 1's confirmed entries; replica 2 untouched.
	if n := x.ClearReplica(1); n != 5 {
		t.Fatalf("cleared %d, want 5", n)
	}
	got, _ = match(x, keys, []ReplicaID{1, 2}, ModeKVEvents, t0)
	if !eq(got, []int32{0, 3}) {
		t.Fatalf("after clear: %v", got)
	}
	// Its engine map is gone too: a chained event now has an unknown parent.
	if err := x.ApplyStored(1, stored([]uint64{16}, 11, true, toks[:4], 4)); !errors.Is(err, ErrUnknownParent) {
		t.Fatalf("err %v", err)
	}
}

func TestApplyStoredBlockSizes(t *testing.T) {
	x := newTestIndex(t, nil)
	h := x.Hasher()
	root := h.Root("m", "", "")
	x.SetReplicaRoot(1, root)
	toks := seqTokens(3*12, 5)
	keys := h.AppendKeys(nil, root, toks)
	for _, tc := range []struct {
		name string
		s    StoredBlocks
		err  error
	}{
		{"engine smaller", stored([]uint64{1}, 0, false, toks[:2], 2), ErrBlockSize},
		{"not a multiple", stored([]uint64{1}, 0, false, toks[:6], 6), ErrBlockSize},
		{"zero", stored([]uint64{1}, 0, false, nil, 0), ErrBlockSize},
		{"token count", stored([]uint64{1, 2}, 0, false, toks[:12], 12), ErrMalformedStored},
	} {
		if err := x.ApplyStored(1, tc.s); !errors.Is(err, tc.err) {
			t.Fatalf("%s: err %v", tc.name, err)
		}
	}
	if x.Stats().TotalEntries() != 0 {
		t.Fatal("rejected events changed the index")
	}
	// Engine blocks of 12 tokens = 3 index blocks each.
	must(t, x.ApplyStored(1, stored([]uint64{100, 101}, 0, false, toks[:24], 12)))
	must(t, x.ApplyStored(1, stored([]uint64{102}, 101, true, toks[24:], 12)))
	got, _ := match(x, keys, []ReplicaID{1}, ModeKVEvents, t0)
	if got[0] != 9 {
		t.Fatalf("matched %d, want 9", got[0])
	}
	// Removing the middle engine block removes its three index blocks.
	if n := x.ApplyRemoved(1, []uint64{101}); n != 3 {
		t.Fatalf("removed %d, want 3", n)
	}
	got, _ = match(x, keys, []ReplicaID{1}, ModeKVEvents, t0)
	if got[0] != 3 || x.Stats().Entries[Confirmed] != 6 {
		t.Fatalf("matched %d, entries %v", got[0], x.Stats().Entries)
	}
}

func TestDropReplica(t *testing.T) {
	x := newTestIndex(t, nil)
	keys := promptKeys(x, 4, 1)
	x.SetReplicaRoot(1, x.Hasher().Root("m", "", ""))
	x.SetPublishesEvents(1, true)
	must(t, x.Record(keys, 1, History, t0))
	must(t, x.Record(keys, 1, Speculative, t0))
	must(t, x.Record(keys, 2, History, t0))
	must(t, x.ApplyStored(1, stored([]uint64{1}, 0, false, seqTokens(4, 1), 4)))
	// 4 history + 4 speculative + 1 confirmed, minus the promoted speculative.
	if n := x.DropReplica(1); n != 8 {
		t.Fatalf("dropped %d, want 8", n)
	}
	s := x.Stats()
	if s.Entries != [3]int{4, 0, 0} || s.EngineHashes != 0 {
		t.Fatalf("stats %+v", s)
	}
	if err := x.ApplyStored(1, stored([]uint64{1}, 0, false, seqTokens(4, 1), 4)); !errors.Is(err, ErrNoRoot) {
		t.Fatalf("root survived drop: %v", err)
	}
	got, _ := match(x, keys, []ReplicaID{1, 2}, ModeHybrid, t0)
	if !eq(got, []int32{0, 4}) {
		t.Fatalf("got %v (publisher flag must be gone)", got)
	}
}

func TestOverflowReplicas(t *testing.T) {
	x := newTestIndex(t, nil)
	keys := promptKeys(x, 6, 1)
	big := []ReplicaID{64, 1000, MaxReplicas - 1}
	must(t, x.Record(keys[:5], 64, History, t0))
	must(t, x.Record(keys[:3], 1000, Speculative, t0))
	must(t, x.Record(keys, MaxReplicas-1, History, t0))
	must(t, x.Record(keys[:2], 3, History, t0))
	x.SetPublishesEvents(1000, true)
	got, l := match(x, keys, append([]ReplicaID{3}, big...), ModeHybrid, t0)
	if !eq(got, []int32{2, 5, 3, 6}) || l != 6 {
		t.Fatalf("got %v %d", got, l)
	}
	// A reset drops the overflow replica's speculative entries too.
	if n := x.ClearReplica(1000); n != 3 {
		t.Fatalf("clear removed %d, want its 3 speculative entries", n)
	}
	if n := x.DropReplica(64); n != 5 {
		t.Fatalf("dropped %d", n)
	}
	got, _ = match(x, keys, big, ModeHistory, t0)
	if !eq(got, []int32{0, 0, 6}) {
		t.Fatalf("got %v", got)
	}
	// Left: MaxReplicas-1 history 6, replica 3 history 2.
	if n, _ := x.Expire(t0+time.Hour.Nanoseconds(), 0); n != 8 {
		t.Fatalf("expired %d, want 8", n)
	}
	if s := x.Stats(); s.TotalEntries() != 0 || s.Blocks != 0 || len(x.ovf) != 0 {
		t.Fatalf("stats %+v ovf %d", s, len(x.ovf))
	}
}

func TestCapacityEvictsLeastRecentlyUsed(t *testing.T) {
	x := newTestIndex(t, func(c *Config) { c.Capacity = 100 })
	hot := promptKeys(x, 20, 1)
	must(t, x.Record(hot, 1, History, t0))
	for i := range 30 {
		// Keep the hot prompt referenced while cold prompts stream in.
		match(x, hot, []ReplicaID{1}, ModeHistory, t0)
		must(t, x.Record(promptKeys(x, 20, uint32(100+i)), 2, History, t0))
		if s := x.Stats(); s.TotalEntries() > 100 {
			t.Fatalf("entries %d over capacity", s.TotalEntries())
		}
	}
	got, _ := match(x, hot, []ReplicaID{1}, ModeHistory, t0)
	if got[0] != 20 {
		t.Fatalf("hot prompt matched %d blocks after eviction pressure, want 20", got[0])
	}
	s := x.Stats()
	if s.Evictions != uint64(20+30*20-s.TotalEntries()) {
		t.Fatalf("evictions %d, entries %d", s.Evictions, s.TotalEntries())
	}
}

func TestMatchNoAllocs(t *testing.T) {
	x := newTestIndex(t, nil)
	keys := promptKeys(x, 300, 1)
	for r := range ReplicaID(16) {
		must(t, x.Record(keys[:10*int(r)], r, History, t0))
	}
	must(t, x.Record(keys[:50], 300, History, t0))
	cands := []ReplicaID{0, 3, 7, 15, 300}
	out := make([]int32, len(cands))
	for _, mode := range []Mode{ModeHistory, ModeKVEvents, ModeHybrid} {
		if a := testing.AllocsPerRun(100, func() { x.Match(keys, cands, mode, t0, out) }); a != 0 {
			t.Fatalf("%v: %v allocs per Match", mode, a)
		}
	}
	// The last mode, ModeHybrid without publishers, reads history.
	if !eq(out, []int32{0, 30, 70, 150, 50}) {
		t.Fatalf("out %v", out)
	}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// TestEngineMapSharing walks a replica's mapping for one engine hash between
// the shared map and its private map, and checks removals stay scoped.
func TestEngineMapSharing(t *testing.T) {
	x := newTestIndex(t, nil)
	h := x.Hasher()
	rootA, rootB := h.Root("m", "", ""), h.Root("m", "lora", "")
	toks := seqTokens(4, 1)
	keyA, keyB := h.AppendKeys(nil, rootA, toks), h.AppendKeys(nil, rootB, toks)
	for _, r := range []ReplicaID{1, 2, 3} {
		x.SetReplicaRoot(r, rootA)
	}
	blk := func(r ReplicaID, root BlockKey) {
		s := stored([]uint64{7}, 0, false, toks, 4)
		s.Root, s.HasRoot = root, true
		must(t, x.ApplyStored(r, s))
	}
	holds := func(keys []BlockKey, want []int32) {
		t.Helper()
		if got, _ := match(x, keys, []ReplicaID{1, 2, 3}, ModeKVEvents, t0); !eq(got, want) {
			t.Fatalf("got %v, want %v", got, want)
		}
	}
	blk(1, rootA)
	blk(2, rootA) // shared: both map 7 -> keyA
	blk(3, rootB) // conflict: 3 maps 7 -> keyB privately
	if s := x.Stats(); s.EngineHashes != 3 || x.eng.len() != 1 {
		t.Fatalf("engine hashes %d, shared %d", s.EngineHashes, x.eng.len())
	}
	blk(2, rootB) // 2 moves from shared to private
	blk(3, rootA) // 3 moves from private to shared
	if s := x.Stats(); s.EngineHashes != 3 || x.eng.len() != 1 || len(x.replicas[2].eng) != 1 || len(x.replicas[3].eng) != 0 {
		t.Fatalf("engine hashes %d, shared %d", s.EngineHashes, x.eng.len())
	}
	// Removing hash 7 from replica 2 removes its keyB entry only (its keyA
	// entry from the first store stays: the engine reported it under the
	// same hash, which now means keyB).
	if n := x.ApplyRemoved(2, []uint64{7}); n != 1 {
		t.Fatalf("removed %d", n)
	}
	holds(keyA, []int32{1, 1, 1})
	holds(keyB, []int32{0, 0, 1})
	if n := x.ApplyRemoved(3, []uint64{7, 7}); n != 1 || x.Stats().UnknownRemoved != 1 {
		t.Fatalf("removed %d, unknown %d", n, x.Stats().UnknownRemoved)
	}
	holds(keyA, []int32{1, 1, 0})
	holds(keyB, []int32{0, 0, 1})
	// Only replica 1 still maps 7 (to keyA); replica 1's removal empties the shared map.
	if n := x.ApplyRemoved(1, []uint64{7}); n != 1 || x.eng.len() != 0 || x.Stats().EngineHashes != 0 {
		t.Fatalf("removed %d, shared %d, mapped %d", n, x.eng.len(), x.Stats().EngineHashes)
	}
}

// TestRecordNeverBackdates: a late write (a peer's batch that was delayed,
// a caller whose clock stepped back) must not shorten the TTL that a later
// record of the same blocks set.
func TestRecordNeverBackdates(t *testing.T) {
	for _, l := range []Ledger{History, Speculative} {
		t.Run(l.String(), func(t *testing.T) {
			x := newTestIndex(t, nil)
			ttl := int64(60 * time.Second)
			mode := ModeHistory
			if l == Speculative {
				ttl, mode = int64(2*time.Second), ModeKVEvents
			}
			keys := promptKeys(x, 3, 0)
			must(t, x.Record(keys, 0, l, t0))
			// Replica 1's decision arrives late, stamped half a TTL earlier.
			must(t, x.Record(keys, 1, l, t0-ttl/2))
			// Just before t0+TTL, replica 0's entries (recorded at t0) live.
			out, _ := match(x, keys, []ReplicaID{0}, mode, t0+ttl-int64(tickNanos))
			if out[0] != 3 {
				t.Fatalf("recorded at t0, matched %d of 3 blocks just before t0+TTL: the late record backdated them", out[0])
			}
			// At t0+TTL they are gone.
			out, _ = match(x, keys, []ReplicaID{0}, mode, t0+ttl+int64(tickNanos))
			if out[0] != 0 {
				t.Fatalf("matched %d blocks after the TTL", out[0])
			}
			// An expired ledger takes the new time, even an older one than
			// the expired stamp would be (it was cleared first).
			late := t0 + 3*ttl
			must(t, x.Record(keys, 2, l, late))
			out, _ = match(x, keys, []ReplicaID{0, 2}, mode, late)
			if out[0] != 0 || out[1] != 3 {
				t.Fatalf("after expiry: %v, want [0 3]", out)
			}
		})
	}
}

// TestApplyStoredLargeEngineBlocks: MaxBlockTokens bounds the index block
// (the hasher's stack buffer), not the engine's: vLLM hybrid models cache
// 1568-token blocks (98 index blocks of 16), and such engine blocks must
// confirm, chain and remove like small ones.
func TestApplyStoredLargeEngineBlocks(t *testing.T) {
	for _, ebs := range []int{1568, MaxBlockTokens * 2, MaxEngineBlockTokens} {
		t.Run(strconv.Itoa(ebs), func(t *testing.T) {
			x := newTestIndex(t, func(c *Config) { c.BlockTokens = 16 })
			h := x.Hasher()
			root := h.Root("m", "", "")
			x.SetReplicaRoot(1, root)
			per := ebs / 16
			toks := seqTokens(3*ebs, 7)
			keys := h.AppendKeys(nil, root, toks)
			must(t, x.ApplyStored(1, stored([]uint64{100, 101}, 0, false, toks[:2*ebs], ebs)))
			must(t, x.ApplyStored(1, stored([]uint64{102}, 101, true, toks[2*ebs:], ebs)))
			got, _ := match(x, keys, []ReplicaID{1}, ModeKVEvents, t0)
			if int(got[0]) != 3*per || x.Stats().Entries[Confirmed] != 3*per {
				t.Fatalf("matched %d, entries %d, want %d", got[0], x.Stats().Entries[Confirmed], 3*per)
			}
			if n := x.ApplyRemoved(1, []uint64{101}); n != per {
				t.Fatalf("removed %d, want %d", n, per)
			}
			got, _ = match(x, keys, []ReplicaID{1}, ModeKVEvents, t0)
			if int(got[0]) != per {
				t.Fatalf("matched %d after removing the middle block, want %d", got[0], per)
			}
		})
	}
}

// TestApplyStoredRejectsHugeEngineBlocks: an engine block size beyond
// MaxEngineBlockTokens is refused, even when len(Hashes)*BlockTokens
// overflows to the token count (a malformed or hostile event must not
// panic the index).
func TestApplyStoredRejectsHugeEngineBlocks(t *testing.T) {
	x := newTestIndex(t, func(c *Config) { c.BlockTokens = 16 })
	x.SetReplicaRoot(1, x.Hasher().Root("m", "", ""))
	for _, s := range []StoredBlocks{
		stored([]uint64{1}, 0, false, seqTokens(MaxEngineBlockTokens+16, 1), MaxEngineBlockTokens+16),
		stored([]uint64{1, 2, 3, 4}, 0, false, nil, 1<<62), // 4<<62 overflows to 0 tokens
	} {
		if err := x.ApplyStored(1, s); !errors.Is(err, ErrBlockSize) {
			t.Fatalf("engine block of %d tokens: err %v, want ErrBlockSize", s.BlockTokens, err)
		}
	}
	if x.Stats().TotalEntries() != 0 {
		t.Fatal("rejected events changed the index")
	}
}

// TestClearReplicaDropsSpeculative: after an engine reset the replica's
// unconfirmed routing decisions are false, so they go with the confirmed
// entries; history entries and other replicas' entries stay.
func TestClearReplicaDropsSpeculative(t *testing.T) {
	x := newTestIndex(t, nil)
	now := int64(1_000_000_000_000)
	keys := []BlockKey{101, 102, 103}
	for _, r := range []ReplicaID{1, 2, 70} {
		for _, l := range []Ledger{History, Speculative} {
			if err := x.Record(keys, r, l, now); err != nil {
				t.Fatal(err)
			}
		}
	}
	if n := x.ClearReplica(1); n != 3 {
		t.Fatalf("cleared %d, want 3 speculative entries", n)
	}
	if n := x.ClearReplica(70); n != 3 {
		t.Fatalf("cleared %d for overflow replica 70, want 3", n)
	}
	cands := []ReplicaID{1, 2, 70}
	if got, _ := match(x, keys, cands, ModeKVEvents, now); !eq(got, []int32{0, 3, 0}) {
		t.Fatalf("kv-events after clear: %v", got)
	}
	if got, _ := match(x, keys, cands, ModeHistory, now); !eq(got, []int32{3, 3, 3}) {
		t.Fatalf("history after clear: %v", got)
	}
	for _, r := range []ReplicaID{1, 70} {
		if ks := x.AppendReplicaKeys(nil, r, Speculative); len(ks) != 0 {
			t.Fatalf("replica %d keeps speculative keys %v", r, ks)
		}
	}
	if s := x.Stats(); s.Entries[Speculative] != 3 || s.Entries[History] != 9 {
		t.Fatalf("entries %v", s.Entries)
	}
}

// TestClearLedgersAll: another engine under a replica's name (a new address)
// inherits nothing: its confirmed, speculative and history entries and its
// engine map go, while its root stays, so the new engine's first events
// apply at once; the other replica keeps everything.
func TestClearLedgersAll(t *testing.T) {
	x := newTestIndex(t, nil)
	h := x.Hasher()
	root := h.Root("m", "", "")
	toks := seqTokens(4*4, 1)
	keys := h.AppendKeys(nil, root, toks)
	for _, r := range []ReplicaID{1, 2} {
		x.SetReplicaRoot(r, root)
		must(t, x.ApplyStored(r, stored([]uint64{10, 11}, 0, false, toks[:8], 4)))
		must(t, x.Record(keys, r, Speculative, t0))
		must(t, x.Record(keys, r, History, t0))
	}
	if n := x.ClearLedgers(1, History, Speculative, Confirmed); n != 2+4+4 {
		t.Fatalf("forgot %d entries, want 10", n)
	}
	for _, mode := range []Mode{ModeKVEvents, ModeHistory} {
		if got, _ := match(x, keys, []ReplicaID{1, 2}, mode, t0); got[0] != 0 || got[1] == 0 {
			t.Fatalf("%v after clearing replica 1: %v", mode, got)
		}
	}
	// The engine map went with it: engine hash 11 is unknown to replica 1
	// now, so a chained event from the new engine cannot attach to it.
	if err := x.ApplyStored(1, stored([]uint64{12}, 11, true, toks[8:12], 4)); !errors.Is(err, ErrUnknownParent) {
		t.Fatalf("chained on the old engine's hash: err %v", err)
	}
	must(t, x.ApplyStored(1, stored([]uint64{20, 21}, 0, false, toks[:8], 4)))
	if got, _ := match(x, keys, []ReplicaID{1}, ModeKVEvents, t0); got[0] != 2 {
		t.Fatalf("the new engine's first event, rooted as before: %v", got)
	}
}
