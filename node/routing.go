package node

import (
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/route"
)

// scratch holds one request's routing buffers; it is pooled so that the hot
// path allocates nothing in steady state. It is the routing core's load
// view (route.LoadView) over reps, the replicas routeOnce found available.
type scratch struct {
	tokens []uint32
	keys   []index.BlockKey
	ids    []index.ReplicaID
	reps   []*replica
	core   route.Scratch
	rng    route.Rand
	// peers and peerQueued are the peers' load reports for this call (nil
	// without peers).
	peers      PeerLoad
	peerQueued PeerQueuedPrefill
	// available is the number of replicas routeOnce found available.
	available int
	// failOpen is set by routeOnce when no replica passed its health
	// checks and it routed among those failing only them
	// (Config.HealthFailOpen).
	failOpen bool
	// keyCut is set by prepare when the prompt was keyed only in part
	// (MaxKeyTokens, MaxKeyPieceBytes or an unrenderable chat), so its
	// token count is not the prompt's length.
	keyCut bool
}

var _ route.LoadView = (*scratch)(nil)

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
	s.peers, s.peerQueued = nil, nil
	scratchPool.Put(s)
}

// Candidate fills c from reps[i]'s atomics and the peers' reports.
func (s *scratch) Candidate(i int, c *route.Candidate) {
	r := s.reps[i]
	local := int(r.inflight.Load())
	inflight, queued := local, 0
	if s.peers != nil {
		inflight += s.peers.InFlight(r.name)
	}
	if s.peerQueued != nil {
		queued = s.peerQueued.QueuedPrefill(r.name)
	}
	c.Name = r.name
	c.InFlight, c.LocalInFlight = inflight, local
	c.Running, c.Waiting, c.KVUsage = r.load()
	c.QueuedPrefillTokens = int(r.queuedPrefill.Load())
	c.PeerQueuedPrefillTokens = queued
	c.ScrapedQueuedPrefillTokens = int(r.scrapedQueued.Load())
	c.LastTokenAt, c.StepNanos = r.lastToken.Load(), r.stepNanos.Load()
	// Peers' reports and the scrape are stale by different amounts: with
	// peers the scrape is not compared with InFlight (route.Candidate).
	c.ScrapedInFlight = int(r.scrapedInFlight.Load())
	c.ScrapedInFlightKnown = s.peers == nil && c.ScrapedInFlight >= 0
	c.UnshownSent = int(r.unshownSent.Load())
	c.Sends = &r.sends
}

// PublishesKVEvents reports whether reps[i] publishes KV events.
func (s *scratch) PublishesKVEvents(i int) bool { return s.reps[i].cfg.PublishesKVEvents() }

// decision is the outcome of routing one request.
type decision struct {
	pool     *pool
	rep      *replica
	strategy route.Strategy
	route.Routed
	req    route.Request
	keyCut bool // the prompt was keyed in part (scratch.keyCut)
	// failOpen: every candidate was failing its /health polls
	// (Config.HealthFailOpen).
	failOpen bool
}

// routeOnce picks a replica of p for keys with strat, skipping exclude,
// through the routing core (route.Scratch.Route) with s as its load view.
// It takes one index read lock, allocates nothing in steady state and
// returns ErrNoHealthyReplica (with the earliest time one may return) when
// no replica is available. With Config.HealthFailOpen, replicas that fail
// only their /health polls count as available when no other does.
// A pin (pinStrategy: the pin header, or the replica that stored a
// Responses API response) makes the pinned replica the only candidate, so
// fail-open applies to it alone: a pinned request whose replica fails only
// its /health polls is sent to it rather than refused, since no other
// replica can serve it.
// explain, when non-nil, receives the reasoning.
func (n *Node) routeOnce(p *pool, strat route.Strategy, keys []index.BlockKey, rr *route.Request,
	s *scratch, exclude *replica, explain *route.Explanation) (decision, int64, error) {
	now := rr.Now
	s.ids = s.ids[:0]
	s.reps = s.reps[:0]
	s.failOpen = false
	earliest := int64(0)
	pin, pinned := strat.(pinStrategy)
	for _, r := range p.replicas {
		if r == exclude || pinned && r.name != pin.name {
			continue
		}
		if !r.available(now) {
			at := r.availableAt(now, n.downPollInterval())
			if earliest == 0 || at < earliest {
				earliest = at
			}
			continue
		}
		s.ids = append(s.ids, r.id)
		s.reps = append(s.reps, r)
	}
	if len(s.ids) == 0 && n.cfg.HealthFailOpen {
		for _, r := range p.replicas {
			if r != exclude && (!pinned || r.name == pin.name) && r.failingHealthOnly(now) {
				s.ids = append(s.ids, r.id)
				s.reps = append(s.reps, r)
			}
		}
		s.failOpen = len(s.ids) > 0
	}
	s.available = len(s.ids)
	if len(s.ids) == 0 {
		return decision{}, earliest, ErrNoHealthyReplica
	}
	s.peers = n.peerLoad()
	s.peerQueued = nil
	if s.peers != nil {
		s.peerQueued, _ = s.peers.(PeerQueuedPrefill)
	}
	out := s.core.Route(&route.Input{
		Keys: keys, Replicas: s.ids, Index: n.index, Mode: p.mode, Load: s,
		Strategy: strat, Rand: &s.rng, Explain: explain, Request: rr,
	})
	return decision{
		pool:     p,
		rep:      s.reps[out.Decision.Index],
		strategy: strat,
		Routed:   out,
		req:      *rr,
		keyCut:   s.keyCut,
		failOpen: s.failOpen,
	}, 0, nil
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
