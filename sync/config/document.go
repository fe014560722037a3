package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/route"
)

// Tokenizer names accepted by PrefixCacheConfig.Tokenizer. They mirror the
// gateway's tokenizer choices (node cannot be imported from here).
const (
	TokenizerAuto      = "auto"
	TokenizerCharacter = "character"
	TokenizerTiktoken  = "tiktoken"
	TokenizerRemote    = "remote"
	// TokenizerHFPrefix starts a model's own Hugging Face tokenizer,
	// "hf:<dir>" (ModelConfig.Tokenizer only).
	TokenizerHFPrefix = "hf:"
)

// RoutingConfig is the cluster-wide routing document held in the raft FSM:
// everything that must be identical on every gateway. Its JSON form (the
// snake_case tags) is what the admin API reads and writes and what merge
// patches address. Start from DefaultRoutingConfig, add models, Validate.
//
// A RoutingConfig handed out by the store (Versioned.Config) is shared and
// must be treated as read-only; use Clone to modify a copy.
type RoutingConfig struct {
	// Strategy is the default routing strategy of a model that names none:
	// random, least-request, prefix-cache, consistent-hash or cost.
	// Default "cost" (the kvbench study's best or tied on every scenario);
	// a gateway seeds an empty cluster config with its own --strategy.
	Strategy string `json:"strategy"`
	// IndexMode is the default index mode of a model that names none:
	// history, kv-events or hybrid. Default "history" (needs no engine
	// configuration); a gateway seeds an empty cluster config with its own
	// resolved mode (--index-mode auto: hybrid when a replica publishes KV
	// events).
	IndexMode string `json:"index_mode"`
	// HashSeed is mixed into every block key's root; identical on every
	// gateway because it lives here. Default 0. Changing it invalidates
	// every index entry (keys no longer match).
	HashSeed uint64 `json:"hash_seed"`
	// Models are the replica pools keyed by the model name clients send.
	// At least one model with at least one replica is required.
	Models map[string]ModelConfig `json:"models"`
	// PrefixCache holds prefix-cache's thresholds and the block hashing
	// parameters.
	PrefixCache PrefixCacheConfig `json:"prefix_cache"`
	// ConsistentHash holds consistent-hash's ring and load bound.
	ConsistentHash route.ConsistentHashConfig `json:"consistent_hash"`
	// Cost holds the cost model's priors and engine facts.
	Cost route.CostConfig `json:"cost"`
	// PeerLoadDelaySeconds: see route.Config (how stale peers' reported
	// load is; 0 = the default, 0.025 s). The gateway YAML key of the same
	// name and --peer-load-delay-seconds seed it.
	PeerLoadDelaySeconds float64 `json:"peer_load_delay_seconds"`
	// Index holds the prefix index's capacity and TTLs.
	Index IndexConfig `json:"index"`
	// SLO holds the service-level targets the gateway reports against.
	SLO SLOConfig `json:"slo"`
}

// ModelConfig is one model's pool and routing choices.
type ModelConfig struct {
	// Strategy overrides RoutingConfig.Strategy when non-empty.
	Strategy string `json:"strategy,omitempty"`
	// IndexMode overrides RoutingConfig.IndexMode when non-empty.
	IndexMode string `json:"index_mode,omitempty"`
	// Adapters are LoRA adapter names served by this pool.
	Adapters []string `json:"adapters,omitempty"`
	// SharedResponseStore: the pool's engines share one Responses API
	// store, so gateways need not pin stored-response requests to the
	// replica that made the response.
	SharedResponseStore bool `json:"shared_response_store,omitempty"`
	// Tokenizer is the model's own tokenizer when non-empty: tiktoken or
	// hf:<dir>, a directory holding tokenizer.json and
	// tokenizer_config.json on every gateway's filesystem. Empty: the
	// gateway's global tokenizer. Validate checks only the syntax (the FSM
	// reads no files); a gateway that cannot load it refuses the whole
	// version and keeps routing with the previous one (its apply error is
	// logged and counted). It needs a token-space global tokenizer: a
	// gateway keying with character (block size in bytes) refuses it too.
	// Changing it takes effect at the next apply, without a restart; the
	// model's older speculative and history entries stop matching and age
	// out.
	Tokenizer string `json:"tokenizer,omitempty"`
	// Replicas are the engines serving the model; names are unique across
	// all models.
	Replicas []ReplicaConfig `json:"replicas"`
}

// ReplicaConfig is one engine.
type ReplicaConfig struct {
	// Name identifies the replica in headers, metrics and logs.
	Name string `json:"name"`
	// URL is the engine's base URL (http or https, with a host).
	URL string `json:"url"`
	// KV is the engine's KV-event PUB endpoint to connect to; empty: none.
	KV string `json:"kv,omitempty"`
	// KVBind is an endpoint the gateway binds for an engine whose publisher
	// connects. Mutually exclusive with KV.
	KVBind string `json:"kv_bind,omitempty"`
	// Replay is the engine's replay ROUTER endpoint; empty: gaps reset.
	Replay string `json:"replay,omitempty"`
	// DataParallelSize is the engine's data-parallel size (node's
	// ReplicaConfig.DataParallelSize: each rank a replica "name#r",
	// events on the endpoints' port + r); 0 or 1: one engine.
	DataParallelSize int `json:"data_parallel_size,omitempty"`
}

// PrefixCacheConfig is prefix-cache's thresholds (route.PrefixCacheConfig,
// the one definition: its keys are this document's, its Validate applies)
// plus the block hashing parameters.
type PrefixCacheConfig struct {
	route.PrefixCacheConfig
	// BlockSize is the number of tokens per index block; 0 = auto (128
	// with the character tokenizer, 16 otherwise, as the gateway resolves
	// it). Otherwise validated by index.Config. Default 0.
	BlockSize int `json:"block_size"`
	// Tokenizer is auto, character, tiktoken, remote or hf:<dir>: the
	// gateways' global tokenizer (it takes effect at restart). Default
	// "auto".
	Tokenizer string `json:"tokenizer"`
}

// IndexConfig is the prefix index's capacity and TTLs (index.Config's
// Validate applies).
type IndexConfig struct {
	// Capacity bounds (block, replica) entries. Default 1<<20 (the
	// gateway's default).
	Capacity int `json:"capacity"`
	// HistoryTTL: default 2h, the gateway's default.
	HistoryTTL Duration `json:"history_ttl"`
	// SpeculativeTTL: default 10s, the gateway's default.
	SpeculativeTTL Duration `json:"speculative_ttl"`
}

// SLOConfig holds the targets a request is judged against (the study's
// SLO: TTFT ≤ 2 s, TPOT ≤ 150 ms, E2E ≤ 30 s). Zero disables a target.
type SLOConfig struct {
	// TTFT is the longest time to first token that meets the SLO.
	// Default 2s.
	TTFT Duration `json:"ttft"`
	// TPOT is the longest mean time per output token after the first.
	// Default 150ms.
	TPOT Duration `json:"tpot"`
	// E2E is the longest whole-request time. Default 30s.
	E2E Duration `json:"e2e"`
}

// Duration is a time.Duration whose JSON form is a Go duration string
// ("250ms"); a JSON number is read as nanoseconds.
type Duration time.Duration

// MarshalJSON implements json.Marshaler.
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

// UnmarshalJSON implements json.Unmarshaler.
func (d *Duration) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return err
		}
		v, err := time.ParseDuration(s)
		if err != nil {
			return err
		}
		*d = Duration(v)
		return nil
	}
	n, err := strconv.ParseInt(string(b), 10, 64)
	if err != nil {
		return fmt.Errorf("duration %s: want a string like \"5s\" or integer nanoseconds", b)
	}
	*d = Duration(n)
	return nil
}

// DefaultRoutingConfig returns the defaults documented on each field, with
// no models.
func DefaultRoutingConfig() RoutingConfig {
	rc := route.DefaultConfig()
	return RoutingConfig{
		Strategy:  route.NameCost,
		IndexMode: "history",
		Models:    map[string]ModelConfig{},
		PrefixCache: PrefixCacheConfig{
			PrefixCacheConfig: rc.PrefixCache,
			Tokenizer:         TokenizerAuto,
		},
		ConsistentHash: rc.ConsistentHash,
		Cost:           rc.Cost,
		Index: IndexConfig{
			Capacity:       1 << 20,
			HistoryTTL:     Duration(2 * time.Hour),
			SpeculativeTTL: Duration(10 * time.Second),
		},
		SLO: SLOConfig{
			TTFT: Duration(2 * time.Second),
			TPOT: Duration(150 * time.Millisecond),
			E2E:  Duration(30 * time.Second),
		},
	}
}

// Route converts the strategy parameters to route.Config.
func (c *RoutingConfig) Route() route.Config {
	return route.Config{
		PrefixCache:          c.PrefixCache.PrefixCacheConfig,
		ConsistentHash:       c.ConsistentHash,
		Cost:                 c.Cost,
		PeerLoadDelaySeconds: c.PeerLoadDelaySeconds,
	}
}

// IndexFor converts the index parameters to index.Config, with blockTokens
// as the resolved block size (PrefixCache.BlockSize, or the gateway's auto
// choice when it is 0).
func (c *RoutingConfig) IndexFor(blockTokens int) index.Config {
	return index.Config{
		Seed:           c.HashSeed,
		BlockTokens:    blockTokens,
		Capacity:       c.Index.Capacity,
		HistoryTTL:     time.Duration(c.Index.HistoryTTL),
		SpeculativeTTL: time.Duration(c.Index.SpeculativeTTL),
	}
}

// ModelStrategy is the model's effective strategy.
func (c *RoutingConfig) ModelStrategy(model string) string {
	if m, ok := c.Models[model]; ok && m.Strategy != "" {
		return m.Strategy
	}
	return c.Strategy
}

// ModelIndexMode is the model's effective index mode.
func (c *RoutingConfig) ModelIndexMode(model string) string {
	if m, ok := c.Models[model]; ok && m.IndexMode != "" {
		return m.IndexMode
	}
	return c.IndexMode
}

// ModelNames returns the model names in sorted order.
func (c *RoutingConfig) ModelNames() []string {
	names := make([]string, 0, len(c.Models))
	for n := range c.Models {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// KeysCompatible reports whether block keys computed under c equal those
// computed under o: same hash seed, block size and tokenizer. When it is
// false, a gateway applying o must drop (or rebuild) its prefix index,
// because no old key matches a new one.
func (c *RoutingConfig) KeysCompatible(o *RoutingConfig) bool {
	return c.HashSeed == o.HashSeed &&
		c.PrefixCache.BlockSize == o.PrefixCache.BlockSize &&
		c.PrefixCache.Tokenizer == o.PrefixCache.Tokenizer
}

// Clone returns a deep copy.
func (c *RoutingConfig) Clone() RoutingConfig {
	out := *c
	out.Models = make(map[string]ModelConfig, len(c.Models))
	for n, m := range c.Models {
		m.Adapters = append([]string(nil), m.Adapters...)
		m.Replicas = append([]ReplicaConfig(nil), m.Replicas...)
		out.Models[n] = m
	}
	return out
}

// Validate reports every invalid field, joined; each is a *FieldError
// wrapping ErrInvalidConfig and naming the field by its JSON path.
// Parameter checks are delegated to route's and index's own Validate.
func (c *RoutingConfig) Validate() error {
	var errs []error
	bad := func(path string, err error) { errs = append(errs, &FieldError{Path: path, Err: err}) }
	badf := func(path, format string, args ...any) { bad(path, fmt.Errorf(format, args...)) }

	if _, err := route.ParseName(c.Strategy); err != nil {
		bad("strategy", err)
	}
	if _, err := index.ParseMode(c.IndexMode); err != nil {
		bad("index_mode", err)
	}
	if len(c.Models) == 0 {
		badf("models", "at least one model is required")
	}
	owner := map[string]string{} // replica name → model
	for _, name := range c.ModelNames() {
		m := c.Models[name]
		p := fmt.Sprintf("models[%q]", name)
		if strings.TrimSpace(name) == "" {
			badf(p, "model name is empty")
		}
		if m.Strategy != "" {
			if _, err := route.ParseName(m.Strategy); err != nil {
				bad(p+".strategy", err)
			}
		}
		if m.IndexMode != "" {
			if _, err := index.ParseMode(m.IndexMode); err != nil {
				bad(p+".index_mode", err)
			}
		}
		if m.Tokenizer != "" {
			hf := strings.HasPrefix(m.Tokenizer, TokenizerHFPrefix) && len(m.Tokenizer) > len(TokenizerHFPrefix)
			switch {
			case m.Tokenizer != TokenizerTiktoken && !hf:
				badf(p+".tokenizer", "%q unknown (want tiktoken or hf:<dir>)", m.Tokenizer)
			case c.PrefixCache.Tokenizer == TokenizerCharacter:
				badf(p+".tokenizer", "a per-model tokenizer needs a token-space prefix_cache.tokenizer, not character (its block size is bytes)")
			}
		}
		for i, a := range m.Adapters {
			if a == "" {
				badf(fmt.Sprintf("%s.adapters[%d]", p, i), "adapter name is empty")
			}
		}
		if len(m.Replicas) == 0 {
			badf(p+".replicas", "at least one replica is required")
		}
		for i, r := range m.Replicas {
			rp := fmt.Sprintf("%s.replicas[%d]", p, i)
			if err := r.validate(); err != nil {
				var fe *FieldError
				if errors.As(err, &fe) {
					bad(rp+"."+fe.Path, fe.Err)
				}
			}
			if r.Name != "" {
				if prev, dup := owner[r.Name]; dup {
					badf(rp+".name", "replica %q already listed under model %q", r.Name, prev)
				}
				owner[r.Name] = name
			}
		}
	}
	rc := c.Route()
	if err := rc.PrefixCache.Validate(); err != nil {
		bad("prefix_cache", err)
	}
	if err := rc.ConsistentHash.Validate(); err != nil {
		bad("consistent_hash", err)
	}
	if math.IsNaN(rc.PeerLoadDelaySeconds) || math.IsInf(rc.PeerLoadDelaySeconds, 0) {
		bad("peer_load_delay_seconds", fmt.Errorf("%v is not finite", rc.PeerLoadDelaySeconds))
	}
	if err := rc.Cost.Validate(); err != nil {
		bad("cost", err)
	}
	switch tok := c.PrefixCache.Tokenizer; {
	case tok == TokenizerAuto, tok == TokenizerCharacter, tok == TokenizerTiktoken, tok == TokenizerRemote:
	case strings.HasPrefix(tok, TokenizerHFPrefix) && len(tok) > len(TokenizerHFPrefix):
	default:
		badf("prefix_cache.tokenizer", "%q unknown (want auto, character, tiktoken, remote or hf:<dir>)", tok)
	}
	bs := c.PrefixCache.BlockSize
	if bs < 0 {
		badf("prefix_cache.block_size", "%d is negative", bs)
	} else {
		if bs == 0 {
			bs = index.DefaultBlockTokens // auto resolves to a valid size
		}
		if err := c.IndexFor(bs).Validate(); err != nil {
			path := "index"
			if c.PrefixCache.BlockSize > 0 && strings.Contains(err.Error(), "BlockTokens") {
				path = "prefix_cache.block_size"
			}
			bad(path, err)
		}
	}
	for path, d := range map[string]Duration{"slo.ttft": c.SLO.TTFT, "slo.tpot": c.SLO.TPOT, "slo.e2e": c.SLO.E2E} {
		if d < 0 {
			badf(path, "%v is negative", time.Duration(d))
		}
	}
	sort.SliceStable(errs, func(i, j int) bool { return errs[i].(*FieldError).Path < errs[j].(*FieldError).Path })
	return errors.Join(errs...)
}

// validate checks one replica; errors are *FieldError with a relative path.
func (r ReplicaConfig) validate() error {
	switch {
	case strings.TrimSpace(r.Name) == "":
		return &FieldError{Path: "name", Err: errors.New("replica name is empty")}
	case strings.ContainsAny(r.Name, ",= \t\n"):
		return &FieldError{Path: "name", Err: fmt.Errorf("%q contains a space, comma or '='", r.Name)}
	}
	u, err := url.Parse(r.URL)
	switch {
	case r.URL == "":
		return &FieldError{Path: "url", Err: errors.New("empty")}
	case err != nil:
		return &FieldError{Path: "url", Err: err}
	case u.Scheme != "http" && u.Scheme != "https":
		return &FieldError{Path: "url", Err: fmt.Errorf("%q: scheme must be http or https", r.URL)}
	case u.Host == "":
		return &FieldError{Path: "url", Err: fmt.Errorf("%q has no host", r.URL)}
	}
	if r.KV != "" && r.KVBind != "" {
		return &FieldError{Path: "kv_bind", Err: errors.New("kv and kv_bind are mutually exclusive")}
	}
	for path, ep := range map[string]string{"kv": r.KV, "kv_bind": r.KVBind, "replay": r.Replay} {
		if ep != "" && !strings.Contains(ep, "://") {
			return &FieldError{Path: path, Err: fmt.Errorf("%q is not a ZMQ endpoint (want tcp://host:port or ipc://path)", ep)}
		}
	}
	switch {
	case r.DataParallelSize < 0 || r.DataParallelSize > 256:
		return &FieldError{Path: "data_parallel_size", Err: fmt.Errorf("%d not in 0..256", r.DataParallelSize)}
	case r.DataParallelSize > 1 && r.KVBind != "":
		return &FieldError{Path: "kv_bind", Err: errors.New("not supported with data_parallel_size")}
	}
	return nil
}

// MarshalDocument encodes c as indented JSON, the form the admin API serves.
func MarshalDocument(c *RoutingConfig) ([]byte, error) {
	return json.MarshalIndent(c, "", "  ")
}

// ParseDocument decodes a JSON document strictly (unknown fields are
// errors, naming the field) and validates it. Absent fields keep their
// DefaultRoutingConfig values.
func ParseDocument(data []byte) (RoutingConfig, error) {
	c, err := decodeDocument(data)
	if err != nil {
		return c, err
	}
	return c, c.Validate()
}

func decodeDocument(data []byte) (RoutingConfig, error) {
	c := DefaultRoutingConfig()
	c.Models = nil
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		var ute *json.UnmarshalTypeError
		if errors.As(err, &ute) && ute.Field != "" {
			return c, &FieldError{Path: ute.Field, Err: err}
		}
		return c, &FieldError{Path: "(document)", Err: err}
	}
	if dec.More() {
		return c, &FieldError{Path: "(document)", Err: errors.New("trailing data after the JSON document")}
	}
	return c, nil
}
