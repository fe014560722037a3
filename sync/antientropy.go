package sync

import (
	"context"
	"slices"
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
	node := originNode(d.Origin)
	c.dmu.Lock()
	c.digests[node] = digestEntry{at: time.Now(), sources: src}
	c.dmu.Unlock()
	c.checkKV(node, src)
}

// checkKV compares the fingerprints an engine owner's digest carries
// (srcKVAt, srcKVN, srcKVSum) with this gateway's view of the same engine
// and marks the engine diverged when they differ at the same watermark.
// Watermarks alone miss one loss: a gateway that knew nothing of an engine
// and missed the owner's first batches (its NATS was down, or the route to
// the owner's server not up yet) takes the next batch as the stream's
// start, and its watermark then equals the owner's. It runs when the
// digest arrives, a moment after the owner took its fingerprint, so that
// under a steady stream of batches the two views are still likely at the
// same seq.
func (c *Cluster) checkKV(node string, src map[string]uint64) {
	now := time.Now()
	for k, at := range src {
		r, ok := strings.CutPrefix(k, srcKVAt)
		if !ok || at == 0 || c.own.owned(r) || !c.kvOwn.accepts(r, node, now) {
			continue
		}
		mine, ok := c.ap.kvCheckOf(r, at)
		if !ok || mine.n == int(src[srcKVN+r]) && mine.sum == src[srcKVSum+r] {
			continue
		}
		c.m.kvDiverged.Inc()
		c.log.Warn("confirmed view of an engine differs from its owner's at the same seq; repairing from the owner",
			"replica", r, "owner", node, "seq", at-1, "blocks", mine.n, "owner_blocks", src[srcKVN+r])
		c.dmu.Lock()
		c.diverged[r] = node
		c.dmu.Unlock()
	}
}

// nextKVCheck returns the fingerprint of the next engine this gateway owns
// after *next in the KV sources' order (round robin: one engine per digest
// keeps digests small), ok false when it owns none with a complete view.
func (c *Cluster) nextKVCheck(next *int) (string, kvCheck, bool) {
	srcs := c.kvSources()
	for range srcs {
		*next = (*next + 1) % len(srcs)
		r := srcs[*next].Replica
		if !c.own.owned(r) {
			continue
		}
		if chk, ok := c.ap.kvCheckOf(r, 0); ok {
			return r, chk, true
		}
	}
	return "", kvCheck{}, false
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
	check := -1 // the KVSources position last fingerprinted
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
		if r, chk, ok := c.nextKVCheck(&check); ok {
			d.Sources = append(d.Sources, watermark{Source: srcKVAt + r, Seq: chk.at},
				watermark{Source: srcKVN + r, Seq: uint64(chk.n)}, watermark{Source: srcKVSum + r, Seq: chk.sum})
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
		peer, reason, force := c.driftPeer(mine)
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
		err = c.restoreFrom(rctx, m, false, lost, force)
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
		for r := range force {
			if c.diverged[r] == peer {
				delete(c.diverged, r)
			}
		}
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
// peer to repair from ("" = none), why, and the engines whose confirmed
// view the repair must take from it whatever the watermarks say (those
// checkKV found diverged from that owner's).
func (c *Cluster) driftPeer(mine map[string]uint64) (string, string, map[string]bool) {
	live := make(map[string]bool)
	for _, m := range c.ms.snapshot() {
		live[m.Name] = true
	}
	c.dmu.Lock()
	defer c.dmu.Unlock()
	if peer, force := c.divergedPeer(live); peer != "" {
		names := make([]string, 0, len(force))
		for r := range force {
			names = append(names, r)
		}
		slices.Sort(names)
		return peer, "confirmed view of " + strings.Join(names, ", ") + " differs from the owner's", force
	}
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
			if !c.comparable(s, live) || v <= mine[s] || !c.ap.leadUseful(s, d.sources, now) {
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
		return next[confirmed].peer, "behind on " + confirmed, nil
	}
	if best != "" && c.ap.hasLoss() {
		return best, "lost deltas", nil
	}
	return "", "", nil
}

// divergedPeer picks, among the live owners checkKV found a diverged
// engine view with, the first by name, and returns it with the engines to
// take from it. Entries of departed owners are dropped: the next owner's
// digest checks again. The caller holds dmu.
func (c *Cluster) divergedPeer(live map[string]bool) (string, map[string]bool) {
	peer := ""
	for r, node := range c.diverged {
		switch {
		case !live[node]:
			delete(c.diverged, r)
		case peer == "" || node < peer:
			peer = node
		}
	}
	if peer == "" {
		return "", nil
	}
	force := make(map[string]bool)
	for r, node := range c.diverged {
		if node == peer {
			force[r] = true
		}
	}
	return peer, force
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
