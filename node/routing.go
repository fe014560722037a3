package node

import (
	"sync"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/route"
)

// scratch holds one request's routing buffers; it is pooled so that the hot
// path allocates nothing in steady state.
type scratch struct {
	tokens  []uint32
	keys    []index.BlockKey
	ids     []index.ReplicaID
	reps    []*replica
	matched []int32
	cands   []route.Candidate
	rng     route.Rand
	// available is the number of replicas routeOnce found available.
	available int
	// keyCut is set by prepare when the prompt was keyed only in part
	// (MaxKeyTokens, MaxKeyPieceBytes or an unrenderable chat), so its
	// token count is not the prompt's length.
	keyCut bool
}

var scratchPool = sync.Pool{New: func() any { return new(scratch) }}

func getScratch() *scratch { return scratchPool.Get().(*scratch) }

func putScratch(s *scratch) {
	const maxKeep = 1 << 16 // do not pin the buffers of a giant prompt
	if cap(s.tokens) > maxKeep*16 {
		s.tokens = nil
	}
	if cap(s.keys) > maxKeep {
		s.keys = nil
	}
	clear(s.reps[:cap(s.reps)])
	scratchPool.Put(s)
}

// decision is the outcome of routing one request.
type decision struct {
	pool      *pool
	rep       *replica
	strategy  route.Strategy
	d         route.Decision
	matched   int // blocks the picked replica was believed to hold
	uncached  int // prompt tokens it still has to prefill (estimate)
	req       route.Request
	keyCut    bool // the prompt was keyed in part (scratch.keyCut)
	candCount int
}

// routeOnce picks a replica of p for keys with strat, skipping exclude.
// It takes one index read lock, allocates nothing in steady state and
// returns ErrNoHealthyReplica (with the earliest time one may return) when
// no replica is available. explain, when non-nil, receives the reasoning.
func (n *Node) routeOnce(p *pool, strat route.Strategy, keys []index.BlockKey, rr *route.Request,
	s *scratch, exclude *replica, explain *route.Explanation) (decision, int64, error) {
	now := rr.Now
	s.ids = s.ids[:0]
	s.reps = s.reps[:0]
	earliest := int64(0)
	for _, r := range p.replicas {
		if r == exclude {
			continue
		}
		if !r.available(now) {
			at := r.availableAt(now, n.cfg.HealthInterval)
			if earliest == 0 || at < earliest {
				earliest = at
			}
			continue
		}
		s.ids = append(s.ids, r.id)
		s.reps = append(s.reps, r)
	}
	s.available = len(s.ids)
	if len(s.ids) == 0 {
		return decision{}, earliest, ErrNoHealthyReplica
	}
	if cap(s.matched) < len(s.ids) {
		s.matched = make([]int32, len(s.ids))
	}
	s.matched = s.matched[:len(s.ids)]
	n.index.Match(keys, s.ids, p.mode, now, s.matched)

	peers := n.peerLoad()
	var peerQueued PeerQueuedPrefill
	if peers != nil {
		peerQueued, _ = peers.(PeerQueuedPrefill)
	}
	s.cands = s.cands[:0]
	for i, r := range s.reps {
		local := int(r.inflight.Load())
		inflight, queued := local, 0
		if peers != nil {
			inflight += peers.InFlight(r.name)
		}
		if peerQueued != nil {
			queued = peerQueued.QueuedPrefill(r.name)
		}
		running, waiting, kv := r.load()
		s.cands = append(s.cands, route.Candidate{
			ID:                      r.id,
			Name:                    r.name,
			Matched:                 int(s.matched[i]),
			InFlight:                inflight,
			LocalInFlight:           local,
			Running:                 running,
			Waiting:                 waiting,
			KVUsage:                 kv,
			QueuedPrefillTokens:     int(r.queuedPrefill.Load()),
			PeerQueuedPrefillTokens: queued,
		})
	}
	d := strat.Pick(rr, s.cands, &s.rng, explain)
	c := &s.cands[d.Index]
	return decision{
		pool:      p,
		rep:       s.reps[d.Index],
		strategy:  strat,
		d:         d,
		matched:   c.Matched,
		uncached:  uncachedTokens(rr, c.Matched),
		req:       *rr,
		keyCut:    s.keyCut,
		candCount: len(s.cands),
	}, 0, nil
}

// uncachedTokens is the prompt work left on a replica holding matched
// leading blocks.
func uncachedTokens(r *route.Request, matched int) int {
	prompt := max(r.PromptTokens, r.TotalBlocks*r.BlockTokens)
	return max(prompt-matched*r.BlockTokens, 0)
}

// sessionKey is consistent-hash's key: the client's session id (the
// x-session-id header or the "user" field) when given, else the key of the
// prompt's first blocks (so same-prefix prompts share a replica), else the
// root key.
func sessionKey(session string, root index.BlockKey, keys []index.BlockKey) uint64 {
	if session != "" {
		return xxh3.HashString(session)
	}
	const affinityBlocks = 4
	switch {
	case len(keys) >= affinityBlocks:
		return uint64(keys[affinityBlocks-1])
	case len(keys) > 0:
		return uint64(keys[len(keys)-1])
	}
	return uint64(root)
}

// retryAfterSeconds turns the earliest availability into a Retry-After
// value: at least 1 second, rounded up.
func retryAfterSeconds(now, earliest int64) int {
	if earliest <= now {
		return 1
	}
	d := time.Duration(earliest - now)
	s := int((d + time.Second - 1) / time.Second)
	return max(s, 1)
}
