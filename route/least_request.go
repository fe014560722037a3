package route

// LeastRequest picks the candidate with the fewest cluster-wide in-flight
// requests (Candidate.InFlight), breaking ties uniformly at random.
//
// Use it when prompts share little prefix, or as the safe choice under a
// hotspot: it never concentrates load, and it never exploits the cache.
type LeastRequest struct{}

var _ Strategy = LeastRequest{}

// Name returns "least-request".
func (LeastRequest) Name() string { return NameLeastRequest }

// Pick returns the least-loaded candidate.
func (LeastRequest) Pick(req *Request, cands []Candidate, rng *Rand, explain *Explanation) Decision {
	d := Decision{Index: leastInFlight(cands, rng), Selection: SelectionLeastRequest}
	if explain != nil {
		explain.begin(NameLeastRequest, req, cands)
		explain.ScoreUnit = "in_flight"
		for i := range cands {
			explain.Replicas[i].Score = float64(cands[i].InFlight)
		}
		explain.finish(cands, d)
	}
	return d
}

// leastInFlight returns the index of a candidate with the minimum InFlight,
// uniform among ties (reservoir sampling: one pass, no scratch).
func leastInFlight(cands []Candidate, rng *Rand) int {
	best, ties := 0, 0
	for i := range cands {
		switch {
		case i == 0 || cands[i].InFlight < cands[best].InFlight:
			best, ties = i, 1
		case cands[i].InFlight == cands[best].InFlight:
			ties++
			if rng.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}
