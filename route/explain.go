package route

import "github.com/kvmesh/kvmesh/index"

// FilterReason says why a strategy set a candidate aside.
type FilterReason uint8

const (
	// NotFiltered: the candidate stayed in the running.
	NotFiltered FilterReason = iota
	// FilteredImbalance: prefix-cache's imbalance gate kept only the
	// least-loaded replicas and this one was not among them.
	FilteredImbalance
	// FilteredNoMatch: prefix-cache considered only matching replicas and
	// this one matched nothing.
	FilteredNoMatch
	// FilteredOverLoadBound: the candidate's load was above prefix-cache's
	// mean + k·stddev bound.
	FilteredOverLoadBound
	// FilteredOverCapacity: consistent-hash skipped the candidate because
	// its load was at its bounded-load capacity.
	FilteredOverCapacity
	// FilteredNotReached: consistent-hash picked a replica before reaching
	// this one on the ring.
	FilteredNotReached
	numFilterReasons
)

var filterReasonNames = [numFilterReasons]string{
	NotFiltered:           "",
	FilteredImbalance:     "imbalance_gate",
	FilteredNoMatch:       "no_match",
	FilteredOverLoadBound: "over_load_bound",
	FilteredOverCapacity:  "over_capacity",
	FilteredNotReached:    "not_reached",
}

// String returns the reason's name ("" for NotFiltered).
func (f FilterReason) String() string {
	if f < numFilterReasons {
		return filterReasonNames[f]
	}
	return "unknown"
}

// MarshalText makes a FilterReason marshal as its name in JSON.
func (f FilterReason) MarshalText() ([]byte, error) { return []byte(f.String()), nil }

// Explanation is a decision's reasoning, served at GET /debug/route. The
// caller owns it and may reuse it across Picks (its Replicas slice is
// reused); it is not safe for concurrent use.
//
// A Pick given an Explanation is taken as a question, not a routed
// request: cost leaves it out of the prefix shares and the recent-request
// rate its later decisions read. A hook that explains every request it
// routes therefore changes what cost decides: every prompt looks
// unshared, so every copy pays the full duplicate charge.
type Explanation struct {
	// Strategy is the strategy's name.
	Strategy string `json:"strategy"`
	// Picked is the picked candidate's position; PickedName its name.
	Picked     int    `json:"picked"`
	PickedName string `json:"picked_name"`
	// Selection is the decision's label.
	Selection Selection `json:"selection"`
	// LoadImbalanced: prefix-cache's imbalance gate tripped.
	LoadImbalanced bool `json:"load_imbalanced,omitempty"`
	// Bound is the strategy's load bound when it has one: prefix-cache's
	// mean + k·stddev of in-flight counts, consistent-hash's per-replica
	// capacity, cost's near-tie bound (candidates scoring at most Bound
	// are near-ties).
	Bound float64 `json:"bound,omitempty"`
	// ScoreUnit says what ExplainedReplica.Score measures.
	ScoreUnit string `json:"score_unit,omitempty"`
	// UnseenPeerRequests is cost's estimate of the requests peers sent
	// that no in-flight count includes yet; the pick is one of that many
	// plus one placed on the scores' view (see Cost.Pick). 0 with one
	// gateway.
	UnseenPeerRequests int `json:"unseen_peer_requests,omitempty"`
	// HeldFrom names the replica cost's scores ranked first when it kept
	// the request with the prefix's holders instead (selection
	// "cost_held": that replica would have recomputed the prompt, and
	// was estimated past the TTFT target, or HeldWaiting is set); ""
	// otherwise.
	HeldFrom string `json:"held_from,omitempty"`
	// HeldWaiting is, where cost held a recompute its estimate put within
	// the target because at least half the candidates' scrapes showed
	// requests waiting, how many did; 0 otherwise.
	HeldWaiting int `json:"held_waiting_replicas,omitempty"`
	// HotHolders and HotHoldersNeeded: where cost, on a gateway that
	// sees other senders only in the engines' scrapes, found a hot
	// prefix held by fewer replicas than its share of the traffic needs
	// (share·candidates), the holders it found and that need; the
	// request then started a copy with probability 1 − holders/need
	// (see Cost.Pick). CopiedFrom names the holder the scores ranked
	// first when it did; "" otherwise.
	HotHolders       int     `json:"hot_holders,omitempty"`
	HotHoldersNeeded float64 `json:"hot_holders_needed,omitempty"`
	CopiedFrom       string  `json:"copied_from,omitempty"`
	// PrefixShare is cost's estimate of the share of this gateway's
	// recent requests that share the prompt as far as the best-matching
	// replica holds it (0 when none holds any). A replica that would
	// recompute what another holds is charged the duplicate prefill,
	// each block weighed by (1 − share·replicas)⁺ with the share of the
	// prompt up to that block (see Cost).
	PrefixShare float64 `json:"prefix_share,omitempty"`
	// TTFTTarget is cost's TTFT target in seconds (CostConfig.
	// TTFTTargetSeconds; 0: none) and TargetMissCharge what a candidate
	// whose EstimatedTTFT exceeds it is charged in its Score.
	TTFTTarget       float64 `json:"ttft_target_s,omitempty"`
	TargetMissCharge float64 `json:"target_miss_charge_s,omitempty"`
	// UnitsPerToken is the characters-per-token ratio the prompt's
	// character keys were converted with (Request.UnitsPerToken, learned:
	// Model.UnitsPerToken); 0 when the keys are engine tokens.
	UnitsPerToken float64 `json:"units_per_token,omitempty"`
	// Replicas holds one entry per candidate, in candidate order.
	Replicas []ExplainedReplica `json:"replicas"`
}

// ExplainedReplica is one candidate's part of an Explanation.
type ExplainedReplica struct {
	ID      index.ReplicaID `json:"id"`
	Name    string          `json:"name"`
	Matched int             `json:"matched_blocks"`
	// OffloadCPU and OffloadDisk are the run after Matched in the
	// engine's offload tiers as the strategy saw it (Candidate; 0 for a
	// strategy that does not price tiers).
	OffloadCPU    int     `json:"offload_cpu_blocks,omitempty"`
	OffloadDisk   int     `json:"offload_disk_blocks,omitempty"`
	MatchFraction float64 `json:"match_fraction"`
	InFlight      int     `json:"in_flight"`
	LocalInFlight int     `json:"local_in_flight"`
	Running       int     `json:"running"`
	Waiting       int     `json:"waiting"`
	KVUsage       float64 `json:"kv_usage"`
	// QueuedPrefill is the uncached prompt tokens this gateway has sent
	// to the replica and not yet seen a first token for; PeerQueuedPrefill
	// the same figure its peers last reported (cost's queue input).
	QueuedPrefill     int `json:"queued_prefill_tokens"`
	PeerQueuedPrefill int `json:"peer_queued_prefill_tokens"`
	// ScrapedQueuedPrefill is both as they were when the last scrape was
	// read: the prefill that explains requests the scrape showed waiting
	// (Candidate.ScrapedQueuedPrefillTokens; see Cost's capacity).
	ScrapedQueuedPrefill int `json:"scraped_queued_prefill_tokens,omitempty"`
	// UnshownSent is Candidate.UnshownSent: this gateway's requests in
	// flight to the replica that a scrape may not show yet (without
	// peers' reports; cost adds the other senders' share of them).
	UnshownSent int `json:"unshown_sent,omitempty"`
	// StepEndsIn is how long, in seconds from the decision, the engine
	// step in progress runs on as the tokens this gateway's streams
	// received time it (Candidate.LastTokenAt, StepNanos; cost's step
	// wait); absent when they do not time it.
	StepEndsIn float64 `json:"step_ends_in_s,omitempty"`
	// EstimatedTTFT, SlotWait and Capacity are cost's view of the
	// candidate (0 for other strategies): the time to first token it
	// estimates (Score less the delay the request would impose on others
	// there), the part of it spent waiting for a running-set slot, and
	// the running-set size it assumed (0: unknown, no slot wait priced;
	// see Cost.capacity). A replica cost passed over usually shows why
	// here: a slot wait where the running set is about to fill, or a TTFT
	// that a recompute makes long.
	EstimatedTTFT float64 `json:"estimated_ttft_s,omitempty"`
	SlotWait      float64 `json:"slot_wait_s,omitempty"`
	Capacity      int     `json:"capacity,omitempty"`
	// Score is the strategy's figure for this candidate (see
	// Explanation.ScoreUnit): cost's estimated TTFT plus the delay the
	// request would impose on others there, in seconds (Bound is its
	// near-tie bound),
	// prefix-cache's match percent, consistent-hash's ring order.
	Score float64 `json:"score"`
	// Filtered says why the candidate was set aside, if it was.
	Filtered FilterReason `json:"filtered,omitempty"`
	// Picked marks the chosen candidate.
	Picked bool `json:"picked,omitempty"`
}

// begin resets e for a decision over cands, filling the load view.
func (e *Explanation) begin(strategy string, req *Request, cands []Candidate) {
	e.Strategy = strategy
	e.Picked = -1
	e.PickedName = ""
	e.Selection = SelectionNone
	e.LoadImbalanced = false
	e.Bound = 0
	e.ScoreUnit = ""
	e.UnseenPeerRequests = 0
	e.HeldFrom, e.HeldWaiting = "", 0
	e.HotHolders, e.HotHoldersNeeded, e.CopiedFrom = 0, 0, ""
	e.PrefixShare = 0
	e.UnitsPerToken = 0
	if req.unitsKeyed() {
		e.UnitsPerToken = req.UnitsPerToken
	}
	if cap(e.Replicas) < len(cands) {
		e.Replicas = make([]ExplainedReplica, len(cands))
	}
	e.Replicas = e.Replicas[:len(cands)]
	for i := range cands {
		c := &cands[i]
		frac := 0.0
		if req.TotalBlocks > 0 {
			frac = float64(c.Matched) / float64(req.TotalBlocks)
		}
		e.Replicas[i] = ExplainedReplica{
			ID: c.ID, Name: c.Name, Matched: c.Matched, MatchFraction: frac,
			OffloadCPU: c.OffloadCPU, OffloadDisk: c.OffloadDisk,
			InFlight: c.InFlight, LocalInFlight: c.LocalInFlight,
			Running: c.Running, Waiting: c.Waiting, KVUsage: c.KVUsage,
			QueuedPrefill: c.QueuedPrefillTokens, PeerQueuedPrefill: c.PeerQueuedPrefillTokens,
			ScrapedQueuedPrefill: c.ScrapedQueuedPrefillTokens,
		}
		if c.ScrapedInFlightKnown {
			e.Replicas[i].UnshownSent = c.UnshownSent
		}
		if stepTimed(req.Now, c) {
			e.Replicas[i].StepEndsIn = stepLeft(req.Now, c)
		}
	}
}

// RecordPick fills e for a strategy outside this package that decides
// without scores (the gateway's pin to one replica): the candidates'
// figures as every strategy reports them, and d's pick.
func (e *Explanation) RecordPick(strategy string, req *Request, cands []Candidate, d Decision) {
	e.begin(strategy, req, cands)
	if d.Index >= 0 && d.Index < len(cands) {
		e.finish(cands, d)
	}
}

// finish records the decision d in e.
func (e *Explanation) finish(cands []Candidate, d Decision) {
	e.Picked = d.Index
	e.PickedName = cands[d.Index].Name
	e.Selection = d.Selection
	e.LoadImbalanced = d.LoadImbalanced
	e.Replicas[d.Index].Picked = true
	e.Replicas[d.Index].Filtered = NotFiltered
}
