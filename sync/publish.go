package sync

import (
	"context"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/index"
)

// pendingDecision is one coalesced decision; its keys are keys[off:off+n]
// of the pending buffer.
type pendingDecision struct {
	replica string
	ledger  index.Ledger
	at      int64
	off, n  int
}

type pendingBuf struct {
	entries []pendingDecision
	keys    []index.BlockKey
}

// PublishDecision queues a routing decision (replica probably holds keys
// in ledger, decided at now, Unix ns) for every peer. Call it next to the
// gateway's own index.Record. It copies keys, never blocks on the network,
// and does not allocate once its buffers have grown; when the publisher is
// stuck beyond Config.MaxPendingEntries the decision is dropped and
// counted. Ledgers other than History and Speculative are ignored. Safe
// for concurrent use.
func (c *Cluster) PublishDecision(replica string, ledger index.Ledger, keys []index.BlockKey, now int64) {
	if len(keys) == 0 || ledger > index.Speculative || len(replica) > maxName || len(keys) > maxKeys {
		return
	}
	c.pmu.Lock()
	p := &c.pending
	if len(p.entries) >= c.cfg.MaxPendingEntries {
		c.pmu.Unlock()
		c.m.dropped.WithLabelValues("decisions", "pending_full").Inc()
		return
	}
	p.entries = append(p.entries, pendingDecision{replica: replica, ledger: ledger, at: now, off: len(p.keys), n: len(keys)})
	p.keys = append(p.keys, keys...)
	n := len(p.entries)
	c.pmu.Unlock()
	if n == 1 || n >= c.cfg.FlushEntries {
		select {
		case c.kick <- struct{}{}:
		default:
		}
	}
}

// flushLoop publishes pending decisions: at most FlushInterval after the
// first one arrives, or at once when FlushEntries are pending.
func (c *Cluster) flushLoop(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	var spare pendingBuf
	var msg []byte
	var batch DecisionBatch
	for {
		select {
		case <-ctx.Done():
			// Last decisions out, best effort (Shutdown closes NATS right
			// after; memberlist is still up for the fallback).
			c.pmu.Lock()
			cur := c.pending
			c.pending = pendingBuf{}
			c.pmu.Unlock()
			if len(cur.entries) > 0 {
				c.publishPending(&cur, &batch, msg)
			}
			return
		case <-c.kick:
		}
		c.pmu.Lock()
		n := len(c.pending.entries)
		c.pmu.Unlock()
		if n == 0 {
			continue
		}
		if n < c.cfg.FlushEntries {
			timer.Reset(c.cfg.FlushInterval)
			select {
			case <-ctx.Done():
				timer.Stop() // publish now; the outer loop then returns
			case <-timer.C:
			case <-c.kick:
				timer.Stop()
			}
		}
		c.pmu.Lock()
		cur := c.pending
		c.pending = spare
		c.pmu.Unlock()
		msg = c.publishPending(&cur, &batch, msg)
		cur.entries, cur.keys = cur.entries[:0], cur.keys[:0]
		spare = cur
		// More may have arrived while publishing.
		c.pmu.Lock()
		more := len(c.pending.entries) > 0
		c.pmu.Unlock()
		if more {
			select {
			case c.kick <- struct{}{}:
			default:
			}
		}
	}
}

// publishPending encodes p as batches of at most FlushEntries decisions and
// publishes them on NATS, or gossips them (split to fit a packet) while
// NATS is down.
func (c *Cluster) publishPending(p *pendingBuf, batch *DecisionBatch, msg []byte) []byte {
	for start := 0; start < len(p.entries); start += c.cfg.FlushEntries {
		end := min(start+c.cfg.FlushEntries, len(p.entries))
		batch.Entries = batch.Entries[:0]
		for _, e := range p.entries[start:end] {
			batch.Entries = append(batch.Entries, Decision{Replica: e.replica, Ledger: e.ledger, At: e.at, Keys: p.keys[e.off : e.off+e.n]})
		}
		if c.bus.connected() {
			msg = c.sendDecisions(batch, msg, "nats")
		} else {
			msg = c.gossipDecisions(batch.Entries, msg)
		}
	}
	return msg
}

// sendDecisions stamps batch with the next seq, encodes, remembers and
// sends it over transport ("nats" or "gossip").
func (c *Cluster) sendDecisions(batch *DecisionBatch, msg []byte, transport string) []byte {
	seq := c.pubSeq.Add(1)
	batch.Origin, batch.Seq, batch.SentAt = c.origin, seq, time.Now().UnixNano()
	var err error
	msg, err = AppendDecisions(msg[:0], batch)
	if err != nil {
		c.m.dropped.WithLabelValues("decisions", "encode_error").Add(float64(len(batch.Entries)))
		c.log.Warn("encoding decisions", "err", err)
		return msg
	}
	c.ring.add(seq, msg)
	switch transport {
	case "nats":
		if err := c.bus.publish(c.bus.subj.decisions, msg); err != nil {
			// Lost between the check and the send: gossip this one.
			c.ms.broadcastSplit(msg, c)
			transport = "gossip"
		}
	default:
		if c.testBroadcast != nil {
			c.testBroadcast(msg)
		} else {
			c.ms.broadcast(append([]byte(nil), msg...))
		}
	}
	c.m.published.WithLabelValues("decisions", transport).Inc()
	return msg
}

// gossipDecisions sends entries as batches small enough for one gossip
// packet each, splitting long key chains.
func (c *Cluster) gossipDecisions(entries []Decision, msg []byte) []byte {
	// Per-batch overhead: header 4, origin, seq and time 20, entry count 3
	// and a name table; size counts each entry's name once more, 16 bytes
	// of ledger, name index, age and key count, and 8 per key.
	budget := broadcastLimit - 40 - len(c.origin) - (maxName + 3)
	var part []Decision
	size := 0
	flush := func() {
		if len(part) > 0 {
			b := DecisionBatch{Entries: part}
			msg = c.sendDecisions(&b, msg, "gossip")
			part, size = nil, 0
		}
	}
	for _, e := range entries {
		keys := e.Keys
		for len(keys) > 0 {
			room := (budget - size - 16) / 8
			if room <= 0 {
				flush()
				continue
			}
			k := keys[:min(room, len(keys))]
			keys = keys[len(k):]
			part = append(part, Decision{Replica: e.Replica, Ledger: e.Ledger, At: e.At, Keys: k})
			size += 16 + len(e.Replica) + 8*len(k)
		}
	}
	flush()
	return msg
}

// broadcastSplit gossips an encoded decision batch that NATS refused,
// re-encoding it in packet-sized pieces when it is too large.
func (ms *membership) broadcastSplit(msg []byte, c *Cluster) {
	if len(msg) <= broadcastLimit {
		ms.broadcast(append([]byte(nil), msg...))
		return
	}
	m, err := decodeMessage(msg)
	if err != nil || m.Decisions == nil {
		return
	}
	c.gossipDecisions(m.Decisions.Entries, nil)
}

// publishedSeq is the seq of the last decision batch this gateway sent.
func (c *Cluster) publishedSeq() uint64 { return c.pubSeq.Load() }

// ownRing keeps this gateway's recent encoded decision batches so that
// after restoring a peer's snapshot it can re-apply those the peer had not
// applied yet. Only the flush goroutine adds; replay reads under mu.
type ownRing struct {
	mu    sync.Mutex
	seqs  []uint64
	msgs  [][]byte
	next  int
	count int
}

func newOwnRing(n int) *ownRing {
	return &ownRing{seqs: make([]uint64, n), msgs: make([][]byte, n)}
}

func (r *ownRing) add(seq uint64, msg []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seqs[r.next] = seq
	r.msgs[r.next] = append(r.msgs[r.next][:0], msg...)
	r.next = (r.next + 1) % len(r.seqs)
	r.count = min(r.count+1, len(r.seqs))
}

// after calls f for each kept batch with seq > seq, oldest first.
func (r *ownRing) after(seq uint64, f func([]byte)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	start := (r.next - r.count + len(r.seqs)) % len(r.seqs)
	for i := 0; i < r.count; i++ {
		j := (start + i) % len(r.seqs)
		if r.seqs[j] > seq {
			f(r.msgs[j])
		}
	}
}
