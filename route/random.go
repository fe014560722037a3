package route

// Random picks uniformly among the candidates, ignoring match and load.
//
// Use it as the study's baseline, or where replicas share no cache state
// worth steering towards and load is uniform by construction.
type Random struct{}

var _ Strategy = Random{}

// Name returns "random".
func (Random) Name() string { return NameRandom }

// Pick returns a uniformly random candidate.
func (Random) Pick(req *Request, cands []Candidate, rng *Rand, explain *Explanation) Decision {
	d := Decision{Index: rng.IntN(len(cands)), Selection: SelectionRandom}
	if explain != nil {
		explain.begin(NameRandom, req, cands)
		explain.finish(cands, d)
	}
	return d
}
