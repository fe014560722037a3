package sync

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// peerLoad aggregates one figure of peers' load reports (InFlight or
// QueuedPrefillTokens, as value picks) into an immutable view that the
// routing hot path reads without locks or allocation.
type peerLoad struct {
	ttl   time.Duration
	value func(*ReplicaLoad) int

	mu      sync.Mutex
	reports map[string]loadEntry // by origin
	// left holds when each departed node left (forget): a report of its
	// that arrives afterwards (sent before it left, delivered late) is
	// dropped for a TTL, or until the node joins again (rejoin).
	left map[string]time.Time

	view atomic.Pointer[map[string]int]
}

type loadEntry struct {
	at    time.Time // local receive time: peers' clocks do not matter
	loads []ReplicaLoad
}

func inFlightOf(l *ReplicaLoad) int      { return l.InFlight }
func queuedPrefillOf(l *ReplicaLoad) int { return l.QueuedPrefillTokens }

func newPeerLoad(ttl time.Duration, value func(*ReplicaLoad) int) *peerLoad {
	p := &peerLoad{ttl: ttl, value: value, reports: make(map[string]loadEntry), left: make(map[string]time.Time)}
	empty := map[string]int{}
	p.view.Store(&empty)
	return p
}

// report stores origin's latest report and republishes the view. A report
// of a node that left within the TTL is dropped: it was sent before the
// node left and delivered after its departure was handled (forget), and it
// would otherwise count for a whole TTL.
func (p *peerLoad) report(r *loadReport, now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	node := originNode(r.Origin)
	if at, ok := p.left[node]; ok {
		if now.Sub(at) <= p.ttl {
			return
		}
		delete(p.left, node)
	}
	p.reports[r.Origin] = loadEntry{at: now, loads: r.Loads}
	p.rebuildLocked(now)
}

// forget drops every report of a departed node, and the reports of its
// that arrive within the TTL (see report).
func (p *peerLoad) forget(node string, now time.Time) {
	p.mu.Lock()
	for o := range p.reports {
		if originNode(o) == node {
			delete(p.reports, o)
		}
	}
	p.left[node] = now
	p.rebuildLocked(now)
	p.mu.Unlock()
}

// rejoin counts node's reports again at once: it is a member again.
func (p *peerLoad) rejoin(node string) {
	p.mu.Lock()
	delete(p.left, node)
	p.mu.Unlock()
}

// expire drops reports older than the TTL; it returns the fresh count.
func (p *peerLoad) expire(now time.Time) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rebuildLocked(now)
}

func (p *peerLoad) rebuildLocked(now time.Time) int {
	view := make(map[string]int)
	fresh := 0
	for node, at := range p.left {
		if now.Sub(at) > p.ttl {
			delete(p.left, node)
		}
	}
	for o, e := range p.reports {
		if now.Sub(e.at) > p.ttl {
			delete(p.reports, o)
			continue
		}
		fresh++
		for i := range e.loads {
			if v := p.value(&e.loads[i]); v > 0 {
				view[e.loads[i].Replica] += v
			}
		}
	}
	p.view.Store(&view)
	return fresh
}

// InFlight is the sum of the live peers' latest reported in-flight requests
// to replica (0 when unknown). It implements node.PeerLoad: it takes no
// lock, does not allocate, and is safe for concurrent use. Reports of dead
// or silent peers stop counting after Config.LoadTTL.
func (c *Cluster) InFlight(replica string) int {
	return (*c.peers.view.Load())[replica]
}

// QueuedPrefill is the sum of the live peers' latest reported queued
// prefill tokens to replica: uncached prompt tokens they sent it whose
// first byte has not come back (0 when unknown, or when every peer runs a
// release that does not report it). It implements node.PeerQueuedPrefill
// with InFlight's rules: no lock, no allocation, safe for concurrent use;
// a peer's report stops counting after Config.LoadTTL without a refresh,
// or at once when the peer leaves or is declared dead.
func (c *Cluster) QueuedPrefill(replica string) int {
	return (*c.queued.view.Load())[replica]
}

// loadLoop publishes this gateway's load every LoadInterval and expires
// stale peer reports. The in-flight counts (kind 3) go out every interval;
// the queued prefill (kind 5) only while some replica has any, and once
// more when it drops to nothing, so an idle gateway sends one message per
// interval as before (a lost all-zero report is bounded by LoadTTL).
func (c *Cluster) loadLoop(ctx context.Context) {
	t := time.NewTicker(c.cfg.LoadInterval)
	defer t.Stop()
	var loads []ReplicaLoad
	var msg []byte
	subject := c.bus.subj.load(c.cfg.NodeName)
	queuedSubject := c.bus.subj.queued(c.cfg.NodeName)
	queuedSent := false // the last kind-5 report had a non-zero entry
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			fresh := c.peers.expire(now)
			c.queued.expire(now)
			c.m.peerLoadReports.Set(float64(fresh))
			if c.deps.Load == nil {
				continue
			}
			loads = c.deps.Load.AppendInFlight(loads[:0])
			r := loadReport{Origin: c.origin, SentAt: now.UnixNano(), Loads: loads}
			var err error
			if msg, err = appendLoad(msg[:0], &r); err != nil {
				c.log.Warn("encoding load report", "err", err)
				continue
			}
			// Load is fresh every interval: while NATS is down it is not
			// worth gossip bandwidth, and peers' reports simply expire.
			if err := c.bus.publish(subject, msg); err == nil {
				c.m.published.WithLabelValues("load", "nats").Inc()
			}
			queued := false
			for i := range loads {
				if loads[i].QueuedPrefillTokens > 0 {
					queued = true
					break
				}
			}
			if !queued && !queuedSent {
				continue
			}
			if msg, err = appendQueued(msg[:0], &r); err != nil {
				c.log.Warn("encoding queued prefill report", "err", err)
				continue
			}
			if err := c.bus.publish(queuedSubject, msg); err == nil {
				c.m.published.WithLabelValues("queued", "nats").Inc()
				queuedSent = queued
			}
		}
	}
}
