package route

import (
	"testing"

	"github.com/kvmesh/kvmesh/index"
)

// tierFixture is a token-keyed index where replica 0 holds a 320-block
// prompt in its CPU offload tier only (its engine's KV events) and replica
// 1 holds nothing; replica 0 is the busier one.
func tierFixture(t testing.TB) (*index.Index, []index.ReplicaID, *arrayLoad, []index.BlockKey, Request) {
	t.Helper()
	cfg := index.DefaultConfig()
	cfg.BlockTokens = TokenBlockTokens
	ix, err := index.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := ix.Hasher()
	root := h.Root("m", "", "")
	ix.SetReplicaRoot(0, root)
	ix.SetReplicaRoot(1, root)
	const blocks = 320
	toks := make([]uint32, blocks*TokenBlockTokens)
	hashes := make([]uint64, blocks)
	for i := range toks {
		toks[i] = uint32(i*7 + 1)
	}
	for i := range hashes {
		hashes[i] = uint64(i + 1)
	}
	if err := ix.ApplyStored(0, index.StoredBlocks{Hashes: hashes, Tokens: toks, BlockTokens: TokenBlockTokens, Tier: index.TierCPU}); err != nil {
		t.Fatal(err)
	}
	keys := h.AppendKeys(nil, root, toks)
	load := &arrayLoad{
		names:     []string{"cpu-holder", "cold"},
		inflight:  []int{2, 0},
		queued:    []int{1000, 0},
		publishes: []bool{true, true},
	}
	req := NewRequest(keys, root, TokenBlockTokens, len(toks)+9, 64, "")
	req.Now = 1
	return ix, []index.ReplicaID{0, 1}, load, keys, req
}

// TestRouteCostPricesCPUTier: with the tier term, cost sends a prompt to
// the busier replica that holds it in CPU memory (a load at 50k tokens/s
// beats recomputing 5,129 tokens at 3,000/s on the idle one), reports the
// run in the candidate, and counts only the tail as uncached work; with
// the CPU rate negative (the term off) the same view sends it to the idle
// replica. prefix-cache sees no tiers (GPU-only).
func TestRouteCostPricesCPUTier(t *testing.T) {
	ix, ids, load, keys, req := tierFixture(t)
	var s Scratch
	rng := NewRand(1)
	route := func(cfg Config, strategy func(*Set) Strategy) Routed {
		t.Helper()
		set, err := NewSet(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return s.Route(&Input{Keys: keys, Replicas: ids, Index: ix, Mode: index.ModeKVEvents, Load: load,
			Strategy: strategy(set), Rand: &rng, Request: &req})
	}
	cost := func(s *Set) Strategy { return s.Cost }
	on := route(DefaultConfig(), cost)
	if on.Decision.Index != 0 || on.Matched != 0 || on.Uncached != 9 || on.Observation.UncachedTokens != 9 {
		t.Fatalf("tier priced: %+v, want replica 0 with 9 tokens computed", on)
	}
	if c := s.Candidates()[0]; c.OffloadCPU != 320 || c.OffloadDisk != 0 {
		t.Fatalf("candidate 0 tiers %d/%d, want 320/0", c.OffloadCPU, c.OffloadDisk)
	}
	off := DefaultConfig()
	off.Cost.CPULoadTokensPerSecond = -1
	off.Cost.DiskLoadTokensPerSecond = -1
	if got := route(off, cost); got.Decision.Index != 1 || got.Uncached != req.UncachedTokens(0) {
		t.Fatalf("tier term off: %+v, want the idle replica recomputing", got)
	}
	if c := s.Candidates()[0]; c.OffloadCPU != 0 {
		t.Fatalf("tier term off: candidate 0 offload %d, want 0 (MatchTiers not asked)", c.OffloadCPU)
	}
	pc := route(DefaultConfig(), func(s *Set) Strategy { return s.PrefixCache })
	if pc.Matched != 0 || s.Candidates()[0].OffloadCPU != 0 {
		t.Fatalf("prefix-cache saw tiers: %+v %+v", pc, s.Candidates()[0])
	}
}

// TestRouteTiersNoAllocs: the tier-priced route allocates nothing once the
// scratch has grown.
func TestRouteTiersNoAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocations differ under -race")
	}
	ix, ids, load, keys, req := tierFixture(t)
	set, err := NewSet(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	var s Scratch
	rng := NewRand(1)
	in := &Input{Keys: keys, Replicas: ids, Index: ix, Mode: index.ModeKVEvents, Load: load,
		Strategy: set.Cost, Rand: &rng, Request: &req}
	s.Route(in)
	if n := testing.AllocsPerRun(100, func() { s.Route(in) }); n != 0 {
		t.Fatalf("%v allocs per Route", n)
	}
}

// BenchmarkRouteCostTiers: one cost Route over 16 replicas and a
// 320-block prompt, replica 0 holding it in its CPU tier: "gpu-only" is
// the route before tiers were priced (CPU and disk rates negative: Match
// alone), "tiers" asks MatchTiers and prices the offloaded run.
func BenchmarkRouteCostTiers(b *testing.B) {
	ix, _, _, keys, req := tierFixture(b)
	const n = 16
	ids := make([]index.ReplicaID, n)
	load := &arrayLoad{}
	for i := range ids {
		ids[i] = index.ReplicaID(i)
		ix.SetReplicaRoot(ids[i], ix.Hasher().Root("m", "", ""))
		load.names = append(load.names, "r"+string(rune('a'+i)))
		load.inflight = append(load.inflight, i%3)
		load.queued = append(load.queued, 100*i)
		load.publishes = append(load.publishes, true)
	}
	for _, tc := range []struct {
		name string
		rate float64
	}{{"gpu-only", -1}, {"tiers", 0}} {
		b.Run(tc.name, func(b *testing.B) {
			cfg := DefaultConfig()
			cfg.Cost.CPULoadTokensPerSecond, cfg.Cost.DiskLoadTokensPerSecond = tc.rate, tc.rate
			set, err := NewSet(cfg)
			if err != nil {
				b.Fatal(err)
			}
			var s Scratch
			rng := NewRand(1)
			in := &Input{Keys: keys, Replicas: ids, Index: ix, Mode: index.ModeKVEvents, Load: load,
				Strategy: set.Cost, Rand: &rng, Request: &req}
			b.ReportAllocs()
			for b.Loop() {
				s.Route(in)
			}
		})
	}
}
