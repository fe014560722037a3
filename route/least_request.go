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
func leastInFlight(cands []Candidate, rng *Rand) int { return leastLoaded(cands, rng, false) }

// loadOf is a candidate's in-flight count: this gateway's own (local) or
// the cluster-wide one.
func loadOf(c *Candidate, local bool) int {
	if local {
		return c.LocalInFlight
	}
	return c.InFlight
}

// leastLoaded returns the index of a candidate with the minimum load,
// uniform among ties.
func leastLoaded(cands []Candidate, rng *Rand, local bool) int {
	best, bestLoad, ties := 0, 0, 0
	for i := range cands {
		l := loadOf(&cands[i], local)
		switch {
		case i == 0 || l < bestLoad:
			best, bestLoad, ties = i, l, 1
		case l == bestLoad:
			ties++
			if rng.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}
