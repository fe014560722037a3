package route

import (
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
)

// TestModelLearnsRates feeds synthetic observations generated from known
// rates and checks the model converges to them.
func TestModelLearnsRates(t *testing.T) {
	cfg := DefaultCostConfig() // prior 3000 tok/s, 0.03 s/step, overhead 0.02 s
	tests := []struct {
		name        string
		prefillRate float64 // true tokens/s
		decodeStep  float64 // true seconds/step
		outTokens   int
		noise       float64 // ± multiplicative noise on the prefill time
		outliers    float64 // fraction of samples with a 10× unreported queue
		samples     int
		tolerance   float64 // relative error allowed at the end
	}{
		{"slower than prior", 3000, 0.045, 400, 0, 0, 60, 0.01},
		{"faster than prior", 30000, 0.012, 128, 0, 0, 80, 0.01},
		{"far slower than prior", 500, 0.2, 64, 0, 0, 120, 0.01},
		{"noisy", 5000, 0.03, 256, 0.10, 0, 200, 0.06},
		{"outliers", 5000, 0.03, 256, 0, 0.10, 200, 0.30},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, err := NewModel(cfg)
			require.NoError(t, err)
			src := rand.New(rand.NewPCG(11, 12))
			const id = index.ReplicaID(3)
			for range tc.samples {
				uncached := 500 + src.IntN(6000)
				prefill := float64(uncached) / tc.prefillRate * (1 + tc.noise*(2*src.Float64()-1))
				// An estimated queue up to the prefill itself: a larger
				// one only bounds the prefill (TestModelQueueDominatedIsABound).
				queue := src.Float64() * prefill
				ttft := cfg.PrefillOverheadSeconds + queue + prefill
				if src.Float64() < tc.outliers {
					ttft += 10 * prefill // queued behind something the gateway did not see
				}
				m.Observe(id, Observation{
					UncachedTokens: uncached, TTFT: ttft, QueueSeconds: queue, QueueEstimated: true,
					TPOT: tc.decodeStep, OutputTokens: tc.outTokens,
				})
			}
			r := m.Rates(id)
			require.InEpsilon(t, tc.prefillRate, r.PrefillTokensPerSecond, tc.tolerance)
			require.InEpsilon(t, tc.decodeStep, r.DecodeStepSeconds, 0.01)
			require.InEpsilon(t, float64(tc.outTokens), r.OutputTokens, 0.01)
			require.EqualValues(t, tc.samples, r.PrefillSamples)
			require.EqualValues(t, tc.samples, r.DecodeSamples)

			// Other replicas, with no prefill sample of their own, take the
			// pool's prefill rate (here learned from id alone; the pool's
			// longer memory leaves it within 5% of the truth after these
			// samples, or the case's own tolerance if wider) and keep the
			// prior decode step.
			o := m.Rates(id + 1)
			require.InEpsilon(t, tc.prefillRate, o.PrefillTokensPerSecond, max(tc.tolerance, 0.05))
			require.InEpsilon(t, cfg.PriorDecodeStepSeconds, o.DecodeStepSeconds, 1e-9)
			require.Zero(t, o.PrefillSamples)

			m.Forget(id)
			f := m.Rates(id)
			require.InEpsilon(t, o.PrefillTokensPerSecond, f.PrefillTokensPerSecond, 1e-9)
			require.InEpsilon(t, cfg.PriorDecodeStepSeconds, f.DecodeStepSeconds, 1e-9)
			require.Zero(t, f.PrefillSamples)
		})
	}
}

// TestModelIgnoresUninformativeObservations: tiny prompts (TTFT is mostly
// overhead), TTFT not above the queueing, and missing figures teach nothing.
// TestModelPoolPrefill: a replica with no prefill sample of its own is
// estimated at the rate learned from the others, and its own estimate
// starts there, not at the prior.
func TestModelPoolPrefill(t *testing.T) {
	cfg := DefaultCostConfig() // prior 3000 tok/s
	m, err := NewModel(cfg)
	require.NoError(t, err)
	const truth = 20000.0 // tokens/s, far from the prior
	// One sample on each of 100 replicas: none learns much alone.
	for id := range index.ReplicaID(100) {
		m.Observe(id, Observation{UncachedTokens: 4000, TTFT: cfg.PrefillOverheadSeconds + 4000/truth, QueueEstimated: true})
	}
	require.InEpsilon(t, truth, m.Rates(140).PrefillTokensPerSecond, 0.01, "unseen replica")
	require.Zero(t, m.Rates(140).PrefillSamples)
	// A replica's first own sample moves it from the pool's figure.
	m.Observe(141, Observation{UncachedTokens: 4000, TTFT: cfg.PrefillOverheadSeconds + 4000/truth, QueueEstimated: true})
	require.InEpsilon(t, truth, m.Rates(141).PrefillTokensPerSecond, 0.01)
	require.EqualValues(t, 1, m.Rates(141).PrefillSamples)
	// A decode-only observation does not hide the pool's prefill rate.
	m.Observe(142, Observation{TPOT: 0.05, OutputTokens: 10})
	require.InEpsilon(t, truth, m.Rates(142).PrefillTokensPerSecond, 0.01)
}

func TestModelIgnoresUninformativeObservations(t *testing.T) {
	cfg := DefaultCostConfig()
	m, err := NewModel(cfg)
	require.NoError(t, err)
	for _, obs := range []Observation{
		{UncachedTokens: cfg.MinSampleTokens - 1, TTFT: 5},
		{UncachedTokens: 4000, TTFT: 0.5, QueueSeconds: 0.6},
		{UncachedTokens: 4000, TTFT: 0},
		{UncachedTokens: 4000, TTFT: 0.01}, // below the fixed overhead
		{},
	} {
		m.Observe(0, obs)
	}
	r := m.Rates(0)
	require.Zero(t, r.PrefillSamples)
	require.Zero(t, r.DecodeSamples)
	require.InEpsilon(t, cfg.PriorPrefillTokensPerSecond, r.PrefillTokensPerSecond, 1e-9)
	require.InEpsilon(t, cfg.PriorOutputTokens, r.OutputTokens, 1e-9)
}

// TestCostUsesLearnedRates: a cold request goes to the replica the model
// has learned is faster, and the estimate follows the learned rate.
func TestCostUsesLearnedRates(t *testing.T) {
	m, err := NewModel(DefaultCostConfig())
	require.NoError(t, err)
	c := NewCost(m)
	for range 50 {
		m.Observe(0, Observation{UncachedTokens: 4000, TTFT: 0.02 + 4000.0/2000, TPOT: 0.05, QueueEstimated: true})
		m.Observe(1, Observation{UncachedTokens: 4000, TTFT: 0.02 + 4000.0/16000, TPOT: 0.02, QueueEstimated: true})
	}
	req := Request{TotalBlocks: 32, BlockTokens: 128, PromptTokens: 4096}
	cands := []Candidate{
		{ID: 0, Name: "slow", Running: Unknown, Waiting: Unknown, KVUsage: Unknown},
		{ID: 1, Name: "fast", Running: Unknown, Waiting: Unknown, KVUsage: Unknown},
	}
	rng := NewRand(1)
	d := c.Pick(&req, cands, &rng, nil)
	require.Equal(t, 1, d.Index)
	require.Equal(t, SelectionCostCold, d.Selection)
	require.InEpsilon(t, 0.02+4096.0/16000, d.EstimatedTTFT, 0.02)
	require.Zero(t, d.EstimatedQueue)

	// The slow replica holding the whole prompt beats recomputing on the
	// fast one: 0.02 s vs 0.276 s.
	cands[0].Matched = 32
	d = c.Pick(&req, cands, &rng, nil)
	require.Equal(t, 0, d.Index)
	require.Equal(t, SelectionCostLocality, d.Selection)
}

// TestCostSpreadThreshold: locality holds while the holder's slot wait is
// below the recompute on the idle replica and flips right after.
func TestCostSpreadThreshold(t *testing.T) {
	cfg, _, c := eightSlotCost(t)
	req := Request{TotalBlocks: 40, BlockTokens: 128, PromptTokens: 5200}
	recompute := cfg.PrefillOverheadSeconds + 5200/cfg.PriorPrefillTokensPerSecond
	slot := cfg.PriorOutputTokens * cfg.PriorDecodeStepSeconds / 8
	for inflight := 0; inflight <= 12; inflight++ {
		cands := []Candidate{
			{ID: 0, Name: "holder", Matched: 40, InFlight: inflight, Running: min(inflight, 8), Waiting: max(inflight-8, 0), KVUsage: 0.3},
			{ID: 1, Name: "idle", InFlight: 0, Running: 0, Waiting: 0, KVUsage: 0},
		}
		rng := NewRand(1)
		var ex Explanation
		d := c.Pick(&req, cands, &rng, &ex)
		holder := ex.Replicas[0].Score
		if holder < recompute {
			require.Equal(t, 0, d.Index, "in-flight %d: %.3f vs %.3f", inflight, holder, recompute)
			require.Equal(t, SelectionCostLocality, d.Selection)
		} else {
			require.Equal(t, 1, d.Index, "in-flight %d", inflight)
			require.Equal(t, SelectionCostSpread, d.Selection)
		}
		if inflight >= 8 {
			require.Greater(t, holder, float64(inflight-7)*slot, "slot wait counted at %d", inflight)
			require.Equal(t, 1, d.Index, "a full running set must spread at %d", inflight)
		} else {
			require.Equal(t, 0, d.Index, "free slots keep locality at %d", inflight)
		}
	}
}

// TestModelConcurrent: Observe from many goroutines while Pick reads (run
// with -race).
func TestModelConcurrent(t *testing.T) {
	m, err := NewModel(DefaultCostConfig())
	require.NoError(t, err)
	c := NewCost(m)
	req, cands := benchCandidates()
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(2)
		go func() {
			defer wg.Done()
			for i := range 2000 {
				m.Observe(index.ReplicaID((g*7+i)%20), Observation{UncachedTokens: 1000 + i, TTFT: 0.5, TPOT: 0.03, OutputTokens: 100})
			}
		}()
		go func() {
			defer wg.Done()
			rng := NewRand(uint64(g))
			for range 2000 {
				if d := c.Pick(&req, cands, &rng, nil); d.Index < 0 || d.Index >= len(cands) {
					t.Errorf("index %d", d.Index)
					return
				}
			}
		}()
	}
	wg.Wait()
}

// TestCostLearnsRunningSet: a scrape showing requests waiting that prefill
// does not explain teaches the replica's running-set size, which then
// applies to a stale scrape; waiting behind queued prefill teaches nothing,
// nor does waiting behind prefill queued when the scrape was read and done
// since; Forget drops the replica's figure (the pool's stays as the
// assumption).
func TestCostLearnsRunningSet(t *testing.T) {
	m, err := NewModel(DefaultCostConfig())
	require.NoError(t, err)
	c := NewCost(m)
	for id := range index.ReplicaID(2) { // give both replicas a slot view
		m.Observe(id, Observation{TPOT: 0.03, OutputTokens: 128})
	}
	req := Request{TotalBlocks: 40, BlockTokens: 128, PromptTokens: 5200, MaxTokens: 128}
	cands := []Candidate{
		{ID: 0, Name: "a", Matched: 40},
		{ID: 1, Name: "b", Matched: 40},
	}
	slotOf := func(id index.ReplicaID) (peak, full int32) {
		m.mu.RLock()
		defer m.mu.RUnlock()
		sv := m.slot(id)
		return sv.peak.Load(), sv.full.Load()
	}
	rng := NewRand(1)

	// Waiting behind 5000 queued prefill tokens: not a full running set.
	cands[0].Running, cands[0].Waiting, cands[0].InFlight, cands[0].QueuedPrefillTokens = 2, 1, 3, 5000
	c.Pick(&req, cands, &rng, nil)
	peak, full := slotOf(0)
	require.EqualValues(t, 2, peak)
	require.Zero(t, full)
	require.Zero(t, m.poolFull.Load())

	// The prompt has produced its first token since the scrape: no
	// prefill is queued now, but the scrape shows what it held back then.
	cands[0].QueuedPrefillTokens, cands[0].ScrapedQueuedPrefillTokens = 0, 5000
	var held Explanation
	c.Pick(&req, cands, &rng, &held)
	peak, full = slotOf(0)
	require.EqualValues(t, 2, peak)
	require.Zero(t, full, "the scrape's waiting request waited for the prefill queued then")
	require.Zero(t, held.Replicas[0].Capacity, "no running-set size assumed")
	require.Equal(t, 5000, held.Replicas[0].ScrapedQueuedPrefill)
	cands[0].ScrapedQueuedPrefillTokens = 0

	// Waiting at the peak with no prefill queued: full at 8.
	cands[0].Running, cands[0].Waiting, cands[0].InFlight, cands[0].QueuedPrefillTokens = 8, 2, 10, 0
	c.Pick(&req, cands, &rng, nil)
	peak, full = slotOf(0)
	require.EqualValues(t, 8, peak)
	require.EqualValues(t, 8, full)
	require.EqualValues(t, 8, m.poolFull.Load())

	// A stale scrape (running 0) with 8 in flight still pays a slot wait;
	// b, never seen full, is assumed to run 8 as well.
	cands[0].Running, cands[0].Waiting, cands[0].InFlight = 0, 0, 8
	cands[1].Running, cands[1].Waiting, cands[1].InFlight = 0, 0, 8
	var ex Explanation
	d := c.Pick(&req, cands, &rng, &ex)
	slot := 128 * 0.03 / 8
	require.Greater(t, d.EstimatedQueue, 2*slot-1e-9)
	require.InDelta(t, ex.Replicas[0].Score, ex.Replicas[1].Score, 1e-9)

	m.Forget(0)
	peak, full = slotOf(0)
	require.Zero(t, peak)
	require.Zero(t, full)
}

// TestModelUnestimatedQueueIsABound: an observation whose decision
// estimated no queue (least-request's) only bounds prefill from above: a
// slow one (its TTFT holds a queue) teaches nothing, neither the replica
// nor the pool, while a fast one still lowers the estimate; with the
// queue estimated, the same slow observation is learned.
func TestModelUnestimatedQueueIsABound(t *testing.T) {
	cfg := DefaultCostConfig()
	m, err := NewModel(cfg)
	require.NoError(t, err)
	prior := cfg.PriorPrefillTokensPerSecond
	slow := Observation{UncachedTokens: 3000, TTFT: cfg.PrefillOverheadSeconds + 3000/prior + 4} // 4 s queued
	for range 20 {
		m.Observe(0, slow)
	}
	require.Zero(t, m.Rates(0).PrefillSamples)
	require.InEpsilon(t, prior, m.Rates(0).PrefillTokensPerSecond, 1e-9)
	require.InEpsilon(t, prior, m.Rates(1).PrefillTokensPerSecond, 1e-9, "the pool learned a queue as prefill")

	fast := Observation{UncachedTokens: 3000, TTFT: cfg.PrefillOverheadSeconds + 3000/(2*prior)}
	for range 40 {
		m.Observe(0, fast)
	}
	require.InEpsilon(t, 2*prior, m.Rates(0).PrefillTokensPerSecond, 0.02)
	require.EqualValues(t, 40, m.Rates(0).PrefillSamples)

	estimated := slow
	estimated.QueueEstimated = true // the queue it met was not the one estimated (0): learned
	m.Observe(2, estimated)
	require.Less(t, m.Rates(2).PrefillTokensPerSecond, 2*prior)
	require.EqualValues(t, 1, m.Rates(2).PrefillSamples)
}

// TestCostChargesArrivalDelay: a recompute on a loaded replica is charged
// the wait of the requests arriving there while it computes
// (arrivalDelay), so a holder whose slot wait is below recompute plus that
// delay keeps the request; on an idle replica the same recompute charges
// nothing and wins. Without the term both spread.
func TestCostChargesArrivalDelay(t *testing.T) {
	cfg, m, c := eightSlotCost(t)
	// 4,000 tokens: 1.33 s of prefill at the prior 3,000 tokens/s. The
	// holder has 9 in flight on 8 slots: 3 slot waits of 128·0.03/8 s,
	// 1.44 s, more than the recompute's TTFT on either other replica.
	req := Request{TotalBlocks: 250, BlockTokens: 16, PromptTokens: 4000, MaxTokens: 128, Prefixes: NewPrefixes(promptKeys(0, 250, 7))}
	// Every recent request carried this prefix: its traffic needs both
	// replicas, so a copy is not charged as a duplicate prefill
	// (TestCostChargesDuplicatePrefill) and the score differs from the
	// TTFT by the arrival delay alone.
	countRequest(m, &req.Prefixes, 0)
	compute := 4000 / cfg.PriorPrefillTokensPerSecond
	hold := 128 * cfg.PriorDecodeStepSeconds
	for _, tc := range []struct {
		name     string
		inflight int
		want     int
		sel      Selection
	}{
		{"loaded replica", 6, 0, SelectionCostLocality},
		{"idle replica", 0, 1, SelectionCostSpread},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cands := []Candidate{
				{ID: 0, Name: "holder", Matched: 250, InFlight: 9, Running: Unknown, Waiting: Unknown, KVUsage: Unknown},
				{ID: 1, Name: "other", InFlight: tc.inflight, Running: Unknown, Waiting: Unknown, KVUsage: Unknown},
			}
			rng := NewRand(1)
			var ex Explanation
			d := c.Pick(&req, cands, &rng, &ex)
			require.Equal(t, tc.want, d.Index)
			require.Equal(t, tc.sel, d.Selection)
			// The other replica's score carries the arrival delay: its
			// TTFT estimate alone is below the holder's score.
			e := c.estimateFor(&req, &cands[1])
			require.InDelta(t, float64(tc.inflight)*compute*compute/(2*hold), ex.Replicas[1].Score-e, 1e-9)
			require.Less(t, e, ex.Replicas[0].Score, "without the arrival delay the recompute would win")
		})
	}
	require.Zero(t, arrivalDelay(0, 1, 1))
	require.Zero(t, arrivalDelay(5, 0, 1))
	require.Zero(t, arrivalDelay(5, 1, 0))
}

// estimateFor is cand's estimated TTFT for req on the model's current
// rates (test helper).
func (c *Cost) estimateFor(req *Request, cand *Candidate) float64 {
	m := c.model
	m.mu.RLock()
	defer m.mu.RUnlock()
	ttft, _, _, _ := c.estimate(req, cand, m.rate(cand.ID), m.slot(cand.ID), placement{}, nil, nil)
	return ttft
}

// TestModelQueueDominatedIsABound: an observation whose estimated queue is
// larger than the prefill time it leaves teaches the prefill rate only as
// a bound (the whole TTFT), so a queue estimate counting a half-computed
// prefill in full does not teach a prefill several times too fast; one
// whose prefill is most of the TTFT is learned as before.
func TestModelQueueDominatedIsABound(t *testing.T) {
	cfg := DefaultCostConfig()
	m, err := NewModel(cfg)
	require.NoError(t, err)
	prior := cfg.PriorPrefillTokensPerSecond
	// 5,000 tokens at the prior take 1.67 s; the decision expected 1.8 s
	// of queue, the request met 0.3 s: the remainder (0.15 s) would read
	// as 33,000 tokens/s.
	dominated := Observation{UncachedTokens: 5000, TTFT: cfg.PrefillOverheadSeconds + 0.3 + 5000/prior,
		QueueSeconds: 1.8, QueueEstimated: true}
	for range 20 {
		m.Observe(0, dominated)
	}
	require.Zero(t, m.Rates(0).PrefillSamples)
	require.InEpsilon(t, prior, m.Rates(0).PrefillTokensPerSecond, 1e-9)
	require.InEpsilon(t, prior, m.Rates(1).PrefillTokensPerSecond, 1e-9, "the pool learned a queue error as prefill")

	// As a bound, the whole TTFT still lowers a slower estimate.
	bound := dominated
	bound.TTFT = cfg.PrefillOverheadSeconds + 5000/(2*prior) // 0.83 s < 1.8 s queue: bound
	bound.QueueSeconds = 1.8
	m.Observe(2, bound)
	require.Greater(t, m.Rates(2).PrefillTokensPerSecond, prior)
	require.EqualValues(t, 1, m.Rates(2).PrefillSamples)

	// A queue smaller than the prefill it leaves is taken as estimated.
	learned := Observation{UncachedTokens: 5000, TTFT: cfg.PrefillOverheadSeconds + 0.5 + 5000/(2*prior),
		QueueSeconds: 0.5, QueueEstimated: true}
	m.Observe(3, learned)
	require.EqualValues(t, 1, m.Rates(3).PrefillSamples)
	require.Greater(t, m.Rates(3).PrefillTokensPerSecond, prior)
}

// TestModelLearnsUnitsPerToken: the characters-per-token ratio starts at
// CharsPerToken and follows the prompts' own (the engine's prompt_tokens
// against the characters keyed); observations without both figures teach
// nothing, and one wild sample moves it by a bounded step.
func TestModelLearnsUnitsPerToken(t *testing.T) {
	m, err := NewModel(DefaultCostConfig())
	require.NoError(t, err)
	require.Equal(t, CharsPerToken, m.UnitsPerToken())
	for _, obs := range []Observation{
		{PromptUnits: 5830},                         // no usage from the engine
		{PromptTokens: 1000},                        // keys are tokens
		{UncachedTokens: 4000, TTFT: 1, TPOT: 0.05}, // neither
	} {
		m.Observe(0, obs)
	}
	require.Equal(t, CharsPerToken, m.UnitsPerToken())

	// The first sample weighs as much as the prior: halfway.
	m.Observe(0, Observation{PromptUnits: 5830, PromptTokens: 1000})
	require.InDelta(t, (4+5.83)/2, m.UnitsPerToken(), 1e-9)
	for range 200 {
		m.Observe(1, Observation{PromptUnits: 5830, PromptTokens: 1000})
	}
	require.InEpsilon(t, 5.83, m.UnitsPerToken(), 0.01)

	// A prompt of one character per token (or a bogus usage) is clamped
	// to a quarter of the current ratio before it is weighed.
	before := m.UnitsPerToken()
	w := DefaultCostConfig().Alpha / poolAlphaDivisor
	m.Observe(0, Observation{PromptUnits: 1, PromptTokens: 1000})
	require.InDelta(t, before+w*(before/4-before), m.UnitsPerToken(), 1e-9)
}
