package sync

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
	peerv1 "github.com/kvmesh/kvmesh/proto/peer/v1"
)

// Replicas maps replica names, which travel between gateways, to the
// index's process-local ReplicaIDs and back. Both methods are called
// concurrently and must not block.
type Replicas interface {
	ReplicaID(name string) (index.ReplicaID, bool)
	ReplicaName(id index.ReplicaID) (string, bool)
}

// LoadSource reports this gateway's exact load per replica: in-flight
// counts and queued prefill tokens (ReplicaLoad's fields). It is called
// every Config.LoadInterval from the Cluster's load goroutine (never
// concurrently with itself) and must not block.
type LoadSource interface {
	// AppendInFlight appends one entry per replica to dst and returns it,
	// with InFlight and QueuedPrefillTokens set (the name is historical).
	AppendInFlight(dst []ReplicaLoad) []ReplicaLoad
}

// Deps are the Cluster's collaborators, owned by the caller.
type Deps struct {
	// Index is the gateway's prefix index; peers' deltas are applied to it
	// and snapshots are taken from it. Required.
	Index *index.Index
	// Replicas resolves replica names. Required.
	Replicas Replicas
	// Load is this gateway's in-flight source; nil publishes no load.
	Load LoadSource
	// Registerer receives the kvmesh_sync_* metrics; nil registers none.
	Registerer prometheus.Registerer
	// KVMetrics are the owners' subscriber counters (shared with the node's
	// own subscribers, registered by the caller); nil keeps them private.
	KVMetrics *kvevents.Metrics
	// Logger; nil discards.
	Logger *slog.Logger
	// Transport replaces memberlist's UDP/TCP transport (a MemNetwork
	// transport in tests); nil binds Config.GossipAddr.
	Transport memberlist.Transport
	// AfterRestore, when set, is called after every snapshot restore, before
	// any further delta is applied. It must not call the Cluster. Restores
	// keep this index's replica roots and publisher flags
	// (index.KeepReplicaSettings), so nothing needs re-applying.
	AfterRestore func()
	// PeerServices, when set, registers more gRPC services on the peer
	// port at Start (node registers the config store's forwarding there):
	// they get the peer port's security, mutual TLS under the cluster CA,
	// so only gateways that proved the cluster key reach them.
	PeerServices func(grpc.ServiceRegistrar)
}

// Cluster makes this gateway one of N that share an index and a load view.
// See the package documentation for the contract.
type Cluster struct {
	cfg    Config
	deps   Deps
	log    *slog.Logger
	m      *metrics
	ms     *membership
	bus    *bus
	ap     *applier
	peers  *peerLoad // peers' in-flight counts
	queued *peerLoad // peers' queued prefill tokens
	own    *owners
	kvOwn  *ownerTable // who may speak for each engine (applier)
	ring   *ownRing
	origin string // "<node>#<incarnation>": a restarted gateway is a new origin

	// Decision publishing (PublishDecision → flushLoop).
	pmu     sync.Mutex
	pending pendingBuf
	kick    chan struct{}
	pubSeq  atomic.Uint64

	// Anti-entropy.
	dmu        sync.Mutex
	digests    map[string]digestEntry // by node name
	behind     map[string]lag         // by source
	diverged   map[string]string      // engine → owner whose view differs (checkKV)
	lastRepair time.Time

	// srcs are the engines whose KV events the cluster ingests
	// (Config.KVSources, then SetKVSources); replaced, never modified.
	setSrcMu sync.Mutex // serialises SetKVSources
	srcMu    sync.RWMutex
	srcs     []KVSource

	// routeMu orders syncRoutes' updates of the embedded server's routes.
	routeMu    sync.Mutex
	routeHold  time.Duration // natsRouteHold (tests shorten it)
	routeTimer *time.Timer   // ends the next held route
	routesDone bool          // torn down: no more updates

	grpcSrv *grpc.Server
	peerLis net.Listener
	sec     *peerSecurity

	// onApplied, when set (tests, benchmarks), sees every applied peer
	// decision batch with the local apply time.
	onApplied func(b *DecisionBatch, appliedAt int64)
	// testBroadcast, when set (tests), receives gossip fallback messages
	// instead of memberlist.
	testBroadcast func(msg []byte)

	mu       sync.Mutex
	started  bool
	stopped  bool
	ready    atomic.Bool // bootstrap done: owners may start
	bg       context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	stopOnce sync.Once
	leaving  atomic.Bool
}

// New validates cfg and deps and registers the metrics; nothing is opened
// before Start.
func New(cfg Config, deps Deps) (*Cluster, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if deps.Index == nil || deps.Replicas == nil {
		return nil, fmt.Errorf("%w: Deps.Index and Deps.Replicas are required", ErrInvalidConfig)
	}
	log := deps.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("component", "sync", "node", cfg.NodeName)
	c := &Cluster{cfg: cfg, deps: deps, log: log,
		origin:    cfg.NodeName + "#" + strconv.FormatInt(time.Now().UnixNano(), 36),
		kick:      make(chan struct{}, 1),
		routeHold: natsRouteHold,
		digests:   make(map[string]digestEntry),
		behind:    make(map[string]lag),
		diverged:  make(map[string]string),
	}
	c.m = newMetrics(func() bool { return c.bus.connected() })
	c.bus = newBus(cfg, log, c.m.natsRejected, c.m.natsDrops)
	var err error
	if c.sec, err = newPeerSecurity(cfg, c.m.peerRejected, c.m.peerInput); err != nil {
		return nil, err
	}
	if err := c.m.register(deps.Registerer); err != nil {
		return nil, err
	}
	c.ms = newMembership(cfg, log, c.m, c.onGossip)
	c.ap = newApplier(c)
	c.peers = newPeerLoad(cfg.LoadTTL, inFlightOf)
	c.queued = newPeerLoad(cfg.LoadTTL, queuedPrefillOf)
	c.own = newOwners(c)
	c.srcs = slices.Clone(cfg.KVSources)
	c.kvOwn = newOwnerTable(c.srcs)
	c.ring = newOwnRing(cfg.OwnRing)
	return c, nil
}

// Config returns the configuration the Cluster was built with.
func (c *Cluster) Config() Config { return c.cfg }

// Origin is this incarnation's origin id in deltas ("<node>#<incarnation>").
func (c *Cluster) Origin() string { return c.origin }

// Start opens the transports, joins the seeds, bootstraps the index from a
// peer and starts the background goroutines; it returns when this gateway
// is a member and its index is restored (or the bootstrap gave up: it is
// then logged and anti-entropy retries). ctx bounds Start only.
func (c *Cluster) Start(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return ErrShutdown
	}
	if c.started {
		return ErrAlreadyStarted
	}
	c.bg, c.cancel = context.WithCancel(context.Background())
	if err := c.start(ctx); err != nil {
		c.stopped = true
		c.teardown()
		return err
	}
	c.started = true
	return nil
}

func (c *Cluster) start(ctx context.Context) error {
	// 1. The peer service, so that our metadata can name its address.
	lis, err := net.Listen("tcp", c.cfg.PeerAddr)
	if err != nil {
		return fmt.Errorf("sync: peer listener: %w", err)
	}
	c.peerLis = lis
	c.grpcSrv = grpc.NewServer(c.sec.serverOptions()...)
	peerv1.RegisterPeerServer(c.grpcSrv, &peerService{c: c})
	if c.deps.PeerServices != nil {
		c.deps.PeerServices(c.grpcSrv)
	}
	srv := c.grpcSrv
	c.goFunc(func() { _ = srv.Serve(lis) })

	// 2. NATS: subscribe before anything is applied; the applier buffers
	// until the bootstrap below restored a snapshot.
	c.ap.beginBuffering()
	c.goFunc(func() { c.ap.run(c.bg) })
	if c.cfg.NATSURL == "" {
		if err := c.bus.startServer(); err != nil {
			return err
		}
	}
	if err := c.bus.connect(); err != nil {
		return err
	}
	subs := []struct {
		subject string
		h       func([]byte)
	}{
		{c.bus.subj.decisions, c.onNATS}, {c.bus.subj.kvAll, c.onNATS},
		{c.bus.subj.loadAll, c.onNATS}, {c.bus.subj.queuedAll, c.onNATS},
		{c.bus.subj.digest, c.onNATS},
	}
	for _, s := range subs {
		if err := c.bus.subscribe(s.subject, s.h); err != nil {
			return err
		}
	}

	// 3. Membership. The advertised host is known once memberlist bound.
	meta, err := c.encodeMeta()
	if err != nil {
		return err
	}
	if err := c.ms.start(meta, c.deps.Transport); err != nil {
		return err
	}
	if meta, err = c.encodeMeta(); err != nil {
		return err
	}
	if err := c.ms.updateMeta(meta, time.Second); err != nil {
		c.log.Debug("updating metadata", "err", err)
	}
	c.kvOwn.update(c.ms.snapshot(), time.Now())
	c.ms.addListener(MemberListenerFunc(c.onMember))
	c.goFunc(func() { c.ms.eventLoop(c.bg) })
	if n, err := c.ms.join(c.cfg.Join); err != nil {
		c.log.Warn("no seed answered; retrying in the background", "err", err)
	} else if n > 0 {
		c.log.Info("joined cluster", "seeds_answered", n)
	}
	c.goFunc(func() { c.ms.joinLoop(c.bg) })

	// 4. Bootstrap from a peer, once our NATS server routes to the others
	// (deltas published meanwhile are buffered, not missed).
	if len(c.ms.snapshot()) > 1 {
		c.waitRoutes(ctx)
		if err := c.bootstrap(ctx); err != nil {
			c.log.Warn("starting without a peer snapshot; anti-entropy will retry", "err", err)
			c.ap.markLoss()
		}
	} else {
		c.ap.endBuffering()
	}
	c.ready.Store(true)

	// 5. Background work.
	c.goFunc(func() { c.flushLoop(c.bg) })
	c.goFunc(func() { c.loadLoop(c.bg) })
	c.goFunc(func() { c.digestLoop(c.bg) })
	c.own.reconcile()
	return ctx.Err()
}

// waitRoutes waits up to RouteWait (or ctx) for the embedded NATS server
// to route to every peer's server and for our subscriptions to be
// registered, so that no peer's delta misses us after the snapshot.
func (c *Cluster) waitRoutes(ctx context.Context) {
	if c.cfg.NATSURL == "" {
		deadline := time.Now().Add(c.cfg.RouteWait)
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for c.bus.numRemotes() < c.peersWithRoutes() && time.Now().Before(deadline) {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}
	if err := c.bus.flushSubscriptions(c.cfg.RouteWait); err != nil {
		c.log.Warn("NATS flush", "err", err)
	}
}

// goFunc runs f in a goroutine the Cluster waits for at Shutdown.
func (c *Cluster) goFunc(f func()) {
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		f()
	}()
}

// encodeMeta builds this gateway's memberlist metadata.
func (c *Cluster) encodeMeta() ([]byte, error) {
	host := c.advertiseHost()
	m := NodeMeta{
		Cluster:    c.cfg.ClusterName,
		Version:    c.cfg.Version,
		HTTPAddr:   c.cfg.HTTPAddr,
		RaftAddr:   c.cfg.RaftAddr,
		AdminAddr:  c.cfg.AdminAddr,
		IndexModes: c.cfg.IndexModes,
		NATSRoute:  c.bus.routeURL(host),
		Leaving:    c.leaving.Load(),
	}
	if c.cfg.NATSURL == "" && c.bus.opts != nil {
		m.NATSClient = c.bus.clientURL()
	}
	if c.cfg.AdvertisePeerAddr != "" {
		m.PeerAddr = c.cfg.AdvertisePeerAddr
	} else if c.peerLis != nil {
		a := c.peerLis.Addr().(*net.TCPAddr)
		h := a.IP.String()
		if a.IP.IsUnspecified() {
			h = host
		}
		m.PeerAddr = net.JoinHostPort(h, strconv.Itoa(a.Port))
	}
	return AppendMeta(nil, m, memberlist.MetaMaxSize)
}

// advertiseHost is the host peers reach this gateway at: the gossip
// advertise host (memberlist's choice once it runs).
func (c *Cluster) advertiseHost() string {
	if c.cfg.AdvertiseAddr != "" {
		if hp, err := splitHostPort(c.cfg.AdvertiseAddr); err == nil {
			return hp.host
		}
	}
	if c.ms.ml != nil {
		return c.ms.ml.LocalNode().Addr.String()
	}
	if hp, err := splitHostPort(c.cfg.GossipAddr); err == nil && hp.host != "" {
		if ip := net.ParseIP(hp.host); ip == nil || !ip.IsUnspecified() {
			return hp.host
		}
	}
	return "127.0.0.1"
}

// Shutdown leaves the cluster gracefully (so peers move KV ownership at
// once rather than after failure detection), stops every goroutine and
// closes the transports. Idempotent; ctx bounds the graceful leave.
func (c *Cluster) Shutdown(ctx context.Context) error {
	c.mu.Lock()
	wasStarted := c.started
	c.stopped = true
	c.mu.Unlock()
	var err error
	c.stopOnce.Do(func() {
		if wasStarted {
			timeout := time.Second
			if d, ok := ctx.Deadline(); ok {
				timeout = min(timeout, max(time.Until(d)/2, 10*time.Millisecond))
			}
			if lerr := c.leave(timeout); lerr != nil {
				c.log.Debug("leave", "err", lerr)
			}
		}
		err = c.teardown()
	})
	return err
}

// kill stops the Cluster without a graceful leave, as a crash would: peers
// detect the failure. Tests only.
func (c *Cluster) kill() {
	c.mu.Lock()
	c.stopped = true
	c.mu.Unlock()
	c.stopOnce.Do(func() { _ = c.teardown() })
}

// teardown stops in order: owners (no more KV ingestion), the peer service,
// NATS, every goroutine, then memberlist.
func (c *Cluster) teardown() error {
	c.leaving.Store(true)
	c.own.stopAll()
	if c.cancel != nil {
		c.cancel()
	}
	if c.grpcSrv != nil {
		c.grpcSrv.Stop()
	} else if c.peerLis != nil {
		_ = c.peerLis.Close()
	}
	c.stopRoutes()
	c.bus.close()
	c.wg.Wait()
	var errs []error
	if err := c.ms.shutdown(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Members returns the live members of the cluster, this gateway included,
// sorted by name.
func (c *Cluster) Members() []Member { return c.ms.snapshot() }

// Changed returns a channel closed at the next membership change (join,
// leave, failure or metadata update). Call Changed, then Members, then
// wait, and no change is missed (the sync/config store's Membership
// contract).
func (c *Cluster) Changed() <-chan struct{} { return c.ms.changedCh() }

// AddMemberListener registers l for membership events from now on.
func (c *Cluster) AddMemberListener(l MemberListener) { c.ms.addListener(l) }

// Join contacts more seeds at run time; it returns how many answered.
func (c *Cluster) Join(seeds []string) (int, error) {
	if !c.running() {
		return 0, ErrNotStarted
	}
	return c.ms.join(seeds)
}

// Leave announces a graceful leave without stopping; Shutdown does it too.
func (c *Cluster) Leave(timeout time.Duration) error {
	if !c.running() {
		return ErrNotStarted
	}
	return c.leave(timeout)
}

// leave gossips metadata marked Leaving, announces the leave to every
// member directly, then runs memberlist's leave.
func (c *Cluster) leave(timeout time.Duration) error {
	c.leaving.Store(true)
	if meta, err := c.encodeMeta(); err == nil {
		if err := c.ms.updateMeta(meta, timeout/3); err != nil {
			c.log.Debug("gossiping leave intent", "err", err)
		}
	}
	c.ms.announceLeave(timeout / 3)
	return c.ms.leave(timeout / 3)
}

// GossipAddr is the gossip address peers join (host:port), after Start.
func (c *Cluster) GossipAddr() string {
	if c.ms.ml == nil {
		return ""
	}
	return c.ms.ml.LocalNode().Address()
}

func (c *Cluster) running() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.started && !c.stopped
}

// peersWithRoutes counts other members that advertise an embedded server.
func (c *Cluster) peersWithRoutes() int {
	n := 0
	for _, m := range c.ms.snapshot() {
		if !m.Self && m.Meta.NATSRoute != "" {
			n++
		}
	}
	return n
}

// PeerAddr is the peer gRPC service's listen address, after Start.
func (c *Cluster) PeerAddr() string {
	if c.peerLis == nil {
		return ""
	}
	return c.peerLis.Addr().String()
}

// NATSConnected reports whether deltas currently travel over NATS (else
// decisions are gossiped).
func (c *Cluster) NATSConnected() bool { return c.bus.connected() }

// natsRouteHold is how long the embedded server keeps routing to a member
// the failure detector declared dead. On a loaded host memberlist declares
// live gateways dead now and then (a probe answered too late), and they
// refute within a second or two. Removing the route at once closed a
// working connection and lost what was in flight on it (a KV batch, seen
// by a peer as a sequence gap and repaired from a snapshot), then rebuilt
// it when the member came back. A route to a member that really died
// costs a connection attempt a second until the hold ends; a member that
// leaves gracefully loses its route at once.
const natsRouteHold = 30 * time.Second

// syncRoutes points the embedded server's routes at the members' servers
// and at those of members declared dead less than natsRouteHold ago, and
// arms itself for the next held route's end. Called on membership events
// (event goroutine) and by that timer.
func (c *Cluster) syncRoutes() {
	c.routeMu.Lock()
	defer c.routeMu.Unlock()
	if c.routesDone {
		return
	}
	routes, next := c.ms.heldRoutes(time.Now(), c.routeHold)
	for _, m := range c.ms.snapshot() {
		if !m.Self && m.Meta.NATSRoute != "" {
			routes = append(routes, m.Meta.NATSRoute)
		}
	}
	c.bus.setRoutes(routes)
	if next.IsZero() {
		return
	}
	if c.routeTimer == nil {
		c.routeTimer = time.AfterFunc(time.Until(next), c.syncRoutes)
	} else {
		c.routeTimer.Reset(time.Until(next))
	}
}

// stopRoutes ends syncRoutes' updates (teardown).
func (c *Cluster) stopRoutes() {
	c.routeMu.Lock()
	defer c.routeMu.Unlock()
	c.routesDone = true
	if c.routeTimer != nil {
		c.routeTimer.Stop()
	}
}

// kvSources returns the engines whose KV events the cluster ingests now
// (the caller must not modify the slice).
func (c *Cluster) kvSources() []KVSource {
	c.srcMu.RLock()
	defer c.srcMu.RUnlock()
	return c.srcs
}

// SetKVSources replaces the engines whose KV events the cluster ingests
// (Config.KVSources), as replicas come and go (a config reload, engine
// discovery). Every gateway of the cluster should be given the same list.
// Each engine's owner is recomputed: this gateway starts the subscribers
// of added engines it owns and stops those of removed ones, and of engines
// whose endpoints changed it restarts them. Batches for an engine no
// longer listed are refused (kvmesh_sync_kv_rejected_total, not_owner).
// What this gateway knew of the stream of an engine removed or listed with
// other endpoints (its resume point, its seq) is forgotten. The list is
// validated as Config.KVSources is. Safe for concurrent use; before Start
// it only replaces the list.
func (c *Cluster) SetKVSources(srcs []KVSource) error {
	if err := validateKVSources(srcs); err != nil {
		return err
	}
	next := slices.Clone(srcs)
	listed := make(map[string]KVSource, len(next))
	for _, s := range next {
		listed[s.Replica] = s
	}
	c.setSrcMu.Lock()
	defer c.setSrcMu.Unlock()
	// The list and the re-pointed marks change together under the
	// owners' lock, so a reconcile sees both or neither.
	c.own.mu.Lock()
	now := time.Now()
	c.srcMu.Lock()
	prev := c.srcs
	c.srcs = next
	c.srcMu.Unlock()
	for _, s := range prev {
		if cur, ok := listed[s.Replica]; ok && cur.Endpoint != s.Endpoint {
			c.own.repointed[s.Replica] = repoint{endpoint: cur.Endpoint, at: now}
		}
	}
	c.own.mu.Unlock()
	c.kvOwn.setSources(next, c.ms.snapshot(), now)
	for _, s := range prev {
		if cur, ok := listed[s.Replica]; !ok || cur != s {
			// Gone, or another engine under its name: its stream
			// starts afresh, as with a new subscriber of its own.
			c.ap.forgetKV(s.Replica)
		}
	}
	if c.ready.Load() {
		c.own.reconcile()
	}
	return nil
}

// onMember reacts to membership changes (event goroutine): NATS routes to
// the members' embedded servers, KV ownership, forgetting departed peers.
func (c *Cluster) onMember(ev MemberEvent) {
	c.syncRoutes()
	c.kvOwn.update(c.ms.snapshot(), time.Now())
	if ev.Kind == MemberJoin {
		c.peers.rejoin(ev.Member.Name)
		c.queued.rejoin(ev.Member.Name)
	}
	if ev.Kind == MemberLeave || ev.Kind == MemberFail {
		now := time.Now()
		c.peers.forget(ev.Member.Name, now)
		c.queued.forget(ev.Member.Name, now)
		c.ap.forgetOrigins(ev.Member.Name)
		c.dmu.Lock()
		delete(c.digests, ev.Member.Name)
		c.dmu.Unlock()
	}
	if c.ready.Load() {
		c.own.reconcile()
	}
}

// onNATS decodes a NATS message (nats.go's subscription goroutine) and
// routes it; it never blocks.
func (c *Cluster) onNATS(data []byte) { c.receive(data, "nats") }

// onGossip receives memberlist user messages (the NATS-outage fallback);
// memberlist's packet goroutine calls it, so it never blocks.
func (c *Cluster) onGossip(data []byte) { c.receive(data, "gossip") }

func (c *Cluster) receive(data []byte, via string) {
	m, err := decodeMessage(data)
	if err != nil {
		c.m.malformed.WithLabelValues(via).Inc()
		c.log.Debug("malformed peer message", "via", via, "bytes", len(data), "err", err)
		return
	}
	switch m.Kind {
	case kindDecisions:
		if m.Decisions.Origin == c.origin {
			return
		}
		if m.Decisions.Seq == 0 {
			c.m.malformed.WithLabelValues(via).Inc()
			return
		}
	case kindKV:
		if m.KV.Origin == c.origin {
			return
		}
	case kindLoad:
		if m.Load.Origin != c.origin {
			c.peers.report(m.Load, time.Now())
		}
		return
	case kindQueued:
		if m.Load.Origin != c.origin {
			c.queued.report(m.Load, time.Now())
		}
		return
	case kindDigest:
		if m.Digest.Origin != c.origin {
			c.storeDigest(m.Digest)
		}
		return
	}
	c.ap.enqueue(inbound{msg: m, via: via})
}
