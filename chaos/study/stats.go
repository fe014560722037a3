package study

import (
	"math"
	"slices"
	"time"
)

// SLO is the pass rule: a request passes when its stream completed
// successfully and TTFT, TPOT and E2E are all within these bounds
// (inclusive), in model time.
type SLO struct {
	// TTFT bounds the time to first content (seed: 2 s).
	TTFT time.Duration `json:"ttft"`
	// TPOT bounds the mean inter-token time (seed: 150 ms).
	TPOT time.Duration `json:"tpot"`
	// E2E bounds the whole request (seed: 30 s).
	E2E time.Duration `json:"e2e"`
}

// DefaultSLO returns the seed study's SLO.
func DefaultSLO() SLO {
	return SLO{TTFT: 2 * time.Second, TPOT: 150 * time.Millisecond, E2E: 30 * time.Second}
}

// Percentile returns the p-th percentile (0..100) of xs by linear
// interpolation between closest ranks, as numpy.percentile does by default:
// rank = p/100·(n−1), interpolating between the two neighbouring order
// statistics. It returns NaN for an empty slice and does not modify xs.
func Percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if p <= 0 {
		return s[0]
	}
	if p >= 100 {
		return s[len(s)-1]
	}
	rank := p / 100 * float64(len(s)-1)
	lo := int(math.Floor(rank))
	hi := lo + 1
	if hi >= len(s) {
		return s[lo]
	}
	frac := rank - float64(lo)
	return s[lo] + (s[hi]-s[lo])*frac
}

// TPOT returns the mean generation interval of one request as the seed
// defines it: (last content time − first content time) / (n − 1), where n
// is the number of generated tokens (usage's completion tokens, or the
// number of content chunks when usage is missing). It is zero when n < 2.
func TPOT(o Outcome) time.Duration {
	n := o.CompletionTokens
	if !o.HasUsage || n <= 0 {
		n = o.ContentChunks
	}
	if n < 2 {
		return 0
	}
	return (o.LastContent - o.FirstContent) / time.Duration(n-1)
}

// Complete reports whether o is a fully successful stream for a request
// asking for maxTokens tokens: HTTP 200, some content, the [DONE] marker,
// usage with exactly maxTokens completion tokens, and no transport error.
func Complete(o Outcome, maxTokens int) bool {
	return o.Err == "" && o.Status == 200 && o.ContentChunks > 0 && o.GotDone &&
		o.HasUsage && o.CompletionTokens == maxTokens
}

// Pass reports whether o meets slo: a complete stream with TTFT, TPOT and
// E2E all within bounds.
func (slo SLO) Pass(o Outcome, maxTokens int) bool {
	return Complete(o, maxTokens) && o.FirstContent <= slo.TTFT && TPOT(o) <= slo.TPOT && o.End <= slo.E2E
}

// Summary is the per-phase statistics the report tables show.
type Summary struct {
	// Arrivals is the number of scheduled arrivals (sent or not).
	Arrivals int
	// Unsent counts arrivals the client could not send (in-flight cap).
	Unsent int
	// Succeeded counts complete streams; Failed = Arrivals − Succeeded.
	Succeeded int
	Failed    int
	// SLOPass counts arrivals that passed the SLO.
	SLOPass int
	// TTFTP95, TPOTP95 and E2EP95 are P95s over successful requests (NaN if
	// none succeeded).
	TTFTP95 float64 // seconds
	TPOTP95 float64 // milliseconds
	E2EP95  float64 // seconds
	// PerReplica counts requests by the replica that served them (requests
	// with no replica header are not counted).
	PerReplica map[string]int
}

// Summarize computes a Summary over the scheduled arrivals of one phase.
// Each record is an arrival; unsent arrivals count in the denominator and as
// failures.
func Summarize(recs []RequestRecord, slo SLO) Summary {
	s := Summary{Arrivals: len(recs), PerReplica: map[string]int{}}
	var ttft, tpot, e2e []float64
	for _, r := range recs {
		if !r.Sent {
			s.Unsent++
			continue
		}
		o := r.Outcome()
		if o.Replica != "" {
			s.PerReplica[o.Replica]++
		}
		if !Complete(o, r.MaxTokens) {
			continue
		}
		s.Succeeded++
		ttft = append(ttft, o.FirstContent.Seconds())
		tpot = append(tpot, float64(TPOT(o))/float64(time.Millisecond))
		e2e = append(e2e, o.End.Seconds())
		if slo.Pass(o, r.MaxTokens) {
			s.SLOPass++
		}
	}
	s.Failed = s.Arrivals - s.Succeeded
	s.TTFTP95 = Percentile(ttft, 95)
	s.TPOTP95 = Percentile(tpot, 95)
	s.E2EP95 = Percentile(e2e, 95)
	return s
}

// HitRate returns Σ Δhits / Σ Δqueries between two counter snapshots (NaN if
// no queries were made).
func HitRate(before, after Counters) float64 {
	var q, h float64
	for i := range after.Queries {
		if i < len(before.Queries) {
			q += after.Queries[i] - before.Queries[i]
			h += after.Hits[i] - before.Hits[i]
		}
	}
	if q <= 0 {
		return math.NaN()
	}
	return h / q
}

// SelectionDelta returns after − before for every selection label that
// changed, or nil when the gateways expose no selection counters.
func SelectionDelta(before, after Counters) map[string]int {
	if after.Selections == nil {
		return nil
	}
	d := map[string]int{}
	for k, v := range after.Selections {
		if n := int(math.Round(v - before.Selections[k])); n != 0 {
			d[k] = n
		}
	}
	return d
}

// MaxWaiting returns the largest sampled waiting count per replica name.
func MaxWaiting(names []string, obs []Observation) map[string]int {
	m := make(map[string]int, len(names))
	for i, n := range names {
		m[n] = 0
		for _, o := range obs {
			if i < len(o.Waiting) && o.Waiting[i] > m[n] {
				m[n] = o.Waiting[i]
			}
		}
	}
	return m
}
