package route

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"
)

// ConsistentHashConfig holds consistent-hash's parameters.
type ConsistentHashConfig struct {
	// VirtualNodes is the number of ring points per replica. More points
	// spread keys more evenly (the standard deviation of a replica's share
	// falls roughly as 1/√VirtualNodes) at the cost of a larger ring.
	// Default 100. Must be ≥ 1.
	VirtualNodes int `json:"virtual_nodes" yaml:"virtual_nodes"`
	// LoadFactor is c in the bounded-load rule: a replica takes a new
	// request only while InFlight+1 ≤ ceil(c · (total InFlight + 1) / n).
	// 1 forces near-perfect balance (little affinity); large values
	// approach plain consistent hashing. Default 1.25 (Mirrokni et al.;
	// the Ray affinity router's fixed "queue > 16" cut-off does not scale
	// with cluster load). Must be ≥ 1.
	LoadFactor float64 `json:"load_factor" yaml:"load_factor"`
	// MinCapacity is a floor under the bounded-load capacity: a replica with
	// fewer than MinCapacity requests in flight is never over capacity. At
	// low load c·average is below one request, and without a floor a
	// session would leave its replica as soon as that replica had one
	// request more than the others, giving up affinity exactly when it is
	// free. Default 4 (an engine batches a few sequences at almost no extra
	// step cost; the Ray router in the seeds used a fixed 16). 1 gives the
	// textbook algorithm. Must be ≥ 1.
	MinCapacity int `json:"min_capacity" yaml:"min_capacity"`
}

// DefaultConsistentHashConfig returns 100 virtual nodes, c = 1.25 and a
// capacity floor of 4.
func DefaultConsistentHashConfig() ConsistentHashConfig {
	return ConsistentHashConfig{VirtualNodes: 100, LoadFactor: 1.25, MinCapacity: 4}
}

// Validate reports a parameter out of range.
func (c ConsistentHashConfig) Validate() error {
	if c.VirtualNodes < 1 || c.VirtualNodes > 10000 {
		return fmt.Errorf("%w: consistent-hash VirtualNodes %d not in [1, 10000]", ErrInvalidConfig, c.VirtualNodes)
	}
	if !(c.LoadFactor >= 1) || math.IsInf(c.LoadFactor, 0) {
		return fmt.Errorf("%w: consistent-hash LoadFactor %v must be finite and ≥ 1", ErrInvalidConfig, c.LoadFactor)
	}
	if c.MinCapacity < 1 {
		return fmt.Errorf("%w: consistent-hash MinCapacity %d must be ≥ 1", ErrInvalidConfig, c.MinCapacity)
	}
	return nil
}

// ConsistentHash maps Request.SessionKey onto a ring of replicas with
// virtual nodes and walks clockwise to the first candidate under its
// bounded-load capacity max(ceil(c·(total in-flight+1)/n), MinCapacity)
// (consistent hashing with bounded loads, with a floor). The key's
// own replica wins with "hash_affinity"; a replica further round the ring
// with "hash_spillover". Replicas on the ring that are not candidates
// (ejected, unhealthy) are skipped, which is the same as a ring built
// without them, so ejecting and readmitting a replica moves only its keys.
//
// The ring is built once per membership: call SetMembers when the replica
// pool changes. If Pick meets a candidate the ring does not know, it rebuilds
// the ring once (members ∪ candidates) under a mutex and reuses it after.
//
// Use it for multi-turn sessions (give a session id) where affinity should
// not depend on index state, e.g. when the index is cold or the gateway has
// no KV events; it ignores how much of the prompt each replica holds.
type ConsistentHash struct {
	cfg     ConsistentHashConfig
	ring    atomic.Pointer[Ring]
	mu      sync.Mutex // serializes rebuilds
	scratch sync.Pool  // *[]int32, member → candidate index
}

var _ Strategy = (*ConsistentHash)(nil)

// NewConsistentHash returns the strategy with cfg, which must be valid, and
// an empty ring.
func NewConsistentHash(cfg ConsistentHashConfig) (*ConsistentHash, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &ConsistentHash{cfg: cfg}, nil
}

// Name returns "consistent-hash".
func (h *ConsistentHash) Name() string { return NameConsistentHash }

// SetMembers rebuilds the ring for the replica pool. Safe for concurrent use
// with Pick; it allocates.
func (h *ConsistentHash) SetMembers(members []RingMember) error {
	r, err := NewRing(members, h.cfg.VirtualNodes)
	if err != nil {
		return err
	}
	h.mu.Lock()
	h.ring.Store(r)
	h.mu.Unlock()
	return nil
}

// Ring returns the current ring (nil before the first SetMembers or Pick).
func (h *ConsistentHash) Ring() *Ring { return h.ring.Load() }

// ringFor returns a ring covering cands, rebuilding it if it does not.
func (h *ConsistentHash) ringFor(cands []Candidate) *Ring {
	if r := h.ring.Load(); r != nil && r.covers(cands) {
		return r
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	old := h.ring.Load()
	if old != nil && old.covers(cands) {
		return old
	}
	members := make([]RingMember, 0, len(cands)+8)
	for i := range cands {
		members = append(members, RingMember{ID: cands[i].ID, Name: cands[i].Name})
	}
	if old != nil {
		// Keep the old members unless a candidate took over their ID or name.
		members = append(members, old.members...)
	}
	r, err := NewRing(members, h.cfg.VirtualNodes)
	if err != nil { // unreachable: the config was validated
		panic(err)
	}
	h.ring.Store(r)
	return r
}

// Pick walks the ring from the key's position; see the type documentation.
func (h *ConsistentHash) Pick(req *Request, cands []Candidate, rng *Rand, explain *Explanation) Decision {
	r := h.ringFor(cands)
	n := len(cands)
	total := 0
	for i := range cands {
		total += cands[i].InFlight
	}
	capacity := max(int(math.Ceil(h.cfg.LoadFactor*float64(total+1)/float64(n))), h.cfg.MinCapacity)

	if explain != nil {
		explain.begin(NameConsistentHash, req, cands)
		explain.ScoreUnit = "ring_order"
		explain.Bound = float64(capacity)
		for i := range explain.Replicas {
			explain.Replicas[i].Filtered = FilteredNotReached
		}
	}

	sp, _ := h.scratch.Get().(*[]int32)
	if sp == nil {
		sp = new([]int32)
	}
	candOf := *sp
	if cap(candOf) < len(r.members) {
		candOf = make([]int32, len(r.members))
	}
	candOf = candOf[:len(r.members)]
	for i := range candOf {
		candOf[i] = -1
	}
	for i := range cands {
		// A candidate whose ID and name disagree with the ring (the caller
		// broke the one-to-one ID↔name contract) is simply not on it.
		if m := r.member(cands[i].ID); m >= 0 && r.members[m].Name == cands[i].Name {
			candOf[m] = int32(i)
		}
	}

	d := Decision{Index: -1, Selection: SelectionHashAffinity}
	seen := 0
	for step, start := 0, r.start(req.SessionKey); step < len(r.points) && seen < n; step++ {
		p := r.points[(start+step)%len(r.points)]
		ci := candOf[p.member]
		if ci < 0 {
			continue
		}
		candOf[p.member] = -1 // visit each candidate once
		seen++
		if explain != nil {
			explain.Replicas[ci].Score = float64(seen)
		}
		if cands[ci].InFlight+1 <= capacity {
			d.Index = int(ci)
			break
		}
		d.Selection = SelectionHashSpillover
		if explain != nil {
			explain.Replicas[ci].Filtered = FilteredOverCapacity
		}
	}
	*sp = candOf
	h.scratch.Put(sp)

	if d.Index < 0 {
		// Unreachable with consistent input (the least-loaded replica is
		// always under capacity when LoadFactor ≥ 1, and every candidate is
		// on the ring); kept so Pick never fails on inconsistent input.
		d.Index = leastInFlight(cands, rng)
		d.Selection = SelectionHashSpillover
	}
	if explain != nil {
		explain.finish(cands, d)
	}
	return d
}
