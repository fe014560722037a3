// Package des is kvbench's discrete-event engine: the study (package
// chaos/study) in virtual time, for tens of replicas and gateways on one
// core.
//
// A World implements study.Engine, so every scenario, the phase driver, the
// statistics and the outputs of chaos/study run on it unchanged. Inside it:
//
//   - Replicas: one sim.Engine per replica (the simulator's pure model:
//     continuous batching, chunked prefill, block pool with LRU eviction,
//     step-time profile), stepped by the event loop exactly as sim.Server's
//     driver steps it: a step starts when the previous one ends or, on an
//     idle engine, when a request arrives; its outputs take effect at its
//     end; its KV events leave when the step is scheduled (as sim.Server
//     publishes them) and reach each gateway KVDelay later.
//   - Gateways: each has its own index.Index and route.Set (the real code),
//     turns a prompt into block keys the way node does (character keys of
//     route.CharacterBlockTokens bytes in history mode, tiktoken keys at
//     the engine's block size with KV events) and routes it through the
//     routing core node calls too (route.Scratch.Route: match, candidates,
//     pick, ledger, cost observation), so the decision flow is node's by
//     construction, not by copy. Its load view (route.LoadView) is its
//     exact in-flight counts, its peers' counts as seen LoadDelay ago, the
//     engine load it scraped at its last scrape tick and its queued prefill
//     tokens. It records the decision in its index and sends it to its peers,
//     who apply it SyncDelay later. NoSync isolates the gateways: no
//     decision deltas, no peer load. The tokens and keys of a prefix
//     group's shared document are computed once and only each prompt's
//     tail per request, split only where the tokenizer itself splits, so
//     they equal a full encode (prompt_test.go). An engine's KV batch is
//     normalized for the index once (kvevents.Normalize, as a synced
//     cluster's owner does) and applied by every gateway's index
//     (index.ApplyKV, node's and sync's apply path).
//   - Clients: a request's outcome is what the streaming client of the
//     live engine would observe over a zero-latency network.
//
// Contract: the core is single-threaded and deterministic. Events are
// ordered by virtual time, then by the order they were scheduled; nothing
// reads the wall clock, no goroutine is started, no map is iterated where
// order could reach an output, and every random choice is seeded from
// Options.Seed. The same options and study configuration therefore give
// byte-identical results.json.
//
// Where the model differs from the live engine, on purpose:
//
//   - The network has zero latency and the gateway zero processing time;
//     the live engine adds loopback and tokenizer milliseconds (times its
//     speed factor).
//   - Every engine uses one hash seed (vLLM with a fixed seed); only the
//     index's memory depends on it.
//   - Gateways expire their index every ExpireInterval instead of every
//     second (Match ignores expired entries either way).
//   - Health checks, ejection and retries are not modelled: every replica
//     is always available.
//
// Node behaviour shared outside the routing core: a request's queued prefill tokens are released
// at its first token (node's proxy releases them at the first body byte;
// Options.QueuedUntilFirstToken=false holds them to the stream's end, to
// study that effect), and the cost model learns from the number of content
// tokens and the first-to-last content interval.
//
// Entry points: Factory builds a study.EngineFactory for study.Runner
// (it is safe for concurrent use: every World is independent, so
// study.Runner.Workers may run cells in parallel); DefaultGrid is the
// grid kvbench --engine des runs by default; Sweep runs a study over
// replica, gateway and rate settings and writes one table per setting.
package des
