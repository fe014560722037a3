package route

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
)

// ms is a millisecond in Request.Now's nanoseconds.
const ms = int64(1e6)

// costAt returns a cost strategy over a fresh default model and a routing
// time.
func costAt(t *testing.T) (*Cost, int64) {
	t.Helper()
	m, err := NewModel(DefaultCostConfig())
	require.NoError(t, err)
	return NewCost(m), 1_000_000 * ms
}

// TestStepWait: the wait for the step in progress is what the last token's
// timing leaves of it, half a learned step when the timing says nothing
// (no token yet, or none within the last step), none at an idle replica.
func TestStepWait(t *testing.T) {
	now := 1000 * ms
	d := 0.030
	cases := []struct {
		name  string
		last  int64
		step  int64
		n     int
		wantS float64
	}{
		{"idle replica", now - 5*ms, 40 * ms, 0, 0},
		{"no timing", 0, 0, 3, d / 2},
		{"step ends in 30 ms", now - 10*ms, 40 * ms, 3, 0.030},
		{"step ends now", now - 40*ms, 40 * ms, 3, d / 2},
		{"token from a long-gone step", now - 500*ms, 40 * ms, 3, d / 2},
		{"token stamped after now (another clock read)", now + 1*ms, 40 * ms, 3, d / 2},
	}
	for _, tc := range cases {
		c := Candidate{LastTokenAt: tc.last, StepNanos: tc.step}
		require.InDelta(t, tc.wantS, stepWait(now, &c, tc.n, d), 1e-12, tc.name)
	}
}

// TestCostPicksTheSoonerStep: two replicas hold the prompt alike and run
// as many requests; the one whose engine step ends sooner gets the
// request, and the choice follows the step phase, not the replica. With
// one request more in flight, a sooner step does not win: the outstanding
// count comes first, which keeps the batches even and the TTFT tail with
// them (see Pick).
func TestCostPicksTheSoonerStep(t *testing.T) {
	c, now := costAt(t)
	req := Request{TotalBlocks: 32, BlockTokens: 128, PromptTokens: 4096, Now: now}
	cand := func(id int, inflight int, sinceToken int64) Candidate {
		return Candidate{ID: index.ReplicaID(id), Name: string(rune('a' + id)), Matched: 32, InFlight: inflight, LocalInFlight: inflight,
			Running: inflight, Waiting: 0, KVUsage: 0.3, LastTokenAt: now - sinceToken, StepNanos: 50 * ms}
	}
	for _, tc := range []struct {
		name string
		a, b Candidate
		want int
	}{
		{"equal load, b's step ends sooner", cand(0, 5, 5*ms), cand(1, 5, 45*ms), 1},
		{"equal load, a's step ends sooner", cand(0, 5, 45*ms), cand(1, 5, 5*ms), 0},
		{"b runs one more and its step ends 20 ms sooner", cand(0, 4, 20*ms), cand(1, 5, 40*ms), 0},
		{"a runs one more and its step ends 20 ms sooner", cand(0, 5, 40*ms), cand(1, 4, 20*ms), 1},
	} {
		rng := NewRand(7)
		d := c.Pick(&req, []Candidate{tc.a, tc.b}, &rng, nil)
		require.Equal(t, tc.want, d.Index, tc.name)
		require.Equal(t, SelectionCostLocality, d.Selection, tc.name)
	}
}

// TestExplainShowsStepEnds: the explanation carries when each replica's
// step ends as the streams time it, and nothing where they do not.
func TestExplainShowsStepEnds(t *testing.T) {
	c, now := costAt(t)
	req := Request{TotalBlocks: 4, BlockTokens: 128, PromptTokens: 512, Now: now}
	cands := []Candidate{
		{ID: 0, Name: "a", InFlight: 2, Running: 2, Waiting: 0, KVUsage: 0.1, LastTokenAt: now - 10*ms, StepNanos: 40 * ms},
		{ID: 1, Name: "b", InFlight: 2, Running: 2, Waiting: 0, KVUsage: 0.1},
	}
	var ex Explanation
	rng := NewRand(1)
	c.Pick(&req, cands, &rng, &ex)
	require.InDelta(t, 0.030, ex.Replicas[0].StepEndsIn, 1e-12)
	require.Zero(t, ex.Replicas[1].StepEndsIn)
}

// TestExplainShowsSlotWait: the explanation carries cost's estimate per
// replica: the running-set size it assumed (none until one is known), the
// slot wait that size puts on a replica about to fill, and the TTFT below
// the score; explaining does not change the pick.
func TestExplainShowsSlotWait(t *testing.T) {
	now := 1_000_000 * ms
	req := Request{TotalBlocks: 4, BlockTokens: 128, PromptTokens: 512, MaxTokens: 100, Now: now}
	cands := []Candidate{
		{ID: 0, Name: "busy", Matched: 4, InFlight: 3, Running: 3, Waiting: 0},
		{ID: 1, Name: "idle", InFlight: 0, Running: 0, Waiting: 0},
	}
	pick := func(cfg CostConfig) (Decision, Explanation) {
		return explainedPick(t, cfg, &req, cands)
	}

	cfg := DefaultCostConfig()
	_, ex := pick(cfg)
	for _, r := range ex.Replicas {
		require.Zero(t, r.Capacity, "%s: no running-set size known", r.Name)
		require.Zero(t, r.SlotWait, r.Name)
		require.Positive(t, r.EstimatedTTFT, r.Name)
		require.GreaterOrEqual(t, r.Score, r.EstimatedTTFT, r.Name)
	}

	// With 4 slots, the busy replica's fourth request takes its last free
	// one: one slot's wait, a running request's decode time over 4 slots.
	// Nothing observed yet, a running request's output is taken as this
	// request's max_tokens.
	cfg.MaxRunning = 4
	d, ex := pick(cfg)
	busy, idle := ex.Replicas[0], ex.Replicas[1]
	require.Equal(t, 4, busy.Capacity)
	require.Equal(t, 4, idle.Capacity)
	wantWait := float64(req.MaxTokens) * cfg.PriorDecodeStepSeconds / 4
	require.InDelta(t, wantWait, busy.SlotWait, 1e-9)
	require.Zero(t, idle.SlotWait)
	require.GreaterOrEqual(t, busy.EstimatedTTFT, busy.SlotWait)
	require.Equal(t, d.EstimatedTTFT, ex.Replicas[d.Index].EstimatedTTFT, "the decision's TTFT is the picked replica's")
}

// TestSlotWaitCountsRecentSends: a replica whose running set is full
// frees a slot no sooner than the C−1-th most recent request there can
// have produced its output. Spacing the frees evenly over a request's
// decode time understates the wait where this gateway sent the running
// requests just now; where it sent them long ago, or where other senders
// show (a peer's request, or a scrape beyond this gateway's own), the
// even spacing stands, and so it does where this request takes the last
// free slot. Of two full holders alike but for their requests' ages, the
// one whose requests are older gets the request.
func TestSlotWaitCountsRecentSends(t *testing.T) {
	now := 1_000_000 * ms
	req := Request{TotalBlocks: 4, BlockTokens: 128, PromptTokens: 512, MaxTokens: 100, Now: now}
	cfg := DefaultCostConfig()
	cfg.MaxRunning = 4
	decode := float64(req.MaxTokens) * cfg.PriorDecodeStepSeconds // a request's L·d
	log := func(ago ...int64) *SendLog {
		var l SendLog
		for _, a := range ago {
			l.Add(now-a*ms, 0)
		}
		return &l
	}
	full := func(name string, local int, sends *SendLog) Candidate {
		return Candidate{ID: 0, Name: name, Matched: 4, InFlight: 4, LocalInFlight: local, Running: 4, Waiting: 0, Sends: sends}
	}
	old := int64(decode*1000) + 500 // ms: every request there could have ended
	lastSlot := full("last slot", 3, log(300, 200, 100))
	lastSlot.InFlight, lastSlot.Running = 3, 3
	for _, tc := range []struct {
		name string
		cand Candidate
		want float64
	}{
		{"no log", full("none", 4, nil), decode / 2},
		{"sent long ago", full("old", 4, log(old, old, old, old)), decode / 2},
		{"sent just now", full("new", 4, log(400, 300, 200, 100)), decode - 0.3},
		{"the third most recent is old", full("mixed", 4, log(old, old, 200, 100)), decode / 2},
		{"one of a peer", full("peer", 3, log(300, 200, 100)), decode / 2},
		{"another sender in the scrape", Candidate{Name: "scraped", Matched: 4, InFlight: 4, LocalInFlight: 4,
			Running: 5, ScrapedInFlight: 4, ScrapedInFlightKnown: true, Sends: log(400, 300, 200, 100)}, 3 * decode / 4},
		// This request takes the last free slot and starts at once; the
		// one wait charged for the next arrival stays evenly spaced.
		{"the last free slot", lastSlot, decode / 4},
	} {
		_, ex := explainedPick(t, cfg, &req, []Candidate{tc.cand})
		require.InDelta(t, tc.want, ex.Replicas[0].SlotWait, 1e-9, tc.name)
	}

	young, aged := full("young", 4, log(400, 300, 200, 100)), full("aged", 4, log(old, old, old, old))
	aged.ID = 1
	d, _ := explainedPick(t, cfg, &req, []Candidate{young, aged})
	require.Equal(t, 1, d.Index, "the holder whose requests are older")
	aged.ID, young.ID = 0, 1
	d, _ = explainedPick(t, cfg, &req, []Candidate{aged, young})
	require.Equal(t, 0, d.Index, "the holder whose requests are older, in either place")
}

// TestSlotWaitCountsPrefillSentSince: the C−1-th most recent request on
// a full replica decodes only in the steps the prefill sent there since
// leaves it, its own prompt's included and that of requests which have
// ended since after their prefill; prefill sent before it, or taken
// back, does not hold it back. Each uncached token sent since delays the
// free slot by the prefill time of a token (a cold phase's full holder,
// seed grid, was estimated at 1.85 s for a request that took 5.66 s
// without it).
func TestSlotWaitCountsPrefillSentSince(t *testing.T) {
	now := 1_000_000 * ms
	req := Request{TotalBlocks: 4, BlockTokens: 128, PromptTokens: 512, MaxTokens: 100, Now: now}
	cfg := DefaultCostConfig()
	cfg.MaxRunning = 4
	decode := float64(req.MaxTokens) * cfg.PriorDecodeStepSeconds
	p := 1 / cfg.PriorPrefillTokensPerSecond
	// Four requests in flight, sent 400, 300, 200 and 100 ms ago; the
	// slot frees once the third most recent (300 ms ago) has finished.
	// One more, sent endedAgo ms ago with an ended prompt, has ended,
	// after its prefill or (takenBack) before it.
	holder := func(endedAgo int64, ended int, takenBack bool, uncached ...int) Candidate {
		var l SendLog
		for i, u := range uncached {
			l.Add(now-int64(400-100*i)*ms, u)
		}
		if endedAgo > 0 {
			l.Add(now-endedAgo*ms, ended)
			l.Remove(now-endedAgo*ms, ended, !takenBack)
		}
		return Candidate{Name: "full", Matched: 4, InFlight: 4, LocalInFlight: 4, Running: 4, Sends: &l}
	}
	for _, tc := range []struct {
		name            string
		endedAgo, ended int
		takenBack       bool
		uncached        []int
		stall           int // tokens of prefill that hold the slot's request back
	}{
		{"all cached", 0, 0, false, []int{0, 0, 0, 0}, 0},
		{"before it: no delay", 0, 0, false, []int{3000, 0, 0, 0}, 0},
		{"its own prompt", 0, 0, false, []int{0, 3000, 0, 0}, 3000},
		{"sent since", 0, 0, false, []int{0, 0, 1500, 600}, 2100},
		{"every one since", 0, 0, false, []int{3000, 3000, 1500, 600}, 5100},
		{"one sent since has ended", 250, 800, false, []int{0, 0, 1500, 600}, 2900},
		{"one sent since ended before its prefill", 250, 800, true, []int{0, 0, 1500, 600}, 2100},
		{"one sent before it has ended", 350, 800, false, []int{0, 0, 1500, 600}, 2100},
	} {
		_, ex := explainedPick(t, cfg, &req, []Candidate{holder(int64(tc.endedAgo), tc.ended, tc.takenBack, tc.uncached...)})
		require.InDelta(t, decode-0.3+float64(tc.stall)*p, ex.Replicas[0].SlotWait, 1e-9, tc.name)
	}
	if raceEnabled {
		return // the race detector makes sync.Pool drop items, which allocates
	}
	m, err := NewModel(cfg)
	require.NoError(t, err)
	c, cands, rng := NewCost(m), []Candidate{holder(250, 800, false, 3000, 3000, 1500, 600)}, NewRand(1)
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = c.Pick(&req, cands, &rng, nil) }), "the bound's path allocates nothing")
}

// TestOutstandingCountsUnseenSendersOnce: without peers' reports the
// engine's count beyond this gateway's in-flight at the scrape is other
// senders' load, added to the fresh in-flight count, so requests that
// ended since the scrape no longer count; where peers report, the larger
// of the two counts stands.
func TestOutstandingCountsUnseenSendersOnce(t *testing.T) {
	m, err := NewModel(DefaultCostConfig())
	require.NoError(t, err)
	c := NewCost(m)
	req := Request{TotalBlocks: 4, BlockTokens: 128, PromptTokens: 512}
	r := m.rate(0)
	for _, tc := range []struct {
		name  string
		cand  Candidate
		wantN int
	}{
		{"own requests ended since the scrape", Candidate{InFlight: 2, LocalInFlight: 2, Running: 6, Waiting: 0,
			ScrapedInFlight: 6, ScrapedInFlightKnown: true}, 2},
		{"two requests of another sender", Candidate{InFlight: 2, LocalInFlight: 2, Running: 6, Waiting: 1,
			ScrapedInFlight: 5, ScrapedInFlightKnown: true}, 4},
		{"engine behind this gateway's sends", Candidate{InFlight: 5, LocalInFlight: 5, Running: 3, Waiting: 0,
			ScrapedInFlight: 4, ScrapedInFlightKnown: true}, 5},
		{"peers report: the larger count", Candidate{InFlight: 2, LocalInFlight: 1, Running: 6, Waiting: 0,
			ScrapedInFlight: 6}, 6},
		{"no scrape", Candidate{InFlight: 3, LocalInFlight: 3, Running: Unknown, Waiting: Unknown,
			ScrapedInFlight: 0, ScrapedInFlightKnown: true}, 3},
	} {
		_, _, _, n := c.estimate(&req, &tc.cand, r, nil, placement{}, nil, nil)
		require.Equal(t, tc.wantN, n, tc.name)
	}
}

// TestObservationEngineUsage: the engine's usage replaces the routing-time
// estimate of the prefill it ran; figures that do not fit leave it.
func TestObservationEngineUsage(t *testing.T) {
	o := Observation{UncachedTokens: 1000}
	require.Equal(t, 40, o.Engine(1000, 960, true).UncachedTokens)
	require.Equal(t, 1000, o.Engine(1000, 0, true).UncachedTokens)
	require.Equal(t, 1000, o.Engine(1000, 960, false).UncachedTokens, "no usage")
	require.Equal(t, 1000, o.Engine(0, 0, true).UncachedTokens, "no prompt count")
	require.Equal(t, 1000, o.Engine(100, 960, true).UncachedTokens, "more cached than prompt")
	require.Equal(t, 1000, o.Engine(100, -1, true).UncachedTokens)
}

// explainedPick is a fresh cost model's explained Pick of req over cands
// with cfg; it fails t when the same Pick unexplained chooses otherwise.
func explainedPick(t *testing.T, cfg CostConfig, req *Request, cands []Candidate) (Decision, Explanation) {
	t.Helper()
	m, err := NewModel(cfg)
	require.NoError(t, err)
	c := NewCost(m)
	var ex Explanation
	rng := NewRand(1)
	d := c.Pick(req, cands, &rng, &ex)
	rng = NewRand(1)
	require.Equal(t, d.Index, c.Pick(req, cands, &rng, nil).Index, "explaining changed the pick")
	return d, ex
}
