package route

import (
	"math"
	"sync"
)

// shareTau is the time constant, in seconds, over which a shareTable
// forgets: a request t seconds ago counts e^(−t/shareTau). Half a minute
// spans a few stream lifetimes at the seed's load (a 128-token answer
// holds its slot for 6–10 s), long enough that a prefix's share is not
// the luck of the last few arrivals and short enough that a prefix that
// turns hot counts as hot within a minute. In the discrete-event seed
// grid (five seeds, see Cost) 10, 30 and 60 s gave the same verdicts
// within one row.
const shareTau = 30.0

// shareSlots is the size of a shareTable: prefixes tracked at once (two
// slots are probed per key, so a popular prefix survives a colliding
// newcomer).
const (
	shareBits  = 10
	shareSlots = 1 << shareBits
)

// shareProbes returns key's two slots: its low bits, and the high bits
// of a multiplicative hash (which differ for keys that share low bits).
func shareProbes(key uint64) (i, j uint64) {
	return key % shareSlots, (key * 0x9e3779b97f4a7c15) >> (64 - shareBits)
}

// shareTable estimates each prefix's share of the requests a gateway
// routed recently: counts per Request.PrefixKey and a total, each
// decayed with time constant shareTau, in a fixed table (no allocation
// after construction). A key probes two slots; a new key takes the one
// whose count has decayed further, so the table keeps the prefixes that
// are still arriving and forgets one-off prompts. Safe for concurrent
// use.
type shareTable struct {
	mu    sync.Mutex
	at    int64 // time of the last update of total, ns
	total float64
	slots [shareSlots]shareSlot
}

type shareSlot struct {
	key uint64
	at  int64 // ns; 0: empty
	val float64
}

// share returns key's share of the recent requests at now (ns), in
// [0, 1], counting one more request with key first when add. A key not
// in the table has share 0; a table with no requests yet gives 0 too.
// A now before the last update counts as the same time.
func (s *shareTable) share(key uint64, now int64, add bool) float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.total = decay(s.total, s.at, now, shareTau)
	s.at = max(s.at, now)
	i, j := shareProbes(key)
	slot := (*shareSlot)(nil)
	switch {
	case s.slots[i].at != 0 && s.slots[i].key == key:
		slot = &s.slots[i]
	case s.slots[j].at != 0 && s.slots[j].key == key:
		slot = &s.slots[j]
	case add:
		// Take the emptier of the two slots.
		slot = &s.slots[i]
		if decay(s.slots[j].val, s.slots[j].at, now, shareTau) < decay(slot.val, slot.at, now, shareTau) {
			slot = &s.slots[j]
		}
		*slot = shareSlot{key: key}
	}
	if slot == nil {
		return 0
	}
	slot.val = decay(slot.val, slot.at, now, shareTau)
	slot.at = max(slot.at, now, 1)
	if add {
		slot.val++
		s.total++
	}
	if !(s.total > 0) {
		return 0
	}
	return min(slot.val/s.total, 1)
}

// duplication prices, for one Pick, the prefill a candidate would compute
// beyond the least any candidate computes: the part of the prompt another
// replica already holds (see Cost, duplicate prefill).
type duplication struct {
	// share is the prefix's share of the gateway's recent requests.
	share float64
	// weight is (1 − share·R)⁺ over R candidates: 1 for a prefix no
	// recent request shared, 0 for one whose traffic alone needs more
	// than one replica.
	weight float64
	// least is the fewest prompt tokens any candidate computes (engine
	// tokens).
	least float64
}

// duplication returns the duplicate-prefill pricing of req over cands,
// counting req in the prefix shares when add.
func (c *Cost) duplication(req *Request, cands []Candidate, add bool) duplication {
	d := duplication{share: c.model.shares.share(req.PrefixKey, req.Now, add)}
	d.weight = max(0, 1-d.share*float64(len(cands)))
	if d.weight == 0 {
		return d
	}
	d.least = math.Inf(1)
	for i := range cands {
		d.least = min(d.least, req.tokens(c.computedUnits(req, &cands[i])))
	}
	return d
}

// penalty is the duplicate-prefill term of a candidate's cost: computed
// engine tokens there at p seconds a token, stalling running decoding
// sequences.
func (d duplication) penalty(computed, p float64, running int) float64 {
	extra := computed - d.least
	if d.weight <= 0 || !(extra > 0) || running <= 0 {
		return 0
	}
	return d.weight * float64(running) * extra * p
}
