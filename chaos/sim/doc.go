// Package sim is a vLLM-compatible engine simulator: one Server is one vLLM
// replica serving one model, with vLLM's OpenAI-compatible HTTP API, its
// Prometheus metric names and its KV-cache events, so that everything kvmesh
// routes to can be tested and measured without a GPU.
//
// The package has two layers.
//
// Engine is the pure model: a block pool with prefix caching by chained
// block hashes and vLLM's LRU free-block queue, a continuous-batching
// scheduler with chunked prefill and recompute preemption, and a step-time
// model taken from a Profile. Engine starts no goroutines and reads no
// clock: callers Add requests and call Step(now), which returns what the step
// did and how long it takes in model time. Tests drive it with a fake clock;
// a discrete-event simulator can drive it directly. In steady state Step
// allocates only the step's KV events: a StepResult's Scheduled, Outputs, Finished and
// Preempted are engine-owned buffers valid until the next Step (copy what
// must outlive it); its Events may be kept. Prefix lookups of a waiting
// head that cannot be admitted resume after the hits already found while no
// cached block was evicted, and follow each block's last-seen successor
// before the hash map; neither changes any result.
//
// Server wraps an Engine with a driver goroutine that runs steps in real
// time (model durations divided by Config.Speed), an HTTP server, Prometheus
// metrics on a private registry and an EventPublisher for KV events. Several
// Servers can run in one process.
//
// Beyond completions and chat, Server serves vLLM's other endpoints in its
// shapes (endpoints.go): embeddings, pooling, classify, score and rerank
// with deterministic vectors derived from the input's tokens, /detokenize,
// the Responses API with an in-process store (create streamed or not,
// previous_response_id, retrieve, delete, cancel), and audio transcription
// and translation whose text states the upload's duration. A prompt list is
// one request with a choice per prompt; a chat's media part is a text
// placeholder naming a hash of the part, so equal media share cache blocks.
//
// Fidelity choices, where vLLM leaves room or where the simulator differs:
//   - Generation always produces exactly max_tokens tokens (as if ignore_eos
//     were set); finish_reason is "length". Output tokens are a fixed
//     deterministic word sequence, one word per token.
//   - When blocks run out, the scheduler preempts the most recently admitted
//     running request (recompute, as vLLM v1): its blocks are freed and it
//     goes back to the head of the waiting queue. A request whose prompt plus
//     max_tokens could never fit in the pool is refused at admission with
//     HTTP 400 instead of waiting forever.
//   - Prefix-cache queries and hits are counted in tokens each time a waiting
//     request with no computed tokens is looked up, as vLLM does; a request
//     that cannot be admitted in a step is looked up (and counted) again.
//   - A full block whose hash is already cached by another block is not
//     cached a second time (and emits no BlockStored).
//   - Model time runs Config.Speed times faster than wall time; metrics
//     (TTFT, TPOT, E2E histograms) are in model seconds, so they read like
//     the modelled hardware. An arrival's model time is wall time × Speed;
//     the engine's clock is its own: steps follow each other back to back
//     while there is work, an idle engine restarts at the arrival that woke
//     it, and a request joins the first step starting at or after its
//     arrival. The driver releases a step's outputs when its model end is
//     due on the wall clock; if the host runs it late it releases them at
//     once and catches up without sleeping, so host scheduling delay never
//     becomes model time. Clients still see late tokens then:
//     kvmesh_sim_driver_lag_seconds and Stats.DriverLag* report how late
//     (wall time), so a harness can flag phases the host could not keep up
//     with.
//   - A step's KV events are published as one batch when the step is
//     scheduled (vLLM caches a block when it allocates the slots that fill
//     it), in engine order with AllBlocksCleared from resets; no batch is
//     published for a step that changed nothing in the cache.
//   - Engines at the edges real ones reach (issue 16): a hybrid-attention
//     model (EngineConfig.SlidingWindow, vllmsim --hybrid-sliding-window:
//     a full-attention and a sliding-window KV-cache group, each in its
//     own pool, publishing group_idx; see engine_hybrid.go for the vLLM
//     rules it follows and where it differs), a CPU offload tier
//     (OffloadBlocks, --kv-offload-blocks; medium CPU events, loads timed
//     by a bandwidth) and data-parallel ranks (DPServer,
//     --data-parallel-size). PrefixHit says what a new request would hit
//     right now, by the engine's own rule: the truth a consumer's index is
//     checked against (chaos/truth). vLLM shares one pool between groups;
//     here each group has its own, and the window group allocates every
//     block a request computes and frees those behind the window at the
//     request's next step (remove_skipped_blocks). Not modelled: an engine
//     that never allocates window blocks already behind the window when a
//     long chunk is scheduled, which would press a small window pool less
//     than here.
//   - POST /reset_prefix_cache answers 200 with {"success": bool}: like
//     vLLM, the reset is refused while any request holds blocks.
//   - Error bodies are vLLM's: {"error": {"message", "type", "param",
//     "code"}} with code the HTTP status (400 BadRequestError, 404
//     NotFoundError for an unknown model).
//   - temperature is accepted and ignored (output is deterministic); n
//     must be 1; one prompt per request.
//
// Typical in-process use (see Example):
//
//	cfg := sim.LocalConfig()                  // 127.0.0.1:0, fast profile
//	cfg.KVEvents.EnableKVCacheEvents = true    // ZMQ PUB + replay on port 0
//	s, _ := sim.NewServer(cfg)
//	_ = s.Start(ctx)
//	defer s.Shutdown(ctx)
//	// HTTP at s.URL(); events at s.KVEventsAddr(), s.KVReplayAddr();
//	// ground truth of the cache: s.CachedBlocks().
package sim
