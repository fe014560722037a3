package node

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/route"
)

// table is one immutable routing configuration: the pools, the model and
// adapter names that reach them, and the replicas. A request loads the
// Node's current table once and uses that snapshot to its end; a config
// apply builds a new table and swaps the pointer, so no request ever sees
// half a config. Replicas whose definition did not change are carried over
// (same *replica: in-flight counts, health and learned rates survive a
// reload); a removed replica is simply absent from the new table, so it
// gets no new traffic while the streams that hold it finish.
type table struct {
	// version is the raft config version the table was built from; 0 for
	// the Node's own Config.
	version  uint64
	strategy string // default strategy of a model that names none
	route    route.Config
	pools    []*pool
	models   map[string]modelRef
	replicas []*replica
	byName   map[string]*replica
	// digest identifies the routing config (specDigest): gateways that
	// route alike show the same digest, whatever their version counters.
	digest string
}

// routingSpec is what a table is built from: the routing part of a node
// Config, or a raft RoutingConfig converted to it.
type routingSpec struct {
	version  uint64
	strategy string
	mode     string // default index mode
	route    route.Config
	models   []ModelConfig
}

// specFromConfig is the routing part of the Node's own Config.
func specFromConfig(c *Config) routingSpec {
	return routingSpec{strategy: c.Strategy, mode: c.IndexMode, route: c.Route, models: c.Models}
}

// maxForeignReplicas bounds the IDs handed out for names that peers
// mention before this gateway's routing table has them (see
// replicaIDs.ReplicaID), so a confused peer cannot use up the index's
// ID space.
const maxForeignReplicas = 1024

// replicaIDs maps replica names to process-local index.ReplicaIDs. An ID
// is assigned at a name's first appearance and never reused, so a replica
// that leaves and comes back keeps its ID, and deltas about a name always
// land on one ledger column. Safe for concurrent use.
type replicaIDs struct {
	mu      sync.RWMutex
	byName  map[string]index.ReplicaID
	names   []string // by ID
	foreign int      // IDs assigned for names peers mentioned first
}

func newReplicaIDs() *replicaIDs { return &replicaIDs{byName: map[string]index.ReplicaID{}} }

// assign returns name's ID, allocating one for a new name.
func (m *replicaIDs) assign(name string) (index.ReplicaID, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if id, ok := m.byName[name]; ok {
		return id, nil
	}
	if len(m.names) >= index.MaxReplicas {
		return 0, fmt.Errorf("%w: more than %d distinct replica names", ErrInvalidConfig, index.MaxReplicas)
	}
	id := index.ReplicaID(len(m.names))
	m.byName[name] = id
	m.names = append(m.names, name)
	return id, nil
}

// ReplicaID implements sync.Replicas. A name this gateway has not seen
// yet gets an ID too (up to maxForeignReplicas such names): a peer's
// snapshot or deltas may name a replica that a config change added before
// this gateway applied it (a restarted gateway restores the index before
// its raft config catches up). Its entries are then kept, and the replica
// routes on them as soon as the config adds it.
func (m *replicaIDs) ReplicaID(name string) (index.ReplicaID, bool) {
	m.mu.RLock()
	id, ok := m.byName[name]
	m.mu.RUnlock()
	if ok || name == "" {
		return id, ok
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if id, ok := m.byName[name]; ok {
		return id, true
	}
	if m.foreign >= maxForeignReplicas || len(m.names) >= index.MaxReplicas {
		return 0, false
	}
	m.foreign++
	id = index.ReplicaID(len(m.names))
	m.byName[name] = id
	m.names = append(m.names, name)
	return id, true
}

// ReplicaName implements sync.Replicas.
func (m *replicaIDs) ReplicaName(id index.ReplicaID) (string, bool) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if int(id) >= len(m.names) {
		return "", false
	}
	return m.names[id], true
}

// tableChange is what a rebuild did to the replica set.
type tableChange struct {
	added   []*replica // new *replica objects (new names or changed definitions)
	removed []*replica // objects no longer in the table
	dropped []*replica // removed and their name is gone: index entries dropped
}

// buildTable builds the table for spec. prev (nil at New) supplies the
// replicas and strategy sets to carry over. It touches the index only to
// register new replicas' roots and publisher flags, which routing reads
// under the index lock.
func (n *Node) buildTable(spec routingSpec, prev *table) (*table, tableChange, error) {
	var ch tableChange
	defMode, err := index.ParseMode(spec.mode)
	if err != nil {
		return nil, ch, fmt.Errorf("%w: index_mode: %w", ErrInvalidConfig, err)
	}
	t := &table{version: spec.version, strategy: spec.strategy, route: spec.route,
		models: map[string]modelRef{}, byName: map[string]*replica{}}
	sameRoute := prev != nil && reflect.DeepEqual(prev.route, spec.route)
	prevPools := map[string]*pool{}
	if prev != nil {
		for _, p := range prev.pools {
			prevPools[p.model] = p
		}
	}
	for _, mc := range spec.models {
		if _, dup := t.models[mc.Name]; dup {
			return nil, ch, fmt.Errorf("%w: model %q appears twice", ErrInvalidConfig, mc.Name)
		}
		var set *route.Set
		if pp := prevPools[mc.Name]; sameRoute && pp != nil {
			set = pp.set // keeps the cost model's learned rates
		} else if set, err = route.NewSet(n.routeConfig(spec.route)); err != nil {
			return nil, ch, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
		p := &pool{model: mc.Name, strategy: mc.Strategy, set: set, mode: defMode, sharedStore: mc.SharedResponseStore,
			failingOpen: new(atomic.Bool)}
		if pp := prevPools[mc.Name]; pp != nil {
			p.failingOpen = pp.failingOpen
		}
		// Exported at 0 from the start, so that an alert's increase()
		// sees the first fail-open decisions (a series born at 9 shows
		// no increase until its next sample).
		n.m.failOpen.WithLabelValues(mc.Name)
		if p.tok, err = n.modelTokenizer(mc.Tokenizer); err != nil {
			return nil, ch, fmt.Errorf("%w: model %q: tokenizer: %w", ErrInvalidConfig, mc.Name, err)
		}
		if mc.IndexMode != "" {
			if p.mode, err = index.ParseMode(mc.IndexMode); err != nil {
				return nil, ch, fmt.Errorf("%w: model %q: %w", ErrInvalidConfig, mc.Name, err)
			}
		}
		rcs, err := expandRanks(mc.Replicas)
		if err != nil {
			return nil, ch, fmt.Errorf("model %q: %w", mc.Name, err)
		}
		members := make([]route.RingMember, 0, len(rcs))
		for _, rc := range rcs {
			if _, dup := t.byName[rc.Name]; dup {
				return nil, ch, fmt.Errorf("%w: replica %q appears twice", ErrInvalidConfig, rc.Name)
			}
			id, err := n.ids.assign(rc.Name)
			if err != nil {
				return nil, ch, err
			}
			var r *replica
			if prev != nil {
				if old := prev.byName[rc.Name]; old != nil && old.model == mc.Name && old.cfg == rc {
					r = old
				}
			}
			if r == nil {
				if r, err = newReplica(id, rc, mc.Name); err != nil {
					return nil, ch, fmt.Errorf("%w: replica %q: %w", ErrInvalidConfig, rc.Name, err)
				}
				r.mInflight = n.m.inflight.WithLabelValues(r.name)
				r.mPicked = n.m.replicaDecisions.WithLabelValues(mc.Name, r.name)
				r.mPast = n.m.pastTarget.WithLabelValues(mc.Name, r.name)
				r.mTTFT = n.m.ttft.WithLabelValues(r.name)
				r.mTTFTEst = n.m.ttftEstimate.WithLabelValues(r.name)
				r.mHealthy = n.m.healthy.WithLabelValues(r.name)
				r.mScrape = n.m.scrapeInterval.WithLabelValues(r.name)
				ch.added = append(ch.added, r)
			}
			p.replicas = append(p.replicas, r)
			t.replicas = append(t.replicas, r)
			t.byName[r.name] = r
			members = append(members, route.RingMember{ID: r.id, Name: r.name})
		}
		if err := set.ConsistentHash.SetMembers(members); err != nil {
			return nil, ch, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
		t.pools = append(t.pools, p)
		t.models[mc.Name] = modelRef{pool: p}
		for _, a := range mc.Adapters {
			if _, dup := t.models[a]; dup {
				return nil, ch, fmt.Errorf("%w: model or adapter %q appears twice", ErrInvalidConfig, a)
			}
			t.models[a] = modelRef{pool: p, lora: a}
		}
	}
	if prev != nil {
		for _, old := range prev.replicas {
			if t.byName[old.name] == old {
				continue
			}
			ch.removed = append(ch.removed, old)
			if t.byName[old.name] == nil {
				ch.dropped = append(ch.dropped, old)
			}
		}
	}
	for _, r := range ch.added {
		n.index.SetPublishesEvents(r.id, r.cfg.PublishesKVEvents())
		n.index.SetReplicaRoot(r.id, n.hasher.Root(r.model, "", ""))
		r.mHealthy.Set(1)
	}
	return t, ch, nil
}

// modelTokenizer resolves a model's Tokenizer field: nil for "" or the
// gateway's own local tokenizer (the pool keys with the global one), else
// the tokenizer called name, loaded at its first use and cached by name
// in n.modelToks (an HF tokenizer takes a second or two to load). Only
// tiktoken and hf:<dir> are accepted, and only when the global tokenizer
// keys in token space: with character the block size counts bytes. Called
// under reloadMu.
func (n *Node) modelTokenizer(name string) (*keyTokenizer, error) {
	local := n.tokName
	if local == TokenizerRemote {
		local = TokenizerTiktoken
	}
	switch {
	case name == "" || name == local:
		return nil, nil
	case name != TokenizerTiktoken && !(strings.HasPrefix(name, TokenizerHFPrefix) && len(name) > len(TokenizerHFPrefix)):
		return nil, fmt.Errorf("%q unknown (want tiktoken or hf:<dir>)", name)
	case n.tokName == TokenizerCharacter:
		return nil, fmt.Errorf("%q needs a token-space global tokenizer (tiktoken, remote or hf:<dir>); this gateway keys with character", name)
	}
	if kt := n.modelToks[name]; kt != nil {
		return kt, nil
	}
	kt, _, err := newKeyTokenizer(name, n.cfg.TokenizerCacheBytes)
	if err != nil {
		return nil, err
	}
	n.modelToks[name] = &kt
	return &kt, nil
}

// applySpec rebuilds the routing table from spec and swaps it in: new
// replicas get KV-event subscribers (unless the cluster ingests them) and
// probes, removed ones stop being probed and subscribed, and their index
// entries go when their name left the config. Serialised by reloadMu.
func (n *Node) applySpec(spec routingSpec) error {
	n.reloadMu.Lock()
	defer n.reloadMu.Unlock()
	if err := n.applySpecLocked(spec); err != nil {
		return err
	}
	n.baseSpec = spec
	return nil
}

// applySpecLocked is applySpec under reloadMu: spec with the discovered
// replicas in (withDiscovered) becomes the table.
func (n *Node) applySpecLocked(spec routingSpec) error {
	spec = n.withDiscovered(spec)
	prev := n.tbl.Load()
	t, ch, err := n.buildTable(spec, prev)
	if err != nil {
		return err
	}
	t.digest = specDigest(spec)
	running := n.running.Load()
	for _, r := range ch.added {
		if err := n.newSubscriber(r); err != nil {
			n.log.Error("replica's KV-event subscriber not created", "replica", r.name, "err", err)
		}
	}
	n.tbl.Store(t)
	// Before the dropped replicas' series go: a removed engine's owner
	// stops its subscriber here, so nothing re-creates them.
	n.pushKVSources()
	inUse := map[*keyTokenizer]bool{}
	for _, p := range t.pools {
		inUse[p.tok] = true
	}
	for name, kt := range n.modelToks {
		if !inUse[kt] {
			delete(n.modelToks, name) // requests still holding the old table keep their pointer
		}
	}
	for _, r := range ch.removed {
		r.stopBackground(n.log)
		delete(n.probeDone, r)
	}
	if prev != nil {
		for _, r := range ch.added {
			if old := prev.byName[r.name]; old != nil {
				n.forgetReplaced(old, r)
			}
		}
	}
	for _, r := range ch.dropped {
		n.index.DropReplica(r.id)
		n.forgetSeries(r)
		n.forgetChecks(r)
	}
	if running {
		for _, r := range ch.added {
			n.startReplica(r)
		}
	}
	n.tableVersion.Store(t.version)
	if prev != nil {
		was := map[string]string{}
		for _, p := range prev.pools {
			was[p.model] = p.tok.nameOrGlobal()
		}
		for _, p := range t.pools {
			if old, ok := was[p.model]; ok && old != p.tok.nameOrGlobal() {
				n.log.Info("model's tokenizer changed: its prompts are keyed with the new one from now on",
					"model", p.model, "from", old, "to", p.tok.nameOrGlobal())
				if running {
					n.reprobe(p, ch.added)
				}
			}
		}
		n.log.Info("routing config applied", "version", t.version, "models", len(t.pools),
			"replicas", len(t.replicas), "added", len(ch.added), "removed", len(ch.removed),
			"strategy", t.strategy)
	}
	return nil
}

// forgetReplaced clears what the index knows of old's engine when r, the
// new definition under old's name, stands for another engine: a new
// address (a pod replaced under a stable name) forgets its confirmed,
// speculative and history entries, a new KV-event source (kv or kv_bind)
// its confirmed and speculative ones. Kept, they would steer prompts to an
// engine that never cached them until eviction events that will never
// come. Called under reloadMu after old's subscriber stopped and before
// r's starts, so no batch of the old engine lands after the clear and
// none of the new one before it. The cluster's owner of a KV source it
// ingests clears that replica's confirmed entries for every gateway, in
// stream order (sync's owner resets a re-pointed source), so a gateway of
// a cluster leaves them to it.
func (n *Node) forgetReplaced(old, r *replica) {
	newAddr := old.base.Scheme != r.base.Scheme || old.base.Host != r.base.Host
	newKV := old.cfg.KVEndpoint != r.cfg.KVEndpoint || old.cfg.KVBind != r.cfg.KVBind
	if !newAddr && !newKV {
		return
	}
	ledgers := []index.Ledger{index.Speculative}
	if newAddr {
		ledgers = append(ledgers, index.History)
	}
	if !n.clusterIngests(r) {
		ledgers = append(ledgers, index.Confirmed)
		if newKV && old.cfg.PublishesKVEvents() {
			// Counted where the confirmed view is dropped: here, or
			// (in a cluster) by the source's owner.
			n.kvMetrics.Resets.WithLabelValues(r.name, kvevents.ResetSourceChanged.String()).Inc()
		}
	}
	removed := n.index.ClearLedgers(r.id, ledgers...)
	n.log.Info("replica now names another engine: what the index knew of the old one is dropped",
		"replica", r.name, "new_address", newAddr, "new_kv_source", newKV, "entries", removed)
}

// reprobe restarts the probe loops of p's carried-over replicas after
// p's tokenizer changed, so their tokenizer agreement verdicts (and the
// model's switch to the engine's /tokenize) are those of the new
// tokenizer, not of the one they were probed with. added replicas have a
// fresh loop already. Called under reloadMu with the Node running.
func (n *Node) reprobe(p *pool, added []*replica) {
	for _, r := range p.replicas {
		if r.cancel == nil || slices.Contains(added, r) {
			continue
		}
		r.cancel()
		ctx, cancel := context.WithCancel(n.bgCtx)
		r.cancel = cancel
		n.runProbeLoop(ctx, r)
	}
}

// runProbeLoop runs r's probe loop on ctx once the loop it replaces (if
// any) has returned: a replica's loop is the only writer of its health
// and agreement state, so two must never overlap. Called under reloadMu.
func (n *Node) runProbeLoop(ctx context.Context, r *replica) {
	after := n.probeDone[r]
	done := make(chan struct{})
	n.probeDone[r] = done
	n.goFunc(func() {
		defer close(done)
		if after != nil {
			<-after
			if ctx.Err() != nil {
				return
			}
		}
		n.probeLoop(ctx, r)
	})
}

// startReplica starts r's probe loop and KV-event subscriber; they stop
// with stopBackground or at Shutdown. Called with the Node running.
func (n *Node) startReplica(r *replica) {
	ctx, cancel := context.WithCancel(n.bgCtx)
	r.cancel = cancel
	n.runProbeLoop(ctx, r)
	if r.sub != nil {
		if err := r.sub.Start(n.bgCtx); err != nil {
			n.log.Error("replica's KV-event subscriber did not start", "replica", r.name, "err", err)
		}
	}
}

// stopBackground stops r's probe loop and closes its subscriber (in-flight
// requests to r are not touched: they finish).
func (r *replica) stopBackground(log interface {
	Warn(string, ...any)
}) {
	if r.cancel != nil {
		r.cancel()
	}
	if r.sub != nil {
		if err := r.sub.Close(); err != nil && !errors.Is(err, kvevents.ErrClosed) {
			log.Warn("closing KV-event subscriber", "replica", r.name, "err", err)
		}
	}
}

// routeConfig is rc as this gateway runs it: outside a cluster no peer
// reports load, other senders to the same engines show only in the scrapes,
// so an unset PeerLoadDelaySeconds is the interval the gateway scrapes at
// while they show (Config.SharedScrapeInterval, else ScrapeInterval; see
// route.Config.PeerLoadDelaySeconds; the DES does the same for isolated
// gateways).
func (n *Node) routeConfig(rc route.Config) route.Config {
	if rc.PeerLoadDelaySeconds == 0 && n.cl == nil && n.cfg.ScrapeInterval > 0 {
		rc.PeerLoadDelaySeconds = n.cfg.ScrapeInterval.Seconds()
		if s := n.cfg.sharedScrape(); s > 0 {
			// The replicas other senders share are scraped this often.
			rc.PeerLoadDelaySeconds = s.Seconds()
		}
	}
	return rc
}
