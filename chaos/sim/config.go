package sim

import (
	"fmt"
	"log/slog"
	"net"
	"strconv"
)

// KVEventsConfig is vLLM's --kv-events-config, field for field, plus the
// simulator-only wire options.
type KVEventsConfig struct {
	// EnableKVCacheEvents turns publishing on.
	EnableKVCacheEvents bool `json:"enable_kv_cache_events"`
	// Publisher is "zmq", or "null" for vLLM's publisher that drops
	// everything (then no events are produced at all).
	Publisher string `json:"publisher"`
	// Endpoint is the PUB endpoint; it binds when it contains "*" or "::"
	// and connects otherwise. vLLM's default is tcp://*:5557.
	Endpoint string `json:"endpoint"`
	// ReplayEndpoint is the replay ROUTER endpoint (always binds); empty
	// disables replay.
	ReplayEndpoint string `json:"replay_endpoint"`
	// Topic is the first frame of every message.
	Topic string `json:"topic"`
	// BufferSteps is how many batches the replay buffer keeps.
	BufferSteps int `json:"buffer_steps"`
	// HWM is the PUB socket's send high-water mark.
	HWM int `json:"hwm"`
	// MaxQueueSize is accepted for compatibility with vLLM's config and
	// ignored: the simulator hands each batch to the publisher directly.
	MaxQueueSize int `json:"max_queue_size"`
	// Encoding is the payload form: "map" (v0.26 map events in an array
	// batch), "array" (older tagged-array events) or "map-envelope" (the
	// batch is a map too). Not part of vLLM's JSON.
	Encoding string `json:"-"`
	// ReplayForm is the replay reply form: "with-topic" ([topic, seq,
	// payload], vLLM v0.26) or "no-topic" ([seq, payload], vLLM <= v0.25).
	// Not part of vLLM's JSON.
	ReplayForm string `json:"-"`
	// AlwaysBind binds Endpoint even without a wildcard (tests use
	// tcp://127.0.0.1:0). Not part of vLLM's JSON.
	AlwaysBind bool `json:"-"`
}

// DefaultKVEventsConfig returns vLLM's defaults with events off.
func DefaultKVEventsConfig() KVEventsConfig {
	return KVEventsConfig{
		Publisher:   "zmq",
		Endpoint:    "tcp://*:5557",
		BufferSteps: 10_000, // vLLM's default replay buffer
		HWM:         100_000,
		Encoding:    "map",
		ReplayForm:  "with-topic",
	}
}

// Config configures one simulated replica.
type Config struct {
	// Host and Port are where the HTTP API listens (vLLM --host/--port).
	// Port 0 picks a free port; Addr reports it.
	Host string
	Port int
	// ServedModelName is the one model this replica serves; requests naming
	// another model get 404.
	ServedModelName string
	// MaxModelLen bounds prompt plus output tokens (vLLM --max-model-len).
	MaxModelLen int
	// MaxNumSeqs bounds the running batch. 8 as in the seed study.
	MaxNumSeqs int
	// MaxNumBatchedTokens is the per-step token budget (chunked prefill).
	// The default, 2048, is vLLM v1's default for the API server on GPUs
	// below 70 GiB such as the L20 (8192 on H100-class cards).
	MaxNumBatchedTokens int
	// BlockSize is tokens per KV block; 16 is vLLM's default.
	BlockSize int
	// NumGPUBlocks is the KV pool capacity (vLLM --num-gpu-blocks-override).
	// The default, 12,500 blocks of 16 (200K tokens), roughly matches what
	// an L20 48 GB has left for KV after 27 GB of FP8 weights.
	NumGPUBlocks int
	// KVOffloadBlocks is the capacity of a CPU offload tier in blocks (0:
	// none; EngineConfig.OffloadBlocks), loading at
	// KVOffloadTokensPerSecond (default 50,000 when a tier is set).
	KVOffloadBlocks          int
	KVOffloadTokensPerSecond float64
	// HybridSlidingWindow, when > 0, simulates a hybrid-attention model:
	// a full-attention KV-cache group and a sliding-window group of this
	// many tokens, each with its own pool (HybridWindowBlocks blocks, 0:
	// NumGPUBlocks) that caches and evicts on its own, publishing
	// group_idx 0 and 1; see EngineConfig.SlidingWindow.
	HybridSlidingWindow int
	HybridWindowBlocks  int
	// Profile is the step-time model; see LookupProfile.
	Profile Profile
	// Speed divides every modelled duration: 10 runs ten times faster than
	// the modelled hardware. Must be > 0.
	Speed float64
	// Tokenizer names the tokenizer: "tiktoken" (cl100k), "bytes", or
	// "hf:<dir>" (a model's Hugging Face tokenizer and chat template, as
	// vLLM applies them; see node/tokenizer.LoadHF).
	Tokenizer string
	// DataParallelSize is vLLM's --data-parallel-size: with N > 1,
	// NewServing builds a DPServer of N engines (ranks), each with its own
	// KV pool, scheduler and KV-event publisher (rank r on the endpoints'
	// port + r, data_parallel_rank r in its batches) behind one HTTP
	// address. 0 or 1: one engine.
	DataParallelSize int
	// DataParallelRank is the rank of this engine within a DPServer (set
	// by it; published in every batch when DataParallelSize > 1).
	DataParallelRank int
	// KVEvents configures KV-event publishing.
	KVEvents KVEventsConfig
	// Publisher, if set, receives KV events instead of a publisher built
	// from KVEvents (which then only needs EnableKVCacheEvents). The Server
	// closes it on Shutdown.
	Publisher EventPublisher
	// EnableResetEndpoint serves POST /reset_prefix_cache.
	EnableResetEndpoint bool
	// HashSeed seeds the engine block hash; 0 picks a random seed, as vLLM's
	// default hash is unpredictable to consumers.
	HashSeed uint64
	// Logger receives the server's logs; nil means slog.Default().
	Logger *slog.Logger
}

// DefaultConfig returns a replica shaped like the seed study's: port 8000,
// l20-qwen27b-fp8, max-num-seqs 8, 32K context.
func DefaultConfig() Config {
	return Config{
		Host:                "0.0.0.0",
		Port:                8000,
		ServedModelName:     "qwen38-27b-fp8",
		MaxModelLen:         32768,
		MaxNumSeqs:          8,
		MaxNumBatchedTokens: 2048,
		BlockSize:           16,
		NumGPUBlocks:        12_500,
		Profile:             ProfileL20Qwen27BFP8,
		Speed:               1,
		Tokenizer:           "tiktoken",
		KVEvents:            DefaultKVEventsConfig(),
	}
}

// LocalConfig is a test preset: 127.0.0.1 port 0, the fast profile, the
// byte tokenizer, a small pool and the reset endpoint on.
func LocalConfig() Config {
	c := DefaultConfig()
	c.Host, c.Port = "127.0.0.1", 0
	c.ServedModelName = "sim-model"
	c.MaxModelLen = 4096
	c.MaxNumSeqs = 4
	c.MaxNumBatchedTokens = 512
	c.NumGPUBlocks = 1024
	c.Profile = ProfileFast
	c.Tokenizer = "bytes"
	c.EnableResetEndpoint = true
	c.KVEvents.Endpoint = "tcp://127.0.0.1:0"
	c.KVEvents.ReplayEndpoint = "tcp://127.0.0.1:0"
	c.KVEvents.AlwaysBind = true
	return c
}

// Validate checks every field.
func (c Config) Validate() error {
	if c.Port < 0 || c.Port > 65535 {
		return fmt.Errorf("%w: port %d", ErrInvalidConfig, c.Port)
	}
	if c.DataParallelSize < 0 || c.DataParallelSize > 256 || c.DataParallelRank < 0 ||
		c.DataParallelRank >= max(c.DataParallelSize, 1) {
		return fmt.Errorf("%w: data-parallel rank %d of size %d", ErrInvalidConfig, c.DataParallelRank, c.DataParallelSize)
	}
	if c.ServedModelName == "" {
		return fmt.Errorf("%w: empty served model name", ErrInvalidConfig)
	}
	if !(c.Speed > 0) {
		return fmt.Errorf("%w: speed %v must be > 0", ErrInvalidConfig, c.Speed)
	}
	if c.zmqEvents() {
		if c.KVEvents.Publisher != "zmq" {
			return fmt.Errorf("%w: kv events publisher %q (zmq or null)", ErrInvalidConfig, c.KVEvents.Publisher)
		}
		if _, err := c.KVEvents.publisherConfig(); err != nil {
			return err
		}
	}
	return c.engineConfig().Validate()
}

func (c Config) engineConfig() EngineConfig {
	return EngineConfig{
		MaxModelLen:                c.MaxModelLen,
		MaxNumSeqs:                 c.MaxNumSeqs,
		MaxNumBatchedTokens:        c.MaxNumBatchedTokens,
		BlockSize:                  c.BlockSize,
		NumBlocks:                  c.NumGPUBlocks,
		Profile:                    c.Profile,
		OffloadBlocks:              c.KVOffloadBlocks,
		OffloadLoadTokensPerSecond: c.offloadRate(),
		SlidingWindow:              c.HybridSlidingWindow,
		SlidingWindowBlocks:        c.HybridWindowBlocks,
		HashSeed:                   c.HashSeed,
		EmitEvents:                 c.zmqEvents() || c.Publisher != nil,
	}
}

// offloadRate is KVOffloadTokensPerSecond, 50,000 when unset.
func (c Config) offloadRate() float64 {
	if c.KVOffloadTokensPerSecond > 0 {
		return c.KVOffloadTokensPerSecond
	}
	return 50_000
}

// zmqEvents reports whether Start must build a ZMQ publisher.
func (c Config) zmqEvents() bool {
	return c.KVEvents.EnableKVCacheEvents && c.KVEvents.Publisher != "null" && c.Publisher == nil
}

func (c Config) listenAddr() string {
	return net.JoinHostPort(c.Host, strconv.Itoa(c.Port))
}
