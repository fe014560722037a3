package route

import (
	"math"

	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/index"
)

// Block sizes a gateway keys prompts with when none is configured.
const (
	// CharacterBlockTokens is the block size with character keys (one
	// "token" per prompt byte): AIBrix's chunk size.
	CharacterBlockTokens = 128
	// TokenBlockTokens is the block size with token keys: vLLM's default
	// KV block size, which a KV-event match needs the index to share.
	TokenBlockTokens = 16
)

// DefaultBlockTokens is the block size a gateway keys with when none is
// configured: CharacterBlockTokens with character keys, else
// TokenBlockTokens.
func DefaultBlockTokens(charKeys bool) int {
	if charKeys {
		return CharacterBlockTokens
	}
	return TokenBlockTokens
}

// affinityBlocks is how many leading blocks pick consistent-hash's key
// when the client gives no session id.
const affinityBlocks = 4

// SessionKey is consistent-hash's key (Request.SessionKey): a hash of the
// client's session id when given (the x-session-id header or the "user"
// field), else the key of the prompt's fourth block (so same-prefix
// prompts share a replica) or its last when shorter, else root.
func SessionKey(session string, root index.BlockKey, keys []index.BlockKey) uint64 {
	if session != "" {
		return xxh3.HashString(session)
	}
	return affinityKey(root, keys)
}

// affinityKey is consistent-hash's key without a session: the key of the
// prompt's fourth block, or its last when shorter, else root.
func affinityKey(root index.BlockKey, keys []index.BlockKey) uint64 {
	switch {
	case len(keys) >= affinityBlocks:
		return uint64(keys[affinityBlocks-1])
	case len(keys) > 0:
		return uint64(keys[len(keys)-1])
	}
	return uint64(root)
}

// NewRequest is the Request for a prompt keyed as keys (under root, with
// blockTokens tokens a block) that is promptTokens long in the keys' unit
// and asks for maxTokens (0: not given), from client session session ("":
// none). Now is left for the caller to set per attempt.
func NewRequest(keys []index.BlockKey, root index.BlockKey, blockTokens, promptTokens, maxTokens int, session string) Request {
	return Request{
		TotalBlocks:  len(keys),
		BlockTokens:  blockTokens,
		PromptTokens: promptTokens,
		MaxTokens:    maxTokens,
		SessionKey:   SessionKey(session, root, keys),
		Prefixes:     NewPrefixes(keys),
	}
}

// IndexView is the prefix index as the routing core reads it:
// index.Index's Match (see there). It may be called concurrently.
type IndexView interface {
	Match(keys []index.BlockKey, candidates []index.ReplicaID, mode index.Mode, now int64, out []int32) int
}

var _ IndexView = (*index.Index)(nil)

// TierIndexView is an IndexView that also reports the offload-tier run
// after each candidate's GPU match: index.Index's MatchTiers (see there).
type TierIndexView interface {
	IndexView
	MatchTiers(keys []index.BlockKey, candidates []index.ReplicaID, mode index.Mode, now int64, gpu, cpu, disk []int32) int
}

var _ TierIndexView = (*index.Index)(nil)

// TierPricer is a Strategy that prices blocks held in an engine's offload
// tiers (Candidate.OffloadCPU, OffloadDisk). Route asks the index for
// tiers (TierIndexView) only when the strategy is one and PricesTiers
// reports true: the others pay for the GPU match alone.
type TierPricer interface {
	PricesTiers() bool
}

// LoadView is a gateway's view of the replicas it routes among, by their
// position in Input.Replicas: the node implements it over its replicas'
// atomics and its peers' reports, the discrete-event simulator over its
// arrays. Its methods are called from Route only, do not block and keep
// nothing; the view must not change Input.Replicas during the call.
type LoadView interface {
	// Candidate fills c's Name and load fields (InFlight, LocalInFlight,
	// Running, Waiting, KVUsage, QueuedPrefillTokens,
	// PeerQueuedPrefillTokens) for the replica at position i; Route sets
	// ID, Matched and EventsFed.
	Candidate(i int, c *Candidate)
	// PublishesKVEvents reports whether the replica at position i
	// publishes KV events (the ledger a decision is recorded in depends on
	// it in hybrid mode, and so does Candidate.EventsFed).
	PublishesKVEvents(i int) bool
}

// Input is one routing call's arguments.
type Input struct {
	// Keys are the prompt's block keys (Request.TotalBlocks of them).
	Keys []index.BlockKey
	// Replicas are the replicas to choose among (at least one), in the
	// LoadView's order.
	Replicas []index.ReplicaID
	// Index answers how much of Keys each replica holds, in Mode.
	Index IndexView
	Mode  index.Mode
	// Load is the load view of Replicas.
	Load LoadView
	// Strategy picks; Rand supplies its random choices; Explain, when
	// non-nil, receives its reasoning (see Strategy).
	Strategy Strategy
	Rand     *Rand
	Explain  *Explanation
	// Request is what the strategy knows of the request, Now set.
	Request *Request
}

// Routed is a routing call's outcome.
type Routed struct {
	// Decision is the strategy's; Decision.Index is a position in
	// Input.Replicas.
	Decision Decision
	// Matched is the number of leading blocks the picked replica is
	// believed to hold, and Uncached the prompt work it still has to
	// prefill (Request.UncachedTokens, in the keys' units: what the caller
	// adds to the replica's queued prefill), less the blocks it loads from
	// an offload tier when the strategy priced them (TierPricer).
	Matched, Uncached int
	// Ledger is where the caller records the decision once the replica
	// accepted the request (see LedgerFor).
	Ledger index.Ledger
	// Observation is what the cost model learns from this request, to be
	// completed with Stream when its stream ends (and passed to
	// Model.Observe): the uncached work in engine tokens
	// (Request.UnitsPerToken) and the queue the strategy estimated, if it
	// estimated one (cost does).
	Observation Observation
	// Candidates is the number of replicas chosen among.
	Candidates int
}

// LedgerFor is the ledger a routing decision to a replica is recorded
// in: speculative where the replica's KV events will confirm or refute it
// (kv-events mode, or hybrid mode and a replica that publishes them),
// history otherwise.
func LedgerFor(mode index.Mode, publishesKVEvents bool) index.Ledger {
	switch {
	case mode == index.ModeKVEvents, mode == index.ModeHybrid && publishesKVEvents:
		return index.Speculative
	}
	return index.History
}

// Scratch holds a routing call's buffers, reused from call to call so that
// Route allocates nothing in steady state. It must not be used by two
// calls at once.
type Scratch struct {
	matched, cpu, disk []int32
	cands              []Candidate
}

// grow returns b with length n, reusing its array when large enough.
func grow(b []int32, n int) []int32 {
	if cap(b) < n {
		return make([]int32, n)
	}
	return b[:n]
}

// Route is the gateway's routing step, shared by node and the
// discrete-event simulator: it matches in.Keys against in.Replicas in the
// index, builds one Candidate per replica from the match and the load
// view, lets the strategy pick, and returns the decision with what the
// caller does next (record in Routed.Ledger, learn from
// Routed.Observation). It does no I/O, starts no goroutines, reads no
// clock and allocates nothing once s has grown to the replica count.
func (s *Scratch) Route(in *Input) Routed {
	n := len(in.Replicas)
	s.matched = grow(s.matched, n)
	tiers := false
	if tp, ok := in.Strategy.(TierPricer); ok && tp.PricesTiers() {
		if tv, ok := in.Index.(TierIndexView); ok {
			tiers = true
			s.cpu, s.disk = grow(s.cpu, n), grow(s.disk, n)
			tv.MatchTiers(in.Keys, in.Replicas, in.Mode, in.Request.Now, s.matched, s.cpu, s.disk)
		}
	}
	if !tiers {
		in.Index.Match(in.Keys, in.Replicas, in.Mode, in.Request.Now, s.matched)
	}
	s.cands = s.cands[:0]
	best := 0 // the longest match: the share of what is cached is read where the cache ends
	for i, id := range in.Replicas {
		c := Candidate{ID: id, Matched: int(s.matched[i]),
			EventsFed: LedgerFor(in.Mode, in.Load.PublishesKVEvents(i)) == index.Speculative}
		if tiers {
			c.OffloadCPU, c.OffloadDisk = int(s.cpu[i]), int(s.disk[i])
		}
		best = max(best, c.Matched)
		s.cands = append(s.cands, c)
		in.Load.Candidate(i, &s.cands[i])
	}
	in.Request.Prefixes.AddMatch(best, in.Keys)
	d := in.Strategy.Pick(in.Request, s.cands, in.Rand, in.Explain)
	picked := &s.cands[d.Index]
	matched := picked.Matched
	uncached := in.Request.UncachedTokens(matched) - in.Request.offloadedTokens(picked)
	units := 0
	if in.Request.unitsKeyed() {
		units = in.Request.PromptTokens
	}
	return Routed{
		Decision: d,
		Matched:  matched,
		Uncached: uncached,
		Ledger:   LedgerFor(in.Mode, in.Load.PublishesKVEvents(d.Index)),
		Observation: Observation{
			UncachedTokens: int(math.Round(in.Request.tokens(uncached))),
			QueueSeconds:   d.EstimatedQueue,
			QueueEstimated: d.EstimatedTTFT > 0,
			PromptUnits:    units,
		},
		Candidates: n,
	}
}

// Stream completes o with what the request's stream showed: ttft
// seconds from dispatch to the first token, out tokens generated (0 if
// unknown) over events content events (one token each, or an engine's
// stream interval), the last of which came span seconds after the first.
// The span covers every token but those of the first event: with tokens
// spread evenly, out·(events−1)/events of them, which gives TPOT.
func (o Observation) Stream(ttft float64, out, events int, span float64) Observation {
	o.TTFT = ttft
	if out > 0 && events > 0 {
		o.OutputTokens = out
	}
	if events > 1 && out > 1 {
		inSpan := float64(out) * float64(events-1) / float64(events)
		o.TPOT = span / inSpan
	}
	return o
}

// Engine returns o with UncachedTokens the engine's own figure when its
// usage reports one (prompt − cached tokens: vLLM's usage.prompt_tokens
// and prompt_tokens_details.cached_tokens, the latter with
// --enable-prompt-tokens-details): the prefill it actually ran, where the
// routing-time estimate is only what the index believed. A history index
// does not know what other senders left in the engine's cache; learning
// prefill speed from its estimate would take a prompt the engine found
// cached for a fast recompute. ok false (no usage, or figures that do
// not fit) leaves o as it is.
func (o Observation) Engine(prompt, cached int, ok bool) Observation {
	if ok && prompt > 0 && cached >= 0 && cached <= prompt {
		o.UncachedTokens = prompt - cached
	}
	return o
}

// Prompt returns o with PromptTokens the engine's count of the prompt
// (usage.prompt_tokens; 0: none reported), which with PromptUnits teaches
// the model the prompts' characters per token (Model.UnitsPerToken). It
// needs no cached-token figure, unlike Engine.
func (o Observation) Prompt(tokens int) Observation {
	o.PromptTokens = max(tokens, 0)
	return o
}

// Candidates returns the candidates the last Route call built (the
// strategy's view), valid until the next call.
func (s *Scratch) Candidates() []Candidate { return s.cands }
