package sim

import (
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

// keysOf is the index key of every block, derived from its token chain.
func keysOf(h index.Hasher, root index.BlockKey, blocks []CachedBlock) []index.BlockKey {
	out := make([]index.BlockKey, 0, len(blocks))
	for _, b := range blocks {
		ks := h.AppendKeys(nil, root, b.Prefix)
		out = append(out, ks[len(ks)-1])
	}
	slices.Sort(out)
	return out
}

// TestOffloadTierTruth: an engine with a CPU offload tier, under a
// shared-prefix workload that overflows its GPU pool, publishes CPU-tier
// events; applied through the gateway's path (encode, decode, Normalize,
// ApplyKV), the index's GPU and CPU sets end equal to the engine's own
// tables, offloaded prefixes are loaded (not recomputed) and timed by the
// load bandwidth, and MatchTiers reports the loadable run.
func TestOffloadTierTruth(t *testing.T) {
	cfg := DefaultEngineConfig()
	cfg.NumBlocks, cfg.BlockSize, cfg.MaxNumSeqs = 64, 16, 4
	cfg.OffloadBlocks, cfg.OffloadLoadTokensPerSecond = 96, 16_000
	e, err := NewEngine(cfg)
	if err != nil {
		t.Fatal(err)
	}
	icfg := index.DefaultConfig()
	icfg.BlockTokens = 16
	ix, err := index.New(icfg)
	if err != nil {
		t.Fatal(err)
	}
	h := ix.Hasher()
	root := h.Root("m", "", "")
	ix.SetReplicaRoot(0, root)
	var norm []index.KVEvent
	var rep index.KVReport
	apply := func(evs []kvevents.Event) {
		if len(evs) == 0 {
			return
		}
		p, err := kvevents.Encode(&kvevents.Batch{TS: 1, Events: evs}, kvevents.EncodingMap)
		if err != nil {
			t.Fatal(err)
		}
		b, err := kvevents.Decode(p)
		if err != nil {
			t.Fatal(err)
		}
		norm = kvevents.Normalize(h, "m", b, norm)
		ix.ApplyKV(0, norm, &rep)
		for _, err := range rep.Errors {
			t.Fatalf("apply: %v", err)
		}
	}
	rng := rand.New(rand.NewPCG(4, 5))
	prefixes := [][]uint32{promptTokens(1, 20), promptTokens(2, 20), promptTokens(3, 20), promptTokens(4, 20)}
	now := time.Unix(0, 0)
	var prompts [][]uint32
	for i := range 60 {
		p := append(append([]uint32(nil), prefixes[rng.IntN(len(prefixes))]...), promptTokens(uint64(100+i), 1+rng.IntN(6))...)
		prompts = append(prompts, p)
		if err := e.Add(Request{ID: RequestID(strconv.Itoa(i + 1)), Prompt: p, MaxTokens: 2}, now); err != nil {
			t.Fatal(err)
		}
		for range 1000 {
			res := e.Step(now)
			apply(res.Events)
			now = res.End()
			if res.Idle() {
				break
			}
		}
	}
	st := e.Stats()
	if st.OffloadLoadedTokens == 0 {
		t.Fatal("no prompt loaded offloaded blocks")
	}
	gpuTruth := keysOf(h, root, e.CachedBlocks())
	cpuTruth := keysOf(h, root, e.OffloadedBlocks())
	gpu := ix.AppendReplicaKeys(nil, 0, index.Confirmed)
	cpu := ix.AppendReplicaTierKeys(nil, 0, index.TierCPU)
	slices.Sort(gpu)
	slices.Sort(cpu)
	if !slices.Equal(gpu, gpuTruth) {
		t.Fatalf("GPU: index %d keys, engine %d", len(gpu), len(gpuTruth))
	}
	if !slices.Equal(cpu, cpuTruth) || len(cpu) == 0 {
		t.Fatalf("CPU: index %d keys, engine %d", len(cpu), len(cpuTruth))
	}
	// MatchTiers: the GPU run, then the CPU run after it, as the engine
	// would find them (GPU lookup, then the offload store).
	g, c, d := make([]int32, 1), make([]int32, 1), make([]int32, 1)
	offloaded := 0
	for _, p := range prompts {
		keys := h.AppendKeys(nil, root, p)
		ix.MatchTiers(keys, []index.ReplicaID{0}, index.ModeKVEvents, 0, g, c, d)
		hashes := e.HashTokens(p)
		wantG := 0
		for wantG < len(hashes) && e.pool.cache[hashes[wantG]] != nil {
			wantG++
		}
		wantC := 0
		for wantG+wantC < len(hashes) && e.pool.offload.has(hashes[wantG+wantC]) {
			wantC++
		}
		if int(g[0]) != wantG || int(c[0]) != wantC || d[0] != 0 {
			t.Fatalf("MatchTiers %d/%d/%d, engine %d GPU then %d CPU", g[0], c[0], d[0], wantG, wantC)
		}
		if wantC > 0 {
			offloaded++
		}
	}
	if offloaded == 0 {
		t.Fatal("no prompt had an offloaded run at the end")
	}
}

// TestOffloadLoadIsTimed: a prompt whose prefix was evicted to the CPU
// tier loads it (the step is timed by the load bandwidth, not the
// prefill rate) and reports it as cached.
func TestOffloadLoadIsTimed(t *testing.T) {
	third := func(rate float64) (Finished, uint64) {
		cfg := DefaultEngineConfig()
		cfg.NumBlocks, cfg.BlockSize, cfg.MaxNumSeqs = 40, 16, 1
		cfg.OffloadBlocks, cfg.OffloadLoadTokensPerSecond = 64, rate
		e, err := NewEngine(cfg)
		if err != nil {
			t.Fatal(err)
		}
		now := time.Unix(0, 0)
		run := func(id int, p []uint32) Finished {
			if err := e.Add(Request{ID: RequestID(strconv.Itoa(id)), Prompt: p, MaxTokens: 1}, now); err != nil {
				t.Fatal(err)
			}
			for range 100 {
				res := e.Step(now)
				now = res.End()
				for _, f := range res.Finished {
					return f
				}
			}
			t.Fatal("request did not finish")
			return Finished{}
		}
		a := promptTokens(11, 30)
		run(1, a)
		run(2, promptTokens(12, 30)) // evicts a's blocks to the CPU tier
		return run(3, a), e.Stats().OffloadLoadedTokens
	}
	fast, loaded := third(1e9)
	if fast.CachedTokens < 29*16 || loaded == 0 {
		t.Fatalf("cached %d, loaded %d tokens, want a's prefix (%d) partly from the CPU tier", fast.CachedTokens, loaded, 29*16)
	}
	slow, _ := third(1000)
	// The loaded tokens at 1,000 tokens/s: the load alone takes that much more.
	want := time.Duration(float64(loaded) / 1000 * float64(time.Second))
	if d := slow.E2E - fast.E2E; d < want-5*time.Millisecond || d > want+5*time.Millisecond {
		t.Fatalf("slow load adds %v, want about %v (%d tokens)", d, want, loaded)
	}
}
