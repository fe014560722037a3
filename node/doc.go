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
// each replica's /metrics) → the body is forwarded unchanged (to http://
// replicas by the proxy's own HTTP/1.1 client on the handler's goroutine,
// upstream.go; https:// and UpstreamHTTP2 through net/http's Transport) and
// the response relayed byte for byte, flushed per upstream read, the head
// together with the first chunk when they arrived together → the decision
// is recorded in the index (history or speculative ledger) and the cost
// model learns from the observed TTFT and TPOT.
//
// Every other endpoint vLLM serves passes through too (endpoints.go): the
// route table maps each path to how its request is read (a prompt to key,
// only a model, a multipart form read up to its model field, or a stored
// response's id), endpoints without a prompt prefix are routed by load, and
// Responses API ids are pinned to the replica that stored them
// (responses.go). A prompt list is keyed by its longest prompt, a chat up to
// its first media part (multimodal.go).
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
// subscriber whose batches feed the index's confirmed ledger through
// kvevents.Normalize and index.ApplyKV (GPU into the confirmed ledger, CPU
// and disk into the index's offload tiers, KV-cache groups apart; salted
// and LoRA chains under the request-side root; blocks from the first
// opaque, multimodal one on left out); a reset drops that replica's
// confirmed entries.
//
// Routing table: pools, model names and replicas live in one immutable
// table behind an atomic pointer. A request loads it once; a config apply
// builds a new table and swaps it, so no request sees half a config.
// Replicas whose definition is unchanged are carried over (in-flight
// counts, health and learned cost rates survive); a removed replica drains
// (its in-flight streams finish, it gets no new traffic, its probes and
// subscriber stop, and its index entries are dropped); an added one gets
// probes, a subscriber and traffic. Replica names map to index IDs that
// are never reused. Hash seed, block size, tokenizer and index capacity
// and TTLs shape the index and are read at New only.
//
// Standalone mode (the default): nothing but HTTPAddr is opened; the Node
// routes on its own Config and index. Config.Cluster.NoSync forces this
// mode even when cluster flags are set (the study's isolated baseline).
//
// Cluster mode (Config.Cluster.Enabled): Start opens, in order, the admin
// gRPC listener, the raft config store (sync/config; its membership is the
// gossip view: raft id = node id, raft and admin addresses from the
// memberlist metadata), the sync.Cluster (memberlist, embedded or external
// NATS, the peer snapshot service; Start joins and restores the index from
// a live peer), and the admin gRPC server; then it wires the seams:
// SetPeerLoad(cluster) adds peers' in-flight counts to the load view,
// SetRecordListener publishes every recorded decision as a delta, and
// Store.OnApply hot-reloads the routing table on every applied config
// version. An empty raft config is seeded from the Node's own Config by
// the first leader. KV events: engines with a kv (connect) endpoint are
// the cluster's KV sources, ingested by exactly one owner gateway
// (rendezvous hash over live members) and applied everywhere from its
// normalized deltas; the Node subscribes itself only to kv_bind engines
// and to kv engines added by a config change after Start (every gateway
// then subscribes: sync.Cluster's sources are fixed at Start). The admin
// API is served over gRPC on Cluster.AdminAddr and over HTTP/JSON on the
// gateway's own listener under /admin/v1/ (bearer token on every call).
// A config that changes what shapes block keys (hash seed, block size,
// tokenizer) or the index bounds is applied to routing but the index keeps
// its own until restart: kvmesh_config_restart_required is 1 meanwhile.
// Cluster mode needs the cluster key (Cluster.ClusterKeyFile,
// KVMESH_CLUSTER_KEY; New fails with ErrNoClusterKey without it unless
// Cluster.Insecure): gossip is encrypted with it, and raft, the peer
// service (snapshots, and the config writes gateways forward to each other)
// and the embedded NATS routes run mutual TLS under a CA derived from it
// (package sync/trust; SECURITY.md). The admin token is the operators'
// only: no gateway sends it to another. Cluster.PeerTLS and RaftTLS
// replace the key's TLS with the operator's certificates (flags
// --peer-tls-*, --raft-tls-*).
// After a snapshot restore the Node re-applies its replica roots and
// publisher flags (sync.Deps.AfterRestore). The raft transport is the
// config store's own (pipelined replication off, see sync/config).
//
// Probes: GET /health is liveness (200 until Shutdown begins). GET /ready
// is readiness: 200 once serving and, in cluster mode, joined, index
// bootstrapped and a raft config version applied; its JSON (ReadyReport)
// carries the config version and digest and annotates, without failing,
// suspect replicas and tokenizer disagreements. kvmesh_config_version
// is exported on every node (0 standalone).
//
// Self-checks: responses carrying usage.prompt_tokens_details.cached_tokens
// are compared with the index's prediction for their replica (selfcheck.go:
// kvmesh_index_suspect, kvmesh_index_prediction_error_tokens); KV-event
// replicas' /tokenize is compared with the gateway's tokenizer when they
// (re)join (agreement.go: kvmesh_tokenizer_agreement), and a disagreeing
// model is tokenized by the engine.
//
// HTTP edges (edges.go): /debug/route and /debug/replicas need the admin
// token (Config.AdminToken, $KVMESH_ADMIN_TOKEN or the cluster's token
// file) unless Config.DebugPublic; HeaderPinReplica pins a request to a
// replica with the token in HeaderAdminToken; Config.MaxInFlight bounds
// concurrent inference and /debug/route requests (429 with Retry-After).
//
// Graceful shutdown (SIGTERM in kvmesh serve, then Shutdown with
// ShutdownGrace): /health and /ready turn 503; the gateway gossips its
// leave (peers take over its KV-event streams at once instead of after
// failure detection); the config store leaves raft (a leader first
// transfers leadership, so writes pause for a round trip, not an election
// timeout); connections without a request in flight (idle keep-alives,
// new ones that sent nothing) are closed at once, the HTTP server stops
// accepting and in-flight streams drain until the grace ends; the rest are
// cut, and a cut is always visible to the client: a stream ends with an
// SSE error event of code gateway_shutdown, a request not yet answered
// gets a 503 gateway_shutdown, and any other response is aborted (never
// terminated as if complete); the admin API, config store and cluster
// stop; probes and subscribers stop. Each step is logged with its
// duration.
//
// Lifecycle: New builds, Start listens and returns, Shutdown stops in
// order (stop accepting, drain streams until its context ends, cut the
// rest, stop subscribers and probes, wait). Every Node has its own
// Prometheus registry, so several Nodes can share a process. Node methods
// are safe for concurrent use.
package node
