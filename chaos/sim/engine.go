package sim

import (
	"fmt"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/kvevents"
)

// RequestID names one request inside an Engine.
type RequestID string

// FinishReason is vLLM's finish_reason.
type FinishReason string

// FinishLength is the only reason the simulator finishes a request: it
// always generates exactly max_tokens.
const FinishLength FinishReason = "length"

// EngineConfig configures the pure engine model.
type EngineConfig struct {
	// MaxModelLen bounds prompt plus generated tokens (vLLM --max-model-len).
	MaxModelLen int
	// MaxNumSeqs bounds the running batch (vLLM --max-num-seqs).
	MaxNumSeqs int
	// MaxNumBatchedTokens is the per-step token budget; prefills longer than
	// it are chunked (vLLM --max-num-batched-tokens).
	MaxNumBatchedTokens int
	// BlockSize is the number of tokens per KV block (vLLM --block-size).
	BlockSize int
	// NumBlocks is the KV pool capacity in blocks
	// (vLLM --num-gpu-blocks-override).
	NumBlocks int
	// Profile is the step-time model.
	Profile Profile
	// HashSeed seeds the engine block hash. Server picks a random one.
	HashSeed uint64
	// EmitEvents makes Step and ResetPrefixCache return KV events.
	EmitEvents bool
	// OffloadBlocks is the capacity of a CPU offload tier in blocks (vLLM
	// CPU offloading, LMCache): blocks the GPU pool evicts go there, and a
	// prompt that continues past its GPU hit with offloaded blocks loads
	// them instead of recomputing them. 0: no tier.
	OffloadBlocks int
	// OffloadLoadTokensPerSecond is how fast offloaded blocks load (their
	// tokens per second of step time). Must be > 0 with OffloadBlocks.
	OffloadLoadTokensPerSecond float64
	// SlidingWindow, when > 0, makes the engine a hybrid-attention model
	// (see hybridEngine in engine_hybrid.go): KV-cache group 0 is full
	// attention in the pool of NumBlocks blocks, group 1 a sliding window
	// of SlidingWindow tokens in a pool of its own that caches and evicts
	// independently, and the prefix hit follows vLLM's hybrid rule. It
	// must be > 1, and the offload tier is not modelled with it.
	SlidingWindow int
	// SlidingWindowBlocks is the window group's pool in blocks (0: as
	// many as NumBlocks).
	SlidingWindowBlocks int
}

// DefaultEngineConfig is the engine of DefaultConfig: the seed's replica
// (l20-qwen27b-fp8, max-num-seqs 8, 32K context, 12,500 blocks of 16) with
// a fixed hash seed and events on.
func DefaultEngineConfig() EngineConfig {
	c := DefaultConfig().engineConfig()
	c.HashSeed = 1
	c.EmitEvents = true
	return c
}

// Validate checks every field.
func (c EngineConfig) Validate() error {
	switch {
	case c.MaxModelLen < 1:
		return fmt.Errorf("%w: max model len %d < 1", ErrInvalidConfig, c.MaxModelLen)
	case c.MaxNumSeqs < 1:
		return fmt.Errorf("%w: max num seqs %d < 1", ErrInvalidConfig, c.MaxNumSeqs)
	case c.MaxNumBatchedTokens < 1:
		return fmt.Errorf("%w: max num batched tokens %d < 1", ErrInvalidConfig, c.MaxNumBatchedTokens)
	case c.BlockSize < 1:
		return fmt.Errorf("%w: block size %d < 1", ErrInvalidConfig, c.BlockSize)
	case c.NumBlocks < 1:
		return fmt.Errorf("%w: num blocks %d < 1", ErrInvalidConfig, c.NumBlocks)
	case c.OffloadBlocks < 0 || c.OffloadBlocks > 0 && !(c.OffloadLoadTokensPerSecond > 0):
		return fmt.Errorf("%w: offload %d blocks at %v tokens/s", ErrInvalidConfig, c.OffloadBlocks, c.OffloadLoadTokensPerSecond)
	case c.SlidingWindow < 0 || c.SlidingWindow == 1 || c.SlidingWindowBlocks < 0:
		return fmt.Errorf("%w: sliding window of %d tokens in %d blocks", ErrInvalidConfig, c.SlidingWindow, c.SlidingWindowBlocks)
	case c.SlidingWindow > 0 && c.OffloadBlocks > 0:
		return fmt.Errorf("%w: a sliding-window group with an offload tier is not modelled", ErrInvalidConfig)
	}
	return c.Profile.Validate()
}

// Request is one generation request handed to Engine.Add.
type Request struct {
	ID RequestID
	// Prompt is the prompt's token IDs; Add copies them, so the caller may
	// reuse the slice.
	Prompt []uint32
	// MaxTokens is the exact number of tokens to generate.
	MaxTokens int
}

// Output is one generated token.
type Output struct {
	ID RequestID
	// Index is the token's position in the output, from 0.
	Index int
	Token uint32
	// TTFT is set on the first token (Index 0): model time from Add to the
	// end of the step that produced it.
	TTFT time.Duration
}

// Finished describes a request that completed in a step.
type Finished struct {
	ID           RequestID
	Reason       FinishReason
	PromptTokens int
	OutputTokens int
	// CachedTokens is the prefix-cache hit of the request's first
	// admission, what vLLM reports as prompt_tokens_details.cached_tokens.
	CachedTokens int
	// E2E is model time from Add to the end of the final step.
	E2E time.Duration
}

// Scheduled is what one step computed for one request.
type Scheduled struct {
	ID RequestID
	// NumTokens is the number of tokens computed (1 for a decode).
	NumTokens int
	// Decode is true for a one-token decode, false for (a chunk of) prefill.
	Decode bool
}

// StepResult is what one step did. Its outputs and events take effect at
// Start+Duration.
//
// The Scheduled, Outputs, Finished and Preempted slices are buffers owned
// by the engine and reused: they are valid until the next Step on the same
// engine; copy what must outlive it. Events is allocated for each step and
// may be kept (publishers and event queues hold it).
type StepResult struct {
	Start    time.Time
	Duration time.Duration
	// Scheduled lists the requests computed in this step, running first.
	Scheduled []Scheduled
	// PrefillTokens and DecodeSeqs are the inputs of the step-time model.
	PrefillTokens int
	DecodeSeqs    int
	Outputs       []Output
	Finished      []Finished
	// Preempted lists running requests sent back to the waiting queue.
	Preempted []RequestID
	// Events are the KV events of the step, in order.
	Events []kvevents.Event
}

// Idle reports whether the step computed nothing.
func (r StepResult) Idle() bool { return len(r.Scheduled) == 0 }

// End is when the step's results take effect.
func (r StepResult) End() time.Time { return r.Start.Add(r.Duration) }

// Stats is a snapshot of the engine's gauges and counters.
type Stats struct {
	// Running and Waiting are vLLM's num_requests_running and
	// num_requests_waiting. vLLM takes them from the scheduler's stats
	// after each step (Scheduler.make_stats), so a request that arrived
	// since the last step is in neither until a step has seen it: waiting
	// counts only the requests a schedule left waiting (no slot, no KV
	// blocks, no token budget). Engine.Stats gives them after the last
	// Step, which computes a step whole; Server.Stats once that step's
	// time has passed, as vLLM shows them while the next step runs.
	Running, Waiting int
	// Queued counts the requests held that no step has seen yet: added
	// to the engine since its last step, and for a Server also submitted
	// and not yet handed to it, or handed to it for the step still
	// running. They wait all the same, but vLLM's gauges do not show them
	// yet.
	Queued int
	// KVUsage is the fraction of blocks referenced by a request (of a
	// hybrid engine: in its fuller group).
	KVUsage float64
	// CachedBlocks is the number of blocks holding a cached hash.
	CachedBlocks int
	// PrefixQueries and PrefixHits count tokens, as vLLM's
	// prefix_cache_queries/hits.
	PrefixQueries, PrefixHits uint64
	PromptTokens              uint64
	GenerationTokens          uint64
	// OffloadLoadedTokens counts prompt tokens loaded from the offload
	// tier instead of computed.
	OffloadLoadedTokens uint64
	Preemptions         uint64
	Finished            map[FinishReason]uint64

	// The Driver fields describe a Server's real-time driver and are zero
	// from Engine.Stats. A step's outputs are due at the wall time of its
	// model end; its lag is how much later (wall time, >= 0) they were
	// released because the host ran the driver late. Lag never stretches
	// model time (the driver catches up), but clients see late tokens, so
	// a phase whose lag is a sizeable part of the step time (model step /
	// Speed) measured the host, not the model. Diff DriverSteps and
	// DriverLagSum over a phase for its mean lag.
	DriverSteps uint64
	// DriverLag is the last step's lag.
	DriverLag time.Duration
	// DriverLagMax is the largest lag since Start.
	DriverLagMax time.Duration
	// DriverLagSum is the sum of every step's lag since Start.
	DriverLagSum time.Duration
}

// CachedBlock is one block the engine can currently reuse: what a consumer
// of the engine's KV events should hold.
type CachedBlock struct {
	Hash      kvevents.EngineHash
	Parent    kvevents.EngineHash
	HasParent bool
	// Tokens are the block's own BlockSize tokens.
	Tokens []uint32
	// Prefix is the token chain from the first token of the sequence that
	// cached the block through the block's last token (what a consumer
	// hashes to derive its own key for the block). It is shared: do not
	// modify it.
	Prefix []uint32
	// InUse is true while a request references the block.
	InUse bool
}

type seqState uint8

const (
	stateWaiting seqState = iota + 1
	stateRunning
)

type seq struct {
	id          RequestID
	tokens      []uint32 // prompt then outputs
	promptLen   int
	maxTokens   int
	outputs     int
	numComputed int
	blocks      []*block
	// wblocks are the window group's blocks of a hybrid engine, index by
	// index beside blocks; nil entries are vLLM's null blocks (before the
	// window, never allocated or already freed).
	wblocks []*block
	// hashes[i] is the chained hash of full block i of tokens.
	hashes []kvevents.EngineHash
	// numCachedBlocks is how many leading blocks were offered to the cache.
	numCachedBlocks int
	cachedTokens    int
	admitted        bool
	arrival         time.Time
	state           seqState
}

// Engine is the pure engine model. It is not safe for concurrent use: the
// caller serialises Add, Abort, Step and the readers.
type Engine struct {
	cfg  EngineConfig
	pool *blockPool
	// wpool is a hybrid engine's sliding-window group (nil otherwise).
	wpool   *blockPool
	waiting []*seq
	running []*seq
	// arrived is how many requests at the back of waiting were added
	// since the last Step: no schedule has seen them yet, so the waiting
	// gauge leaves them out (see Stats).
	arrived int
	byID    map[RequestID]*seq
	stats   Stats

	// Step's reused buffers (see StepResult).
	sched     []schedEntry
	scheduled []Scheduled
	outputs   []Output
	finished  []Finished
	preempted []RequestID
	// cacheBlocks' reused buffers.
	cacheHashes   []kvevents.EngineHash
	cachePrefixes [][]uint32

	// head memoizes the prefix lookup of the waiting queue's head, which a
	// step repeats while the head cannot be admitted: headHit are the
	// blocks cached for its leading hashes as of headEvictions (the pool's
	// eviction count). Cached entries only disappear by eviction, so while
	// that count is unchanged they still hit and the lookup resumes after
	// them; a hash that missed may have been cached since and is looked up
	// again.
	head          *seq
	headHit       []*block
	headEvictions uint64
	// whit is hybridHit's reused buffer.
	whit []*block
}

// NewEngine returns an idle engine with an empty cache.
func NewEngine(cfg EngineConfig) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	e := &Engine{
		cfg:   cfg,
		pool:  newBlockPool(cfg.NumBlocks, cfg.BlockSize, cfg.HashSeed, cfg.EmitEvents),
		byID:  make(map[RequestID]*seq),
		stats: Stats{Finished: make(map[FinishReason]uint64)},
	}
	if cfg.OffloadBlocks > 0 {
		e.pool.offload = newOffloadStore(cfg.OffloadBlocks)
	}
	if cfg.SlidingWindow > 0 {
		n := cfg.SlidingWindowBlocks
		if n == 0 {
			n = cfg.NumBlocks
		}
		e.wpool = newBlockPool(n, cfg.BlockSize, cfg.HashSeed, cfg.EmitEvents)
	}
	return e, nil
}

// Config returns the engine's configuration.
func (e *Engine) Config() EngineConfig { return e.cfg }

// Check validates a request's size against the model and the pool without
// adding it.
func (e *Engine) Check(promptLen, maxTokens int) error {
	if promptLen < 1 {
		return fmt.Errorf("%w: empty prompt", ErrBadRequest)
	}
	if maxTokens < 1 {
		return fmt.Errorf("%w: max_tokens must be at least 1, got %d", ErrBadRequest, maxTokens)
	}
	if promptLen+maxTokens > e.cfg.MaxModelLen {
		return fmt.Errorf("%w: this model's maximum context length is %d tokens, however you requested %d tokens (%d in the prompt, %d in the completion)",
			ErrPromptTooLong, e.cfg.MaxModelLen, promptLen+maxTokens, promptLen, maxTokens)
	}
	if need := (promptLen + maxTokens + e.cfg.BlockSize - 1) / e.cfg.BlockSize; need > e.cfg.NumBlocks ||
		e.wpool != nil && need > len(e.wpool.blocks) {
		return fmt.Errorf("%w: needs %d blocks, the pool has %d", ErrRequestTooLarge, need, e.cfg.NumBlocks)
	}
	return nil
}

// Add queues a request at the back of the waiting queue. now is its arrival.
func (e *Engine) Add(r Request, now time.Time) error {
	if err := e.Check(len(r.Prompt), r.MaxTokens); err != nil {
		return err
	}
	if _, dup := e.byID[r.ID]; dup {
		return fmt.Errorf("%w: duplicate request id %q", ErrBadRequest, r.ID)
	}
	s := &seq{
		id:        r.ID,
		tokens:    append(make([]uint32, 0, len(r.Prompt)+r.MaxTokens), r.Prompt...),
		hashes:    make([]kvevents.EngineHash, 0, (len(r.Prompt)+r.MaxTokens)/e.cfg.BlockSize),
		promptLen: len(r.Prompt),
		maxTokens: r.MaxTokens,
		arrival:   now,
		state:     stateWaiting,
	}
	e.byID[r.ID] = s
	e.waiting = append(e.waiting, s)
	e.arrived++
	return nil
}

// Abort removes a waiting or running request and frees its blocks (they stay
// cached). It reports whether the request was known.
func (e *Engine) Abort(id RequestID) bool {
	s, ok := e.byID[id]
	if !ok {
		return false
	}
	delete(e.byID, id)
	if e.head == s {
		e.head = nil
	}
	switch s.state {
	case stateWaiting:
		if i := slices.Index(e.waiting, s); i >= len(e.waiting)-e.arrived {
			e.arrived--
		}
		e.waiting = removeSeq(e.waiting, s)
	case stateRunning:
		e.running = removeSeq(e.running, s)
	}
	e.pool.free(s.blocks)
	s.blocks = nil
	e.freeWindow(s)
	return true
}

func removeSeq(q []*seq, s *seq) []*seq {
	for i, x := range q {
		if x == s {
			return append(q[:i], q[i+1:]...)
		}
	}
	return q
}

// ResetPrefixCache drops every cached block hash, like vLLM's
// /reset_prefix_cache. It refuses (false) while any request holds blocks.
// On success the returned events hold one AllBlocksCleared (if events are on).
func (e *Engine) ResetPrefixCache() (bool, []kvevents.Event) {
	if e.wpool != nil {
		if e.pool.numUsed() != 0 || e.wpool.numUsed() != 0 {
			return false, e.takeEvents()
		}
		e.wpool.reset()
		e.wpool.takeEvents() // one AllBlocksCleared covers both groups
	}
	ok := e.pool.reset()
	return ok, e.pool.takeEvents()
}

// Stats returns the gauges and counters after the last step.
func (e *Engine) Stats() Stats {
	s := e.stats
	s.Finished = make(map[FinishReason]uint64, len(e.stats.Finished))
	for k, v := range e.stats.Finished {
		s.Finished[k] = v
	}
	s.Running, s.Waiting, s.Queued = len(e.running), e.waitingGauge(), e.arrived
	s.KVUsage = e.usage()
	s.CachedBlocks = len(e.pool.cache)
	return s
}

// Gauges are the load gauges a scrape reads: Stats' Running, Waiting and
// KVUsage.
type Gauges struct {
	Running, Waiting int
	KVUsage          float64
}

// Gauges returns the engine's load gauges after its last step, without
// copying the counters. A driver that models the step's duration shows
// them once the step has ended (see Server.Stats).
func (e *Engine) Gauges() Gauges {
	return Gauges{Running: len(e.running), Waiting: e.waitingGauge(), KVUsage: e.usage()}
}

// waitingGauge is num_requests_waiting: the waiting requests a step has
// seen (see Stats).
func (e *Engine) waitingGauge() int { return len(e.waiting) - e.arrived }

// usage is the fraction of blocks referenced by requests: of a hybrid
// engine, in whichever group's pool is fuller (the one that limits
// admission).
func (e *Engine) usage() float64 {
	if e.wpool == nil {
		return e.pool.usage()
	}
	return max(e.pool.usage(), e.wpool.usage())
}

// CachedBlocks returns every block whose hash is cached, in block-id order.
// The token slices alias the engine's immutable token arrays.
func (e *Engine) CachedBlocks() []CachedBlock { return e.pool.cachedBlocks() }

// cachedBlocks lists the pool's cached blocks in block-id order.
func (p *blockPool) cachedBlocks() []CachedBlock {
	out := make([]CachedBlock, 0, len(p.cache))
	for i := range p.blocks {
		b := &p.blocks[i]
		if !b.cached {
			continue
		}
		out = append(out, CachedBlock{
			Hash: b.hash, Parent: b.parent, HasParent: b.hasParent,
			Tokens: b.prefix[len(b.prefix)-p.blockSize:], Prefix: b.prefix, InUse: b.refCnt > 0,
		})
	}
	return out
}

// HashTokens returns the engine's chained hashes of the full blocks of
// tokens, what the engine would report for them.
func (e *Engine) HashTokens(tokens []uint32) []kvevents.EngineHash {
	bs := e.cfg.BlockSize
	var out []kvevents.EngineHash
	var parent kvevents.EngineHash
	for i := 0; (i+1)*bs <= len(tokens); i++ {
		parent = e.pool.hashBlock(parent, i > 0, tokens[i*bs:(i+1)*bs])
		out = append(out, parent)
	}
	return out
}

// blockHash returns the hash of full block i of s, extending s.hashes.
func (e *Engine) blockHash(s *seq, i int) kvevents.EngineHash {
	bs := e.cfg.BlockSize
	for len(s.hashes) <= i {
		j := len(s.hashes)
		var parent kvevents.EngineHash
		if j > 0 {
			parent = s.hashes[j-1]
		}
		s.hashes = append(s.hashes, e.pool.hashBlock(parent, j > 0, s.tokens[j*bs:(j+1)*bs]))
	}
	return s.hashes[i]
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

type schedEntry struct {
	s      *seq
	n      int
	decode bool
}

// Step schedules and runs one engine step starting at now. All state
// changes (allocation, caching, new tokens, completion) are applied at once;
// the result says when they take effect. An idle engine returns an idle
// result with zero duration.
func (e *Engine) Step(now time.Time) StepResult {
	res := StepResult{Start: now}
	e.arrived = 0 // this step's schedule sees every waiting request
	budget := e.cfg.MaxNumBatchedTokens
	bs := e.cfg.BlockSize
	sched := e.sched[:0]
	preempted := e.preempted[:0]
	loadTokens := 0

	// Running requests first, in admission order; preempt from the back.
	for i := 0; i < len(e.running) && budget > 0; {
		s := e.running[i]
		e.removeSkipped(s)
		n := min(len(s.tokens)-s.numComputed, budget)
		need := ceilDiv(s.numComputed+n, bs) - len(s.blocks)
		scheduled := true
		for need > e.numFree() {
			victim := e.running[len(e.running)-1]
			e.preempt(victim)
			preempted = append(preempted, victim.id)
			if victim == s {
				scheduled = false
				break
			}
		}
		if !scheduled {
			break
		}
		if need > 0 {
			s.blocks = e.pool.allocate(need, s.blocks)
			if e.wpool != nil {
				s.wblocks = e.wpool.allocate(need, s.wblocks)
			}
		}
		decode := s.outputs > 0 && n == 1 && s.numComputed == len(s.tokens)-1
		sched = append(sched, schedEntry{s: s, n: n, decode: decode})
		budget -= n
		i++
	}

	// Then waiting requests, FCFS, unless this step had to preempt.
	for len(preempted) == 0 && len(e.waiting) > 0 && len(e.running) < e.cfg.MaxNumSeqs && budget > 0 {
		s := e.waiting[0]
		hit := e.lookupHead(s)
		var whit []*block
		if e.wpool != nil {
			hit, whit = e.hybridHit(s, hit)
		}
		freeHits := 0
		for _, b := range hit {
			if b.refCnt == 0 {
				freeHits++
			}
		}
		e.stats.PrefixQueries += uint64(len(s.tokens))
		e.stats.PrefixHits += uint64(len(hit) * bs)
		// Offloaded blocks right after the GPU hit load instead of
		// computing (at least one token is still computed).
		loaded := 0
		if o := e.pool.offload; o != nil {
			for i := len(hit); i < (len(s.tokens)-1)/bs && o.has(e.blockHash(s, i)); i++ {
				loaded++
			}
		}
		computed := (len(hit) + loaded) * bs
		n := min(len(s.tokens)-computed, budget)
		need := ceilDiv(computed+n, bs) - len(hit)
		if need > e.pool.numFree()-freeHits || e.wpool != nil && need > e.wpool.numFree()-freeCount(whit) {
			break
		}
		e.head = nil
		for _, b := range hit {
			e.pool.touch(b)
		}
		if e.wpool != nil {
			// The hit's blocks before its window are null blocks.
			s.wblocks = append(s.wblocks[:0], make([]*block, len(hit)-len(whit))...)
			for _, b := range whit {
				e.wpool.touch(b)
				s.wblocks = append(s.wblocks, b)
			}
			s.wblocks = e.wpool.allocate(need, s.wblocks)
		}
		for i := len(hit); i < len(hit)+loaded; i++ {
			e.pool.offload.touch(e.blockHash(s, i))
		}
		loadTokens += loaded * bs
		e.stats.OffloadLoadedTokens += uint64(loaded * bs)
		s.blocks = append(s.blocks[:0], hit...)
		s.blocks = e.pool.allocate(need, s.blocks)
		s.numComputed = computed
		s.numCachedBlocks = len(hit)
		if !s.admitted {
			s.admitted = true
			s.cachedTokens = computed
		}
		e.waiting = e.waiting[1:]
		s.state = stateRunning
		e.running = append(e.running, s)
		sched = append(sched, schedEntry{s: s, n: n})
		budget -= n
	}
	e.sched = sched
	if len(preempted) > 0 {
		res.Preempted = preempted
	}
	e.preempted = preempted[:0]

	if len(sched) == 0 {
		res.Events = e.takeEvents()
		return res
	}
	scheduledOut := e.scheduled[:0]
	for _, x := range sched {
		scheduledOut = append(scheduledOut, Scheduled{ID: x.s.id, NumTokens: x.n, Decode: x.decode})
		if x.decode {
			res.DecodeSeqs++
		} else {
			res.PrefillTokens += x.n
		}
	}
	e.scheduled = scheduledOut
	res.Scheduled = scheduledOut
	res.Duration = e.cfg.Profile.StepTime(res.PrefillTokens, res.DecodeSeqs)
	if loadTokens > 0 {
		res.Duration += time.Duration(float64(loadTokens) / e.cfg.OffloadLoadTokensPerSecond * float64(time.Second))
	}
	end := res.End()

	// Apply the step: cache newly full blocks, sample, finish.
	outputs, finished := e.outputs[:0], e.finished[:0]
	for _, x := range sched {
		s := x.s
		s.numComputed += x.n
		if full := s.numComputed / bs; full > s.numCachedBlocks {
			e.cacheBlocks(s, s.numCachedBlocks, full)
			s.numCachedBlocks = full
		}
		if s.numComputed < len(s.tokens) {
			continue // a prefill chunk that did not reach the end
		}
		idx := s.outputs
		tok := OutputTokenID(idx)
		s.tokens = append(s.tokens, tok)
		s.outputs++
		e.stats.GenerationTokens++
		out := Output{ID: s.id, Index: idx, Token: tok}
		if idx == 0 {
			out.TTFT = end.Sub(s.arrival)
			e.stats.PromptTokens += uint64(s.promptLen)
		}
		outputs = append(outputs, out)
		if s.outputs >= s.maxTokens {
			finished = append(finished, Finished{
				ID: s.id, Reason: FinishLength, PromptTokens: s.promptLen,
				OutputTokens: s.outputs, CachedTokens: s.cachedTokens, E2E: end.Sub(s.arrival),
			})
			e.stats.Finished[FinishLength]++
			e.running = removeSeq(e.running, s)
			delete(e.byID, s.id)
			e.pool.free(s.blocks)
			s.blocks = nil
			e.freeWindow(s)
		}
	}
	e.outputs, e.finished = outputs, finished
	if len(outputs) > 0 {
		res.Outputs = outputs
	}
	if len(finished) > 0 {
		res.Finished = finished
	}
	res.Events = e.takeEvents()
	return res
}

// lookupHead returns the cached blocks of s's leading full blocks, leaving
// at least one token to compute (vLLM recomputes the last token of a fully
// cached prompt). s is the waiting queue's head; the result is memoized
// for it (see Engine.head) and valid until the pool changes.
func (e *Engine) lookupHead(s *seq) []*block {
	bs := e.cfg.BlockSize
	hit := e.headHit[:0]
	if e.head == s && e.headEvictions == e.pool.evictions {
		hit = e.headHit
	}
	var prev *block
	if len(hit) > 0 {
		prev = hit[len(hit)-1]
	}
	for i := len(hit); i < (len(s.tokens)-1)/bs; i++ {
		b := e.pool.lookupAfter(prev, e.blockHash(s, i))
		if b == nil {
			break
		}
		hit = append(hit, b)
		prev = b
	}
	e.head, e.headHit, e.headEvictions = s, hit, e.pool.evictions
	return hit
}

func (e *Engine) cacheBlocks(s *seq, from, to int) {
	bs := e.cfg.BlockSize
	hashes, prefixes := e.cacheHashes[:0], e.cachePrefixes[:0]
	for i := from; i < to; i++ {
		hashes = append(hashes, e.blockHash(s, i))
		end := (i + 1) * bs
		prefixes = append(prefixes, s.tokens[:end:end])
	}
	var parent kvevents.EngineHash
	if from > 0 {
		parent = e.blockHash(s, from-1)
	}
	e.pool.cacheRun(s.blocks[from:to], hashes, prefixes, parent, from > 0)
	if e.wpool != nil {
		e.wpool.cacheRun(s.wblocks[from:to], hashes, prefixes, parent, from > 0)
	}
	clear(prefixes) // drop the token arrays' references
	e.cacheHashes, e.cachePrefixes = hashes, prefixes[:0]
}

// preempt sends a running request back to the head of the waiting queue,
// freeing its blocks (recompute preemption).
func (e *Engine) preempt(s *seq) {
	e.running = removeSeq(e.running, s)
	e.pool.free(s.blocks)
	s.blocks = nil
	e.freeWindow(s)
	s.numComputed = 0
	s.numCachedBlocks = 0
	s.state = stateWaiting
	e.waiting = append(e.waiting, nil)
	copy(e.waiting[1:], e.waiting)
	e.waiting[0] = s
	e.stats.Preemptions++
}

// outputWords is the deterministic output vocabulary: output token i is
// outputWords[i%len] with ID outputTokenBase+i%len.
var outputWords = [...]string{
	" The", " service", " tracks", " request", " latency", ",", " token",
	" throughput", ",", " cache", " utilization", ",", " and", " healthy",
	" replicas", ".",
}

const outputTokenBase = 1 << 20

// OutputTokenID is the token ID of output position i.
func OutputTokenID(i int) uint32 { return outputTokenBase + uint32(i%len(outputWords)) }

// OutputTokenText is the text of output position i: one word per token.
func OutputTokenText(i int) string { return outputWords[i%len(outputWords)] }
