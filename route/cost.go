package route

import "math"

// Cost is kvmesh's own strategy: it estimates each candidate's time to
// first token for this request and picks the minimum (ties: fewer in-flight,
// then uniformly at random).
//
// For a candidate with learned prefill time per token p, decode step time
// d and output length L (see Model), the estimate is
//
//	TTFT = overhead + slot wait + queued prefill + own prefill + stretch
//
// where:
//
//   - outstanding N = max(InFlight, Running+Waiting): the load view is
//     partly stale, and requests this gateway (or a peer) sent that the
//     engine has not reported yet are ahead of this one all the same;
//   - capacity C = CostConfig.MaxRunning, or Running when the engine reports
//     waiting requests or KV usage ≥ KVSaturation (its running set is full),
//     unbounded otherwise; if N ≥ C this request waits for N−C+1 slots to
//     free, one every L·d/C seconds (a running request holds its slot for
//     about L decode steps): slot wait = (N−C+1)·L·d/C;
//   - queued prefill = QueuedPrefillTokens·p: prompt work this gateway sent
//     there that has not produced a first token yet;
//   - own prefill = uncached·p, uncached = (TotalBlocks−Matched)·BlockTokens
//     plus the partial tail;
//   - stretch (decode interference): with R = min(N, C) sequences
//     decoding, each prefill chunk (ChunkTokens) shares its engine step
//     with the decode batch, which adds one memory-bound decode pass (d,
//     nearly independent of R) plus R tokens of compute (R·p):
//     ceil((queued+uncached)/ChunkTokens)·(d + R·p).
//
// Everything but own prefill and overhead is returned as
// Decision.EstimatedQueue, which the caller passes back in
// Observation.QueueSeconds.
//
// It keeps locality while the replica holding the prefix can start soon
// (its estimate saves the recompute), and spreads a hot prefix to a replica
// that must recompute once the queue in front of the holder costs more than
// the recompute ("cost_spread").
//
// Use it where the load is uneven or a few prefixes are hot: it is the
// strategy that trades cache locality against queueing explicitly.
type Cost struct {
	model *Model
}

var _ Strategy = (*Cost)(nil)

// NewCost returns the strategy reading rates from model, which the caller
// keeps feeding with Observe.
func NewCost(model *Model) *Cost { return &Cost{model: model} }

// Name returns "cost".
func (c *Cost) Name() string { return NameCost }

// Model returns the model the strategy reads.
func (c *Cost) Model() *Model { return c.model }

// estimate returns the estimated TTFT and its queueing part for cand.
func (c *Cost) estimate(req *Request, cand *Candidate, r replicaRates) (ttft, queue float64) {
	cfg := &c.model.cfg
	n := cand.InFlight
	if cand.Running >= 0 && cand.Waiting >= 0 {
		n = max(n, cand.Running+cand.Waiting)
	}
	capacity := math.MaxInt
	if cfg.MaxRunning > 0 {
		capacity = cfg.MaxRunning
	}
	if cand.Running > 0 && (cand.Waiting > 0 || (cand.KVUsage >= cfg.KVSaturation)) {
		capacity = min(capacity, cand.Running)
	}
	slotWait := 0.0
	if n >= capacity {
		slotWait = float64(n-capacity+1) * r.outputTokens * r.decodeStep / float64(capacity)
	}
	uncached := req.UncachedTokens(cand.Matched)
	queued := max(cand.QueuedPrefillTokens, 0)
	queuedPrefill := float64(queued) * r.prefillSecPerToken
	own := float64(uncached) * r.prefillSecPerToken
	stretch := 0.0
	if running := min(n, capacity); running > 0 {
		chunks := (queued + uncached + cfg.ChunkTokens - 1) / cfg.ChunkTokens
		stretch = float64(chunks) * (r.decodeStep + float64(running)*r.prefillSecPerToken)
	}
	queue = slotWait + queuedPrefill + stretch
	return cfg.PrefillOverheadSeconds + queue + own, queue
}

// Pick returns the candidate with the smallest estimated TTFT.
func (c *Cost) Pick(req *Request, cands []Candidate, rng *Rand, explain *Explanation) Decision {
	if explain != nil {
		explain.begin(NameCost, req, cands)
		explain.ScoreUnit = "estimated_ttft_seconds"
	}
	best, ties, bestMatch := -1, 0, 0
	var bestTTFT, bestQueue float64
	c.model.mu.RLock()
	for i := range cands {
		cand := &cands[i]
		bestMatch = max(bestMatch, min(cand.Matched, req.TotalBlocks))
		ttft, queue := c.estimate(req, cand, c.model.rate(cand.ID))
		if explain != nil {
			explain.Replicas[i].Score = ttft
		}
		switch {
		case best < 0 || ttft < bestTTFT || (ttft == bestTTFT && cand.InFlight < cands[best].InFlight):
			best, ties, bestTTFT, bestQueue = i, 1, ttft, queue
		case ttft == bestTTFT && cand.InFlight == cands[best].InFlight:
			ties++
			if rng.IntN(ties) == 0 {
				best, bestQueue = i, queue
			}
		}
	}
	c.model.mu.RUnlock()

	d := Decision{Index: best, Selection: SelectionCostLocality, EstimatedTTFT: bestTTFT, EstimatedQueue: bestQueue}
	switch {
	case bestMatch == 0:
		d.Selection = SelectionCostCold
	case min(cands[best].Matched, req.TotalBlocks) < bestMatch:
		d.Selection = SelectionCostSpread
	}
	if explain != nil {
		explain.finish(cands, d)
	}
	return d
}
