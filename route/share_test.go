package route

import (
	"math"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
)

const sec = int64(1e9)

// newShareTable returns a table with the default time constant, as
// NewModel builds it.
func newShareTable() *shareTable { return &shareTable{tau: DefaultShareTauSeconds} }

func TestShareTable(t *testing.T) {
	s := newShareTable()
	require.Zero(t, s.share(1, 0, false), "an empty table knows no share")

	// One prefix only: all of the traffic.
	for i := range 10 {
		require.Equal(t, 1.0, s.share(1, int64(i)*sec, true))
	}
	// A second prefix at the same rate from now on: both converge to a
	// half as the first one's history decays.
	now := 10 * sec
	for i := range 400 {
		now = (10 + int64(i)) * sec
		s.share(1+uint64(i%2), now, true)
	}
	require.InDelta(t, 0.5, s.share(1, now, false), 0.02)
	require.InDelta(t, 0.5, s.share(2, now, false), 0.02)

	// Peeking changes nothing; a prefix never counted has no share.
	before := s.share(1, now, false)
	require.Equal(t, before, s.share(1, now, false))
	require.Zero(t, s.share(3, now, false))

	// Prefix 2 stops; five time constants later, 100 requests of prefix
	// 3 leave it e^−5 of its count.
	now += 5 * int64(DefaultShareTauSeconds) * sec
	for range 100 {
		s.share(3, now, true)
	}
	old := s.share(2, now, false)
	require.Less(t, old, 0.01)
	require.Greater(t, old, 0.0)
	require.Greater(t, s.share(3, now, false), 0.98)

	// A time before the last update counts as the same time.
	require.Equal(t, s.share(3, now, false), s.share(3, now-sec, false))
}

// TestShareTauScalesTime: a table with τ/S seen at times t/S gives the
// shares a default table gives at times t (the live study runs engines S
// times faster than real time and divides τ by S); with the default τ
// the fast table remembers S times as much of an earlier phase.
func TestShareTauScalesTime(t *testing.T) {
	const speed = 10
	m, err := NewModel(CostConfig{PriorPrefillTokensPerSecond: 1, PriorDecodeStepSeconds: 1, PriorOutputTokens: 1,
		ChunkTokens: 1, KVSaturation: 1, Alpha: 1, MinSampleTokens: 1, ShareTauSeconds: DefaultShareTauSeconds / speed})
	require.NoError(t, err)
	require.Equal(t, DefaultShareTauSeconds/speed, m.shares.tau)
	fast := &m.shares
	real, fastDefault := newShareTable(), newShareTable()
	// An earlier phase of prefix 1, then a gap, then a phase of 2 and 3
	// alternating: one request every 600 ms of model time.
	at := func(i int) int64 { return int64(i) * 600 * int64(1e6) }
	step := func(key uint64, i int) (r, f, fd float64) {
		return real.share(key, at(i), true), fast.share(key, at(i)/speed, true), fastDefault.share(key, at(i)/speed, true)
	}
	for i := range 96 {
		step(1, i)
	}
	for i := 0; i < 27; i++ {
		step(2+uint64(i%2), 200+i)
	}
	r, f, fd := real.share(2, at(226), false), fast.share(2, at(226)/speed, false), fastDefault.share(2, at(226)/speed, false)
	require.InDelta(t, r, f, 1e-9, "τ/S at S× speed is the same table")
	require.Less(t, fd, r/2, "the default τ at S× speed dilutes the current prefix with the earlier phase")

	// NewModel takes the default for 0.
	m, err = NewModel(DefaultCostConfig())
	require.NoError(t, err)
	require.Equal(t, DefaultShareTauSeconds, m.shares.tau)
}

// TestShareTableCollisions: keys that share a slot take the other of
// their two; a newcomer replaces the emptier of the two, so the prefix
// still arriving keeps its count.
func TestShareTableCollisions(t *testing.T) {
	s := newShareTable()
	// slot(k) = k % shareSlots for both keys' first probe.
	a, b, c := uint64(5), uint64(5+shareSlots), uint64(5+2*shareSlots)
	ia, ja := shareProbes(a)
	ib, jb := shareProbes(b)
	require.Equal(t, ia, ib, "the test needs keys colliding on their first slot")
	require.NotEqual(t, ja, jb)
	for range 30 {
		s.share(a, 0, true)
	}
	s.share(b, 0, true)
	require.InDelta(t, 30.0/31, s.share(a, 0, false), 1e-9)
	require.InDelta(t, 1.0/31, s.share(b, 0, false), 1e-9)

	// c collides with a's slot; its second probe decides which goes.
	ic, jc := shareProbes(c)
	require.Equal(t, ia, ic)
	s.share(c, 0, true)
	require.InDelta(t, 30.0/32, s.share(a, 0, false), 1e-9, "the popular prefix keeps its count")
	if jc == jb {
		require.Zero(t, s.share(b, 0, false), "b's slot was the emptier one")
	}
	require.InDelta(t, 1.0/32, s.share(c, 0, false), 1e-9)
}

// TestShareTableConcurrent: shares from many goroutines stay in [0, 1]
// and count every request (run with -race).
func TestShareTableConcurrent(t *testing.T) {
	s := newShareTable()
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 1000 {
				v := s.share(uint64(g), int64(i), true)
				if v < 0 || v > 1 || math.IsNaN(v) {
					t.Errorf("share %v", v)
					return
				}
			}
		})
	}
	wg.Wait()
	sum := 0.0
	for g := range 8 {
		sum += s.share(uint64(g), 1000, false)
	}
	require.InDelta(t, 1, sum, 1e-6)
}

// promptKeys returns n block keys of which the first shared are the
// same for every prompt (a preamble) and the rest are this prompt's own
// (distinct for each id).
func promptKeys(shared, n int, id uint64) []index.BlockKey {
	keys := make([]index.BlockKey, n)
	for i := range keys {
		keys[i] = index.BlockKey(1 + i)
		if i >= shared {
			keys[i] = index.BlockKey(id<<32 | uint64(i+1))
		}
	}
	return keys
}

// share returns key's share at now (ns), counting one request with this
// key alone first when add (test helper over shares).
func (s *shareTable) share(key uint64, now int64, add bool) float64 {
	p := Prefixes{n: 1, depth: [maxPrefixes]int32{1}, key: [maxPrefixes]uint64{key}}
	var out [maxPrefixes]float64
	s.shares(&p, now, add, &out)
	return out[0]
}

// countRequest counts one routed request with prefixes p at now in m's
// share table.
func countRequest(m *Model, p *Prefixes, now int64) {
	var out [maxPrefixes]float64
	m.shares.shares(p, now, true, &out)
}

// TestSharesCountEveryDepth: a request counts once in the total and once
// at each of its prefixes, so prompts that share a preamble share its
// depths and no others.
func TestSharesCountEveryDepth(t *testing.T) {
	s := newShareTable()
	a := NewPrefixes(promptKeys(8, 40, 1))
	b := NewPrefixes(promptKeys(8, 40, 2))
	var out [maxPrefixes]float64
	s.shares(&a, 0, true, &out)
	s.shares(&b, 0, true, &out)
	s.shares(&a, 0, false, &out)
	require.Equal(t, []int32{1, 2, 4, 8, 16, 32, 40}, a.depth[:a.n])
	require.Equal(t, []float64{1, 1, 1, 1, 0.5, 0.5, 0.5}, out[:a.n], "depths 1–8 are the shared preamble")
}

// TestCostChargesDuplicatePrefill: recomputing what a busy holder holds
// is charged the duplicate prefill, running sequences there times its
// seconds, weighted by (1 − share·replicas)⁺: a prefix one replica can
// carry stays with its holder, a hot one spreads.
func TestCostChargesDuplicatePrefill(t *testing.T) {
	cfg := DefaultCostConfig()
	cfg.MaxRunning = 8
	req := Request{TotalBlocks: 250, BlockTokens: 16, PromptTokens: 4000, MaxTokens: 128, Prefixes: NewPrefixes(promptKeys(0, 250, 42))}
	p := 1 / cfg.PriorPrefillTokensPerSecond
	for _, tc := range []struct {
		name   string
		others int // requests of other prefixes before this one's
		want   int
		sel    Selection
	}{
		// 12 in flight on 8 slots: six slot waits of 128·0.03/8 s at the
		// holder, 2.9 s, against a 1.4 s recompute where 2 run.
		{"hot prefix", 0, 1, SelectionCostSpread},
		{"one prefix of many", 20, 0, SelectionCostLocality},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := NewModel(cfg)
			require.NoError(t, err)
			c := NewCost(m)
			for i := range tc.others {
				other := NewPrefixes(promptKeys(0, 250, uint64(1000+i)))
				countRequest(m, &other, 0)
			}
			countRequest(m, &req.Prefixes, 0)
			cands := []Candidate{
				{ID: 0, Name: "holder", Matched: 250, InFlight: 12, Running: Unknown, Waiting: Unknown, KVUsage: Unknown},
				{ID: 1, Name: "other", InFlight: 2, Running: Unknown, Waiting: Unknown, KVUsage: Unknown},
			}
			share := 1.0 / float64(tc.others+1)
			weight := max(0, 1-2*share)

			rng := NewRand(1)
			var ex Explanation
			d := c.Pick(&req, cands, &rng, &ex)
			require.InDelta(t, share, ex.PrefixShare, 1e-9)
			require.Equal(t, tc.want, d.Index)
			require.Equal(t, tc.sel, d.Selection)

			// The other replica's score is its cost without the term plus
			// weight × 2 running × the 4,000 tokens it would duplicate.
			plain := c.costFor(&req, &cands[1], nil)
			require.InDelta(t, weight*2*4000*p, ex.Replicas[1].Score-plain, 1e-9)
			// The holder computes the least: never charged.
			require.InDelta(t, c.costFor(&req, &cands[0], nil), ex.Replicas[0].Score, 1e-9)
			require.Less(t, plain, ex.Replicas[0].Score, "without the term the recompute wins")

			// An explained decision does not count: the share is unchanged.
			first := req.Prefixes.key[0]
			require.InDelta(t, share, m.shares.share(first, 0, false), 1e-9)
			// A routed one does.
			c.Pick(&req, cands, &rng, nil)
			if share < 1 {
				require.Greater(t, m.shares.share(first, 0, false), share)
			}
		})
	}

	// Blocks weigh by their prefix's share: of 4 blocks (depths 1, 2, 4),
	// block 1 is hot (share ½ over 2 candidates), blocks 2–4 are not.
	pre := NewPrefixes(promptKeys(0, 4, 1))
	d := duplication{best: 4}
	d.weigh(&pre, &[maxPrefixes]float64{0.5, 0.25, 0.25}, 2)
	require.True(t, d.charged)
	require.Equal(t, []float64{0, 0.5, 0.5}, d.weight[:3])
	require.Equal(t, []float64{0, 0.5, 1.5}, d.cum[:3])
	require.InDelta(t, 4*100*p*1.5/4, d.penalty(0, 100, p, 4), 1e-12, "blocks 1–4: mean weight 1.5/4")
	require.InDelta(t, 4*100*p*0.5, d.penalty(1, 100, p, 4), 1e-12, "blocks 2–4")
	require.Zero(t, d.penalty(4, 100, p, 4), "nothing of the prompt left to duplicate")
	d.best = 2
	require.InDelta(t, 4*100*p*0.5, d.penalty(2, 100, p, 4), 1e-12, "as long a match as the best, more to compute: the next block's weight")
	d.best = 4
	require.Zero(t, d.penalty(0, 100, p, 0), "nothing running, nothing stalled")
	require.Zero(t, (*duplication)(nil).penalty(0, 100, p, 4))
	d.least = 100
	require.Zero(t, d.penalty(0, 100, p, 4), "the least computed is no duplicate")
	d = duplication{best: 4}
	d.weigh(&pre, &[maxPrefixes]float64{0.5, 0.5, 0.5}, 2)
	require.False(t, d.charged)
	require.Zero(t, d.penalty(0, 100, p, 4), "a prefix whose traffic needs both replicas")
}

// TestCostChargesDuplicatePrefillAfterPreamble: when every prompt starts
// with the same preamble (a system prompt), every replica holds it and a
// copy starts computing after it, so the share that weighs the duplicate
// is the document's, not the preamble's (which is 1 and would let every
// copy go uncharged).
func TestCostChargesDuplicatePrefillAfterPreamble(t *testing.T) {
	cfg, m, c := eightSlotCost(t)
	const preamble = 40
	req := Request{TotalBlocks: 250, BlockTokens: 16, PromptTokens: 4000, MaxTokens: 128, Prefixes: NewPrefixes(promptKeys(preamble, 250, 42))}
	for i := range 20 {
		other := NewPrefixes(promptKeys(preamble, 250, uint64(1000+i)))
		countRequest(m, &other, 0)
	}
	countRequest(m, &req.Prefixes, 0)
	cands := []Candidate{
		{ID: 0, Name: "holder", Matched: 250, InFlight: 12, Running: Unknown, Waiting: Unknown, KVUsage: Unknown},
		{ID: 1, Name: "other", Matched: preamble, InFlight: 2, Running: Unknown, Waiting: Unknown, KVUsage: Unknown},
	}
	rng := NewRand(1)
	var ex Explanation
	d := c.Pick(&req, cands, &rng, &ex)
	require.InDelta(t, 1.0/21, ex.PrefixShare, 1e-9, "the document's share")
	require.Equal(t, 0, d.Index, "one document of 21 stays with its holder")
	p := 1 / cfg.PriorPrefillTokensPerSecond
	w := 1 - 2.0/21
	plain := c.costFor(&req, &cands[1], nil)
	require.InDelta(t, w*2*(250-preamble)*16*p, ex.Replicas[1].Score-plain, 1e-9)

	// A replica holding nothing would also compute the preamble, which
	// every request shares (weight 0): depths 1–32 weigh nothing, the
	// 218 blocks after them the document's weight.
	cands[1].Matched = 0
	d = c.Pick(&req, cands, &rng, &ex)
	require.InDelta(t, 1.0/21, ex.PrefixShare, 1e-9, "the share of what the holder holds")
	require.Equal(t, 0, d.Index)
	plain = c.costFor(&req, &cands[1], nil)
	require.InDelta(t, w*218/250*2*4000*p, ex.Replicas[1].Score-plain, 1e-9)
}

// TestCostReadsTheShareAtTheMatch: a document every other request
// carries, each with its own question after it, is shared as far as a
// replica holds it. Routed through the core, the share is read at the
// holder's match (Prefixes.AddMatch): the document's 300 blocks run past
// the last power of two (256), and read at the next depth, the whole
// prompt's (its question included, this request's alone), its last 44
// blocks were charged as a copy of a rare prompt.
func TestCostReadsTheShareAtTheMatch(t *testing.T) {
	const doc, total = 300, 320
	_, _, c := eightSlotCost(t)
	icfg := index.DefaultConfig()
	icfg.BlockTokens = 16
	ix, err := index.New(icfg)
	require.NoError(t, err)
	require.NoError(t, ix.Record(promptKeys(doc, doc, 0), 0, index.History, 1))
	load := &arrayLoad{names: []string{"holder", "other"}, inflight: []int{12, 2}, queued: []int{0, 0}, publishes: []bool{false, false}}
	ids := []index.ReplicaID{0, 1}
	var s Scratch
	rng := NewRand(1)
	route := func(keys []index.BlockKey, explain *Explanation) Routed {
		req := NewRequest(keys, 0, 16, total*16, 128, "")
		req.Now = 2
		return s.Route(&Input{Keys: keys, Replicas: ids, Index: ix, Mode: index.ModeHistory, Load: load,
			Strategy: c, Rand: &rng, Explain: explain, Request: &req})
	}
	// Every other request carries the document: a share of ½ over 2
	// replicas, traffic one replica alone cannot carry.
	for i := range 40 {
		id := uint64(1000 + i)
		if i%2 == 0 {
			route(promptKeys(doc, total, id), nil)
		} else {
			route(promptKeys(0, total, id), nil)
		}
	}
	keys := promptKeys(doc, total, 7)
	var ex Explanation
	out := route(keys, &ex)
	require.InDelta(t, 0.5, ex.PrefixShare, 0.05, "the document's share, not the prompt's")
	req := NewRequest(keys, 0, 16, total*16, 128, "")
	req.Now = 2
	cands := s.Candidates()
	require.InDelta(t, c.costFor(&req, &cands[1], nil), ex.Replicas[1].Score, 1e-9,
		"a copy of a document half the traffic carries is not charged")
	require.Equal(t, 1, out.Decision.Index, "the busy holder's queue sends it to the other")
	require.Equal(t, SelectionCostSpread, out.Decision.Selection)
}

// eightSlotCost returns the default cost configuration with 8 slots a
// replica, and a fresh model and strategy on it (test helper).
func eightSlotCost(t *testing.T) (CostConfig, *Model, *Cost) {
	t.Helper()
	cfg := DefaultCostConfig()
	cfg.MaxRunning = 8
	m, err := NewModel(cfg)
	require.NoError(t, err)
	return cfg, m, NewCost(m)
}

// costFor is cand's cost for req on the model's current rates with dup
// (test helper).
func (c *Cost) costFor(req *Request, cand *Candidate, dup *duplication) float64 {
	m := c.model
	m.mu.RLock()
	defer m.mu.RUnlock()
	_, _, cost, _ := c.estimate(req, cand, m.rate(cand.ID), m.slot(cand.ID), placement{}, dup, nil)
	return cost
}
