package sync

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// peerLoad aggregates peers' load reports into an immutable view that the
// routing hot path reads without locks or allocation.
type peerLoad struct {
	ttl time.Duration

	mu      sync.Mutex
	reports map[string]loadEntry // by origin

	view atomic.Pointer[map[string]int]
}

type loadEntry struct {
	at    time.Time // local receive time: peers' clocks do not matter
	loads []ReplicaLoad
}

func newPeerLoad(ttl time.Duration) *peerLoad {
	p := &peerLoad{ttl: ttl, reports: make(map[string]loadEntry)}
	empty := map[string]int{}
	p.view.Store(&empty)
	return p
}

// report stores origin's latest report and republishes the view.
func (p *peerLoad) report(r *LoadReport, now time.Time) {
	p.mu.Lock()
	p.reports[r.Origin] = loadEntry{at: now, loads: r.Loads}
	p.rebuildLocked(now)
	p.mu.Unlock()
}

// forget drops every report of a departed node.
func (p *peerLoad) forget(node string, now time.Time) {
	p.mu.Lock()
	for o := range p.reports {
		if originNode(o) == node {
			delete(p.reports, o)
		}
	}
	p.rebuildLocked(now)
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
	for o, e := range p.reports {
		if now.Sub(e.at) > p.ttl {
			delete(p.reports, o)
			continue
		}
		fresh++
		for _, l := range e.loads {
			view[l.Replica] += l.InFlight
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

// loadLoop publishes this gateway's load every LoadInterval and expires
// stale peer reports.
func (c *Cluster) loadLoop(ctx context.Context) {
	t := time.NewTicker(c.cfg.LoadInterval)
	defer t.Stop()
	var loads []ReplicaLoad
	var msg []byte
	subject := c.bus.subj.load(c.cfg.NodeName)
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			c.m.peerLoadReports.Set(float64(c.peers.expire(now)))
			if c.deps.Load == nil {
				continue
			}
			loads = c.deps.Load.AppendInFlight(loads[:0])
			r := LoadReport{Origin: c.origin, SentAt: now.UnixNano(), Loads: loads}
			var err error
			if msg, err = AppendLoad(msg[:0], &r); err != nil {
				c.log.Warn("encoding load report", "err", err)
				continue
			}
			// Load is fresh every interval: while NATS is down it is not
			// worth gossip bandwidth, and peers' reports simply expire.
			if err := c.bus.publish(subject, msg); err == nil {
				c.m.published.WithLabelValues("load", "nats").Inc()
			}
		}
	}
}
