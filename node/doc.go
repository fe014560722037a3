// Package node is one kvmesh gateway process: an OpenAI-compatible HTTP
// proxy in front of vLLM replicas that routes each request by where its
// prompt's KV cache most likely lives.
//
// Request flow: POST /v1/completions or /v1/chat/completions → the prompt
// is extracted (string, token list, or chat messages rendered with
// node/tokenizer) → tokenized (character, tiktoken, or the engine's
// /tokenize with a cache and a local fallback) → hashed into block keys
// (index.Hasher) → index.Match per available replica (one read lock) → a
// route.Strategy picks using the load view (this gateway's exact in-flight
// counts, peers' counts through PeerLoad, and vllm:* figures scraped from
// each replica's /metrics) → the body is forwarded unchanged and the
// response relayed byte for byte, flushed per upstream read → the decision
// is recorded in the index (history or speculative ledger) and the cost
// model learns from the observed TTFT and TPOT.
//
// Failure handling: a connect failure before any byte is sent is retried
// once on the next-best replica; a body that breaks mid-stream ends with an
// SSE error event (`data: {"error":{...}}`); consecutive failures eject a
// replica for an exponentially growing period; a failing /health poll takes
// it out until it passes; with no replica left the answer is 503 with
// Retry-After. Client errors get OpenAI-style JSON errors with the stable
// codes listed as Code* constants. Prompts are never logged.
//
// Index modes (history, kv-events, hybrid) are per model. KV events:
// replicas with a kv (connect) or kv_bind (bind) endpoint get a kvevents
// subscriber whose batches feed the index's confirmed ledger; a reset drops
// that replica's confirmed entries.
//
// Seams for the replication work: SetPeerLoad adds peers' in-flight counts
// to the load view; SetRecordListener hears every decision written to the
// index; Index exposes the index for snapshots and remote deltas.
//
// Lifecycle: New builds, Start listens and returns, Shutdown stops in
// order (stop accepting, drain streams until its context ends, cut the
// rest, stop subscribers and probes, wait). Every Node has its own
// Prometheus registry, so several Nodes can share a process. Node methods
// are safe for concurrent use.
package node
