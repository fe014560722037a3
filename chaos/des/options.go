package des

import (
	"fmt"
	"time"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node/tokenizer"
	"github.com/kvmesh/kvmesh/route"
)

// Options configure a World. Replicas, Gateways and Mode are taken from the
// study cell by Factory; everything else is fixed for a study.
type Options struct {
	// Replicas is the number of simulated engines, named A..Z, then R26,
	// R27, ... Factory takes it from the cell.
	Replicas int
	// Gateways is the number of gateways. Factory takes it from the cell.
	Gateways int
	// Mode is the gateways' index mode: history, kv-events or hybrid.
	// Factory takes it from the cell.
	Mode string

	// Profile names the engines' step-time profile (sim.LookupProfile).
	// Default l20-qwen27b-fp8, the study's.
	Profile string
	// Model is the served model name (part of every block key's root).
	Model string
	// EngineBlockSize is the engines' KV block size in tokens; with KV
	// events the gateways index at the same size. Default 16 (vLLM's).
	EngineBlockSize int
	// EngineTokens is each engine's KV pool in tokens (rounded down to whole
	// blocks). Default 200,000, as the live engine.
	EngineTokens int
	// MaxNumSeqs, MaxNumBatchedTokens and MaxModelLen are the engines'
	// vLLM limits. Defaults 8, 2048 and 32768 (sim.DefaultConfig).
	MaxNumSeqs          int
	MaxNumBatchedTokens int
	MaxModelLen         int
	// OffloadBlocks is each engine's CPU offload tier in blocks (0: none;
	// sim.EngineConfig.OffloadBlocks): GPU evictions go there, publish CPU
	// KV events and load at OffloadLoadTokensPerSecond (default 50,000,
	// the cost model's default CPU rate) instead of being recomputed.
	OffloadBlocks              int
	OffloadLoadTokensPerSecond float64
	// HybridSlidingWindow, when > 0, makes every engine a hybrid-attention
	// model (sim.EngineConfig.SlidingWindow): a full-attention group and a
	// sliding-window group of this many tokens, each with its own pool
	// (HybridWindowTokens tokens, 0: EngineTokens), evicting
	// independently and publishing group_idx; hits follow vLLM's hybrid
	// rule. Not with OffloadBlocks.
	HybridSlidingWindow int
	HybridWindowTokens  int
	// Tokenizer is the engines' tokenizer: "tiktoken" (default, cl100k, the
	// seed's ~5K-token prompts) or "bytes". Gateways with KV events use
	// the same one (node's character tokenizer for "bytes"); in history
	// mode they use character keys, as node does.
	Tokenizer string

	// SyncDelay is how long a gateway's routing decision (history or
	// speculative record) takes to reach its peers' indexes. Default 5 ms:
	// the replication flush interval (2 ms) plus a LAN hop.
	SyncDelay time.Duration
	// LoadDelay is how stale a gateway's view of its peers' in-flight counts
	// is. Default 25 ms, the replication load interval.
	LoadDelay time.Duration
	// KVDelay is how long an engine's KV events take to reach the gateways'
	// indexes. Default 1 ms (ZMQ on a LAN).
	KVDelay time.Duration
	// NoSync isolates the gateways: no decision deltas and no peer load.
	NoSync bool

	// ScrapeInterval is how often a gateway scrapes each engine's
	// running/waiting/KV usage. Default 500 ms, node's default. Gateway g
	// scrapes at phase g·ScrapeInterval/Gateways.
	ScrapeInterval time.Duration
	// SharedScrapeInterval is node's Config.SharedScrapeInterval: isolated
	// gateways (NoSync) scrape every engine this often while a scrape
	// within the last 100 such intervals showed an engine running requests
	// beyond their own (the other gateways'). Default 100 ms, node's
	// default; 0, or not below ScrapeInterval, keeps ScrapeInterval.
	SharedScrapeInterval time.Duration
	// ExpireInterval is how often a gateway runs index.Expire (bounded to
	// ExpireNodes blocks a call). Default 60 s and 16,384: expiry only
	// bounds memory (Match ignores expired entries), and node's 1 s period
	// would dominate a long simulation.
	ExpireInterval time.Duration
	ExpireNodes    int
	// HistoryTTL, SpeculativeTTL and IndexCapacity are the gateways' index
	// settings. Defaults: node's (2 h, 10 s, 1<<20 entries).
	HistoryTTL     time.Duration
	SpeculativeTTL time.Duration
	IndexCapacity  int
	// Route is every gateway's strategy configuration. Default
	// route.DefaultConfig(), as node, with cost's TTFT target set to the
	// study's SLO (study.DefaultSLO: 2 s), as an operator states the SLO
	// the deployment serves (route.CostConfig.TTFTTargetSeconds).
	Route route.Config

	// QueuedUntilFirstToken releases a request's queued prefill tokens
	// (route.Candidate.QueuedPrefillTokens) at its first token, as node's
	// proxy does (at the first body byte). Default true: mirror node.
	// False holds them until the stream ends, which overstates a busy
	// replica's queue and is kept only to study that effect.
	QueuedUntilFirstToken bool

	// Seed seeds every random choice of the engine (routing tie-breaks,
	// engine and index hash seeds). The study's own seed drives the
	// workload.
	Seed uint64

	// substitute routes a request that names strategy k with
	// substitute[k] instead (its phases keep k's name): a strategy under
	// study that route does not have. Tests only.
	substitute map[string]route.Strategy
}

// DefaultOptions returns two replicas behind one gateway in history mode on
// the L20 profile, with the propagation delays documented on Options.
func DefaultOptions() Options {
	rcfg := route.DefaultConfig()
	rcfg.Cost.TTFTTargetSeconds = study.DefaultSLO().TTFT.Seconds()
	return Options{
		Replicas:             2,
		Gateways:             1,
		Mode:                 "history",
		Profile:              sim.ProfileL20Qwen27BFP8.Name,
		Model:                "qwen38-27b-fp8",
		EngineBlockSize:      16,
		EngineTokens:         200_000,
		MaxNumSeqs:           8,
		MaxNumBatchedTokens:  2048,
		MaxModelLen:          32768,
		Tokenizer:            tokenizer.NameTiktoken,
		SyncDelay:            5 * time.Millisecond,
		LoadDelay:            25 * time.Millisecond,
		KVDelay:              time.Millisecond,
		ScrapeInterval:       500 * time.Millisecond,
		SharedScrapeInterval: 100 * time.Millisecond,
		ExpireInterval:       time.Minute,
		ExpireNodes:          1 << 14,
		HistoryTTL:           2 * time.Hour,
		SpeculativeTTL:       10 * time.Second,
		IndexCapacity:        1 << 20,
		Route:                rcfg,
		// node releases queued prefill at the first body byte.
		QueuedUntilFirstToken: true,
		Seed:                  1,
	}
}

// Validate reports the first problem with o.
func (o *Options) Validate() error {
	bad := func(f string, a ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidOptions, fmt.Sprintf(f, a...))
	}
	switch {
	case o.Replicas < 1 || o.Replicas > 64*1024:
		return bad("replicas %d not in 1..65536", o.Replicas)
	case o.Gateways < 1:
		return bad("gateways %d < 1", o.Gateways)
	case o.Model == "":
		return bad("no model name")
	case o.EngineBlockSize < 1 || o.EngineBlockSize > index.MaxBlockTokens && IndexBlockTokens(o.EngineBlockSize) < 8:
		return bad("engine block size %d: < 1, or above %d without a divisor of 8..%d for the index", o.EngineBlockSize, index.MaxBlockTokens, index.MaxBlockTokens)
	case o.HybridSlidingWindow < 0 || o.HybridSlidingWindow == 1 || o.HybridWindowTokens < 0 ||
		o.HybridWindowTokens > 0 && o.HybridWindowTokens < o.EngineBlockSize || o.HybridSlidingWindow > 0 && o.OffloadBlocks > 0:
		return bad("hybrid sliding window %d tokens in %d tokens (> 1, and not with an offload tier)", o.HybridSlidingWindow, o.HybridWindowTokens)
	case o.EngineTokens < o.EngineBlockSize:
		return bad("engine tokens %d < block size", o.EngineTokens)
	case o.MaxNumSeqs < 1 || o.MaxNumBatchedTokens < 1 || o.MaxModelLen < 1:
		return bad("engine limits must be >= 1")
	case o.OffloadBlocks < 0 || o.OffloadLoadTokensPerSecond < 0:
		return bad("offload blocks %d and rate %v must be >= 0", o.OffloadBlocks, o.OffloadLoadTokensPerSecond)
	case o.Tokenizer != tokenizer.NameTiktoken && o.Tokenizer != tokenizer.NameBytes:
		return bad("tokenizer %q (want tiktoken or bytes)", o.Tokenizer)
	case o.SyncDelay < 0 || o.LoadDelay < 0 || o.KVDelay < 0:
		return bad("delays must be >= 0")
	case o.ScrapeInterval <= 0 || o.SharedScrapeInterval < 0:
		return bad("scrape interval must be > 0, shared scrape interval >= 0")
	case o.ExpireInterval <= 0 || o.ExpireNodes < 1:
		return bad("expire interval and nodes must be > 0")
	case o.HistoryTTL <= 0 || o.SpeculativeTTL <= 0 || o.IndexCapacity < 1:
		return bad("index TTLs and capacity must be > 0")
	}
	switch o.Mode {
	case "history", "kv-events", "hybrid":
	default:
		return bad("mode %q", o.Mode)
	}
	if _, err := sim.LookupProfile(o.Profile); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidOptions, err)
	}
	if err := o.Route.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidOptions, err)
	}
	return nil
}

// IndexBlockTokens is the gateways' index block for engines of
// engineBlock tokens under KV events: the engine's block, or, above
// index.MaxBlockTokens (the seed's hybrid model caches 1568-token blocks),
// its largest divisor the index takes, so that each engine block stands
// for a whole number of index blocks (index.StoredBlocks).
func IndexBlockTokens(engineBlock int) int {
	if engineBlock <= index.MaxBlockTokens {
		return engineBlock
	}
	for d := index.MaxBlockTokens; d > 1; d-- {
		if engineBlock%d == 0 {
			return d
		}
	}
	return 1
}

// events reports whether the engines publish KV events and the gateways
// consume them (every mode but history, as in the live engine).
func (o *Options) events() bool { return o.Mode != "history" }

// scrapeTick is how often a gateway's scrape event fires: the shared
// scrape interval where it applies (isolated gateways, see
// SharedScrapeInterval), else ScrapeInterval. Each firing scrapes the
// engines that are due (gateway.scrape).
func (o *Options) scrapeTick() time.Duration {
	if o.sharedScrapes() {
		return o.SharedScrapeInterval
	}
	return o.ScrapeInterval
}

// sharedScrapes reports whether gateways scrape the engines other senders
// share at SharedScrapeInterval: isolated gateways (no peer reports
// their load) with a shared interval below ScrapeInterval, as node does.
func (o *Options) sharedScrapes() bool {
	return o.NoSync && o.SharedScrapeInterval > 0 && o.SharedScrapeInterval < o.ScrapeInterval
}
