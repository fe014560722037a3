package sync

import (
	"context"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/index"
)

// digestEntry is a peer's latest digest.
type digestEntry struct {
	at      time.Time
	sources map[string]uint64
}

// lag is a source on which a peer was ahead of us at the last comparison.
type lag struct {
	want uint64
	peer string
}

func (c *Cluster) storeDigest(d *digest) {
	src := make(map[string]uint64, len(d.Sources))
	for _, w := range d.Sources {
		src[w.Source] = w.Seq
	}
	c.dmu.Lock()
	c.digests[originNode(d.Origin)] = digestEntry{at: time.Now(), sources: src}
	c.dmu.Unlock()
}

// digestLoop publishes this gateway's digest every DigestInterval and
// repairs drift: a source on which a peer was ahead one interval ago and
// still is, or a loss the applier saw (sequence gap, full queue), makes
// this gateway pull a snapshot from the most advanced peer, at most once
// per RepairMinInterval and only while NATS is up (else it would drift
// again at once).
func (c *Cluster) digestLoop(ctx context.Context) {
	t := time.NewTicker(c.cfg.DigestInterval)
	defer t.Stop()
	var msg []byte
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		mine := c.mySources()
		st := c.deps.Index.Stats()
		d := digest{Origin: c.origin, SentAt: time.Now().UnixNano(),
			Entries: [3]uint64{uint64(st.Entries[index.History]), uint64(st.Entries[index.Speculative]), uint64(st.Entries[index.Confirmed])}}
		for s, v := range mine {
			d.Sources = append(d.Sources, watermark{Source: s, Seq: v})
		}
		var err error
		if msg, err = appendDigest(msg[:0], &d); err == nil {
			if c.bus.publish(c.bus.subj.digest, msg) == nil {
				c.m.published.WithLabelValues("digest", "nats").Inc()
			}
		}
		if !c.bus.connected() {
			continue
		}
		peer, reason := c.driftPeer(mine)
		if peer == "" {
			continue
		}
		c.dmu.Lock()
		tooSoon := time.Since(c.lastRepair) < c.cfg.RepairMinInterval
		if !tooSoon {
			c.lastRepair = time.Now()
		}
		c.dmu.Unlock()
		if tooSoon {
			continue
		}
		m, ok := c.ms.member(peer)
		if !ok {
			continue
		}
		c.log.Info("anti-entropy repair", "peer", peer, "reason", reason)
		lost := c.ap.takeLoss()
		rctx, cancel := context.WithTimeout(ctx, c.cfg.BootstrapTimeout)
		err = c.restoreFrom(rctx, m, false, lost)
		cancel()
		if err != nil {
			c.m.repairs.WithLabelValues("error").Inc()
			c.ap.markLoss()
			c.log.Warn("anti-entropy repair failed", "peer", peer, "err", err)
			continue
		}
		c.m.repairs.WithLabelValues("ok").Inc()
		c.dmu.Lock()
		clear(c.behind)
		c.dmu.Unlock()
	}
}

// mySources are this gateway's watermarks as a digest carries them: the
// applier's, plus its own origin's published seq.
func (c *Cluster) mySources() map[string]uint64 {
	out := make(map[string]uint64)
	for _, w := range c.ap.sources() {
		out[w.Source] = w.Seq
	}
	out[srcDecisions+c.origin] = c.publishedSeq()
	return out
}

// driftPeer compares the peers' fresh digests with mine and returns the
// peer to repair from ("" = none) and why.
func (c *Cluster) driftPeer(mine map[string]uint64) (string, string) {
	live := make(map[string]bool)
	for _, m := range c.ms.snapshot() {
		live[m.Name] = true
	}
	c.dmu.Lock()
	defer c.dmu.Unlock()
	fresh := 3 * c.cfg.DigestInterval
	now := time.Now()
	best, bestAhead := "", uint64(0)
	next := make(map[string]lag)
	var confirmed string
	for node, d := range c.digests {
		if !live[node] || time.Since(d.at) > fresh {
			continue
		}
		var ahead uint64
		for s, v := range d.sources {
			if !c.comparable(s, live) || v <= mine[s] || !c.ap.leadSane(s, v, now) {
				continue
			}
			ahead += v - mine[s]
			if prev, ok := next[s]; !ok || v > prev.want {
				next[s] = lag{want: v, peer: node}
			}
			if old, ok := c.behind[s]; ok && mine[s] < old.want && confirmed == "" {
				confirmed = s
			}
		}
		if ahead > bestAhead {
			best, bestAhead = node, ahead
		}
	}
	c.behind = next
	if confirmed != "" {
		return next[confirmed].peer, "behind on " + confirmed
	}
	if best != "" && c.ap.hasLoss() {
		return best, "lost deltas"
	}
	return "", ""
}

// comparable reports whether a digest source should match across
// gateways: not our own origin, not a departed node's origin, not an
// engine we own (we are its source of truth).
func (c *Cluster) comparable(source string, live map[string]bool) bool {
	switch {
	case strings.HasPrefix(source, srcDecisions):
		o := source[len(srcDecisions):]
		return o != c.origin && live[originNode(o)]
	case strings.HasPrefix(source, srcKV):
		return !c.own.owned(source[len(srcKV):])
	}
	return false
}
