package route

import (
	"fmt"
	"math"
)

// PrefixCacheConfig holds prefix-cache's thresholds.
type PrefixCacheConfig struct {
	// ImbalanceAbsCount: when max − min in-flight across the candidates is
	// greater than this, only the least-loaded candidates may win by prefix
	// match (AIBRIX_PREFIX_CACHE_POD_RUNNING_REQUEST_IMBALANCE_ABS_COUNT).
	// Default 16: the value the study ran with (AIBrix v0.7.0's Helm chart);
	// AIBrix's compiled-in default is 8.
	ImbalanceAbsCount int `json:"imbalance_abs_count" yaml:"imbalance_abs_count"`
	// StdDevFactor is k in the load bound mean + k·stddev of the
	// candidates' in-flight counts (AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR;
	// AIBrix reads an integer, a fraction is allowed here). Default 2, as in
	// the study; AIBrix's compiled-in default is 1. Must be ≥ 0.
	StdDevFactor float64 `json:"stddev_factor" yaml:"stddev_factor"`
	// LocalLoad makes the strategy use this gateway's own in-flight counts
	// (Candidate.LocalInFlight) instead of the cluster-wide ones, which is
	// what AIBrix does without state sync: each gateway replica sees only
	// the requests it sent. Set it to reproduce that failure mode; default
	// false.
	LocalLoad bool `json:"local_load" yaml:"local_load"`
}

// DefaultPrefixCacheConfig returns the thresholds the study ran AIBrix
// v0.7.0 with: abs count 16, k = 2.
func DefaultPrefixCacheConfig() PrefixCacheConfig {
	return PrefixCacheConfig{ImbalanceAbsCount: 16, StdDevFactor: 2}
}

// Validate reports a threshold out of range.
func (c PrefixCacheConfig) Validate() error {
	if c.ImbalanceAbsCount < 0 {
		return fmt.Errorf("%w: prefix-cache ImbalanceAbsCount %d < 0", ErrInvalidConfig, c.ImbalanceAbsCount)
	}
	if c.StdDevFactor < 0 || math.IsNaN(c.StdDevFactor) || math.IsInf(c.StdDevFactor, 0) {
		return fmt.Errorf("%w: prefix-cache StdDevFactor %v must be finite and ≥ 0", ErrInvalidConfig, c.StdDevFactor)
	}
	return nil
}

// PrefixCache reproduces AIBrix v0.7.0's prefix-cache router (the local
// index branch, pkg/plugins/gateway/algorithms/prefix_cache.go) given
// per-replica match lengths. Load is Candidate.InFlight, or LocalInFlight
// with LocalLoad (AIBrix uses the gateway's own running-request counter,
// which is the same thing with a single gateway).
//
//  1. Imbalance gate: if max − min load > ImbalanceAbsCount, only the
//     replicas at the minimum load (all of them, if tied) may win by prefix
//     match. Decision.LoadImbalanced is set (AIBrix counts it in
//     prefix_cache_load_imbalance_total; it is not a selection label).
//  2. Matching replicas (Matched > 0, among those allowed) are ordered by
//     match percent = Matched·100/TotalBlocks (integer division, as AIBrix
//     computes it) descending, then load ascending; exact ties are broken
//     uniformly at random (AIBrix shuffles, then sorts stably).
//  3. The first whose load ≤ mean + k·stddev wins: "prefix_match". Mean and
//     stddev are over ALL candidates' loads, and stddev is the sample
//     standard deviation (n−1 denominator; 0 for one candidate), as in
//     AIBrix's standardDeviation helper.
//  4. Otherwise least-request over ALL candidates (not just the gated
//     ones), uniform among ties: "prefix_match_skipped" if some allowed
//     replica matched but all were above the bound,
//     "least_request_fallback" if none matched.
//
// "prefix_match_skipped" is therefore not the imbalance label: the gate
// shows up as Decision.LoadImbalanced alongside whichever label the request
// got (prefix_match if a least-loaded replica matched, else
// least_request_fallback).
//
// Version note: this is the gate of the AIBrix source that matches v0.7.0
// (ABS_COUNT, strict >, least-loaded set); later AIBrix replaced it with a
// factor + minimum-gap gate, which this strategy does not model.
//
// Consequences worth knowing (each is a golden or property test): with two
// replicas and k ≥ 1/√2 the bound never excludes the busier one; under the
// gate a matching least-loaded replica is always within the bound, so
// "prefix_match_skipped" only happens when the gate did not trip.
//
// Use it to reproduce AIBrix's behaviour (the study's baseline) or where
// load is light and locality is what matters; under a hotspot it lets one
// replica queue up to ImbalanceAbsCount requests deeper than the others.
type PrefixCache struct {
	cfg PrefixCacheConfig
}

var _ Strategy = (*PrefixCache)(nil)

// NewPrefixCache returns the strategy with cfg, which must be valid.
func NewPrefixCache(cfg PrefixCacheConfig) (*PrefixCache, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &PrefixCache{cfg: cfg}, nil
}

// Name returns "prefix-cache".
func (p *PrefixCache) Name() string { return NamePrefixCache }

// Config returns the strategy's thresholds.
func (p *PrefixCache) Config() PrefixCacheConfig { return p.cfg }

// matchPercent is AIBrix's per-pod match figure: the percentage of the
// prompt's full blocks matched, truncated.
func matchPercent(req *Request, matched int) int {
	if req.TotalBlocks <= 0 || matched <= 0 {
		return 0
	}
	if matched > req.TotalBlocks {
		matched = req.TotalBlocks
	}
	return matched * 100 / req.TotalBlocks
}

// Pick implements the four steps in the type's documentation.
func (p *PrefixCache) Pick(req *Request, cands []Candidate, rng *Rand, explain *Explanation) Decision {
	n := len(cands)
	local := p.cfg.LocalLoad
	minLoad, maxLoad, sum := loadOf(&cands[0], local), loadOf(&cands[0], local), 0
	for i := range cands {
		l := loadOf(&cands[i], local)
		sum += l
		minLoad = min(minLoad, l)
		maxLoad = max(maxLoad, l)
	}
	mean := float64(sum) / float64(n)
	std := 0.0
	if n > 1 {
		ss := 0.0
		for i := range cands {
			d := float64(loadOf(&cands[i], local)) - mean
			ss += d * d
		}
		std = math.Sqrt(ss / float64(n-1))
	}
	bound := mean + p.cfg.StdDevFactor*std
	imbalanced := maxLoad-minLoad > p.cfg.ImbalanceAbsCount

	if explain != nil {
		explain.begin(NamePrefixCache, req, cands)
		explain.ScoreUnit = "match_percent"
		explain.Bound = bound
	}

	best, ties, bestPct, bestLoad := -1, 0, 0, 0
	anyMatched := false
	for i := range cands {
		c := &cands[i]
		pct := matchPercent(req, c.Matched)
		load := loadOf(c, local)
		var why FilterReason
		switch {
		case imbalanced && load != minLoad:
			why = FilteredImbalance
		case c.Matched <= 0 || req.TotalBlocks <= 0:
			why = FilteredNoMatch
		default:
			anyMatched = true
			if float64(load) > bound {
				why = FilteredOverLoadBound
				break
			}
			switch {
			case best < 0 || pct > bestPct || (pct == bestPct && load < bestLoad):
				best, ties, bestPct, bestLoad = i, 1, pct, load
			case pct == bestPct && load == bestLoad:
				ties++
				if rng.IntN(ties) == 0 {
					best = i
				}
			}
		}
		if explain != nil {
			explain.Replicas[i].Score = float64(pct)
			explain.Replicas[i].Filtered = why
		}
	}

	d := Decision{Index: best, Selection: SelectionPrefixMatch, LoadImbalanced: imbalanced}
	if best < 0 {
		d.Index = leastLoaded(cands, rng, local)
		d.Selection = SelectionLeastRequestFallback
		if anyMatched {
			d.Selection = SelectionPrefixMatchSkipped
		}
	}
	if explain != nil {
		explain.finish(cands, d)
	}
	return d
}
