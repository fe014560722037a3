package route

import "fmt"

// Config gathers every strategy's parameters.
type Config struct {
	// PrefixCache holds prefix-cache's thresholds.
	PrefixCache PrefixCacheConfig
	// ConsistentHash holds consistent-hash's ring and load bound.
	ConsistentHash ConsistentHashConfig
	// Cost holds the cost model's priors and engine facts.
	Cost CostConfig
}

// DefaultConfig returns each strategy's defaults.
func DefaultConfig() Config {
	return Config{
		PrefixCache:    DefaultPrefixCacheConfig(),
		ConsistentHash: DefaultConsistentHashConfig(),
		Cost:           DefaultCostConfig(),
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
	return &Set{PrefixCache: pc, ConsistentHash: ch, Cost: NewCost(m)}, nil
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
