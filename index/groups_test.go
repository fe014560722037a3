package index

import (
	"math/rand/v2"
	"testing"
)

// hybridFixture is one replica of a hybrid model: group 0 full attention,
// group 1 sliding window, both storing the same engine blocks (vLLM strips
// the group from the hashes it reports).
type hybridFixture struct {
	x      *Index
	keys   []BlockKey
	hashes []uint64
	toks   []uint32
	window int // tokens
}

const hybridRep ReplicaID = 3

func newHybrid(t *testing.T, blocks, window int) *hybridFixture {
	t.Helper()
	f := &hybridFixture{x: newTestIndex(t, func(c *Config) { c.BlockTokens = 16 }), window: window}
	h := f.x.Hasher()
	root := h.Root("m", "", "")
	f.x.SetReplicaRoot(hybridRep, root)
	f.x.SetReplicaRoot(hybridRep+1, root)
	f.toks = seqTokens(blocks*16, 7)
	f.keys = h.AppendKeys(nil, root, f.toks)
	for i := range blocks {
		f.hashes = append(f.hashes, 1000+uint64(i))
	}
	for g, kind := range []GroupKind{GroupFull, GroupSliding} {
		w := 0
		if kind == GroupSliding {
			w = window
		}
		err := f.x.ApplyStored(hybridRep, StoredBlocks{Hashes: f.hashes, Tokens: f.toks, BlockTokens: 16,
			Group: g, GroupKind: kind, Window: w})
		if err != nil {
			t.Fatal(err)
		}
	}
	return f
}

func (f *hybridFixture) remove(g int, blocks ...int) {
	hs := make([]uint64, 0, len(blocks))
	for _, b := range blocks {
		hs = append(hs, f.hashes[b])
	}
	f.x.ApplyKV(hybridRep, []KVEvent{{Kind: KVRemoved, Removed: hs, Group: g}}, nil)
}

func (f *hybridFixture) match() int {
	out := make([]int32, 1)
	f.x.Match(f.keys, []ReplicaID{hybridRep}, ModeKVEvents, t0, out)
	return int(out[0])
}

func span(from, to int) []int {
	var s []int
	for i := from; i < to; i++ {
		s = append(s, i)
	}
	return s
}

// TestHybridShortPromptInsideWindow is the example: a window (4096
// tokens) longer than the prompt needs every block from the start, so
// removing the first two blocks from the sliding-window group only gives
// 0 — for vLLM's reason, and the full-attention group keeps them.
func TestHybridShortPromptInsideWindow(t *testing.T) {
	f := newHybrid(t, 8, 4096)
	if got := f.match(); got != 8 {
		t.Fatalf("before removal: %d, want 8", got)
	}
	f.remove(1, 0, 1)
	if got := f.match(); got != 0 {
		t.Fatalf("window group lost blocks 0-1: %d, want 0", got)
	}
	// Group 0 still holds them: its residency and the engine mapping stay.
	if got := f.x.ConfirmedRun(f.keys, hybridRep); got != 8 {
		t.Fatalf("group 0 run %d, want 8", got)
	}
	// A removal further in, in the window group only: the hit is the run
	// from the start (shorter than the window).
	f2 := newHybrid(t, 8, 4096)
	f2.remove(1, 5)
	if got := f2.match(); got != 5 {
		t.Fatalf("window group lost block 5: %d, want 5", got)
	}
}

// TestHybridLongPromptOutsideWindow: a prompt ten windows long whose
// sliding-window group freed every block outside the last window (as vLLM
// does during prefill) stays matchable to the full length; a removal
// inside the window limits the match to the end of the last complete
// window before it; a full-attention removal bounds everything.
func TestHybridLongPromptOutsideWindow(t *testing.T) {
	const blocks = 40
	// 64-token window, 16-token blocks: cdiv(63, 16) = 4 blocks needed.
	f := newHybrid(t, blocks, 64)
	f.remove(1, span(0, blocks-4)...)
	if got := f.match(); got != blocks {
		t.Fatalf("window group holds only the last window: %d, want %d", got, blocks)
	}
	f.remove(1, blocks-2) // inside the window
	// Runs of the window group now: [36,38) and [39,40): no 4-block run.
	if got := f.match(); got != 0 {
		t.Fatalf("no complete window left: %d, want 0", got)
	}

	f = newHybrid(t, blocks, 64)
	f.remove(1, 10, 37)
	// Rightmost 4-block window run ending at most 40: [33,37).
	if got := f.match(); got != 37 {
		t.Fatalf("window removal at 37: %d, want 37", got)
	}
	f.remove(0, 30)
	// Full attention stops at 30; the window group holds [26,30).
	if got := f.match(); got != 30 {
		t.Fatalf("full-attention removal at 30: %d, want 30", got)
	}
	f.remove(1, 28)
	// [26,30) broken; the window group's runs below 30: [11,28) -> ends at 28.
	if got := f.match(); got != 28 {
		t.Fatalf("window removal at 28 under a full bound of 30: %d, want 28", got)
	}
}

// TestGroupRemovalKeepsOtherGroups: a removal in one group removes only
// that group's residency, and the engine mapping is dropped only when no
// group holds the block any more.
func TestGroupRemovalKeepsOtherGroups(t *testing.T) {
	f := newHybrid(t, 4, 64)
	before := f.x.Stats().EngineHashes
	f.remove(1, 3)
	if got := f.x.Stats().EngineHashes; got != before {
		t.Fatalf("engine hashes %d after a group-1 removal, want %d", got, before)
	}
	if got := f.x.ConfirmedRun(f.keys, hybridRep); got != 4 {
		t.Fatalf("group 0 run %d, want 4", got)
	}
	f.remove(0, 3)
	if got := f.x.Stats().EngineHashes; got != before-1 {
		t.Fatalf("engine hashes %d after both groups removed block 3, want %d", got, before-1)
	}
	if got := f.match(); got != 3 {
		t.Fatalf("match %d, want 3", got)
	}
	if s := f.x.Stats(); s.GroupEntries != 3 || s.UnknownRemoved != 0 {
		t.Fatalf("stats %+v", s)
	}
	// Clearing the replica drops every group.
	f.x.ClearReplica(hybridRep)
	if s := f.x.Stats(); s.GroupEntries != 0 || s.TotalEntries() != 0 || s.Blocks != 0 {
		t.Fatalf("after clear: %+v", s)
	}
}

// TestSingleGroupReplicaUnaffected: a replica that never names a second
// group matches as before, next to a hybrid one.
func TestSingleGroupReplicaUnaffected(t *testing.T) {
	f := newHybrid(t, 12, 64)
	single := hybridRep + 1
	if err := f.x.ApplyStored(single, StoredBlocks{Hashes: f.hashes, Tokens: f.toks, BlockTokens: 16}); err != nil {
		t.Fatal(err)
	}
	f.remove(1, 0, 1, 2)
	f.x.ApplyRemoved(single, []uint64{f.hashes[9]})
	out := make([]int32, 2)
	l := f.x.Match(f.keys, []ReplicaID{hybridRep, single}, ModeKVEvents, t0, out)
	if out[0] != 12 || out[1] != 9 || l != 12 {
		t.Fatalf("out %v longest %d, want [12 9] 12", out, l)
	}
}

// refHybridHit is an independent reading of vLLM's rule: the longest
// prefix length L such that every full group holds blocks [0, L) and every
// window group with window w holds [max(0, L-w), L).
func refHybridHit(held [][]bool, kinds []GroupKind, w []int) int {
	n := len(held[0])
	for L := n; L > 0; L-- {
		ok := true
		for g := range held {
			from := 0
			if kinds[g] == GroupSliding {
				from = max(0, L-w[g])
			}
			for i := from; i < L && ok; i++ {
				ok = held[g][i]
			}
		}
		if ok {
			return L
		}
	}
	return 0
}

// TestHybridMatchesReference: random group residency (stores and
// removals in three groups: full, window 2 blocks, window 5 blocks) against
// refHybridHit.
func TestHybridMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	kinds := []GroupKind{GroupFull, GroupSliding, GroupSliding}
	windows := []int{0, 2*16 + 1, 5*16 + 1} // tokens: cdiv(w-1, 16) = 2, 5 blocks
	wBlocks := []int{0, 2, 5}
	for trial := range 300 {
		n := 1 + rng.IntN(30)
		x := newTestIndex(t, func(c *Config) { c.BlockTokens = 16 })
		h := x.Hasher()
		root := h.Root("m", "", "")
		x.SetReplicaRoot(1, root)
		toks := seqTokens(n*16, uint32(trial))
		keys := h.AppendKeys(nil, root, toks)
		hashes := make([]uint64, n)
		for i := range hashes {
			hashes[i] = uint64(trial)<<16 | uint64(i) + 1
		}
		held := make([][]bool, len(kinds))
		for g := range kinds {
			must(t, x.ApplyStored(1, StoredBlocks{Hashes: hashes, Tokens: toks, BlockTokens: 16,
				Group: g, GroupKind: kinds[g], Window: windows[g]}))
			held[g] = make([]bool, n)
			for i := range held[g] {
				held[g][i] = true
			}
		}
		for range rng.IntN(2 * n) {
			g, i := rng.IntN(len(kinds)), rng.IntN(n)
			if g == 0 && rng.IntN(4) != 0 {
				continue // full-attention removals end most prefixes: fewer of them
			}
			x.ApplyRemovedGroup(1, g, []uint64{hashes[i]})
			held[g][i] = false
		}
		want := refHybridHit(held, kinds, wBlocks)
		out := make([]int32, 1)
		x.Match(keys, []ReplicaID{1}, ModeKVEvents, t0, out)
		if int(out[0]) != want {
			t.Fatalf("trial %d: match %d, reference %d (held %v)", trial, out[0], want, held)
		}
	}
}

// TestGroupOutOfRange: groups beyond MaxGroups are refused and counted.
func TestGroupOutOfRange(t *testing.T) {
	f := newHybrid(t, 2, 64)
	err := f.x.ApplyStored(hybridRep, StoredBlocks{Hashes: f.hashes, Tokens: f.toks, BlockTokens: 16, Group: MaxGroups})
	if err == nil {
		t.Fatal("group MaxGroups accepted")
	}
	f.x.ApplyRemovedGroup(hybridRep, MaxGroups, f.hashes)
	if got := f.x.Stats().SkippedGroupEvents; got != 2 {
		t.Fatalf("skipped %d, want 2", got)
	}
	if got := f.match(); got != 2 {
		t.Fatalf("match %d, want 2", got)
	}
}

// TestHybridConcurrentMatch: matches of a hybrid replica (and MatchTiers)
// run in parallel with group stores and removals; run under -race.
func TestHybridConcurrentMatch(t *testing.T) {
	f := newHybrid(t, 24, 64)
	done := make(chan struct{})
	errs := make(chan int, 4)
	for range 2 {
		go func() {
			out := make([]int32, 1)
			gpu, cpu, disk := make([]int32, 1), make([]int32, 1), make([]int32, 1)
			bad := 0
			for range 2000 {
				f.x.Match(f.keys, []ReplicaID{hybridRep}, ModeKVEvents, t0, out)
				f.x.MatchTiers(f.keys, []ReplicaID{hybridRep}, ModeKVEvents, t0, gpu, cpu, disk)
				if out[0] < 0 || out[0] > 24 || gpu[0] < 0 || gpu[0] > 24 {
					bad++
				}
			}
			errs <- bad
		}()
	}
	go func() {
		defer close(done)
		for i := range 500 {
			b := i % 24
			f.remove(1+i%2, b)
			if err := f.x.ApplyStored(hybridRep, StoredBlocks{Hashes: f.hashes, Tokens: f.toks, BlockTokens: 16,
				Group: 1, GroupKind: GroupSliding, Window: f.window}); err != nil {
				t.Error(err) // not Fatal: this is not the test's goroutine
				return
			}
		}
	}()
	<-done
	for range 2 {
		if bad := <-errs; bad != 0 {
			t.Fatalf("%d matches out of range", bad)
		}
	}
	if got := f.match(); got != 24 {
		t.Fatalf("after the writer restored every block: %d, want 24", got)
	}
}
