package route

import (
	"fmt"
	"math"
)

// Config gathers every strategy's parameters.
type Config struct {
	// PrefixCache holds prefix-cache's thresholds.
	PrefixCache PrefixCacheConfig `json:"prefix_cache" yaml:"prefix_cache"`
	// ConsistentHash holds consistent-hash's ring and load bound.
	ConsistentHash ConsistentHashConfig `json:"consistent_hash" yaml:"consistent_hash"`
	// Cost holds the cost model's priors and engine facts.
	Cost CostConfig `json:"cost" yaml:"cost"`
	// PeerLoadDelaySeconds is how stale peers' reported in-flight counts
	// (Candidate.InFlight − LocalInFlight) are: the replication load
	// interval. Requests peers sent within that time are in no count this
	// gateway sees; cost estimates how many there are from its own recent
	// decisions and the peers' share of the traffic, and places them
	// before choosing (see Cost.Pick). When no peer reports load (an
	// isolated gateway), the same applies to the other senders the
	// engines' scrapes show, and the value is best the interval those
	// scrapes come at (cost counts three of them where the replica it
	// ranks first holds the prompt by its KV events: the engines' gauges
	// lag the scrape by the step in progress, and every gateway reads the
	// same holders).
	// A gateway that is the replicas' only sender decides the same
	// whatever its value. The default, 0, means
	// DefaultPeerLoadDelaySeconds (0.025 s), so a Config built field by field
	// (or a configuration document that does not carry the field) gets it;
	// a gateway outside a cluster (kvmesh serve without --cluster) takes its
	// shared scrape interval instead (the one it scrapes at once other
	// senders show; its scrape interval when that is off);
	// a negative value treats the peers' view as fresh (cost as before this
	// field existed). Must be finite.
	PeerLoadDelaySeconds float64 `json:"peer_load_delay_seconds" yaml:"peer_load_delay_seconds"`
}

// DefaultPeerLoadDelaySeconds is Config.PeerLoadDelaySeconds' default: the
// replication's default load interval (sync.Config.LoadInterval, 25 ms).
const DefaultPeerLoadDelaySeconds = 0.025

// peerLoadDelay resolves PeerLoadDelaySeconds: the default for 0, 0
// (disabled) for a negative value.
func (c Config) peerLoadDelay() float64 {
	switch {
	case c.PeerLoadDelaySeconds == 0:
		return DefaultPeerLoadDelaySeconds
	case c.PeerLoadDelaySeconds < 0:
		return 0
	}
	return c.PeerLoadDelaySeconds
}

// DefaultConfig returns each strategy's defaults.
func DefaultConfig() Config {
	return Config{
		PrefixCache:    DefaultPrefixCacheConfig(),
		ConsistentHash: DefaultConsistentHashConfig(),
		Cost:           DefaultCostConfig(),
		// PeerLoadDelaySeconds 0: DefaultPeerLoadDelaySeconds.
	}
}

// Validate reports the first invalid parameter.
func (c Config) Validate() error {
	if err := c.PrefixCache.Validate(); err != nil {
		return err
	}
	if err := c.ConsistentHash.Validate(); err != nil {
		return err
	}
	if math.IsNaN(c.PeerLoadDelaySeconds) || math.IsInf(c.PeerLoadDelaySeconds, 0) {
		return fmt.Errorf("%w: PeerLoadDelaySeconds %v must be finite", ErrInvalidConfig, c.PeerLoadDelaySeconds)
	}
	return c.Cost.Validate()
}

// Set is one instance of every strategy, built from one Config: what a
// gateway holds per model pool. It is safe for concurrent use.
type Set struct {
	Random         Random
	LeastRequest   LeastRequest
	PrefixCache    *PrefixCache
	ConsistentHash *ConsistentHash
	Cost           *Cost
}

// NewSet builds every strategy from cfg, with a fresh cost Model.
func NewSet(cfg Config) (*Set, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	pc, err := NewPrefixCache(cfg.PrefixCache)
	if err != nil {
		return nil, err
	}
	ch, err := NewConsistentHash(cfg.ConsistentHash)
	if err != nil {
		return nil, err
	}
	m, err := NewModel(cfg.Cost)
	if err != nil {
		return nil, err
	}
	return &Set{PrefixCache: pc, ConsistentHash: ch, Cost: &Cost{model: m, peerDelay: cfg.peerLoadDelay()}}, nil
}

// Get returns the strategy called name (as Names spells it).
func (s *Set) Get(name string) (Strategy, error) {
	switch name {
	case NameRandom:
		return s.Random, nil
	case NameLeastRequest:
		return s.LeastRequest, nil
	case NamePrefixCache:
		return s.PrefixCache, nil
	case NameConsistentHash:
		return s.ConsistentHash, nil
	case NameCost:
		return s.Cost, nil
	}
	return nil, fmt.Errorf("%w: %q (want one of %v)", ErrUnknownStrategy, name, Names())
}

// Model returns the cost strategy's model, for the gateway to Observe into.
func (s *Set) Model() *Model { return s.Cost.Model() }
