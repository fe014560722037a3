package sync

import (
	"errors"
	"sync"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

// Owner returns the member that owns engine replica's KV-event stream
// among members: the highest rendezvous score xxh3(replica, seed =
// xxh3(member)). Every gateway computes the same owner from the same live
// set, and when a member leaves only its engines move.
func Owner(replica string, members []string) string {
	best, bestScore := "", uint64(0)
	for _, m := range members {
		s := xxh3.HashStringSeed(replica, xxh3.HashString(m))
		if best == "" || s > bestScore || s == bestScore && m < best {
			best, bestScore = m, s
		}
	}
	return best
}

// ownerTable is every KV source's owner in this gateway's membership view,
// the owner before it and when it changed: the applier accepts an engine's
// batches, resets and clears only from its owner (DESIGN §9). Safe for
// concurrent use.
type ownerTable struct {
	sources []string
	mu      sync.RWMutex
	m       map[string]ownerEntry
}

type ownerEntry struct {
	cur, prev string
	since     time.Time
}

func newOwnerTable(srcs []KVSource) *ownerTable {
	t := &ownerTable{m: make(map[string]ownerEntry, len(srcs))}
	for _, s := range srcs {
		t.sources = append(t.sources, s.Replica)
	}
	return t
}

// setSources replaces the sources: a removed one has no owner from now on,
// an added one gets its owner among members.
func (t *ownerTable) setSources(srcs []KVSource, members []Member, now time.Time) {
	names := make([]string, len(srcs))
	keep := make(map[string]bool, len(srcs))
	for i, s := range srcs {
		names[i] = s.Replica
		keep[s.Replica] = true
	}
	t.mu.Lock()
	t.sources = names
	for r := range t.m {
		if !keep[r] {
			delete(t.m, r)
		}
	}
	t.mu.Unlock()
	t.update(members, now)
}

// update recomputes the owners from the live members that are not
// leaving (the set owners.reconcile uses).
func (t *ownerTable) update(members []Member, now time.Time) {
	names := make([]string, 0, len(members))
	for _, m := range members {
		if !m.Meta.Leaving {
			names = append(names, m.Name)
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range t.sources {
		o := Owner(r, names)
		if e, ok := t.m[r]; !ok || e.cur != o {
			t.m[r] = ownerEntry{cur: o, prev: e.cur, since: now}
		}
	}
}

// accepts reports whether node may speak for replica's KV stream: it owns
// it in this gateway's view, or owned it until less than ownerGrace ago.
// An engine the cluster does not ingest has no owner.
func (t *ownerTable) accepts(replica, node string, now time.Time) bool {
	t.mu.RLock()
	e, ok := t.m[replica]
	t.mu.RUnlock()
	if !ok || node == "" {
		return false
	}
	return node == e.cur || node == e.prev && now.Sub(e.since) < ownerGrace
}

// owners runs a kvevents.Subscriber for each KV source this gateway owns
// and stops it when ownership moves. Only the membership event goroutine
// (and Start/Shutdown) call reconcile and stopAll.
type owners struct {
	c *Cluster

	mu   sync.Mutex
	subs map[string]ownedSource
	// repointed holds the sources whose publisher endpoint a
	// Cluster.SetKVSources changed, by replica, for repointWindow: the
	// gateway that owns such a source resets the replica's confirmed
	// blocks before it subscribes to the new publisher, whether or not it
	// ran the old subscriber. The old owner does so when it applies the
	// change; a gateway that takes the source over within the window
	// does too, in case the old owner left before it applied the change
	// (a second reset of a young stream costs a replay from its start).
	repointed map[string]repoint
}

// repoint is a source's new publisher endpoint and when it changed.
type repoint struct {
	endpoint string
	at       time.Time
}

// repointWindow bounds how long after a re-point a gateway taking the
// source over still resets it (see owners.repointed): long enough for an
// owner that left with the change unapplied to be declared gone, short
// enough that a later takeover keeps a healthy stream.
const repointWindow = 30 * time.Second

// ownedSource is a running subscriber and the source it was started for.
type ownedSource struct {
	sub *kvevents.Subscriber
	src KVSource
}

func newOwners(c *Cluster) *owners {
	return &owners{c: c, subs: make(map[string]ownedSource), repointed: make(map[string]repoint)}
}

// reconcile starts and stops subscribers to match the live member set and
// the KV sources (Cluster.SetKVSources may change them).
func (o *owners) reconcile() {
	c := o.c
	if c.leaving.Load() {
		return
	}
	ms := c.ms.snapshot()
	names := make([]string, 0, len(ms))
	for _, m := range ms {
		if !m.Meta.Leaving {
			names = append(names, m.Name)
		}
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	srcs := c.kvSources()
	listed := make(map[string]bool, len(srcs))
	for _, src := range srcs {
		listed[src.Replica] = true
	}
	for r, cur := range o.subs {
		if !listed[r] {
			o.closeSub(r, cur.sub)
			delete(o.subs, r)
			c.m.ownerChanges.Inc()
			c.log.Info("no longer a KV source: its subscriber stopped", "replica", r)
		}
	}
	now := time.Now()
	for r, rp := range o.repointed {
		if !listed[r] || now.Sub(rp.at) > repointWindow {
			delete(o.repointed, r)
		}
	}
	for _, src := range srcs {
		mine := Owner(src.Replica, names) == c.cfg.NodeName
		cur, running := o.subs[src.Replica]
		// Another publisher's blocks are not the old one's: the owner
		// resets them (applied here, and published ahead of the new
		// stream's first batch, so every gateway clears them in stream
		// order). A new replay endpoint alone is the same publisher.
		rp, repointed := o.repointed[src.Replica]
		repointed = repointed && rp.endpoint == src.Endpoint
		reset := false
		if running && mine && cur.src != src {
			// Its endpoints changed (a new engine under the same name):
			// subscribe to the new ones.
			o.closeSub(src.Replica, cur.sub)
			delete(o.subs, src.Replica)
			running = false
			reset = cur.src.Endpoint != src.Endpoint
			c.log.Info("KV source's endpoints changed: resubscribing", "replica", src.Replica,
				"endpoint", src.Endpoint, "replay", src.ReplayEndpoint)
		} else if repointed && mine && !running {
			reset = true // taken over: the old owner may not have reset it
		}
		if mine && repointed {
			delete(o.repointed, src.Replica)
		}
		if reset {
			(&ownerHandler{c: c, src: src}).HandleReset(src.Replica, kvevents.ResetSourceChanged)
			if m := c.deps.KVMetrics; m != nil {
				m.Resets.WithLabelValues(src.Replica, kvevents.ResetSourceChanged.String()).Inc()
			}
		}
		switch {
		case mine && !running:
			if err := o.startLocked(src); err != nil {
				c.log.Error("starting KV-event subscriber", "replica", src.Replica, "err", err)
				continue
			}
			c.m.ownerChanges.Inc()
			c.log.Info("now owning KV events", "replica", src.Replica)
		case !mine && running:
			o.closeSub(src.Replica, cur.sub)
			delete(o.subs, src.Replica)
			c.m.ownerChanges.Inc()
			c.log.Info("KV events moved to another gateway", "replica", src.Replica)
		}
	}
	c.m.owned.Set(float64(len(o.subs)))
}

func (o *owners) startLocked(src KVSource) error {
	c := o.c
	sc := kvevents.DefaultSubscriberConfig()
	sc.Replica = src.Replica
	sc.Endpoint = src.Endpoint
	sc.ReplayEndpoint = src.ReplayEndpoint
	if c.cfg.KVQueueSize > 0 {
		sc.QueueSize = c.cfg.KVQueueSize
	}
	if c.cfg.KVReplayTimeout > 0 {
		sc.ReplayTimeout = c.cfg.KVReplayTimeout
	}
	if c.cfg.GossipProfile == ProfileLocal {
		sc.ReconnectMin = 20 * time.Millisecond
		sc.ReconnectMax = 500 * time.Millisecond
	}
	if rp, ok := c.ap.resumePoint(src.Replica); ok {
		// This gateway's view already holds the engine's stream up to
		// rp (applied from the previous owner, or restored from a peer):
		// ask the engine only for what follows, not its whole buffer,
		// which every peer would then drop as duplicates.
		sc.Resume = &rp
	} else if c.ap.dropGapped(src.Replica) {
		c.log.Info("KV view missed batches: rebuilding it from the engine's replay", "replica", src.Replica)
	}
	h := &ownerHandler{c: c, src: src, hasher: c.deps.Index.Hasher()}
	sub, err := kvevents.NewSubscriber(sc, h, c.deps.KVMetrics, c.log.With("replica", src.Replica))
	if err != nil {
		return err
	}
	if err := sub.Start(c.bg); err != nil {
		return err
	}
	o.subs[src.Replica] = ownedSource{sub: sub, src: src}
	return nil
}

func (o *owners) closeSub(replica string, sub *kvevents.Subscriber) {
	if err := sub.Close(); err != nil && !errors.Is(err, kvevents.ErrClosed) {
		o.c.log.Warn("closing KV-event subscriber", "replica", replica, "err", err)
	}
}

// owned reports whether this gateway runs replica's subscriber.
func (o *owners) owned(replica string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	_, ok := o.subs[replica]
	return ok
}

func (o *owners) stopAll() {
	o.mu.Lock()
	defer o.mu.Unlock()
	for r, cur := range o.subs {
		o.closeSub(r, cur.sub)
		delete(o.subs, r)
	}
	o.c.m.owned.Set(0)
}

// ownerHandler normalizes one owned engine's batches, applies them here
// and republishes them for the peers.
type ownerHandler struct {
	c      *Cluster
	src    KVSource
	hasher index.Hasher
	batch  KVBatch
	msg    []byte
}

var _ kvevents.Handler = (*ownerHandler)(nil)

// HandleBatch implements kvevents.Handler.
func (h *ownerHandler) HandleBatch(replica string, seq kvevents.Seq, b *kvevents.Batch) {
	kb := &h.batch
	*kb = KVBatch{Origin: h.c.origin, Replica: replica, Seq: uint64(seq), EngineTS: b.TS,
		SentAt: time.Now().UnixNano(), Events: kb.Events[:0]}
	// One place decides the medium, the root (LoRA, cache salt) and which
	// blocks are indexable, exactly as the gateway keys requests. Reusing
	// kb.Events' buffers is safe: the batch is applied and encoded before
	// this returns.
	kb.Events = kvevents.Normalize(h.hasher, h.src.Model, b, kb.Events)
	h.c.ap.applyLocal(kb)
	h.publish(kb)
}

// HandleReset implements kvevents.Handler.
func (h *ownerHandler) HandleReset(replica string, reason kvevents.ResetReason) {
	kb := &KVBatch{Origin: h.c.origin, Replica: replica, SentAt: time.Now().UnixNano(), Reset: true, Reason: uint8(reason)}
	h.c.ap.applyLocal(kb)
	h.publish(kb)
}

func (h *ownerHandler) publish(kb *KVBatch) {
	var err error
	h.msg, err = AppendKV(h.msg[:0], kb)
	if err != nil {
		h.c.m.dropped.WithLabelValues("kv", "encode_error").Inc()
		h.c.log.Warn("encoding KV batch", "replica", kb.Replica, "err", err)
		return
	}
	if err := h.c.bus.publish(h.c.bus.subj.kv(kb.Replica), h.msg); err != nil {
		// Peers see the seq gap when NATS returns and repair.
		h.c.m.dropped.WithLabelValues("kv", "publish_error").Inc()
		return
	}
	h.c.m.published.WithLabelValues("kv", "nats").Inc()
}
