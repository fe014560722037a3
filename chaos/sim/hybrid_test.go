package sim

import (
	"math/rand/v2"
	"testing"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

// hybridRig feeds a HybridCache's events through the gateway's path (the
// vLLM wire encoding, kvevents.Decode, Normalize, index.ApplyKV) into an
// index, so that the index's match can be compared with the simulator's
// own hit.
type hybridRig struct {
	t    *testing.T
	hc   *HybridCache
	ix   *index.Index
	root index.BlockKey
	norm []index.KVEvent
	rep  index.KVReport
}

const hybridBlock = 16

func newHybridRig(t *testing.T, fullBlocks, windowPool, window int) *hybridRig {
	t.Helper()
	hc, err := NewHybridCache(fullBlocks, windowPool, hybridBlock, window, 42)
	if err != nil {
		t.Fatal(err)
	}
	cfg := index.DefaultConfig()
	cfg.BlockTokens = hybridBlock
	ix, err := index.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	g := &hybridRig{t: t, hc: hc, ix: ix, root: ix.Hasher().Root("m", "", "")}
	ix.SetReplicaRoot(0, g.root)
	return g
}

func (g *hybridRig) serve(tokens []uint32) int {
	g.t.Helper()
	hit, evs, err := g.hc.Serve(tokens)
	if err != nil {
		g.t.Fatal(err)
	}
	if len(evs) == 0 {
		return hit
	}
	p, err := kvevents.Encode(&kvevents.Batch{TS: 1, Events: evs}, kvevents.EncodingMap)
	if err != nil {
		g.t.Fatal(err)
	}
	b, err := kvevents.Decode(p)
	if err != nil {
		g.t.Fatal(err)
	}
	g.norm = kvevents.Normalize(g.ix.Hasher(), "m", b, g.norm)
	g.ix.ApplyKV(0, g.norm, &g.rep)
	if len(g.rep.Errors) > 0 {
		g.t.Fatalf("apply: %v", g.rep.Errors)
	}
	return hit
}

// check asserts that the index matches tokens exactly as far as the
// simulator would hit, and returns that hit.
func (g *hybridRig) check(tokens []uint32, what string) int {
	g.t.Helper()
	want := g.hc.Hit(tokens)
	keys := g.ix.Hasher().AppendKeys(nil, g.root, tokens)
	out := make([]int32, 1)
	g.ix.Match(keys, []index.ReplicaID{0}, index.ModeKVEvents, 0, out)
	if int(out[0]) != want {
		g.t.Fatalf("%s: index matches %d blocks, simulator hits %d", what, out[0], want)
	}
	return want
}

func promptTokens(seed uint64, blocks int) []uint32 {
	rng := rand.New(rand.NewPCG(seed, 9))
	toks := make([]uint32, blocks*hybridBlock)
	for i := range toks {
		toks[i] = rng.Uint32N(150000)
	}
	return toks
}

// TestHybridLongPromptKeepsFullHit: a prompt ten windows long, whose
// window group has freed and then evicted blocks outside the window while
// the full-attention group kept them, stays matchable to its full length,
// as the simulator hits it; as the window group keeps evicting, the index
// follows the simulator's hit down, step by step.
func TestHybridLongPromptKeepsFullHit(t *testing.T) {
	// 64-token window: 4 blocks. The window group's pool is small, so it
	// evicts while the full-attention group (200 blocks) keeps everything.
	g := newHybridRig(t, 200, 48, 64)
	long := promptTokens(1, 40)
	g.serve(long)
	if got := g.check(long, "after serving"); got != 40 {
		t.Fatalf("hit %d after serving, want 40", got)
	}
	lost := false
	for i := range 12 {
		g.serve(promptTokens(100+uint64(i), 8))
		hit := g.check(long, "after filler")
		held := 0
		for _, h := range g.hc.hashes { // long's hashes (check hashed it last)
			if g.hc.pools[1].cache[h] != nil {
				held++
			}
		}
		if hit == 40 && held <= 8 {
			lost = true // the window group kept little more than the window: still a full hit
		}
	}
	if !lost {
		t.Fatal("the window group never lost most blocks outside the window while the hit stayed full")
	}
	// The index and the simulator also agree once the window is gone.
	if got := g.check(long, "at the end"); got == 40 {
		t.Fatalf("hit %d after the window group evicted everything, want less", got)
	}
}

// TestHybridShortPromptWindowCoversIt: a window longer than the prompt
// needs the window group's run from the start: evicting its tail blocks
// limits the hit to what is left before them.
func TestHybridShortPromptWindowCoversIt(t *testing.T) {
	g := newHybridRig(t, 200, 10, 4096)
	p := promptTokens(7, 8)
	g.serve(p)
	g.check(p, "after serving")
	g.serve(promptTokens(8, 4)) // the window group evicts 2 of p's tail blocks
	if got := g.check(p, "after filler"); got != 6 {
		t.Fatalf("hit %d, want 6", got)
	}
}

// TestHybridRandomWorkload: shared prefixes, prompts up to several windows
// long, both groups evicting; after every request, every prompt seen so
// far is matched exactly as the simulator would hit it.
func TestHybridRandomWorkload(t *testing.T) {
	for _, tc := range []struct{ full, window, win int }{{96, 64, 64}, {64, 96, 48}, {80, 80, 200}} {
		g := newHybridRig(t, tc.full, tc.window, tc.win)
		rng := rand.New(rand.NewPCG(uint64(tc.win), 3))
		prefixes := [][]uint32{promptTokens(1, 12), promptTokens(2, 20), promptTokens(3, 4)}
		var seen [][]uint32
		hits, partial := 0, 0
		for i := range 150 {
			p := append([]uint32(nil), prefixes[rng.IntN(len(prefixes))]...)
			p = append(p, promptTokens(uint64(1000+i), rng.IntN(30))...)
			if rng.IntN(3) == 0 && len(seen) > 0 {
				p = seen[rng.IntN(len(seen))] // a repeat
			}
			seen = append(seen, p)
			if g.serve(p) > 0 {
				hits++
			}
			for j, q := range seen {
				if j%7 == i%7 {
					if h := g.check(q, "random workload"); h > 0 && h < len(q)/hybridBlock {
						partial++
					}
				}
			}
		}
		if hits == 0 || partial == 0 {
			t.Fatalf("%+v: %d requests hit, %d checks partial: the workload does not exercise the rule", tc, hits, partial)
		}
	}
}
