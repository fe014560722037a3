package sim

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/kvevents"
)

// forget drops the engine's lookup shortcuts: the waiting head's memo and
// every block's child hint, so the next Step looks every block up in the
// map from the start, as a plain prefix lookup does.
func (e *Engine) forget() {
	e.head, e.headHit = nil, nil
	for i := range e.pool.blocks {
		e.pool.blocks[i].child = nil
	}
}

// TestLookupShortcutsChangeNothing drives two engines with the same
// arrivals through a tight pool (blocked heads, evictions, preemptions,
// shared and diverging prefixes, arrivals between steps) and forgets the
// shortcuts on one before every step: every step's result, event and
// counter must be equal.
func TestLookupShortcutsChangeNothing(t *testing.T) {
	cfg := testEngineConfig()
	cfg.NumBlocks = 120
	fast, err := NewEngine(cfg)
	require.NoError(t, err)
	ref, err := NewEngine(cfg)
	require.NoError(t, err)
	rng := rand.New(rand.NewPCG(5, 6))
	now := time.Unix(1000, 0)
	next, steps, blocked, resumed := 0, 0, 0, 0
	for steps < 20_000 {
		for range rng.IntN(3) {
			if next >= 200 {
				break
			}
			p := make([]uint32, 64+rng.IntN(700))
			fam := uint32(rng.IntN(3))
			for j := range p {
				p[j] = fam*10_000 + uint32(j)
			}
			for j := len(p) - 1 - rng.IntN(40); j < len(p); j++ {
				p[j] = uint32(1_000_000 + next) // a private tail
			}
			r := Request{ID: RequestID(fmt.Sprint("r", next)), Prompt: p, MaxTokens: 1 + rng.IntN(30)}
			require.NoError(t, fast.Add(r, now))
			require.NoError(t, ref.Add(r, now))
			next++
		}
		head := fast.head
		ref.forget()
		a, b := fast.Step(now), ref.Step(now)
		if head != nil && fast.head == head && len(fast.waiting) > 0 && fast.waiting[0] == head {
			blocked++
		}
		if head != nil && len(fast.headHit) > 0 {
			resumed++
		}
		require.Equal(t, b, a, "step %d", steps)
		st := fast.Stats()
		require.Equal(t, ref.Stats(), st, "step %d", steps)
		require.Equal(t, Gauges{Running: st.Running, Waiting: st.Waiting, KVUsage: st.KVUsage}, fast.Gauges(), "Gauges at step %d", steps)
		steps++
		if a.Idle() {
			if next >= 200 {
				break
			}
			continue
		}
		now = a.End()
	}
	require.Equal(t, 200, next)
	require.Zero(t, fast.Stats().Running+fast.Stats().Waiting)
	require.Positive(t, fast.Stats().Preemptions)
	// The memo must actually have been exercised.
	require.Positive(t, blocked, "no step found its head still blocked")
	require.Positive(t, resumed)
	t.Logf("%d steps, %d with a blocked head, %d preemptions", steps, blocked, fast.Stats().Preemptions)
}

// TestHashBlockEncoding checks the block hash against its definition:
// seeded xxh3 over a has-parent byte, the parent hash and the tokens, all
// little-endian.
func TestHashBlockEncoding(t *testing.T) {
	p := newBlockPool(1, 16, 99, false)
	rng := rand.New(rand.NewPCG(8, 9))
	for i := range 200 {
		toks := make([]uint32, rng.IntN(40))
		for j := range toks {
			toks[j] = rng.Uint32()
		}
		parent, hasParent := kvevents.EngineHash(rng.Uint64()), i%3 != 0
		buf := make([]byte, 9, 9+4*len(toks))
		if hasParent {
			buf[0] = 1
			binary.LittleEndian.PutUint64(buf[1:], uint64(parent))
		}
		for _, tk := range toks {
			buf = binary.LittleEndian.AppendUint32(buf, tk)
		}
		require.Equal(t, kvevents.EngineHash(xxh3.HashSeed(buf, 99)), p.hashBlock(parent, hasParent, toks))
	}
}
