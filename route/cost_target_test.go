package route

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
)

// TestTTFTTargetCharge: with a TTFT target, a replica estimated past it
// is charged TargetMissCharge·target, so cost takes a replica that meets
// the target over a cheaper one that misses it when the difference in
// cost is below the charge, and not when it is above; and the charge
// applies only while no other sender's requests are seen on the
// candidates.
func TestTTFTTargetCharge(t *testing.T) {
	req := Request{TotalBlocks: 16, BlockTokens: 128, PromptTokens: 2048, MaxTokens: 128}
	// holder: holds the prompt, its 8 slots full (a slot wait). other:
	// must recompute it with 6 streams running, which the recompute
	// delays (the cost it imposes on others).
	cands := func() []Candidate {
		return []Candidate{
			{ID: 0, Name: "holder", Matched: 16, InFlight: 8, LocalInFlight: 8, Running: 8, Waiting: 0,
				ScrapedInFlight: 8, ScrapedInFlightKnown: true},
			{ID: 1, Name: "other", InFlight: 6, LocalInFlight: 6, Running: 6, Waiting: 0,
				ScrapedInFlight: 6, ScrapedInFlightKnown: true},
		}
	}
	pick := func(cfg CostConfig, cs []Candidate) (Decision, Explanation) {
		t.Helper()
		return explainedPick(t, cfg, &req, cs)
	}

	cfg := DefaultCostConfig()
	cfg.MaxRunning = 8
	d, ex := pick(cfg, cands())
	require.Equal(t, 0, d.Index, "no target: the holder's queue costs less than the recompute")
	require.Zero(t, ex.TargetMissCharge)
	holder, other := ex.Replicas[0], ex.Replicas[1]
	require.Greater(t, holder.EstimatedTTFT, other.EstimatedTTFT)
	// The charges below stay clear of the near-tie tolerance (a decode
	// step, 0.03 s here).
	gap := other.Score - holder.Score
	require.Greater(t, gap, 0.1)

	// A target between the two estimates: the holder misses it, the other
	// meets it.
	cfg.TTFTTargetSeconds = (holder.EstimatedTTFT + other.EstimatedTTFT) / 2
	cfg.TargetMissCharge = (gap + 0.05) / cfg.TTFTTargetSeconds
	d, ex = pick(cfg, cands())
	require.Equal(t, 1, d.Index, "a charge above the gap: the replica meeting the target")
	require.InDelta(t, gap+0.05, ex.TargetMissCharge, 1e-9)
	require.InDelta(t, holder.Score+gap+0.05, ex.Replicas[0].Score, 1e-9, "the holder is charged")
	require.InDelta(t, other.Score, ex.Replicas[1].Score, 1e-9, "the other is not")

	cfg.TargetMissCharge = gap / 4 / cfg.TTFTTargetSeconds
	d, _ = pick(cfg, cands())
	require.Equal(t, 0, d.Index, "a charge below the gap: the cheaper replica")

	// Another sender's requests on a candidate (the scrape showed one
	// request more than this gateway had in flight; or a peer's report):
	// no charge.
	cfg.TargetMissCharge = (gap + 0.05) / cfg.TTFTTargetSeconds
	for name, mod := range map[string]func([]Candidate){
		"scrape": func(cs []Candidate) { cs[1].ScrapedInFlight = 5; cs[1].Running = 6 },
		"peer":   func(cs []Candidate) { cs[1].LocalInFlight = 5 },
	} {
		cs := cands()
		mod(cs)
		d, ex = pick(cfg, cs)
		require.Zero(t, ex.TargetMissCharge, name)
		require.Equal(t, 0, d.Index, name)
	}
}

// TestHoldKeepsARecomputePastTheTarget: where other senders show only in
// the engines' scrapes (an isolated gateway), a recompute elsewhere that
// cost estimates past the TTFT target gives way to the prefix's holder
// ("cost_held"). A recompute within the target, no target, a peer's load
// report, a gateway that sees every request, and a hot prefix (share ·
// candidates above hotPrefixReplicas) keep the recompute.
func TestHoldKeepsARecomputePastTheTarget(t *testing.T) {
	// Four prefill chunks to recompute, one on the holder.
	req := Request{TotalBlocks: 64, BlockTokens: 128, PromptTokens: 8192, MaxTokens: 128, Now: 1_000 * sec}
	cfg := DefaultCostConfig()
	cfg.MaxRunning = 8
	d, ex := explainedPick(t, cfg, &req, holdCandidates(3))
	require.Equal(t, SelectionCostSpread, d.Selection, "no target: the recompute")
	recompute := ex.Replicas[d.Index].EstimatedTTFT
	holder := ex.Replicas[0].EstimatedTTFT
	require.Greater(t, holder, recompute)

	cfg.TTFTTargetSeconds = recompute * 1.1
	d, ex = explainedPick(t, cfg, &req, holdCandidates(3))
	require.Equal(t, SelectionCostSpread, d.Selection, "the recompute meets the target")
	require.Empty(t, ex.HeldFrom)

	spreadTo := ex.Replicas[d.Index].Name
	cfg.TTFTTargetSeconds = recompute * 0.9
	d, ex = explainedPick(t, cfg, &req, holdCandidates(3))
	require.Equal(t, 0, d.Index, "the recompute misses the target: held")
	require.Equal(t, SelectionCostHeld, d.Selection)
	require.Equal(t, spreadTo, ex.HeldFrom, "the explanation names the replica the scores ranked first")
	require.Equal(t, SelectionCostHeld, ex.Selection)
	require.InDelta(t, holder, d.EstimatedTTFT, 1e-9, "the holder's estimate")

	for name, mod := range map[string]func([]Candidate){
		// A peer reports a request on one of the others.
		"peer": func(cs []Candidate) { cs[2].InFlight++ },
		// The holder's waiting requests are this gateway's own: it sees
		// every request.
		"alone": func(cs []Candidate) { cs[0].InFlight, cs[0].LocalInFlight, cs[0].ScrapedInFlight = 20, 20, 20 },
	} {
		cs := holdCandidates(3)
		mod(cs)
		d, _ = explainedPick(t, cfg, &req, cs)
		require.Equal(t, SelectionCostSpread, d.Selection, name)
	}

	// A prompt of one chunk: recomputing it computes as many chunks as
	// the holder, and Pick's near-tie ranking already weighed that.
	small := req
	small.TotalBlocks, small.PromptTokens = 8, 1024
	cs := holdCandidates(3)
	cs[0].Matched = 8
	tight := cfg
	tight.TTFTTargetSeconds = 0.001 // every candidate misses it
	d, _ = explainedPick(t, tight, &small, cs)
	require.Equal(t, SelectionCostSpread, d.Selection, "one chunk either way")

	// A prefix every recent request shares: hot over more than
	// hotPrefixReplicas candidates, not over that many.
	req.Prefixes = NewPrefixes(promptKeys(0, 64, 42))
	m, err := NewModel(cfg)
	require.NoError(t, err)
	c := NewCost(m)
	for range 20 {
		rng := NewRand(1)
		c.Pick(&req, holdCandidates(3), &rng, nil)
	}
	rng := NewRand(1)
	d = c.Pick(&req, holdCandidates(hotPrefixReplicas+2), &rng, nil)
	require.Equal(t, SelectionCostSpread, d.Selection, "hot: the recompute")
	d = c.Pick(&req, holdCandidates(hotPrefixReplicas), &rng, nil)
	require.Equal(t, SelectionCostHeld, d.Selection, "a share of one over as many candidates as the bound: held")
}

// holdCandidates returns n candidates for a 64-block prompt: holder
// holds it, its 8 slots full and, in the scrape, 12 requests of other
// senders waiting; the others are idle but for two requests of this
// gateway each and must recompute it.
func holdCandidates(n int) []Candidate {
	cs := []Candidate{{ID: 0, Name: "holder", Matched: 64, InFlight: 8, LocalInFlight: 8, Running: 8, Waiting: 12,
		ScrapedInFlight: 8, ScrapedInFlightKnown: true}}
	for i := 1; i < n; i++ {
		cs = append(cs, Candidate{ID: index.ReplicaID(i), Name: fmt.Sprintf("other-%d", i), InFlight: 2, LocalInFlight: 2,
			Running: 2, ScrapedInFlight: 2, ScrapedInFlightKnown: true})
	}
	return cs
}

// TestHoldWhereMostReplicasQueue: an isolated gateway holds a recompute
// its estimate puts within the TTFT target as well, where at least half
// the candidates' scrapes show requests waiting (their estimates do not
// count the prefill other gateways are about to send there); the
// explanation says how many. Fewer waiting, no target, a peer's report
// or a gateway that sees every request keep the recompute.
func TestHoldWhereMostReplicasQueue(t *testing.T) {
	req := Request{TotalBlocks: 64, BlockTokens: 128, PromptTokens: 8192, MaxTokens: 128, Now: 1_000 * sec}
	cfg := DefaultCostConfig()
	cfg.MaxRunning = 8
	d, ex := explainedPick(t, cfg, &req, holdCandidates(4))
	require.Equal(t, SelectionCostSpread, d.Selection)
	recompute := ex.Replicas[d.Index].EstimatedTTFT
	cfg.TTFTTargetSeconds = recompute * 1.1

	// waiting marks others (never the recompute's replica, whose
	// estimate would change) as showing a request waiting in the scrape,
	// besides the holder.
	spreadTo := d.Index
	waiting := func(others int) []Candidate {
		cs := holdCandidates(4)
		for i := 1; i < len(cs) && others > 0; i++ {
			if i != spreadTo {
				cs[i].Waiting = 1
				others--
			}
		}
		return cs
	}
	d, ex = explainedPick(t, cfg, &req, waiting(0))
	require.Equal(t, SelectionCostSpread, d.Selection, "1 of 4 waiting: the recompute")
	require.Equal(t, spreadTo, d.Index)
	require.Empty(t, ex.HeldFrom)
	require.Zero(t, ex.HeldWaiting)
	require.LessOrEqual(t, d.EstimatedTTFT, cfg.TTFTTargetSeconds, "within the target")

	d, ex = explainedPick(t, cfg, &req, waiting(1))
	require.Equal(t, 0, d.Index, "2 of 4 waiting, half: held")
	require.Equal(t, SelectionCostHeld, d.Selection)
	require.Equal(t, ex.Replicas[spreadTo].Name, ex.HeldFrom)
	require.Equal(t, 2, ex.HeldWaiting)

	// Past the target the hold is the target's: no waiting count.
	past := cfg
	past.TTFTTargetSeconds = recompute * 0.9
	d, ex = explainedPick(t, past, &req, waiting(1))
	require.Equal(t, SelectionCostHeld, d.Selection)
	require.Zero(t, ex.HeldWaiting)

	noTarget := cfg
	noTarget.TTFTTargetSeconds = 0
	d, _ = explainedPick(t, noTarget, &req, waiting(1))
	require.Equal(t, SelectionCostSpread, d.Selection, "no target")
	for name, mod := range map[string]func([]Candidate){
		"peer": func(cs []Candidate) { cs[spreadTo].InFlight++ },
		// Every request the scrapes show is this gateway's own.
		"alone": func(cs []Candidate) {
			for i := range cs {
				n := cs[i].Running + cs[i].Waiting
				cs[i].InFlight, cs[i].LocalInFlight, cs[i].ScrapedInFlight = n, n, n
			}
		},
	} {
		cs := waiting(1)
		mod(cs)
		d, _ = explainedPick(t, cfg, &req, cs)
		require.Equal(t, SelectionCostSpread, d.Selection, name)
	}
}
