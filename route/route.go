package route

import (
	"fmt"

	"github.com/kvmesh/kvmesh/index"
)

// Unknown marks an engine-scraped load figure (Running, Waiting, KVUsage)
// that the gateway has not scraped yet or could not scrape.
const Unknown = -1

// Candidate is one healthy replica as a strategy sees it: how much of this
// prompt the index believes it holds, and the load view. The caller owns the
// slice of Candidates and may reuse it for the next request; strategies never
// keep it.
type Candidate struct {
	// ID is the replica's process-local handle.
	ID index.ReplicaID
	// Name is the replica's stable name. consistent-hash places replicas on
	// its ring by Name, so every gateway maps a key to the same replica. IDs
	// and names must correspond one to one.
	Name string
	// Matched is the number of leading blocks of this prompt the index
	// believes the replica holds (0..Request.TotalBlocks).
	Matched int
	// OffloadCPU and OffloadDisk are the run of blocks after Matched the
	// replica holds in its CPU and then disk offload tier
	// (index.MatchTiers): the engine loads them instead of recomputing
	// them. Route fills them only for a strategy that prices them
	// (TierPricer); the others see 0. prefix-cache never reads them: its
	// match is GPU-only (AIBrix's semantics).
	OffloadCPU, OffloadDisk int
	// EventsFed reports that the index learns what the replica holds from
	// its KV events (LedgerFor gives the speculative ledger: kv-events
	// mode, or hybrid mode and a replica that publishes them); Route sets
	// it. Every gateway reads the same events, so every gateway takes the
	// replica for a holder alike (see Cost's unseen peer requests).
	EventsFed bool

	// InFlight is the cluster-wide count of requests in flight to the
	// replica as this gateway knows it: its own exact count plus the counts
	// peers last reported. This is the "load" of random-free strategies.
	InFlight int
	// LocalInFlight is this gateway's own exact in-flight count (≤ InFlight).
	LocalInFlight int
	// Running and Waiting are the engine's vllm:num_requests_running and
	// vllm:num_requests_waiting at the last scrape, or Unknown.
	Running, Waiting int
	// KVUsage is vllm:kv_cache_usage_perc (0..1) at the last scrape, or
	// Unknown.
	KVUsage float64
	// QueuedPrefillTokens is the uncached prompt tokens this gateway has sent
	// to the replica and not yet seen a first token for: prefill work queued
	// ahead of a new request (input to the cost model).
	QueuedPrefillTokens int
	// PeerQueuedPrefillTokens is the same figure summed over the peers, as
	// they last reported it (as stale as their part of InFlight); 0 when
	// unknown: without it, the cost model sees only this gateway's queued
	// prefill, and a recompute sent where a peer's prefill is running
	// waits for it unforeseen.
	PeerQueuedPrefillTokens int
	// ScrapedQueuedPrefillTokens is QueuedPrefillTokens plus
	// PeerQueuedPrefillTokens as they were when the last scrape was read:
	// the prefill that can explain the requests that scrape showed
	// Waiting. The scrape is as old as its interval, the queued figures
	// are live: a prefill that has produced its first token since no
	// longer counts in them, yet the scrape still shows what it held
	// back (see Cost's capacity). 0 when unknown.
	ScrapedQueuedPrefillTokens int
	// LastTokenAt is when this gateway last received a streamed token
	// from the replica (Request.Now's clock; 0 when none), and StepNanos
	// the gap between that token and the one before it in the same
	// stream: the engine's step period then. An engine admits a new
	// request at its next step, so a request sent now waits about
	// LastTokenAt+StepNanos−Now before its prefill starts (see Cost).
	LastTokenAt, StepNanos int64
	// ScrapedInFlight is InFlight as it was when the scrape last brought
	// news of the engine, when ScrapedInFlightKnown: the view sets it only
	// without peers' load reports (one gateway, or gateways that do not
	// share load). What the engine showed beyond it is load from senders
	// this gateway cannot see (see Cost). A scrape brings news when
	// Running or Waiting changed, or when a token came from the replica
	// since the scrape before (a step ended): vLLM's gauges are as of the
	// engine's last step, so a scrape during a long prefill step reads
	// the step's start again, and requests sent since are in neither.
	ScrapedInFlight      int
	ScrapedInFlightKnown bool
	// UnshownSent is how many of this gateway's requests in flight to the
	// replica a scrape may not show yet (with ScrapedInFlightKnown): those
	// sent since that news, and at the news those SendLog.Unshown counts.
	// Nor does it show the requests other senders sent meanwhile, which
	// Cost estimates from it where it sees other senders only in the
	// scrapes. ScrapedInFlight counts the latter sends as shown, so that a
	// gateway alone never takes its own requests for another sender's.
	UnshownSent int
	// Sends holds when this gateway sent the requests of LocalInFlight
	// (nil: not known). Where no other sender shows, Cost reads from it
	// how soon a full running set frees a slot: not before this
	// gateway's recent requests there can have produced their output
	// (see Cost). The view owns it; a strategy only reads it, during
	// Pick.
	Sends *SendLog
}

// unseen is what the engine's last scrape showed outstanding beyond this
// gateway's view: beyond ScrapedInFlight (its own in-flight count when
// the scrape last brought news) where known, else beyond InFlight now; 0
// without a scrape.
// Where peers report load, InFlight includes theirs, and requests a peer
// sent that its report does not carry yet show here.
func (c *Candidate) unseen() int {
	if c.Running < 0 || c.Waiting < 0 {
		return 0
	}
	own := max(c.InFlight, 0)
	if c.ScrapedInFlightKnown {
		own = c.ScrapedInFlight
	}
	return max(c.Running+c.Waiting-own, 0)
}

// queuedPrefill is the prefill work the load view shows queued on c: this
// gateway's and the peers' reported.
func (c *Candidate) queuedPrefill() int {
	return max(c.QueuedPrefillTokens, 0) + max(c.PeerQueuedPrefillTokens, 0)
}

// Request is what strategies know about the request being routed.
type Request struct {
	// TotalBlocks is the number of full blocks of the prompt (the blocks the
	// index can match; a partial tail block is not counted).
	TotalBlocks int
	// BlockTokens is the number of tokens (or characters, with the character
	// tokenizer) per block.
	BlockTokens int
	// PromptTokens is the prompt length in the same unit; 0 means
	// TotalBlocks·BlockTokens.
	PromptTokens int
	// MaxTokens is the request's max_tokens, 0 if not given.
	MaxTokens int
	// SessionKey is the consistent-hash key: a hash of the session id when
	// the client gave one, else a hash of the first blocks' keys.
	SessionKey uint64
	// Prefixes are the prompt's prefixes at depths of 1, 2, 4, … blocks
	// (NewPrefixes), whatever the session, and at the longest match any
	// candidate holds, which Scratch.Route adds (Prefixes.AddMatch). Cost
	// counts each prefix's share of the recent requests by them.
	Prefixes Prefixes
	// Now is the routing time in nanoseconds (Unix or monotonic, as long as
	// the caller is consistent). Strategies do not read the clock.
	Now int64
	// UnitsPerToken is how many of the keys' units (BlockTokens,
	// PromptTokens and the candidates' queued prefill are counted in them)
	// make one engine token: 1 (0 means 1) when the keys are tokens, a
	// characters-per-token ratio when they are characters (the pool's
	// Model.UnitsPerToken, learned from the engine's usage).
	// The cost model's rates and CostConfig.ChunkTokens are per engine
	// token; it converts with this ratio.
	UnitsPerToken float64
}

// CharsPerToken is the characters-per-token ratio a model assumes for
// prompts keyed by characters until the engine's usage has taught it the
// prompts' own (Model.UnitsPerToken): the rule of thumb for English text
// under BPE vocabularies of the cl100k/Llama 3 size (about four bytes a
// token). A prompt's true ratio varies with its language and content (the
// study's prompts, a hex salt and English sentences, run at about 5.8
// under cl100k).
const CharsPerToken = 4.0

// unitsKeyed reports whether the keys are in units other than engine
// tokens (characters): UnitsPerToken is set and not 1.
func (r *Request) unitsKeyed() bool {
	return r.UnitsPerToken > 0 && r.UnitsPerToken != 1
}

// tokens converts n of the keys' units into engine tokens.
func (r *Request) tokens(n int) float64 {
	if r.unitsKeyed() {
		return float64(n) / r.UnitsPerToken
	}
	return float64(n)
}

// UncachedTokens is the prompt work a replica holding matched leading
// blocks still has to prefill: the unmatched full blocks plus the tail
// (matched is clamped to [0, TotalBlocks]).
func (r *Request) UncachedTokens(matched int) int {
	prompt := r.PromptTokens
	full := r.TotalBlocks * r.BlockTokens
	if prompt < full {
		prompt = full
	}
	if matched > r.TotalBlocks {
		matched = r.TotalBlocks
	}
	if matched < 0 {
		matched = 0
	}
	return prompt - matched*r.BlockTokens
}

// Decision is a strategy's pick.
type Decision struct {
	// Index is the position of the picked replica in the candidates slice.
	Index int
	// Selection says which branch of the strategy picked it (a metric label).
	Selection Selection
	// LoadImbalanced reports that prefix-cache's imbalance gate tripped
	// (AIBrix counts this separately from the selection label).
	LoadImbalanced bool
	// EstimatedTTFT is cost's estimated time to first token on the picked
	// replica, in seconds (0 for other strategies).
	EstimatedTTFT float64
	// EstimatedQueue is the part of EstimatedTTFT spent before this
	// request's own prefill starts, in seconds. Pass it back in
	// Observation.QueueSeconds (with QueueEstimated) so the model learns
	// prefill speed from the rest; the routing core does.
	EstimatedQueue float64
}

// Strategy picks one replica among candidates.
//
// Pick may be called concurrently from many goroutines. It does not block,
// does not allocate in steady state, and does not keep req, cands or
// explain. cands has at least one element (the caller answers "no healthy
// replica" itself). rng supplies every random choice, so a decision is
// reproducible from the seed; it must not be shared between concurrent
// calls. explain, when non-nil, is reset and filled with the per-candidate
// reasoning; pass nil on the hot path.
type Strategy interface {
	// Name is the strategy's name as the routing-strategy header spells it.
	Name() string
	// Pick chooses one of cands; see the interface documentation.
	Pick(req *Request, cands []Candidate, rng *Rand, explain *Explanation) Decision
}

// Strategy names, as the routing-strategy request header spells them.
const (
	NameRandom         = "random"
	NameLeastRequest   = "least-request"
	NamePrefixCache    = "prefix-cache"
	NameConsistentHash = "consistent-hash"
	NameCost           = "cost"
)

// Names lists every strategy name this package implements.
func Names() []string {
	return []string{NameRandom, NameLeastRequest, NamePrefixCache, NameConsistentHash, NameCost}
}

// ParseName checks that s names a strategy and returns it.
func ParseName(s string) (string, error) {
	for _, n := range Names() {
		if s == n {
			return n, nil
		}
	}
	return "", fmt.Errorf("%w: %q (want one of %v)", ErrUnknownStrategy, s, Names())
}

// Selection labels the branch of a strategy that made a decision; it is the
// `selection` label of kvmesh_route_decisions_total.
type Selection uint8

const (
	// SelectionNone is the zero value; no strategy returns it.
	SelectionNone Selection = iota
	// SelectionRandom: random picked uniformly.
	SelectionRandom
	// SelectionLeastRequest: least-request picked the fewest in-flight.
	SelectionLeastRequest
	// SelectionPrefixMatch: prefix-cache picked the best-matching replica
	// within the load bound (AIBrix "prefix_match").
	SelectionPrefixMatch
	// SelectionPrefixMatchSkipped: some replica matched, but every matching
	// replica was above mean + k·stddev, so least-request picked (AIBrix
	// "prefix_match_skipped").
	SelectionPrefixMatchSkipped
	// SelectionLeastRequestFallback: no (eligible) replica matched, so
	// least-request picked (AIBrix "least_request_fallback").
	SelectionLeastRequestFallback
	// SelectionHashAffinity: consistent-hash picked the key's own replica.
	SelectionHashAffinity
	// SelectionHashSpillover: the key's own replica was over the load bound
	// and consistent-hash walked the ring to the next one within it.
	SelectionHashSpillover
	// SelectionCostLocality: cost picked a replica holding the longest match
	// available (locality paid).
	SelectionCostLocality
	// SelectionCostSpread: cost picked a replica with a shorter match than
	// the best available, because queueing there would cost more than
	// recomputing elsewhere.
	SelectionCostSpread
	// SelectionCostCold: no candidate held any of the prompt; cost picked
	// the fastest estimated start.
	SelectionCostCold
	// SelectionCostHeld: cost would have recomputed the prompt elsewhere,
	// but estimated that recompute past the TTFT target where other
	// senders show only in the engines' scrapes, and kept the request
	// with the replicas holding the prefix (see Cost).
	SelectionCostHeld
	numSelections
)

var selectionNames = [numSelections]string{
	SelectionNone:                 "none",
	SelectionRandom:               "random",
	SelectionLeastRequest:         "least_request",
	SelectionPrefixMatch:          "prefix_match",
	SelectionPrefixMatchSkipped:   "prefix_match_skipped",
	SelectionLeastRequestFallback: "least_request_fallback",
	SelectionHashAffinity:         "hash_affinity",
	SelectionHashSpillover:        "hash_spillover",
	SelectionCostLocality:         "cost_locality",
	SelectionCostSpread:           "cost_spread",
	SelectionCostCold:             "cost_cold",
	SelectionCostHeld:             "cost_held",
}

// String returns the label value, e.g. "prefix_match".
func (s Selection) String() string {
	if s < numSelections {
		return selectionNames[s]
	}
	return "unknown"
}

// MarshalText makes a Selection marshal as its label in JSON.
func (s Selection) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// Selections lists every label a strategy can return, for pre-registering
// metric series.
func Selections() []Selection {
	out := make([]Selection, 0, numSelections-1)
	for s := SelectionRandom; s < numSelections; s++ {
		out = append(out, s)
	}
	return out
}
