package route

import (
	"testing"

	"github.com/stretchr/testify/require"
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
