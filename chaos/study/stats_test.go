package study_test

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
)

func TestPercentileMatchesNumpyLinear(t *testing.T) {
	ramp := make([]float64, 96)
	for i := range ramp {
		ramp[i] = float64(96 - i) // unsorted on purpose
	}
	cases := []struct {
		name string
		xs   []float64
		p    float64
		want float64
	}{
		// Values numpy.percentile(xs, p) returns with its default
		// (linear) method: rank p/100·(n−1), interpolated.
		{"four", []float64{1, 2, 3, 4}, 95, 3.85},
		{"unsorted three", []float64{3, 1, 2}, 95, 2.9},
		{"ramp 1..96", ramp, 95, 91.25},
		{"seven", []float64{0.5, 7.2, 1.1, 3.3, 9.9, 2.0, 4.4}, 95, 9.09},
		{"single", []float64{7}, 95, 7},
		{"median even", []float64{1, 2, 3, 4}, 50, 2.5},
		{"p0", []float64{4, 2, 9}, 0, 2},
		{"p100", []float64{4, 2, 9}, 100, 9},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			in := append([]float64(nil), c.xs...)
			assert.InDelta(t, c.want, study.Percentile(c.xs, c.p), 1e-12)
			assert.Equal(t, in, c.xs, "input must not be modified")
		})
	}
	assert.True(t, math.IsNaN(study.Percentile(nil, 95)))
}

func TestPercentileAgainstNaiveReference(t *testing.T) {
	// A naive reference: for p = 100·k/(n−1) the percentile is exactly the
	// k-th order statistic.
	xs := []float64{9, 3, 7, 1, 5}
	sorted := []float64{1, 3, 5, 7, 9}
	for k := range sorted {
		p := 100 * float64(k) / float64(len(xs)-1)
		assert.InDelta(t, sorted[k], study.Percentile(xs, p), 1e-12, "p=%v", p)
	}
}

func TestTPOTDefinition(t *testing.T) {
	o := study.Outcome{
		FirstContent: 500 * time.Millisecond, LastContent: 500*time.Millisecond + 127*60*time.Millisecond,
		HasUsage: true, CompletionTokens: 128, ContentChunks: 64,
	}
	// (last − first) / (n − 1) with n = usage completion tokens, not chunks.
	assert.Equal(t, 60*time.Millisecond, study.TPOT(o))

	o.HasUsage = false
	o.ContentChunks = 128
	assert.Equal(t, 60*time.Millisecond, study.TPOT(o), "without usage, n = content chunks")

	o.ContentChunks = 1
	assert.Equal(t, time.Duration(0), study.TPOT(o), "one token has no interval")
}

func okOutcome(ttft, tpot, e2e time.Duration) study.Outcome {
	return study.Outcome{
		Status: 200, FirstContent: ttft, LastContent: ttft + 127*tpot, End: e2e,
		ContentChunks: 128, GotDone: true, HasUsage: true, CompletionTokens: 128,
	}
}

func TestPassRule(t *testing.T) {
	slo := study.DefaultSLO()
	cases := []struct {
		name string
		o    study.Outcome
		want bool
	}{
		{"all within", okOutcome(time.Second, 100*time.Millisecond, 20*time.Second), true},
		{"bounds inclusive", okOutcome(2*time.Second, 150*time.Millisecond, 30*time.Second), true},
		{"ttft over", okOutcome(2001*time.Millisecond, 100*time.Millisecond, 20*time.Second), false},
		{"tpot over", okOutcome(time.Second, 151*time.Millisecond, 20*time.Second), false},
		{"e2e over", okOutcome(time.Second, 100*time.Millisecond, 30001*time.Millisecond), false},
	}
	for _, c := range cases {
		assert.Equal(t, c.want, slo.Pass(c.o, 128), c.name)
	}
	broken := []func(*study.Outcome){
		func(o *study.Outcome) { o.Status = 503 },
		func(o *study.Outcome) { o.GotDone = false },
		func(o *study.Outcome) { o.ContentChunks = 0 },
		func(o *study.Outcome) { o.CompletionTokens = 127 },
		func(o *study.Outcome) { o.HasUsage = false },
		func(o *study.Outcome) { o.Err = "stream cut" },
	}
	for i, b := range broken {
		o := okOutcome(time.Second, 50*time.Millisecond, 10*time.Second)
		b(&o)
		assert.False(t, study.Complete(o, 128), "broken %d", i)
		assert.False(t, slo.Pass(o, 128), "broken %d", i)
	}
}

// record builds a request record the way the driver fills one.
func record(sent bool, o study.Outcome) study.RequestRecord {
	r := study.RequestRecord{MaxTokens: 128}
	if !sent {
		return r
	}
	r.Sent = true
	r.Status = o.Status
	r.Replica = o.Replica
	r.TTFT = o.FirstContent.Seconds()
	r.Last = o.LastContent.Seconds()
	r.E2E = o.End.Seconds()
	r.Chunks = o.ContentChunks
	r.Done = o.GotDone
	if o.HasUsage {
		r.Usage = &study.Usage{CompletionTokens: o.CompletionTokens}
	}
	return r
}

func TestSummarizeCountsUnsentInDenominator(t *testing.T) {
	slo := study.DefaultSLO()
	var recs []study.RequestRecord
	for i := range 90 {
		o := okOutcome(time.Duration(i+1)*20*time.Millisecond, 60*time.Millisecond, 10*time.Second)
		o.Replica = []string{"A", "B"}[i%2]
		recs = append(recs, record(true, o))
	}
	slow := okOutcome(5*time.Second, 60*time.Millisecond, 15*time.Second)
	slow.Replica = "B"
	recs = append(recs, record(true, slow))                                     // completes, fails SLO
	recs = append(recs, record(true, study.Outcome{Status: 503, Replica: "A"})) // fails
	for range 4 {
		recs = append(recs, record(false, study.Outcome{})) // unsent
	}
	s := study.Summarize(recs, slo)
	assert.Equal(t, 96, s.Arrivals)
	assert.Equal(t, 4, s.Unsent)
	assert.Equal(t, 91, s.Succeeded)
	assert.Equal(t, 5, s.Failed, "unsent arrivals are failures")
	assert.Equal(t, 90, s.SLOPass)
	assert.Equal(t, map[string]int{"A": 46, "B": 46}, s.PerReplica)
	// P95 over the 91 successful TTFTs: 0.02..1.8 s and 5 s.
	ttfts := make([]float64, 0, 91)
	for i := range 90 {
		ttfts = append(ttfts, float64(i+1)*0.02)
	}
	ttfts = append(ttfts, 5)
	assert.InDelta(t, study.Percentile(ttfts, 95), s.TTFTP95, 1e-9)
	assert.InDelta(t, 60, s.TPOTP95, 1e-6)
}

func TestSummarizeNothingSucceeded(t *testing.T) {
	s := study.Summarize([]study.RequestRecord{record(false, study.Outcome{})}, study.DefaultSLO())
	assert.Equal(t, 1, s.Failed)
	assert.True(t, math.IsNaN(s.TTFTP95))
}

func TestHitRateAndSelectionDeltas(t *testing.T) {
	before := study.Counters{Queries: []float64{100, 50}, Hits: []float64{10, 5},
		Selections: map[string]float64{"prefix-cache/prefix_match": 3}}
	after := study.Counters{Queries: []float64{300, 250}, Hits: []float64{170, 125},
		Selections: map[string]float64{"prefix-cache/prefix_match": 10, "prefix-cache/least_request_fallback": 2}}
	assert.InDelta(t, (160.0+120)/(200+200), study.HitRate(before, after), 1e-12)
	assert.Equal(t, map[string]int{"prefix-cache/prefix_match": 7, "prefix-cache/least_request_fallback": 2},
		study.SelectionDelta(before, after))
	assert.Nil(t, study.SelectionDelta(study.Counters{}, study.Counters{}), "no gateway counters: missing, not zero")
	assert.True(t, math.IsNaN(study.HitRate(before, before)))
}

func TestMaxWaiting(t *testing.T) {
	obs := []study.Observation{
		{Waiting: []int{0, 3}}, {Waiting: []int{2, 8}}, {Waiting: []int{-1, 1}},
	}
	require.Equal(t, map[string]int{"A": 2, "B": 8}, study.MaxWaiting([]string{"A", "B"}, obs))
}
