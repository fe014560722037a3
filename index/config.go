package index

import (
	"fmt"
	"time"
)

// Config configures an Index.
type Config struct {
	// Seed is the cluster-wide seed mixed into every root key. Every gateway
	// of a cluster must use the same value (it comes from the raft config).
	// Default 0.
	Seed uint64
	// BlockTokens is the index block size in tokens (1..MaxBlockTokens).
	// Default 16, vLLM's default KV block size, so that engine blocks map 1:1.
	BlockTokens int
	// Capacity bounds the number of (block, replica) entries over all
	// ledgers. Default 4,000,000: about 256 MB at the 64 B/entry budget.
	Capacity int
	// HistoryTTL is how long a history entry lives after its block was last
	// recorded in the history ledger. Default 30 min: a routing decision is a
	// good hint for about as long as an engine keeps a cold prefix cached.
	HistoryTTL time.Duration
	// SpeculativeTTL is how long a speculative entry lives unless a KV event
	// confirms it. Default 3 s: covers prefill of a long prompt plus event
	// publication latency.
	SpeculativeTTL time.Duration
}

// DefaultConfig returns the defaults documented on Config.
func DefaultConfig() Config {
	return Config{
		BlockTokens:    DefaultBlockTokens,
		Capacity:       4_000_000,
		HistoryTTL:     30 * time.Minute,
		SpeculativeTTL: 3 * time.Second,
	}
}

// maxTTL keeps TTLs representable as positive int32 counts of ticks.
const maxTTL = time.Duration(1<<30) * tickNanos

// Validate reports the first invalid field, wrapped in ErrInvalidConfig.
func (c Config) Validate() error {
	switch {
	case c.BlockTokens < 1 || c.BlockTokens > MaxBlockTokens:
		return fmt.Errorf("%w: BlockTokens %d (want 1..%d)", ErrInvalidConfig, c.BlockTokens, MaxBlockTokens)
	case c.Capacity < 1 || c.Capacity > 1<<30:
		return fmt.Errorf("%w: Capacity %d (want 1..%d)", ErrInvalidConfig, c.Capacity, 1<<30)
	case c.HistoryTTL < tickNanos || c.HistoryTTL > maxTTL:
		return fmt.Errorf("%w: HistoryTTL %v (want %v..%v)", ErrInvalidConfig, c.HistoryTTL, time.Duration(tickNanos), maxTTL)
	case c.SpeculativeTTL < tickNanos || c.SpeculativeTTL > maxTTL:
		return fmt.Errorf("%w: SpeculativeTTL %v (want %v..%v)", ErrInvalidConfig, c.SpeculativeTTL, time.Duration(tickNanos), maxTTL)
	}
	return nil
}

// tickNanos is the resolution of stored timestamps: 10 ms. Timestamps are
// stored as uint32 ticks of Unix time (wrapping every ~497 days); ages are
// computed with wrapping subtraction, so TTLs must stay below ~248 days.
const tickNanos = 10 * time.Millisecond

func tickOf(now int64) uint32 { return uint32(uint64(now) / uint64(tickNanos)) }

func ttlTicks(d time.Duration) int32 {
	return int32((d + tickNanos - 1) / tickNanos)
}

// alive reports whether a timestamp t is younger than ttl ticks at tick now.
// A timestamp in the future (a caller's clock went backwards) counts as alive.
func alive(now, t uint32, ttl int32) bool { return int32(now-t) < ttl }
