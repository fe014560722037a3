package node

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node/tokenizer"
	"github.com/kvmesh/kvmesh/route"
)

// Tokenizer names accepted by Config.Tokenizer.
const (
	// TokenizerAuto picks TokenizerCharacter in history mode and
	// TokenizerTiktoken when the index uses KV events, whose confirmed
	// entries are keyed in token space.
	TokenizerAuto = "auto"
	// TokenizerCharacter is AIBrix's character mode: one token per byte.
	TokenizerCharacter = tokenizer.NameCharacter
	// TokenizerTiktoken is a local BPE tokenizer (cl100k).
	TokenizerTiktoken = tokenizer.NameTiktoken
	// TokenizerRemote asks the engine's /tokenize endpoint, with a cache, a
	// timeout and a fallback to TokenizerTiktoken.
	TokenizerRemote = "remote"
	// TokenizerHFPrefix starts "hf:<dir>": the model's own Hugging Face
	// tokenizer (dir holds tokenizer.json and tokenizer_config.json), run
	// in process exactly as vLLM applies it (node/tokenizer.HF): completions
	// with add_special_tokens, chat rendered with the model's template.
	TokenizerHFPrefix = tokenizer.NameHFPrefix
)

// DefaultMaxKeyTokens is Config.MaxKeyTokens's default: 256Ki tokens, more
// than any model context the index holds blocks for today (Qwen3, Llama
// 3.1 and DeepSeek V3 serve 128K).
const DefaultMaxKeyTokens = 256 << 10

// MaxKeyPieceBytes bounds one pre-tokenizer piece that is keyed: keys stop
// before a longer piece (a run of one character or of letters over 64
// KiB), whose BPE costs up to ~0.6 s per MiB with tiktoken's vocabulary.
// Keys stay exact: they are a prefix of the full prompt's.
const MaxKeyPieceBytes = 64 << 10

// Config configures one gateway Node. Start from DefaultConfig (production)
// or LocalConfig (tests), then set fields; Validate reports every problem.
// The YAML keys are the snake_case names given in the field tags.
type Config struct {
	// HTTPAddr is the listen address of the OpenAI-compatible API, /metrics,
	// /health and /debug/route. Default ":8080", vLLM-gateway convention;
	// port 0 picks a free port (see Node.HTTPAddr).
	HTTPAddr string `yaml:"http_addr"`

	// Models are the replica pools, one per served model name. At least one
	// model with at least one replica is required.
	Models []ModelConfig `yaml:"models"`

	// Strategy is the routing strategy used when a request carries no
	// "routing-strategy" header: random, least-request, prefix-cache,
	// consistent-hash or cost. Default "cost": the project's own study
	// (kvbench) rates it best or tied on every scenario, and prefix-cache
	// (AIBrix v0.7's behaviour) worst on warm and hot50.
	Strategy string `yaml:"strategy"`

	// IndexMode is history, kv-events or hybrid (see index.Mode), or auto.
	// Default "auto": hybrid when any replica publishes KV events (kv= or
	// kv_bind=), the study's best mode, else history, which needs no engine
	// configuration. New resolves auto once, from the replicas it starts
	// with; a cluster seeds its raft config with the resolved mode.
	IndexMode string `yaml:"index_mode"`

	// Tokenizer turns prompts into tokens for block hashing: auto,
	// character, tiktoken, remote or hf:<dir> (the model's own Hugging Face
	// tokenizer, TokenizerHFPrefix: the only local choice whose ids equal a
	// real engine's). Default "auto" (character in history mode, tiktoken
	// otherwise, because confirmed entries from KV events are keyed by the
	// engine's token ids).
	Tokenizer string `yaml:"tokenizer"`

	// MaxKeyTokens bounds the tokens of a prompt that are keyed (and so
	// the tokenizer's work per request): block keys cover at most the
	// first MaxKeyTokens tokens, and stop before a pre-tokenizer piece
	// longer than MaxKeyPieceBytes. The keys kept are exactly the full
	// prompt's first keys, so a longer prompt only loses affinity beyond
	// the limit. Default DefaultMaxKeyTokens.
	MaxKeyTokens int `yaml:"max_key_tokens"`
	// ResponseTTL is how long the gateway remembers which replica stored a
	// Responses API response (previous_response_id and /v1/responses/{id}
	// go there). vLLM's in-process store keeps a response until the engine
	// restarts; a restart is seen as the id's owner no longer having it.
	// Default 24h: longer than an agent session.
	ResponseTTL time.Duration `yaml:"response_ttl"`
	// MaxResponseOwners bounds the remembered response ids; the oldest go
	// first. Default 1<<20 (about 100 MB at most).
	MaxResponseOwners int `yaml:"max_response_owners"`

	// BlockSize is the number of tokens per index block. Default 0 = auto:
	// 128 with the character tokenizer (AIBrix's chunk size) and 16
	// otherwise (vLLM's default block size; it must equal the engine's
	// block size for KV-event matches).
	BlockSize int `yaml:"block_size"`

	// HashSeed is mixed into every block key's root. Every gateway of a
	// cluster must use the same seed. Default 0.
	HashSeed uint64 `yaml:"hash_seed"`

	// IndexCapacity bounds the index in (block, replica) entries. Default
	// 1<<20: about 200K prompt blocks on five replicas, what AIBrix's
	// 200K-block default holds, with room for speculation.
	IndexCapacity int `yaml:"index_capacity"`

	// HistoryTTL is how long a history entry lives without being touched.
	// Default 2h: history is a guess about engine caches that churn in
	// minutes to hours.
	HistoryTTL time.Duration `yaml:"history_ttl"`

	// SpeculativeTTL is how long a routing decision counts as a
	// speculative entry before a KV event confirms it. Default 10s: long
	// enough for an engine to finish a 5K-token prefill under load.
	SpeculativeTTL time.Duration `yaml:"speculative_ttl"`

	// MaxBodyBytes is the largest accepted request body; larger bodies get
	// 413. Default 32 MiB: far above a 128K-token prompt in JSON.
	MaxBodyBytes int64 `yaml:"max_body_bytes"`

	// BodyReadTimeout bounds reading a request body from the client, so a
	// client that stalls mid-upload cannot hold a connection forever.
	// Default 30s: 32 MiB at about 1 MB/s.
	BodyReadTimeout time.Duration `yaml:"body_read_timeout"`

	// ConnectTimeout bounds the TCP connect to a replica. Default 2s: a
	// replica on the same network answers in milliseconds, and a failed
	// connect is retried on another replica.
	ConnectTimeout time.Duration `yaml:"connect_timeout"`

	// FirstByteTimeout bounds the wait for the response headers after the
	// request is sent. Default 60s: vLLM sends streaming headers at once,
	// but a non-streaming response arrives only when generation ends.
	FirstByteTimeout time.Duration `yaml:"first_byte_timeout"`

	// IdleTimeout bounds the silence between two chunks of a response body
	// (a relay from an http:// replica ends after IdleTimeout to 9/8 of it).
	// Default 60s: a long prefill under load can delay the first token by
	// tens of seconds, but a minute of silence means a stuck engine.
	IdleTimeout time.Duration `yaml:"idle_timeout"`

	// MaxIdleConnsPerHost is the idle keep-alive pool per replica. Default
	// 512: one gateway may hold hundreds of concurrent streams to one
	// replica and reconnecting costs a handshake per request.
	MaxIdleConnsPerHost int `yaml:"max_idle_conns_per_host"`

	// UpstreamHTTP2 lets the transport negotiate HTTP/2 with replicas that
	// offer it over TLS. Default false: vLLM serves HTTP/1.1, and one
	// HTTP/2 connection would multiplex every stream over one TCP window.
	UpstreamHTTP2 bool `yaml:"upstream_http2"`

	// RetryConnectFailures retries a request once on the next-best replica
	// when connecting to the picked one fails (nothing was sent, so the
	// retry is safe). Default true.
	RetryConnectFailures bool `yaml:"retry_connect_failures"`

	// ScrapeInterval is how often each replica's /metrics is scraped for
	// vllm:num_requests_running/waiting and vllm:kv_cache_usage_perc.
	// Default 500ms: fresh enough for load-aware routing, cheap for vLLM.
	// Zero disables scraping.
	ScrapeInterval time.Duration `yaml:"scrape_interval"`

	// SharedScrapeInterval is how often every replica is scraped instead
	// while this gateway shares its engines with senders it cannot see:
	// outside a cluster (no peer reports its load), a scrape within the
	// last 100 such intervals (10 s at the default) showed some engine
	// running or queueing more requests than this gateway had open there
	// (other gateways', clients' going straight to the engine). Their load
	// reaches the cost strategy only through the scrapes, and gateways
	// that route on one stale scrape send to the same replicas (they
	// herd); the log says when a gateway starts scraping faster.
	//
	// Discrete-event study, 64 replicas behind 8 gateways outside a
	// cluster, default seed: with every replica scraped at 500 / 200 /
	// 100 / 50 ms, cost passed 1,045 / 1,467 / 1,503 / 1,624 of 3,072 on
	// hot50 in history mode (prefix-cache 1,185) and 2,615 / 2,545 /
	// 2,566 / 2,489 on hot90 with KV events (least-request, which reads
	// no scrape, 2,979): there the engines' gauges, updated when a step
	// ends, lag by a prefill step more than by the scrape. Gateways in a
	// cluster, which share their load every 25 ms, moved within ±16 in
	// every cell between 500 and 50 ms.
	//
	// Default 100ms: each such gateway scrapes every replica ten times a
	// second (the Gateway API Inference Extension's endpoint picker
	// scrapes every 50 ms by default). Zero, or a value not below
	// ScrapeInterval, keeps ScrapeInterval. Better still, run the gateways
	// as one cluster.
	SharedScrapeInterval time.Duration `yaml:"shared_scrape_interval"`

	// ScrapeTimeout bounds one scrape. Default 1s.
	ScrapeTimeout time.Duration `yaml:"scrape_timeout"`

	// HealthInterval is how often each replica's /health is polled.
	// Default 2s. Zero disables active health checks (passive ejection
	// still works).
	HealthInterval time.Duration `yaml:"health_interval"`

	// UnhealthyInterval is how often a replica whose last /health poll
	// failed is polled instead, out of rotation or not yet. Default 250ms:
	// an engine that restarts is back in rotation within a quarter second
	// rather than up to a whole HealthInterval later, the poll that
	// confirms an outage comes as quickly, and a dead engine costs each
	// gateway four refused connections a second. Zero polls at
	// HealthInterval throughout.
	UnhealthyInterval time.Duration `yaml:"unhealthy_interval"`

	// HealthTimeout bounds one health poll. Default 1s.
	HealthTimeout time.Duration `yaml:"health_timeout"`

	// UnhealthyAfter is the number of consecutive failed /health polls
	// that take a replica out of rotation (one success brings it back).
	// Default 2: one slow answer from a saturated engine is not an outage.
	UnhealthyAfter int `yaml:"unhealthy_after"`

	// HealthFailOpen routes among a model's replicas that fail their
	// /health polls when none passes them, as Envoy's panic threshold and
	// nginx do: when every engine of a model fails its health check at
	// once, the checker (a saturated engine answering /health late, a
	// probe timeout too tight for the machine) is more often wrong than
	// every engine is down, and answering 503 to every request would turn
	// a false alarm into an outage. Replicas ejected for failing real
	// requests stay out, so a dead engine costs EjectAfter failed requests
	// per ejection period. A request pinned to one replica (the one that
	// stored a Responses API response, or the admin pin header) has no
	// other, so it is sent to its replica when that one fails only its
	// polls. Default true; false answers 503
	// (no_healthy_replica) instead. kvmesh_route_fail_open_total,
	// /ready's fail_open and kvmesh doctor show when it happens.
	HealthFailOpen bool `yaml:"health_fail_open"`

	// EjectAfter is the number of consecutive failed requests (connect
	// errors, timeouts, 5xx) that ejects a replica. Default 3: one failure
	// is noise, three in a row is a pattern.
	EjectAfter int `yaml:"eject_after"`

	// EjectBackoff is the first ejection period; each further ejection
	// without a success in between doubles it up to EjectMaxBackoff.
	// Default 1s.
	EjectBackoff time.Duration `yaml:"eject_backoff"`

	// EjectMaxBackoff caps the ejection period. Default 30s.
	EjectMaxBackoff time.Duration `yaml:"eject_max_backoff"`

	// TokenizerCacheBytes bounds the prefix cache of the local tiktoken
	// tokenizer (node/tokenizer.Cached): prompts that share a long prefix
	// with an earlier one only encode their new part. Default 64 MiB (about
	// 1,300 distinct 28 KB documents). 0 disables the cache.
	TokenizerCacheBytes int64 `yaml:"tokenizer_cache_bytes"`

	// RemoteTokenizeTimeout bounds one call to an engine's /tokenize; on
	// timeout the local tokenizer is used. Default 200ms: routing must not
	// wait longer than a prefill would.
	RemoteTokenizeTimeout time.Duration `yaml:"remote_tokenize_timeout"`

	// RemoteTokenizeCacheSize is the number of prompts whose remote
	// tokenization is cached (by prompt hash). Default 1024.
	RemoteTokenizeCacheSize int `yaml:"remote_tokenize_cache_size"`

	// TokenizerAgreement controls the tokenizer probe (agreement.go): when
	// a replica whose predictions come from KV events (re)joins, the
	// gateway compares its tokenizer with the engine's /tokenize on a fixed
	// probe set. "switch" (default) tokenizes a model's prompts with the
	// engine's /tokenize while a replica disagrees, because keys from a
	// disagreeing tokenizer never match the engine's confirmed blocks;
	// "probe" only reports (kvmesh_tokenizer_agreement, /ready, a WARN);
	// "off" does not probe.
	TokenizerAgreement string `yaml:"tokenizer_agreement"`

	// MaxInFlight bounds the inference and /debug/route requests this
	// gateway handles at once; one more is answered 429 with Retry-After
	// before its body is read. Default 4096: about sixteen vLLM replicas
	// at their default max-num-seqs of 256 all busy, beyond which requests
	// would only wait in the engines' queues, while each one held here
	// costs the gateway its body (up to MaxBodyBytes) and a relay buffer.
	// 0 disables the limit.
	MaxInFlight int `yaml:"max_in_flight"`

	// EPP serves the gateway as a Gateway API Inference Extension endpoint
	// picker (Envoy ext_proc) besides its own proxy; see EPPConfig.
	EPP EPPConfig `yaml:"epp"`

	// Discovery follows one model's replicas from a changing source
	// instead of a fixed list; see DiscoveryConfig.
	Discovery DiscoveryConfig `yaml:"discovery"`

	// DebugPublic serves /debug/route and /debug/replicas without the admin
	// token. Default false: a debug view tells whoever asks whether a
	// prompt (another client's) is cached and where. LocalConfig sets it,
	// for tests on loopback.
	DebugPublic bool `yaml:"debug_public"`

	// AdminToken is the bearer token of the debug views and of the
	// replica-pin header (HeaderPinReplica) in standalone mode; in cluster
	// mode the cluster's admin token (Cluster.AdminToken) is used. Empty:
	// $KVMESH_ADMIN_TOKEN, then Cluster.AdminTokenFile. Without any token
	// the debug views answer 403 unless DebugPublic. Default "".
	AdminToken string `yaml:"admin_token"`

	// Route holds the strategies' parameters (prefix-cache thresholds,
	// consistent-hash ring, cost-model priors); see route.Config. Default
	// route.DefaultConfig(). Its keys are top-level and the cluster
	// document's own (prefix_cache: {stddev_factor: ...}, cost: {alpha:
	// ...}): one schema wherever a knob is set.
	Route route.Config `yaml:",inline"`
	// LegacyRoute catches the route: section of older gateway files, whose
	// keys moved to the top level; ParseConfigYAML refuses it by name.
	LegacyRoute yaml.Node `yaml:"route"`

	// ShutdownGrace is how long the serve command lets streams drain on
	// SIGTERM before cutting them. Default 30s.
	ShutdownGrace time.Duration `yaml:"shutdown_grace"`

	// Cluster makes the gateway a cluster member (gossip, shared index,
	// raft config, admin API); see ClusterConfig. Default: disabled
	// (standalone, no port besides HTTPAddr).
	Cluster ClusterConfig `yaml:"cluster"`
}

// ModelConfig is one replica pool.
type ModelConfig struct {
	// Name is the model name clients send in "model".
	Name string `yaml:"name"`
	// Adapters are LoRA adapter names served by this pool's replicas;
	// a request naming one routes to this pool with the adapter mixed into
	// its block keys.
	Adapters []string `yaml:"adapters"`
	// Strategy overrides Config.Strategy for this model when non-empty.
	Strategy string `yaml:"strategy"`
	// IndexMode overrides Config.IndexMode for this model when non-empty
	// (the block size stays global: one index, one hasher).
	IndexMode string `yaml:"index_mode"`
	// Tokenizer overrides Config.Tokenizer for this model when non-empty:
	// tiktoken or hf:<dir> (the model's own tokenizer), so several models
	// behind one gateway each key with their engine's ids. It needs a
	// token-space global tokenizer (not character: its block size is
	// bytes). In cluster mode it is carried in the raft config
	// (models[].tokenizer) and resolved at every apply.
	Tokenizer string `yaml:"tokenizer"`
	// SharedResponseStore says the pool's engines share one Responses API
	// store backend, so a stored response is readable on every replica:
	// the gateway then routes previous_response_id and /v1/responses/{id}
	// like any request instead of to the replica that made the response.
	SharedResponseStore bool `yaml:"shared_response_store"`
	// Replicas are the engines serving the model.
	Replicas []ReplicaConfig `yaml:"replicas"`
}

// ReplicaConfig is one engine.
type ReplicaConfig struct {
	// Name identifies the replica in headers, metrics and logs; unique
	// across all pools.
	Name string `yaml:"name"`
	// URL is the engine's base URL, e.g. http://10.0.0.5:8000.
	URL string `yaml:"url"`
	// KVEndpoint is the engine's KV-event PUB endpoint to connect to
	// (vLLM publishing on tcp://*:5557). Empty: no KV events.
	KVEndpoint string `yaml:"kv"`
	// KVBind is an endpoint this gateway binds for an engine whose
	// publisher connects. Mutually exclusive with KVEndpoint.
	KVBind string `yaml:"kv_bind"`
	// ReplayEndpoint is the engine's replay ROUTER endpoint, used to fill
	// sequence gaps. Empty: gaps reset the replica's confirmed entries.
	ReplayEndpoint string `yaml:"replay"`
	// DataParallelSize is the engine's data-parallel size (vLLM
	// --data-parallel-size N): N engine cores behind one URL, rank r
	// publishing its KV events on KVEndpoint's port + r (and replaying on
	// ReplayEndpoint's port + r). The gateway then treats each rank as a
	// replica of its own named "name#r" (its own residency in the index)
	// and sends a request to the rank it picks with vLLM's
	// X-data-parallel-rank header. 0 or 1: one engine. KV endpoints must
	// be tcp://host:port; kv_bind is not supported with it.
	DataParallelSize int `yaml:"data_parallel_size"`
	// DataParallelRank is set by the gateway on a rank replica expanded
	// from DataParallelSize; not configurable.
	DataParallelRank int `yaml:"-"`
}

// PublishesKVEvents reports whether the replica has a KV-event source.
func (r ReplicaConfig) PublishesKVEvents() bool { return r.KVEndpoint != "" || r.KVBind != "" }

// DefaultConfig returns the production defaults documented on each field.
// Models must still be filled in.
func DefaultConfig() Config {
	return Config{
		HTTPAddr:                ":8080",
		Strategy:                route.NameCost,
		IndexMode:               IndexModeAuto,
		Tokenizer:               TokenizerAuto,
		MaxKeyTokens:            DefaultMaxKeyTokens,
		ResponseTTL:             24 * time.Hour,
		MaxResponseOwners:       1 << 20,
		IndexCapacity:           1 << 20,
		HistoryTTL:              2 * time.Hour,
		SpeculativeTTL:          10 * time.Second,
		MaxBodyBytes:            32 << 20,
		BodyReadTimeout:         30 * time.Second,
		ConnectTimeout:          2 * time.Second,
		FirstByteTimeout:        60 * time.Second,
		IdleTimeout:             60 * time.Second,
		MaxIdleConnsPerHost:     512,
		RetryConnectFailures:    true,
		ScrapeInterval:          500 * time.Millisecond,
		SharedScrapeInterval:    100 * time.Millisecond,
		ScrapeTimeout:           time.Second,
		HealthInterval:          2 * time.Second,
		UnhealthyInterval:       250 * time.Millisecond,
		HealthTimeout:           time.Second,
		UnhealthyAfter:          2,
		HealthFailOpen:          true,
		EjectAfter:              3,
		EjectBackoff:            time.Second,
		EjectMaxBackoff:         30 * time.Second,
		TokenizerCacheBytes:     64 << 20,
		RemoteTokenizeTimeout:   200 * time.Millisecond,
		RemoteTokenizeCacheSize: 1024,
		TokenizerAgreement:      AgreementSwitch,
		MaxInFlight:             4096,
		EPP:                     EPPConfig{Fallbacks: 2},
		ShutdownGrace:           30 * time.Second,
		Route:                   route.DefaultConfig(),
		Cluster:                 DefaultClusterConfig(),
	}
}

// sharedScrape is SharedScrapeInterval where it applies: set and below a
// ScrapeInterval that is on; 0 otherwise (shared scrapes off).
func (c *Config) sharedScrape() time.Duration {
	if s := c.SharedScrapeInterval; s > 0 && s < c.ScrapeInterval {
		return s
	}
	return 0
}

// LocalConfig is the preset for tests and single-machine experiments:
// loopback port 0 and short timeouts so failures surface in milliseconds.
func LocalConfig() Config {
	c := DefaultConfig()
	c.HTTPAddr = "127.0.0.1:0"
	c.ConnectTimeout = 500 * time.Millisecond
	c.FirstByteTimeout = 10 * time.Second
	c.IdleTimeout = 10 * time.Second
	c.ScrapeInterval = 50 * time.Millisecond
	c.ScrapeTimeout = 250 * time.Millisecond
	c.HealthInterval = 100 * time.Millisecond
	c.UnhealthyInterval = 50 * time.Millisecond
	c.HealthTimeout = 250 * time.Millisecond
	c.EjectBackoff = 200 * time.Millisecond
	c.EjectMaxBackoff = 2 * time.Second
	c.RemoteTokenizeTimeout = 500 * time.Millisecond
	c.ShutdownGrace = 2 * time.Second
	c.DebugPublic = true
	c.Cluster = LocalClusterConfig()
	return c
}

// LoadConfigFile reads a YAML file over base: keys present in the file
// replace base's values, absent keys keep them. Durations are Go duration
// strings ("500ms").
func LoadConfigFile(path string, base Config) (Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return base, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return ParseConfigYAML(data, base)
}

// ParseConfigYAML is LoadConfigFile for bytes.
func ParseConfigYAML(data []byte, base Config) (Config, error) {
	c := base
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil && !errors.Is(err, io.EOF) {
		return base, fmt.Errorf("%w: yaml: %w", ErrInvalidConfig, err)
	}
	if c.LegacyRoute.Kind != 0 {
		return base, fmt.Errorf("%w: yaml: the route: section is gone: its keys (prefix_cache, consistent_hash, cost, peer_load_delay_seconds) are top-level now, with the cluster document's names (docs/config.md)", ErrInvalidConfig)
	}
	return c, nil
}

// ParseReplicaSpec parses the --replica flag form
// "name=url[,kv=endpoint][,kv-bind=endpoint][,replay=endpoint][,model=name][,dp=N]"
// (dp: ReplicaConfig.DataParallelSize).
// The returned model is "" when the spec names none.
func ParseReplicaSpec(spec string) (ReplicaConfig, string, error) {
	var r ReplicaConfig
	var model string
	parts := strings.Split(spec, ",")
	name, u, ok := strings.Cut(parts[0], "=")
	if !ok || name == "" || u == "" {
		return r, "", fmt.Errorf("%w: %q: want name=url[,kv=...][,kv-bind=...][,replay=...][,model=...]", ErrBadReplicaSpec, spec)
	}
	r.Name, r.URL = name, u
	for _, p := range parts[1:] {
		k, v, ok := strings.Cut(p, "=")
		if !ok || v == "" {
			return r, "", fmt.Errorf("%w: %q: option %q wants key=value", ErrBadReplicaSpec, spec, p)
		}
		switch k {
		case "kv":
			r.KVEndpoint = v
		case "kv-bind", "kv_bind":
			r.KVBind = v
		case "replay":
			r.ReplayEndpoint = v
		case "model":
			model = v
		case "dp":
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 {
				return r, "", fmt.Errorf("%w: %q: dp=%q wants a size >= 1", ErrBadReplicaSpec, spec, v)
			}
			r.DataParallelSize = n
		default:
			return r, "", fmt.Errorf("%w: %q: unknown option %q (want kv, kv-bind, replay, model or dp)", ErrBadReplicaSpec, spec, k)
		}
	}
	return r, model, nil
}

func knownStrategy(s string) bool {
	_, err := route.ParseName(s)
	return err == nil
}

// IndexModeAuto is the default IndexMode: hybrid when any replica
// publishes KV events, history otherwise (EffectiveIndexMode).
const IndexModeAuto = "auto"

// EffectiveIndexMode resolves IndexModeAuto (and empty) against the
// replicas: hybrid when any publishes KV events (discovered ones with a
// KV template included), else history.
func (c *Config) EffectiveIndexMode() string {
	if c.IndexMode != IndexModeAuto && c.IndexMode != "" {
		return c.IndexMode
	}
	if c.Discovery.Source != "" && c.Discovery.KV != "" {
		return index.ModeHybrid.String()
	}
	for _, m := range c.Models {
		for _, r := range m.Replicas {
			if r.PublishesKVEvents() {
				return index.ModeHybrid.String()
			}
		}
	}
	return index.ModeHistory.String()
}

// Mode returns the parsed effective IndexMode. Valid only after Validate
// succeeded.
func (c *Config) Mode() index.Mode {
	m, _ := index.ParseMode(c.EffectiveIndexMode())
	return m
}

// EffectiveTokenizer resolves TokenizerAuto.
func (c *Config) EffectiveTokenizer() string {
	if c.Tokenizer != TokenizerAuto && c.Tokenizer != "" {
		return c.Tokenizer
	}
	if c.EffectiveIndexMode() == "history" {
		return TokenizerCharacter
	}
	return TokenizerTiktoken
}

// EffectiveBlockSize resolves BlockSize 0.
func (c *Config) EffectiveBlockSize() int {
	if c.BlockSize > 0 {
		return c.BlockSize
	}
	return route.DefaultBlockTokens(c.EffectiveTokenizer() == TokenizerCharacter)
}

// Validate reports every problem with c, joined, each wrapping
// ErrInvalidConfig.
func (c *Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...))
	}
	if c.HTTPAddr == "" {
		bad("http_addr is empty")
	}
	if !knownStrategy(c.Strategy) {
		bad("strategy %q unknown (want one of %s)", c.Strategy, strings.Join(route.Names(), ", "))
	}
	if _, err := index.ParseMode(c.EffectiveIndexMode()); err != nil {
		bad("index_mode: %v (or auto)", err)
	}
	switch {
	case c.Tokenizer == TokenizerAuto, c.Tokenizer == TokenizerCharacter, c.Tokenizer == TokenizerTiktoken, c.Tokenizer == TokenizerRemote:
	case strings.HasPrefix(c.Tokenizer, TokenizerHFPrefix) && len(c.Tokenizer) > len(TokenizerHFPrefix):
	default:
		bad("tokenizer %q unknown (want auto, character, tiktoken, remote or hf:<dir>)", c.Tokenizer)
	}
	if c.ResponseTTL <= 0 {
		bad("response_ttl %v must be positive", c.ResponseTTL)
	}
	if c.MaxResponseOwners < 1 {
		bad("max_response_owners %d must be positive", c.MaxResponseOwners)
	}
	if c.MaxKeyTokens < 1 {
		bad("max_key_tokens %d must be positive", c.MaxKeyTokens)
	}
	if c.BlockSize < 0 {
		bad("block_size %d is negative", c.BlockSize)
	}
	if c.IndexCapacity <= 0 {
		bad("index_capacity %d must be positive", c.IndexCapacity)
	}
	if c.HistoryTTL <= 0 || c.SpeculativeTTL <= 0 {
		bad("history_ttl and speculative_ttl must be positive")
	}
	if c.MaxBodyBytes <= 0 {
		bad("max_body_bytes %d must be positive", c.MaxBodyBytes)
	}
	for name, d := range map[string]time.Duration{
		"body_read_timeout": c.BodyReadTimeout,
		"connect_timeout":   c.ConnectTimeout, "first_byte_timeout": c.FirstByteTimeout,
		"idle_timeout": c.IdleTimeout, "scrape_timeout": c.ScrapeTimeout,
		"health_timeout": c.HealthTimeout, "eject_backoff": c.EjectBackoff,
		"eject_max_backoff": c.EjectMaxBackoff, "remote_tokenize_timeout": c.RemoteTokenizeTimeout,
	} {
		if d <= 0 {
			bad("%s %v must be positive", name, d)
		}
	}
	if c.ScrapeInterval < 0 || c.SharedScrapeInterval < 0 || c.HealthInterval < 0 || c.UnhealthyInterval < 0 || c.ShutdownGrace < 0 {
		bad("scrape_interval, shared_scrape_interval, health_interval, unhealthy_interval and shutdown_grace must not be negative")
	}
	if c.EjectMaxBackoff < c.EjectBackoff {
		bad("eject_max_backoff %v below eject_backoff %v", c.EjectMaxBackoff, c.EjectBackoff)
	}
	if c.UnhealthyAfter <= 0 {
		bad("unhealthy_after %d must be positive", c.UnhealthyAfter)
	}
	if c.EjectAfter <= 0 {
		bad("eject_after %d must be positive", c.EjectAfter)
	}
	if c.MaxIdleConnsPerHost <= 0 {
		bad("max_idle_conns_per_host %d must be positive", c.MaxIdleConnsPerHost)
	}
	if c.TokenizerCacheBytes < 0 {
		bad("tokenizer_cache_bytes %d is negative", c.TokenizerCacheBytes)
	}
	switch c.TokenizerAgreement {
	case AgreementSwitch, AgreementProbe, AgreementOff:
	default:
		bad("tokenizer_agreement %q unknown (want switch, probe or off)", c.TokenizerAgreement)
	}
	c.EPP.validate(bad)
	if c.MaxInFlight < 0 {
		bad("max_in_flight %d is negative", c.MaxInFlight)
	}
	if c.RemoteTokenizeCacheSize < 0 {
		bad("remote_tokenize_cache_size %d is negative", c.RemoteTokenizeCacheSize)
	}
	if err := c.Route.Validate(); err != nil {
		bad("route: %v", err)
	}
	c.Discovery.validate(bad)
	if len(c.Models) == 0 && c.Discovery.Source == "" {
		bad("no models: give at least one model with replicas")
	}
	models := map[string]bool{}
	replicas := map[string]bool{}
	total := 0
	for i, m := range c.Models {
		if m.Name == "" {
			bad("models[%d]: name is empty", i)
		}
		for _, n := range append([]string{m.Name}, m.Adapters...) {
			if n == "" {
				continue
			}
			if models[n] {
				bad("model or adapter name %q appears twice", n)
			}
			models[n] = true
		}
		if m.IndexMode != "" {
			if _, err := index.ParseMode(m.IndexMode); err != nil {
				bad("model %q: index_mode: %v", m.Name, err)
			}
		}
		if m.Strategy != "" && !knownStrategy(m.Strategy) {
			bad("model %q: strategy %q unknown", m.Name, m.Strategy)
		}
		if m.Tokenizer != "" {
			hf := strings.HasPrefix(m.Tokenizer, TokenizerHFPrefix) && len(m.Tokenizer) > len(TokenizerHFPrefix)
			switch {
			case m.Tokenizer != TokenizerTiktoken && !hf:
				bad("model %q: tokenizer %q unknown (want tiktoken or hf:<dir>)", m.Name, m.Tokenizer)
			case c.EffectiveTokenizer() == TokenizerCharacter:
				bad("model %q: a per-model tokenizer needs a token-space global tokenizer (tokenizer: tiktoken, remote or hf:<dir>), not character", m.Name)
			}
		}
		if len(m.Replicas) == 0 && !c.Discovery.owns(m.Name) {
			bad("model %q has no replicas", m.Name)
		}
		for _, r := range m.Replicas {
			total++
			if r.Name == "" {
				bad("model %q: a replica has no name", m.Name)
			} else if replicas[r.Name] {
				bad("replica name %q appears twice", r.Name)
			}
			replicas[r.Name] = true
			u, err := url.Parse(r.URL)
			if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
				bad("replica %q: url %q must be http(s)://host:port", r.Name, r.URL)
			}
			if r.KVEndpoint != "" && r.KVBind != "" {
				bad("replica %q: kv and kv_bind are mutually exclusive", r.Name)
			}
			if r.ReplayEndpoint != "" && !r.PublishesKVEvents() {
				bad("replica %q: replay needs kv or kv_bind", r.Name)
			}
			if r.DataParallelSize < 0 || r.DataParallelSize > MaxDataParallelSize {
				bad("replica %q: data_parallel_size %d not in 0..%d", r.Name, r.DataParallelSize, MaxDataParallelSize)
			} else if r.DataParallelSize > 1 {
				if r.KVBind != "" {
					bad("replica %q: kv_bind is not supported with data_parallel_size", r.Name)
				}
				for _, ep := range []string{r.KVEndpoint, r.ReplayEndpoint} {
					if ep == "" {
						continue
					}
					if _, err := offsetPort(ep, r.DataParallelSize-1); err != nil {
						bad("replica %q: %v", r.Name, err)
					}
				}
				total += r.DataParallelSize - 1
			}
		}
	}
	if total > index.MaxReplicas {
		bad("%d replicas exceed %d", total, index.MaxReplicas)
	}
	c.Cluster.validate(bad)
	return errors.Join(errs...)
}
