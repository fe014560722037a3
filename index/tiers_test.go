package index

import "testing"

// TestMatchTiers: blocks offloaded to CPU or disk are reported after the
// GPU match, each tier's removals touch only that tier, and the engine
// mapping lives while any tier holds the block.
func TestMatchTiers(t *testing.T) {
	x := newTestIndex(t, func(c *Config) { c.BlockTokens = 16 })
	h := x.Hasher()
	root := h.Root("m", "", "")
	x.SetReplicaRoot(1, root)
	x.SetReplicaRoot(2, root)
	toks := seqTokens(10*16, 5)
	keys := h.AppendKeys(nil, root, toks)
	hs := []uint64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	// Replica 1: the whole prompt on CPU, the first 4 blocks on the GPU,
	// blocks 8-9 on disk too.
	must(t, x.ApplyStored(1, StoredBlocks{Hashes: hs, Tokens: toks, BlockTokens: 16, Tier: TierCPU}))
	must(t, x.ApplyStored(1, StoredBlocks{Hashes: hs[:4], Tokens: toks[:64], BlockTokens: 16}))
	must(t, x.ApplyStored(1, StoredBlocks{Hashes: hs[8:], Tokens: toks[128:], BlockTokens: 16, ParentHash: 8, HasParent: true, Tier: TierDisk}))
	// Replica 2: GPU only, 6 blocks.
	must(t, x.ApplyStored(2, StoredBlocks{Hashes: hs[:6], Tokens: toks[:96], BlockTokens: 16}))

	cands := []ReplicaID{1, 2}
	gpu, cpu, disk := make([]int32, 2), make([]int32, 2), make([]int32, 2)
	check := func(what string, g1, c1, d1, g2 int32) {
		t.Helper()
		x.MatchTiers(keys, cands, ModeKVEvents, t0, gpu, cpu, disk)
		if gpu[0] != g1 || cpu[0] != c1 || disk[0] != d1 || gpu[1] != g2 || cpu[1] != 0 || disk[1] != 0 {
			t.Fatalf("%s: gpu %v cpu %v disk %v, want replica 1 %d/%d/%d, replica 2 %d/0/0", what, gpu, cpu, disk, g1, c1, d1, g2)
		}
		out := make([]int32, 2)
		x.Match(keys, cands, ModeKVEvents, t0, out)
		if out[0] != gpu[0] || out[1] != gpu[1] {
			t.Fatalf("%s: Match %v, MatchTiers gpu %v", what, out, gpu)
		}
	}
	check("stored", 4, 6, 0, 6)
	// A CPU removal inside the run: the CPU run stops before it.
	x.ApplyKV(1, []KVEvent{{Kind: KVRemoved, Removed: hs[6:7], Tier: TierCPU}}, nil)
	check("cpu removal of block 6", 4, 2, 0, 6)
	// A GPU removal of block 3: block 3 is still on CPU.
	x.ApplyKV(1, []KVEvent{{Kind: KVRemoved, Removed: hs[3:4]}}, nil)
	check("gpu removal of block 3", 3, 3, 0, 6)
	if x.Stats().UnknownRemoved != 0 {
		t.Fatal("a removal found no mapping")
	}
	// Block 3 leaves the CPU too: its mapping goes, the GPU match stays 3.
	before := x.Stats().EngineHashes
	x.ApplyKV(1, []KVEvent{{Kind: KVRemoved, Removed: hs[3:4], Tier: TierCPU}}, nil)
	if got := x.Stats().EngineHashes; got != before-1 {
		t.Fatalf("engine hashes %d, want %d", got, before-1)
	}
	check("block 3 gone everywhere", 3, 0, 0, 6)
	// Blocks 6-7 back on CPU? Only disk beyond: restore the CPU copy of
	// block 3 and 6, and the run reaches the disk blocks.
	must(t, x.ApplyStored(1, StoredBlocks{Hashes: hs[3:4], Tokens: toks[48:64], BlockTokens: 16, ParentHash: 3, HasParent: true, Tier: TierCPU}))
	must(t, x.ApplyStored(1, StoredBlocks{Hashes: hs[6:7], Tokens: toks[96:112], BlockTokens: 16, ParentHash: 6, HasParent: true, Tier: TierCPU}))
	check("run to disk", 3, 7, 0, 6)
	x.ApplyKV(1, []KVEvent{{Kind: KVRemoved, Removed: hs[8:], Tier: TierCPU}}, nil)
	check("blocks 8-9 on disk only", 3, 5, 2, 6)
	// History-mode reads report no tiers; a clear drops every tier.
	x.MatchTiers(keys, cands, ModeHistory, t0, gpu, cpu, disk)
	if cpu[0] != 0 || disk[0] != 0 {
		t.Fatalf("history mode: cpu %v disk %v", cpu, disk)
	}
	x.ApplyKV(1, []KVEvent{{Kind: KVCleared}}, nil)
	check("cleared", 0, 0, 0, 6)
	if s := x.Stats(); s.GroupEntries != 0 {
		t.Fatalf("side entries left after a clear: %+v", s)
	}
}

// TestMatchTiersNoAllocs: MatchTiers allocates nothing.
func TestMatchTiersNoAllocs(t *testing.T) {
	x := newTestIndex(t, func(c *Config) { c.BlockTokens = 16 })
	h := x.Hasher()
	root := h.Root("m", "", "")
	x.SetReplicaRoot(1, root)
	toks := seqTokens(8*16, 5)
	keys := h.AppendKeys(nil, root, toks)
	hs := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
	must(t, x.ApplyStored(1, StoredBlocks{Hashes: hs, Tokens: toks, BlockTokens: 16, Tier: TierCPU}))
	must(t, x.ApplyStored(1, StoredBlocks{Hashes: hs[:2], Tokens: toks[:32], BlockTokens: 16}))
	cands := []ReplicaID{1}
	gpu, cpu, disk := make([]int32, 1), make([]int32, 1), make([]int32, 1)
	if a := testing.AllocsPerRun(100, func() { x.MatchTiers(keys, cands, ModeKVEvents, t0, gpu, cpu, disk) }); a != 0 {
		t.Fatalf("%v allocs", a)
	}
	if gpu[0] != 2 || cpu[0] != 6 {
		t.Fatalf("gpu %v cpu %v", gpu, cpu)
	}
}
