package sim

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

// engineRig runs a hybrid Engine and feeds its KV events through the
// gateway's path (vLLM wire encoding, Decode, Normalize, index.ApplyKV),
// keeping per-group mirrors of what the events say.
type engineRig struct {
	t       *testing.T
	e       *Engine
	ix      *index.Index
	root    index.BlockKey
	norm    []index.KVEvent
	rep     index.KVReport
	mirrors [2]map[kvevents.EngineHash]bool
	now     time.Time
	n       int
}

func newEngineRig(t *testing.T, cfg EngineConfig) *engineRig {
	return newEngineRigIndexed(t, cfg, cfg.BlockSize)
}

// newEngineRigIndexed indexes at indexBlock tokens (a divisor of the
// engine's block, as the DES indexes 1568-token engine blocks at 784).
func newEngineRigIndexed(t *testing.T, cfg EngineConfig, indexBlock int) *engineRig {
	t.Helper()
	e, err := NewEngine(cfg)
	require.NoError(t, err)
	icfg := index.DefaultConfig()
	icfg.BlockTokens = indexBlock
	ix, err := index.New(icfg)
	require.NoError(t, err)
	g := &engineRig{t: t, e: e, ix: ix, root: ix.Hasher().Root("m", "", ""), now: time.Unix(1000, 0)}
	g.mirrors = [2]map[kvevents.EngineHash]bool{{}, {}}
	ix.SetReplicaRoot(0, g.root)
	return g
}

func (g *engineRig) apply(evs []kvevents.Event) {
	g.t.Helper()
	for _, ev := range evs {
		switch ev.Kind {
		case kvevents.KindBlockStored:
			for _, h := range ev.Stored.BlockHashes {
				g.mirrors[ev.Stored.GroupIdx][h] = true
			}
		case kvevents.KindBlockRemoved:
			for _, h := range ev.Removed.BlockHashes {
				require.True(g.t, g.mirrors[ev.Removed.GroupIdx][h], "removal of a block group %d never stored", ev.Removed.GroupIdx)
				delete(g.mirrors[ev.Removed.GroupIdx], h)
			}
		case kvevents.KindAllBlocksCleared:
			clear(g.mirrors[0])
			clear(g.mirrors[1])
		}
	}
	if len(evs) == 0 {
		return
	}
	p, err := kvevents.Encode(&kvevents.Batch{TS: 1, Events: evs}, kvevents.EncodingMap)
	require.NoError(g.t, err)
	b, err := kvevents.Decode(p)
	require.NoError(g.t, err)
	g.norm = kvevents.Normalize(g.ix.Hasher(), "m", b, g.norm)
	g.ix.ApplyKV(0, g.norm, &g.rep)
	require.Empty(g.t, g.rep.Errors)
}

// run adds prompts at once and steps the engine until idle, returning
// each request's cached tokens.
func (g *engineRig) run(prompts ...[]uint32) []int {
	g.t.Helper()
	ids := make(map[RequestID]int, len(prompts))
	for i, p := range prompts {
		id := RequestID(fmt.Sprint("r", g.n))
		g.n++
		ids[id] = i
		require.NoError(g.t, g.e.Add(Request{ID: id, Prompt: p, MaxTokens: 3}, g.now))
	}
	cached := make([]int, len(prompts))
	g.now = runUntilIdle(g.t, g.e, g.now, func(r StepResult) {
		g.apply(r.Events)
		for _, f := range r.Finished {
			cached[ids[f.ID]] = f.CachedTokens
		}
	})
	g.apply(g.e.Step(g.now).Events) // frees of the last step
	return cached
}

// requireGroupsMatch checks that each group's events describe exactly the
// blocks that group holds cached.
func (g *engineRig) requireGroupsMatch() {
	g.t.Helper()
	for grp, blocks := range [][]CachedBlock{g.e.CachedBlocks(), g.e.WindowCachedBlocks()} {
		got := map[kvevents.EngineHash]bool{}
		for _, b := range blocks {
			got[b.Hash] = true
		}
		require.Equal(g.t, g.mirrors[grp], got, "group %d", grp)
	}
}

// match is the index's hit for tokens in engine blocks, capped as vLLM
// caps its own (at most the prompt minus one token).
func (g *engineRig) match(tokens []uint32) int {
	per := g.e.cfg.BlockSize / g.ix.Hasher().BlockTokens()
	keys := g.ix.Hasher().AppendKeys(nil, g.root, tokens)
	keys = keys[:min(len(keys), (len(tokens)-1)/g.e.cfg.BlockSize*per)]
	out := make([]int32, 1)
	g.ix.Match(keys, []index.ReplicaID{0}, index.ModeKVEvents, 0, out)
	require.Zero(g.t, int(out[0])%per, "the index matches whole engine blocks")
	return int(out[0]) / per
}

func hybridEngineConfig(numBlocks, windowBlocks, window int) EngineConfig {
	c := testEngineConfig()
	c.NumBlocks, c.SlidingWindowBlocks, c.SlidingWindow = numBlocks, windowBlocks, window
	return c
}

// TestHybridEngineLongPromptKeepsFullHit is the acceptance on the
// engine itself: a prompt ten windows long whose window group then loses
// blocks outside the window (the full-attention group keeps them) is still
// hit to its full length, by the engine's own admission and by the
// index's match; once the window group loses a block inside the window,
// both fall to what vLLM's rule allows.
func TestHybridEngineLongPromptKeepsFullHit(t *testing.T) {
	// 64-token window: 4 blocks of 16. The window pool is small.
	g := newEngineRig(t, hybridEngineConfig(256, 64, 64))
	long := append(promptTokens(1, 40), 7) // 40 full blocks and a token
	g.run(long)
	g.requireGroupsMatch()
	gpu, _ := g.e.PrefixHit(long)
	require.Equal(t, 40, gpu)
	require.Equal(t, 40, g.match(long))

	lostOutside := false
	for i := range 30 {
		g.run(promptTokens(100+uint64(i), 6))
		g.requireGroupsMatch()
		gpu, _ := g.e.PrefixHit(long)
		require.Equal(t, gpu, g.match(long), "filler %d", i)
		held := 0
		for _, h := range g.e.HashTokens(long) {
			if g.mirrors[1][h] {
				held++
			}
		}
		if gpu == 40 && held < 40 {
			lostOutside = true
		}
		if gpu < 40 {
			break
		}
	}
	require.True(t, lostOutside, "the window group lost blocks outside the window while the hit stayed full")
	gpu, _ = g.e.PrefixHit(long)
	// The engine's own admission takes exactly what PrefixHit said.
	require.Equal(t, []int{gpu * 16}, g.run(long))
	g.requireGroupsMatch()
}

// TestHybridEngineShortPrompt: the short example on the engine: a
// window longer than the prompt needs every block in the window group;
// the window group losing the prompt's tail blocks limits the hit to the
// blocks before them, although group 0 still holds them all.
func TestHybridEngineShortPrompt(t *testing.T) {
	g := newEngineRig(t, hybridEngineConfig(256, 12, 4096))
	p := append(promptTokens(7, 8), 1)
	g.run(p)
	gpu, _ := g.e.PrefixHit(p)
	require.Equal(t, 8, gpu)
	g.run(promptTokens(8, 5)) // 6 blocks with its outputs: the window pool evicts p's 2 LRU blocks
	g.requireGroupsMatch()
	full := 0
	for _, h := range g.e.HashTokens(p) {
		if g.mirrors[0][h] {
			full++
		}
	}
	require.Equal(t, 8, full, "group 0 keeps every block")
	gpu, _ = g.e.PrefixHit(p)
	require.Less(t, gpu, 8)
	require.Equal(t, gpu, g.match(p))
	require.Equal(t, []int{gpu * 16}, g.run(p))
}

// TestHybridEngineRandomWorkload: shared prefixes, prompts up to several
// windows long, several requests at a time (chunked prefill, preemption),
// both groups evicting. After every round each group's events equal its
// cached blocks, the index's match equals the engine's hit for every
// prompt seen, and a prompt sent alone is admitted with exactly that hit.
func TestHybridEngineRandomWorkload(t *testing.T) {
	for _, tc := range []struct{ full, window, win, indexBlock int }{{160, 96, 64, 16}, {96, 160, 48, 16}, {128, 128, 200, 16}, {160, 96, 72, 8}} {
		g := newEngineRigIndexed(t, hybridEngineConfig(tc.full, tc.window, tc.win), tc.indexBlock)
		rng := rand.New(rand.NewPCG(uint64(tc.win), 5))
		prefixes := [][]uint32{promptTokens(1, 12), promptTokens(2, 20), promptTokens(3, 4)}
		var seen [][]uint32
		hits, partial, differ := 0, 0, 0
		for i := range 60 {
			var batch [][]uint32
			for j := range 1 + rng.IntN(3) {
				p := append([]uint32(nil), prefixes[rng.IntN(len(prefixes))]...)
				p = append(p, promptTokens(uint64(1000+10*i+j), rng.IntN(24))...)
				p = append(p, uint32(i))
				if rng.IntN(3) == 0 && len(seen) > 0 {
					p = seen[rng.IntN(len(seen))]
				}
				batch = append(batch, p)
			}
			if len(batch) == 1 {
				want, _ := g.e.PrefixHit(batch[0])
				require.Equal(t, []int{want * 16}, g.run(batch[0]), "%+v round %d", tc, i)
			} else {
				g.run(batch...)
			}
			seen = append(seen, batch...)
			g.requireGroupsMatch()
			for _, q := range seen {
				gpu, _ := g.e.PrefixHit(q)
				require.Equal(t, gpu, g.match(q), "%+v round %d", tc, i)
				full := 0
				for _, h := range g.e.HashTokens(q)[:(len(q)-1)/16] {
					if !g.mirrors[0][h] {
						break
					}
					full++
				}
				if gpu > 0 {
					hits++
				}
				if gpu > 0 && gpu < (len(q)-1)/16 {
					partial++
				}
				if gpu < full {
					differ++ // the window group cut the hit
				}
			}
		}
		t.Logf("%+v: %d hits, %d partial, %d cut by the window group", tc, hits, partial, differ)
		require.Positive(t, hits)
		require.Positive(t, partial)
		require.Positive(t, differ, "the window group never limited a hit: the test does not exercise the rule")
	}
}
