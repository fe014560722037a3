package route

import (
	"fmt"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
)

// TestCostOneGatewayUnchanged: without peers' load (InFlight equals
// LocalInFlight) the unseen-peer estimate is 0, so the default cost
// strategy decides exactly as one that takes the peers' view as fresh,
// drawing the same random numbers, whatever it decided before.
func TestCostOneGatewayUnchanged(t *testing.T) {
	fresh := DefaultConfig()
	fresh.PeerLoadDelaySeconds = -1
	a, err := NewSet(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	b, err := NewSet(fresh)
	if err != nil {
		t.Fatal(err)
	}
	gen := NewRand(7)
	ra, rb := NewRand(11), NewRand(11)
	cands := make([]Candidate, 6)
	req := Request{TotalBlocks: 40, BlockTokens: 128, PromptTokens: 5200, MaxTokens: 128}
	for i := range cands {
		cands[i] = Candidate{ID: index.ReplicaID(i), Name: fmt.Sprint("r", i)}
	}
	for k := 0; k < 3000; k++ {
		req.Now += int64(gen.IntN(50)) * 1e6
		for i := range cands {
			c := &cands[i]
			c.Matched = []int{0, 0, 20, 40}[gen.IntN(4)]
			c.LocalInFlight = gen.IntN(12)
			c.InFlight = c.LocalInFlight
			c.Running, c.Waiting, c.KVUsage = min(c.InFlight, 8), max(c.InFlight-8, 0), 0.5
			c.QueuedPrefillTokens = gen.IntN(3) * 2000
		}
		da := a.Cost.Pick(&req, cands, &ra, nil)
		db := b.Cost.Pick(&req, cands, &rb, nil)
		if da != db {
			t.Fatalf("decision %d: %+v with the default, %+v with a fresh view", k, da, db)
		}
	}
	if ra.Uint64() != rb.Uint64() {
		t.Fatal("the two strategies drew different random numbers")
	}
}

// herdRun simulates gateways routing cold requests to idle replicas from
// a peer load view that is refreshed every reportMs milliseconds: one
// arrival every 5 ms, round robin over the gateways, each in flight for
// 2 s. It returns how many requests were sent to a replica that had
// received two or more within the preceding report interval (herded
// requests), and the most any replica received in all.
func herdRun(t *testing.T, cfg Config, gateways, replicas int, reportMs int64) (herded, most int) {
	t.Helper()
	type sent struct {
		gw, rep int
		at      int64
	}
	sets := make([]*Set, gateways)
	rngs := make([]Rand, gateways)
	for g := range sets {
		s, err := NewSet(cfg)
		if err != nil {
			t.Fatal(err)
		}
		sets[g], rngs[g] = s, NewRand(uint64(100+g))
	}
	const life = 2000 // ms in flight
	var log []sent
	reported := make([][]int, gateways) // each gateway's counts at the last report
	for g := range reported {
		reported[g] = make([]int, replicas)
	}
	cands := make([]Candidate, replicas)
	req := Request{TotalBlocks: 40, BlockTokens: 128, PromptTokens: 5200, MaxTokens: 128}
	total := make([]int, replicas)
	for ms := int64(0); ms < 6000; ms += 5 {
		if ms%reportMs == 0 {
			for g := range reported {
				clear(reported[g])
			}
			for _, s := range log {
				if ms-s.at < life {
					reported[s.gw][s.rep]++
				}
			}
		}
		g := int(ms/5) % gateways
		for i := range cands {
			cands[i] = Candidate{ID: index.ReplicaID(i), Name: fmt.Sprint("r", i),
				Running: Unknown, Waiting: Unknown, KVUsage: Unknown}
		}
		for _, s := range log {
			if ms-s.at >= life {
				continue
			}
			c := &cands[s.rep]
			if s.gw == g {
				c.LocalInFlight++
				c.InFlight++
				if ms-s.at < 500 { // its prefill is still queued
					c.QueuedPrefillTokens += req.PromptTokens
				}
			}
		}
		for p := range reported {
			if p != g {
				for i, n := range reported[p] {
					cands[i].InFlight += n
				}
			}
		}
		req.Now = ms * 1e6
		d := sets[g].Cost.Pick(&req, cands, &rngs[g], nil)
		log = append(log, sent{gw: g, rep: d.Index, at: ms})
		total[d.Index]++
	}
	for i, s := range log {
		n := 0
		for j := i - 1; j >= 0 && s.at-log[j].at < reportMs; j-- {
			if log[j].rep == s.rep {
				n++
			}
		}
		if n >= 2 {
			herded++
		}
	}
	for _, n := range total {
		most = max(most, n)
	}
	return herded, most
}

// TestCostStalePeersSpread: eight gateways deciding from a peer view
// refreshed every 100 ms herd onto the replica that view ranks cheapest
// when they take it as fresh (about half the requests go where two or
// more went in the last 100 ms); estimating the unseen peer requests (the
// default, here told the view is 100 ms stale) spreads them (about a
// quarter).
func TestCostStalePeersSpread(t *testing.T) {
	fresh := DefaultConfig()
	fresh.PeerLoadDelaySeconds = -1
	herdFresh, mostFresh := herdRun(t, fresh, 8, 32, 100)
	stale := DefaultConfig()
	stale.PeerLoadDelaySeconds = 0.1
	herd, most := herdRun(t, stale, 8, 32, 100)
	t.Logf("requests sent where two or more went within 100 ms: %d of 1200 taking the view as fresh, %d estimating unseen requests; busiest replica %d / %d",
		herdFresh, herd, mostFresh, most)
	if herd*3 > herdFresh*2 {
		t.Errorf("%d herded requests with the estimate, %d without: not a third fewer", herd, herdFresh)
	}
	// One gateway sees everything: the estimate must not change a thing.
	b1, m1 := herdRun(t, fresh, 1, 32, 100)
	b2, m2 := herdRun(t, DefaultConfig(), 1, 32, 100)
	if b1 != b2 || m1 != m2 {
		t.Errorf("one gateway: burst %d/%d, busiest %d/%d differ", b1, b2, m1, m2)
	}
}

// TestCostIsolatedSeesOthersThroughScrape: a gateway that no peer reports
// load to (isolated: InFlight equals LocalInFlight) still sees other
// senders in the engines' scrapes (Running+Waiting beyond its own
// requests), and estimates the requests they sent since as it would
// peers' (Explanation.UnseenPeerRequests); a scrape showing only its own
// requests leaves the estimate at 0 (TestCostOneGatewayUnchanged).
func TestCostIsolatedSeesOthersThroughScrape(t *testing.T) {
	for _, tc := range []struct {
		name   string
		others int // requests per replica the scrape shows beyond this gateway's
		unseen bool
	}{
		{"others in the scrape", 6, true},
		{"only its own", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := NewSet(DefaultConfig())
			if err != nil {
				t.Fatal(err)
			}
			rng := NewRand(3)
			req := Request{TotalBlocks: 40, BlockTokens: 128, PromptTokens: 5200, MaxTokens: 128}
			cands := make([]Candidate, 4)
			for i := range cands {
				cands[i] = Candidate{ID: index.ReplicaID(i), Name: fmt.Sprint("r", i), LocalInFlight: 1, InFlight: 1,
					Running: 1 + tc.others, Waiting: 0, KVUsage: 0.3}
			}
			// This gateway's own recent decisions, 10 ms apart.
			for k := range 20 {
				req.Now = int64(k) * 1e7
				s.Cost.Pick(&req, cands, &rng, nil)
			}
			var ex Explanation
			s.Cost.Pick(&req, cands, &rng, &ex)
			if got := ex.UnseenPeerRequests > 0; got != tc.unseen {
				t.Fatalf("unseen peer requests %d, want > 0: %v", ex.UnseenPeerRequests, tc.unseen)
			}
		})
	}
}

// TestCostCountsOthersUnshownSends: where other senders show only in the
// engines' scrapes, a replica this gateway sent to since its scrape last
// brought news (Candidate.UnshownSent) is taken to have had the others'
// share of sends too: they route on the same stale figures. Two replicas
// whose figures and in-flight counts come to the same outstanding count
// then differ by those sends, and Pick leaves the one sent to since. With
// peers' reports, or a scrape showing no one else, nothing is added.
func TestCostCountsOthersUnshownSends(t *testing.T) {
	cands := func() []Candidate {
		return []Candidate{
			// 3 own requests, 2 of them sent since the scrape that showed
			// 1 of them and 4 of others.
			{ID: 0, Name: "sent-to", InFlight: 3, LocalInFlight: 3, Running: 5, Waiting: 0, KVUsage: 0.3,
				ScrapedInFlight: 1, ScrapedInFlightKnown: true, UnshownSent: 2},
			{ID: 1, Name: "shown", InFlight: 3, LocalInFlight: 3, Running: 7, Waiting: 0, KVUsage: 0.3,
				ScrapedInFlight: 3, ScrapedInFlightKnown: true},
		}
	}
	req := Request{TotalBlocks: 40, BlockTokens: 128, PromptTokens: 5200, MaxTokens: 128}
	cfg := DefaultCostConfig()
	cfg.MaxRunning = 8
	_, ex := explainedPick(t, cfg, &req, cands())
	require.Greater(t, ex.Replicas[0].SlotWait, ex.Replicas[1].SlotWait)
	require.Equal(t, []int{2, 0}, []int{ex.Replicas[0].UnshownSent, ex.Replicas[1].UnshownSent})
	for seed := range uint64(20) {
		m, err := NewModel(cfg)
		require.NoError(t, err)
		rng := NewRand(seed)
		d := NewCost(m).Pick(&req, cands(), &rng, nil)
		require.Equal(t, 1, d.Index, "seed %d: the replica sent to since its scrape had others' sends too", seed)
	}

	m, err := NewModel(cfg)
	require.NoError(t, err)
	c := NewCost(m)
	r := m.rate(0)
	for _, tc := range []struct {
		name  string
		share float64
		edit  func(*Candidate)
		wantN int
	}{
		{"others' share 1.5 of 2 sends", 1.5, nil, 3 + 4 + 3},
		{"no one else in the scrapes", 0, nil, 3 + 4},
		{"peers report their load", 1.5, func(c *Candidate) { c.ScrapedInFlightKnown = false }, 5},
		{"nothing sent since", 1.5, func(c *Candidate) { c.UnshownSent = 0 }, 3 + 4},
	} {
		cand := cands()[0]
		if tc.edit != nil {
			tc.edit(&cand)
		}
		dup := duplication{scrapeShare: tc.share}
		_, _, _, n := c.estimate(&req, &cand, r, nil, placement{}, &dup, nil)
		require.Equal(t, tc.wantN, n, tc.name)
	}
}

// TestCostIsolatedEventsLongerWindow: an isolated gateway (other senders
// only in the scrapes) estimates the others' unseen requests over
// isolatedEventsWindow delays where the replica it ranks first holds the
// prompt by its KV events (Candidate.EventsFed): every gateway reads the
// same holders, and the engines' gauges are staler than the scrape. Where
// the holders are its own history, or peers report their load (synced),
// the window stays one delay, as it does for a gateway that sees no other
// sender at all.
func TestCostIsolatedEventsLongerWindow(t *testing.T) {
	// How this gateway sees the other senders' six requests a replica
	// runs.
	type view int
	const (
		isolated view = iota // only in the scrapes
		synced               // in the peers' reports too
		alone                // not at all: the scrape counts its own
	)
	meanUnseen := func(t *testing.T, eventsFed bool, v view) float64 {
		t.Helper()
		s := staleViewSet(t, 0)
		rng := NewRand(5)
		req := Request{TotalBlocks: 40, BlockTokens: 128, PromptTokens: 5200, MaxTokens: 128}
		cands := make([]Candidate, 4)
		for i := range cands {
			c := Candidate{ID: index.ReplicaID(i), Name: fmt.Sprint("r", i), LocalInFlight: 1, InFlight: 1,
				Running: 7, Waiting: 0, KVUsage: 0.3, EventsFed: eventsFed}
			switch v {
			case synced:
				c.InFlight = 7 // peers report the six the scrape shows
			case alone:
				// The scrape shows this gateway's own requests as they
				// were when it was read: no other sender.
				c.ScrapedInFlight, c.ScrapedInFlightKnown = 7, true
			}
			cands[i] = c
		}
		// This gateway's own decisions, 50 ms apart: about 1.5 of them
		// within one delay, 5.5 within three.
		for k := range 40 {
			req.Now = int64(k) * 5e7
			s.Cost.Pick(&req, cands, &rng, nil)
		}
		req.Now += 5e7
		sum := 0
		const picks = 400
		for range picks {
			var ex Explanation
			s.Cost.Pick(&req, cands, &rng, &ex)
			sum += ex.UnseenPeerRequests
		}
		return float64(sum) / picks
	}
	history := meanUnseen(t, false, isolated)
	events := meanUnseen(t, true, isolated)
	t.Logf("isolated: %.2f unseen requests with history holders, %.2f with KV-event holders", history, events)
	require.Greater(t, history, 1.0, "isolated with history holders must still estimate the others' requests")
	require.Greater(t, events, 2.5*history, "KV-event holders: the window must be isolatedEventsWindow delays")

	syncedHistory := meanUnseen(t, false, synced)
	syncedEvents := meanUnseen(t, true, synced)
	t.Logf("synced: %.2f with history holders, %.2f with KV-event holders", syncedHistory, syncedEvents)
	require.Greater(t, syncedHistory, 0.5)
	require.Equal(t, syncedHistory, syncedEvents, "peers report their load: one delay whatever the holders")

	// One gateway whose scrape lags its own streams' ends sees no other
	// sender (Candidate.unseen): its estimate stays one delay.
	aloneHistory := meanUnseen(t, false, alone)
	aloneEvents := meanUnseen(t, true, alone)
	t.Logf("alone: %.2f with history holders, %.2f with KV-event holders", aloneHistory, aloneEvents)
	require.Equal(t, aloneHistory, aloneEvents, "no other sender seen: one delay whatever the holders")
}

// TestCostIsolatedEventsHotSpreadCopies: where an isolated gateway ranks
// first a replica its KV events name a holder, every gateway ranks it
// first, and the others' unseen requests pile onto the holders. For a
// hot prefix (its own traffic needs copies) the placements of those
// requests may leave the holders once they fill, so some of the
// gateway's requests start copies on idle replicas; a prefix that is not
// hot, holders known from this gateway's own history, or peers that
// report their load keep every placement with the holder.
func TestCostIsolatedEventsHotSpreadCopies(t *testing.T) {
	type view struct {
		eventsFed, hot, synced bool
	}
	copies := func(t *testing.T, v view) int {
		t.Helper()
		s := staleViewSet(t, 8)
		rng := NewRand(9)
		// Ten holders, each running one request of this gateway's and
		// six of other senders; six idle replicas.
		const holders = 10
		cands := make([]Candidate, 16)
		for i := range cands {
			cands[i] = Candidate{ID: index.ReplicaID(i), Name: fmt.Sprint("r", i), Running: 0, Waiting: 0, KVUsage: 0.1,
				EventsFed: v.eventsFed}
			if i < holders {
				c := &cands[i]
				c.Matched, c.InFlight, c.LocalInFlight, c.Running = 40, 1, 1, 7
				if v.synced {
					c.InFlight = 7 // peers report the six the scrape shows
				}
			}
		}
		req := Request{TotalBlocks: 40, BlockTokens: 128, PromptTokens: 5200, MaxTokens: 128}
		// This gateway's own decisions, 3 ms apart (enough unseen
		// requests to fill the holders over one delay, too), three in
		// five for this prompt (hot: a share of 0.6 needs 9.6 of the 16
		// replicas, so the ten holders are not too few: see
		// TestCostCopyByNeed), else one in five.
		pickHistory(s.Cost, &req, cands, &rng, 3e6, func(k int) bool { return k%5 == 0 || v.hot && k%5 < 3 })
		n := 0
		for range 400 {
			var ex Explanation
			if s.Cost.Pick(&req, cands, &rng, &ex).Index >= holders {
				n++
			}
			require.Zero(t, ex.HotHolders, "the holders are as many as the prefix needs")
		}
		return n
	}
	hot := copies(t, view{eventsFed: true, hot: true})
	t.Logf("copies of 400: %d of a hot prefix held by KV events", hot)
	require.Greater(t, hot, 20, "a hot prefix: the unseen requests' placements leave the full holders")
	for _, tc := range []struct {
		name string
		view
	}{
		{"not hot", view{eventsFed: true}},
		{"history holders", view{hot: true}},
		{"synced", view{eventsFed: true, hot: true, synced: true}},
	} {
		n := copies(t, tc.view)
		t.Logf("copies of 400: %d, %s", n, tc.name)
		require.Zero(t, n, tc.name)
	}
}

// TestCostInProgressCopy: KV events report a prefill chunk by chunk, so
// a replica computing a prompt for another sender shows the prompt's
// start while a scrape still shows it idle. Where the other senders show
// only in the scrapes and the prefix is hot (duplication.isolatedHot),
// the rest of the prompt that another candidate holds further counts as
// prefill queued there, less what this gateway queued itself; a head
// start then no longer makes that replica cheaper than a free one.
func TestCostInProgressCopy(t *testing.T) {
	req := Request{TotalBlocks: 40, BlockTokens: 128, PromptTokens: 5120, MaxTokens: 128}
	m, err := NewModel(DefaultCostConfig())
	require.NoError(t, err)
	c := NewCost(m)
	r := m.rate(0)
	ttft := func(cand Candidate, dup duplication) float64 {
		t.Helper()
		est, _, _, _ := c.estimate(&req, &cand, r, nil, placement{}, &dup, nil)
		return est
	}
	// Eight of the prompt's 40 blocks so far, by its KV events.
	started := Candidate{ID: 1, Name: "started", Matched: 8, EventsFed: true, Running: 0, Waiting: 0, KVUsage: 0.1}
	free := Candidate{ID: 2, Name: "free", EventsFed: true, Running: 0, Waiting: 0, KVUsage: 0.1}
	isolatedHot := duplication{best: 40, isolatedHot: true}
	require.Equal(t, 32*128, isolatedHot.inProgress(&req, &started))
	require.Greater(t, ttft(started, isolatedHot), ttft(free, isolatedHot),
		"the rest of another sender's prefill is ahead of this one's")

	for name, tc := range map[string]struct {
		cand Candidate
		dup  duplication
		want int
	}{
		"not isolated or not hot": {started, duplication{best: 40}, 0},
		"holdings from history":   {func() Candidate { c := started; c.EventsFed = false; return c }(), isolatedHot, 0},
		"the longest holder":      {func() Candidate { c := started; c.Matched = 40; return c }(), isolatedHot, 0},
		"nothing held":            {free, isolatedHot, 0},
		"own prefill queued there, part of it": {func() Candidate { c := started; c.QueuedPrefillTokens = 10 * 128; return c }(),
			isolatedHot, 22 * 128},
		"own prefill queued there, all of it": {func() Candidate { c := started; c.QueuedPrefillTokens = 40 * 128; return c }(),
			isolatedHot, 0},
	} {
		require.Equal(t, tc.want, tc.dup.inProgress(&req, &tc.cand), name)
	}
	plain := duplication{best: 40}
	require.Less(t, ttft(started, plain), ttft(free, plain), "elsewhere a head start is a head start")

	// Pick sees it so: an isolated gateway (other senders' requests in
	// the scrapes) whose recent requests all share the prompt, a holder
	// of all of it, and one replica started on it. Hot over 12
	// candidates, not over 4 (hotPrefixReplicas); and not where the
	// scrapes show this gateway's requests alone.
	for _, tc := range []struct {
		k            int
		alone, ahead bool
	}{{12, false, true}, {4, false, false}, {12, true, false}} {
		cands := []Candidate{{ID: 0, Name: "holder", Matched: 40, EventsFed: true, Running: 6, KVUsage: 0.3}, started}
		for i := 2; i < tc.k; i++ {
			cands = append(cands, Candidate{ID: index.ReplicaID(i), Name: fmt.Sprint("free-", i), EventsFed: true,
				Running: 1, KVUsage: 0.1})
		}
		if tc.alone {
			for i := range cands {
				cands[i].InFlight, cands[i].LocalInFlight = cands[i].Running, cands[i].Running
			}
		}
		hot := req
		hot.Prefixes = NewPrefixes(promptKeys(0, 40, 42))
		m, err := NewModel(DefaultCostConfig())
		require.NoError(t, err)
		c := NewCost(m)
		for n := range 20 {
			hot.Now = int64(n) * 5e7
			rng := NewRand(uint64(n))
			c.Pick(&hot, cands, &rng, nil)
		}
		var ex Explanation
		rng := NewRand(1)
		c.Pick(&hot, cands, &rng, &ex)
		startedTTFT, freeTTFT := ex.Replicas[1].EstimatedTTFT, ex.Replicas[2].EstimatedTTFT
		if tc.ahead {
			require.Greater(t, startedTTFT, freeTTFT, "%+v", tc)
		} else {
			require.Less(t, startedTTFT, freeTTFT, "%+v", tc)
		}
	}
}

// TestCostCopyByNeed: an isolated gateway whose KV events name H holders
// of a hot prefix, fewer than its share of the candidates needs (s·K),
// sends a request to the cheapest replica outside them with probability
// 1 − H/(s·K), however cheap the holders look: every gateway reads the
// same holders and the same stale scrapes, so the holders' load shows too
// late to spread the prefix. History holders, a prefix that is not hot
// and a gateway that sees every request keep the holder.
func TestCostCopyByNeed(t *testing.T) {
	const k = 16
	type view struct {
		holders        int
		eventsFed, hot bool
		alone          bool
	}
	copies := func(t *testing.T, v view) float64 {
		t.Helper()
		s := staleViewSet(t, 0)
		rng := NewRand(13)
		cands := make([]Candidate, k)
		for i := range cands {
			// Each runs one request of another sender, in the scrape.
			cands[i] = Candidate{ID: index.ReplicaID(i), Name: fmt.Sprint("r", i), Running: 1, Waiting: 0, KVUsage: 0.1,
				EventsFed: v.eventsFed}
			if v.alone {
				cands[i].InFlight, cands[i].LocalInFlight = 1, 1
			}
			if i < v.holders {
				cands[i].Matched = 40
			}
		}
		req := Request{TotalBlocks: 40, BlockTokens: 128, PromptTokens: 5120, MaxTokens: 128}
		// This gateway's own decisions, 50 ms apart, for this prompt
		// (hot: all of them; else one in four, a share of 1/4 that
		// needs 4 of the 16 replicas, fewer than hotPrefixReplicas).
		pickHistory(s.Cost, &req, cands, &rng, 5e7, func(k int) bool { return v.hot || k%4 == 0 })
		const picks = 800
		moved := 0
		for range picks {
			var ex Explanation
			d := s.Cost.Pick(&req, cands, &rng, &ex)
			if d.Index >= v.holders {
				moved++
			}
			if !v.eventsFed || !v.hot || v.alone {
				require.Zero(t, ex.HotHolders)
				continue
			}
			// The explanation says what the rule saw and which holder
			// the request left.
			require.Equal(t, v.holders, ex.HotHolders)
			require.InDelta(t, k, ex.HotHoldersNeeded, 0.5, "a share of about 1 over %d candidates", k)
			if d.Index >= v.holders {
				left := slices.IndexFunc(cands[:v.holders], func(c Candidate) bool { return c.Name == ex.CopiedFrom })
				require.GreaterOrEqual(t, left, 0, "the replica left, %q, is a holder", ex.CopiedFrom)
			} else {
				require.Empty(t, ex.CopiedFrom)
			}
		}
		return float64(moved) / picks
	}
	for _, h := range []int{1, 4, 12} {
		got := copies(t, view{holders: h, eventsFed: true, hot: true})
		want := 1 - float64(h)/k
		t.Logf("%d holders of %d: %.3f of the requests started copies, want about %.3f", h, k, got, want)
		require.InDelta(t, want, got, 0.07, "%d holders", h)
	}
	for _, tc := range []struct {
		name string
		view
	}{
		{"history holders", view{holders: 1, hot: true}},
		{"not hot", view{holders: 1, eventsFed: true}},
		{"alone", view{holders: 1, eventsFed: true, hot: true, alone: true}},
	} {
		require.Zero(t, copies(t, tc.view), tc.name)
	}
}

// pickHistory has c make 40 decisions of its own over cands, gap
// nanoseconds apart, the k-th for the prompt promptKeys(0, 40, 42) where
// same(k) and for a prompt of its own otherwise, then sets req to that
// prompt one gap after the last.
func pickHistory(c *Cost, req *Request, cands []Candidate, rng *Rand, gap int64, same func(k int) bool) {
	for k := range 40 {
		id := uint64(100 + k)
		if same(k) {
			id = 42
		}
		req.Prefixes = NewPrefixes(promptKeys(0, 40, id))
		req.Now = int64(k) * gap
		c.Pick(req, cands, rng, nil)
	}
	req.Prefixes = NewPrefixes(promptKeys(0, 40, 42))
	req.Now += gap
}

// staleViewSet returns a strategy set told that the load view is 100 ms
// stale (Config.PeerLoadDelaySeconds), its cost assuming maxRunning slots
// a replica (0: as learned).
func staleViewSet(t *testing.T, maxRunning int) *Set {
	t.Helper()
	cfg := DefaultConfig()
	cfg.PeerLoadDelaySeconds = 0.1
	cfg.Cost.MaxRunning = maxRunning
	s, err := NewSet(cfg)
	require.NoError(t, err)
	return s
}
