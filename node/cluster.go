package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/proto/adminpb"
	kvsync "github.com/kvmesh/kvmesh/sync"
	"github.com/kvmesh/kvmesh/sync/config"
	"github.com/kvmesh/kvmesh/sync/trust"
)

// clusterParts is everything cluster mode adds to a Node. Built by New
// (what cannot fail at run time: the node id, the token, the key), opened
// by startCluster, closed by the shutdown steps.
type clusterParts struct {
	id    string
	token string      // the operators' admin token: served, never sent to peers
	ring  *trust.Ring // credentials from the cluster key; nil = --insecure

	// kvTarget is the sync.Cluster that table changes hand their KV
	// sources to (pushKVSources), from its creation until closeCluster;
	// kvMu orders those hand-overs.
	kvTarget atomic.Pointer[kvsync.Cluster]
	kvMu     sync.Mutex

	// Set by startCluster; read after it returned.
	cluster     *kvsync.Cluster
	store       *config.Store
	admin       *config.Server
	adminHTTP   atomic.Pointer[http.Handler]  // set once the admin server exists
	adminSrv    atomic.Pointer[config.Server] // the same, for peerForwarder
	grpcSrv     *grpc.Server
	grpcLn      net.Listener
	members     *memberView
	cancelApply func()

	joined        atomic.Bool // sync.Cluster.Start returned: joined and bootstrapped
	configApplied atomic.Bool // a raft config version was applied to the router
	applyErrors   atomic.Uint64
	// handledVersion is the last raft config version onConfigApply
	// handled (applied, or refused and logged); caughtUp latches once it
	// was the cluster's current version (see configCurrent).
	handledVersion atomic.Uint64
	caughtUp       atomic.Bool
	staleWarned    atomic.Bool
	storeOpened    time.Time // set by startCluster before the store's first apply
}

// configCatchUpGrace bounds how long a gateway whose raft config no leader
// has confirmed current stays unready: past it, the gateway serves with the
// last config it applied (a cluster that lost its quorum still routes), says
// so in /ready and logs it once.
const configCatchUpGrace = 15 * time.Second

func newClusterParts(cfg *Config) (*clusterParts, error) {
	id, err := cfg.Cluster.nodeID()
	if err != nil {
		return nil, err
	}
	tok, err := cfg.Cluster.adminToken()
	if err != nil {
		return nil, err
	}
	if _, err := cfg.Cluster.gossipKey(); err != nil {
		return nil, err
	}
	keys, err := cfg.Cluster.clusterKeys()
	if err != nil {
		return nil, err
	}
	cp := &clusterParts{id: id, token: tok}
	if keys != nil {
		if cp.ring, err = trust.New(keys, id); err != nil {
			return nil, fmt.Errorf("%w: cluster key: %w", ErrInvalidConfig, err)
		}
	}
	return cp, nil
}

// clusterIngests reports whether the sync.Cluster's owner gateway ingests
// r's KV events (so this Node must not subscribe itself): in cluster mode,
// every replica with a kv endpoint. kv_bind engines connect to this
// gateway, so they cannot move between gateways: each ingests its own.
func (n *Node) clusterIngests(r *replica) bool {
	return n.cl != nil && movableKV(r)
}

// movableKV reports whether r's KV events can be ingested by any gateway:
// it has a kv endpoint to connect to (not kv_bind).
func movableKV(r *replica) bool { return r.cfg.KVEndpoint != "" }

// kvSourcesOf lists t's replicas that the cluster ingests (clusterIngests),
// by name.
func kvSourcesOf(t *table) []kvsync.KVSource {
	var out []kvsync.KVSource
	for _, r := range t.replicas {
		if movableKV(r) {
			out = append(out, kvsync.KVSource{Replica: r.name, Model: r.model,
				Endpoint: r.cfg.KVEndpoint, ReplayEndpoint: r.cfg.ReplayEndpoint})
		}
	}
	slices.SortFunc(out, func(a, b kvsync.KVSource) int { return strings.Compare(a.Replica, b.Replica) })
	return out
}

// pushKVSources hands the current table's KV sources to the sync.Cluster,
// if it exists: a reload or engine discovery that adds a replica gets it
// one owner for the whole cluster, one that removes a replica stops its
// subscriber. Each call reads the table it hands over under kvMu, so the
// last call hands over the newest table.
func (n *Node) pushKVSources() {
	if n.cl == nil {
		return
	}
	n.cl.kvMu.Lock()
	defer n.cl.kvMu.Unlock()
	c := n.cl.kvTarget.Load()
	if c == nil {
		return
	}
	if err := c.SetKVSources(kvSourcesOf(n.tbl.Load())); err != nil {
		n.log.Error("KV sources not handed to the cluster", "err", err)
	}
}

// Cluster is the Node's sync.Cluster (nil standalone or before Start).
func (n *Node) Cluster() *kvsync.Cluster {
	if n.cl == nil {
		return nil
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.cl.cluster
}

// ConfigStore is the Node's raft config store (nil standalone or before
// Start).
func (n *Node) ConfigStore() *config.Store {
	if n.cl == nil {
		return nil
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.cl.store
}

// AdminAddr is the admin gRPC listen address after Start ("" standalone).
func (n *Node) AdminAddr() string {
	if n.cl == nil {
		return ""
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cl.grpcLn == nil {
		return ""
	}
	return n.cl.grpcLn.Addr().String()
}

// NodeID is the gateway's cluster id ("" standalone).
func (n *Node) NodeID() string {
	if n.cl == nil {
		return ""
	}
	return n.cl.id
}

// Ready reports what GET /ready reports: the Node serves HTTP and, in
// cluster mode, has joined, bootstrapped its index from a peer and applied
// a raft config version.
func (n *Node) Ready() bool {
	n.mu.Lock()
	up := n.started && !n.shutdown
	n.mu.Unlock()
	if !up || n.stopping.Load() {
		return false
	}
	if n.cfg.Discovery.Source != "" && !n.disc.seen.Load() {
		return false // the discovered pool is not known yet
	}
	if n.cl == nil {
		return true
	}
	return n.cl.joined.Load() && n.cl.configApplied.Load() && n.configCurrent()
}

// configCurrent reports whether the router holds the cluster's current
// routing config: the raft store is caught up with a leader and its
// version reached the router. A gateway restarted from its data directory
// first applies its own last snapshot, possibly versions behind the
// cluster's, so an applied version alone does not make it ready. Once
// current it stays so (readiness must not flap on every write); past
// configCatchUpGrace without a leader it gives up waiting.
func (n *Node) configCurrent() bool {
	cl := n.cl
	if cl.caughtUp.Load() {
		return true
	}
	if cl.store.CaughtUp() && cl.handledVersion.Load() >= cl.store.Current().Version {
		cl.caughtUp.Store(true)
		return true
	}
	if time.Since(cl.storeOpened) < configCatchUpGrace {
		return false
	}
	if cl.staleWarned.CompareAndSwap(false, true) {
		n.log.Warn("no raft leader has confirmed this gateway's routing config is current; serving with the last version applied",
			"version", cl.handledVersion.Load(), "waited", configCatchUpGrace)
	}
	return true
}

// startCluster opens cluster mode in order: the admin gRPC listener, the
// raft store (its Membership reads the gossip view, filled once gossip
// runs), the sync.Cluster (advertising the HTTP, raft and admin addresses;
// Start joins and bootstraps the index from a peer), the admin gRPC
// server, then the seams: peers' load, decision publishing and config
// applies. On error everything opened is closed again. Called by Start
// with n.mu held, after the HTTP listener is bound.
func (n *Node) startCluster(ctx context.Context, httpAddr string) (err error) {
	cl := n.cl
	cc := &n.cfg.Cluster
	t0 := time.Now()
	ctx, cancel := context.WithTimeout(ctx, cc.StartTimeout)
	defer cancel()
	defer func() {
		if err != nil {
			n.closeCluster(context.Background(), nil)
		}
	}()

	if cl.ring == nil {
		moved := cc.insecureBinds()
		n.log.Warn("INSECURE: cluster mode without a cluster key (--insecure): gossip is clear text and raft, "+
			"the peer port and NATS accept anyone who reaches them; make a key with `kvmesh keygen`",
			"moved_to_loopback", strings.Join(moved, ","))
	} else {
		n.log.Info("cluster key loaded", "key_id", cl.ring.ID())
	}
	if cc.Insecure && cl.ring != nil {
		n.log.Warn("--insecure ignored: a cluster key is configured")
	}

	var lc net.ListenConfig
	if cl.grpcLn, err = lc.Listen(ctx, "tcp", cc.AdminAddr); err != nil {
		return fmt.Errorf("node: listen admin %s: %w", cc.AdminAddr, err)
	}
	adminAdv := cc.AdvertiseAdminAddr
	if adminAdv == "" {
		adminAdv = advertised(cl.grpcLn.Addr().String(), cc.advertiseHost())
	}

	cl.members = newMemberView()
	seed, err := routingDocument(&n.cfg)
	if err != nil {
		return err
	}
	sc := cc.storeConfig()
	sc.NodeID = cl.id
	sc.Membership = cl.members
	sc.Seed = &seed
	// Forwarded writes and status probes go to peers' peer ports
	// (memberView's ForwardAddr), authenticated by the cluster key's
	// mutual TLS: no token travels between gateways.
	sc.Trust = cl.ring
	if cl.ring != nil {
		sc.Forward = config.ClientOptions{TLS: cl.ring.TLSConfig()}
	}
	if cc.PeerTLS.Enabled() {
		if sc.Forward.TLS, err = cc.PeerTLS.ClientConfig(); err != nil {
			return fmt.Errorf("%w: cluster.peer_tls: %w", ErrInvalidConfig, err)
		}
		if cc.PeerTLSServerName != "" {
			sc.Forward.TLS.ServerName = cc.PeerTLSServerName
		}
	}
	sc.Logger = n.log // the store adds component=config
	sc.Registerer = n.m.reg
	cl.storeOpened = time.Now()
	if cl.store, err = openStore(sc); err != nil {
		return err
	}

	kc, err := cc.syncConfig(cl.id)
	if err != nil {
		return err
	}
	kc.HTTPAddr = advertised(httpAddr, cc.advertiseHost())
	kc.RaftAddr = cl.store.RaftAddr()
	kc.AdminAddr = adminAdv
	kc.IndexModes = n.cfg.IndexMode
	kc.Trust = cl.ring
	kc.Insecure = cl.ring == nil
	kc.KVSources = kvSourcesOf(n.tbl.Load())
	if cl.cluster, err = kvsync.New(kc, kvsync.Deps{
		Index: n.index, Replicas: n.ids, Load: loadSource{n}, Registerer: n.m.reg,
		KVMetrics: n.kvMetrics, Logger: n.log, AfterRestore: n.reapplyReplicaFlags,
		Transport: cc.GossipTransport,
		// The peer port (cluster key) also takes peers' forwarded writes.
		PeerServices: func(r grpc.ServiceRegistrar) { adminpb.RegisterAdminServer(r, peerForwarder{cl: cl}) },
	}); err != nil {
		return fmt.Errorf("node: cluster: %w", err)
	}
	// A table change from here on hands its sources over; one between
	// the list above and now is caught by this first hand-over.
	cl.kvTarget.Store(cl.cluster)
	n.pushKVSources()
	cl.members.bind(cl.cluster)
	cl.cluster.AddMemberListener(cl.members)

	if cl.admin, err = config.NewServer(cl.store, config.ServerConfig{
		Token: cl.token, Index: adminProviders{n}, Explainer: adminProviders{n},
		Snapshotter: adminProviders{n}, Logger: n.log,
	}); err != nil {
		return fmt.Errorf("node: admin server: %w", err)
	}
	h := cl.admin.Handler()
	cl.adminHTTP.Store(&h)
	cl.adminSrv.Store(cl.admin)
	if cl.grpcSrv, err = config.NewGRPCServer(cl.admin, cc.AdminTLS); err != nil {
		return fmt.Errorf("%w: cluster.admin_tls: %w", ErrInvalidConfig, err)
	}
	srv, ln := cl.grpcSrv, cl.grpcLn
	n.goFunc(func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			n.log.Error("admin gRPC server stopped", "err", err)
		}
	})

	t1 := time.Now()
	if err = cl.cluster.Start(ctx); err != nil {
		return fmt.Errorf("node: cluster start: %w", err)
	}
	cl.members.refresh()
	cl.joined.Store(true)
	n.SetPeerLoad(cl.cluster)
	n.SetRecordListener(decisionPublisher{cl.cluster})
	cl.cancelApply = cl.store.OnApply(n.onConfigApply)
	n.log.Info("cluster member", "node_id", cl.id, "cluster", cc.Name, "gossip", cl.cluster.GossipAddr(),
		"peer_grpc", cl.cluster.PeerAddr(), "admin_grpc", cl.grpcLn.Addr().String(), "raft", cl.store.RaftAddr(),
		"members", len(cl.cluster.Members()), "kv_sources", len(kc.KVSources),
		"join_and_bootstrap", time.Since(t1).Round(time.Millisecond), "took", time.Since(t0).Round(time.Millisecond))
	return nil
}

// openStore opens the raft config store. raft panics when its log store
// cannot read an entry it needs at start (a damaged or foreign raft
// directory); that becomes ErrRaftLog naming the directory, instead of a
// crashed process, so the operator knows what to move away.
func openStore(sc config.StoreConfig) (s *config.Store, err error) {
	defer func() {
		if r := recover(); r != nil {
			s, err = nil, fmt.Errorf("%w in %s (move it away to rejoin with the cluster's config): %v",
				ErrRaftLog, filepath.Join(sc.DataDir, "raft"), r)
		}
	}()
	if s, err = config.Open(sc); err != nil {
		return nil, fmt.Errorf("node: config store: %w", err)
	}
	return s, nil
}

// closeCluster closes whatever startCluster opened, in reverse order:
// the seams, the admin gRPC server, the config store, the cluster. step
// runs (and may time and log) each part; nil just runs it. Each part's
// own close is idempotent.
func (n *Node) closeCluster(ctx context.Context, step func(what string, f func())) {
	if step == nil {
		step = func(_ string, f func()) { f() }
	}
	cl := n.cl
	if cl.cancelApply != nil {
		cl.cancelApply()
	}
	n.SetRecordListener(nil)
	n.SetPeerLoad(nil)
	if cl.grpcSrv != nil {
		step("stopped the admin gRPC API", func() { stopGRPC(ctx, cl.grpcSrv) })
	} else if cl.grpcLn != nil {
		_ = cl.grpcLn.Close()
	}
	if cl.store != nil {
		step("stopped the config store", func() {
			if err := cl.store.Shutdown(); err != nil {
				n.log.Warn("config store shutdown", "err", err)
			}
		})
	}
	cl.kvTarget.Store(nil)
	if cl.cluster != nil {
		step("stopped the cluster (gossip, NATS, peer service)", func() {
			if err := cl.cluster.Shutdown(ctx); err != nil {
				n.log.Warn("cluster shutdown", "err", err)
			}
		})
	}
}

// stopGRPC stops gs gracefully until ctx ends, then hard.
func stopGRPC(ctx context.Context, gs *grpc.Server) {
	done := make(chan struct{})
	go func() {
		gs.GracefulStop()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
		gs.Stop()
		<-done
	}
}

// onConfigApply hot-reloads the router from an applied raft config. It
// runs on the store's notifier goroutine, one version at a time.
func (n *Node) onConfigApply(v *config.Versioned) {
	if v == nil || v.Config == nil {
		return
	}
	defer n.cl.handledVersion.Store(v.Version)
	spec := specFromDocument(v.Version, v.Config)
	if err := n.applySpec(spec); err != nil {
		n.cl.applyErrors.Add(1)
		n.log.Error("routing config not applied; the previous one stays in force", "version", v.Version, "err", err)
		return
	}
	n.warnRestartOnly(v)
	n.cl.configApplied.Store(true)
}

// reapplyReplicaFlags restores this gateway's replica roots and
// publisher flags in the index after a snapshot from a peer replaced them
// (sync.Deps.AfterRestore).
func (n *Node) reapplyReplicaFlags() {
	for _, r := range n.tbl.Load().replicas {
		n.index.SetPublishesEvents(r.id, r.cfg.PublishesKVEvents())
		n.index.SetReplicaRoot(r.id, n.hasher.Root(r.model, "", ""))
	}
}

// warnRestartOnly logs the config fields that differ from the Node's and
// only take effect when the gateway restarts with them (they shape the
// index and the block keys, which are built once).
func (n *Node) warnRestartOnly(v *config.Versioned) {
	d := v.Config
	var diff []string
	if d.HashSeed != n.cfg.HashSeed {
		diff = append(diff, "hash_seed")
	}
	if d.PrefixCache.BlockSize != 0 && d.PrefixCache.BlockSize != n.hasher.BlockTokens() {
		diff = append(diff, "prefix_cache.block_size")
	}
	if tok := d.PrefixCache.Tokenizer; tok != "" && tok != TokenizerAuto && tok != n.tokName {
		diff = append(diff, "prefix_cache.tokenizer")
	}
	if d.Index.Capacity != n.cfg.IndexCapacity || time.Duration(d.Index.HistoryTTL) != n.cfg.HistoryTTL ||
		time.Duration(d.Index.SpeculativeTTL) != n.cfg.SpeculativeTTL {
		diff = append(diff, "index")
	}
	restart := 0.0
	if len(diff) > 0 {
		restart = 1
		n.log.Warn("routing config fields differ from this gateway's and take effect only at restart",
			"version", v.Version, "fields", strings.Join(diff, ","))
	}
	n.m.restartRequired.Set(restart)
}

// routingDocument converts the Node's own Config into the raft document
// that seeds an empty cluster config.
func routingDocument(c *Config) (config.RoutingConfig, error) {
	d := config.DefaultRoutingConfig()
	d.Strategy = c.Strategy
	d.IndexMode = c.IndexMode
	d.HashSeed = c.HashSeed
	d.Models = make(map[string]config.ModelConfig, len(c.Models))
	for _, m := range c.Models {
		mc := config.ModelConfig{Strategy: m.Strategy, IndexMode: m.IndexMode, Tokenizer: m.Tokenizer,
			Adapters: append([]string(nil), m.Adapters...), SharedResponseStore: m.SharedResponseStore}
		for _, r := range m.Replicas {
			mc.Replicas = append(mc.Replicas, config.ReplicaConfig{Name: r.Name, URL: r.URL,
				KV: r.KVEndpoint, KVBind: r.KVBind, Replay: r.ReplayEndpoint, DataParallelSize: r.DataParallelSize})
		}
		d.Models[m.Name] = mc
	}
	d.PrefixCache = config.PrefixCacheConfig{PrefixCacheConfig: c.Route.PrefixCache, BlockSize: c.BlockSize, Tokenizer: c.Tokenizer}
	d.ConsistentHash = c.Route.ConsistentHash
	d.Cost = c.Route.Cost
	d.PeerLoadDelaySeconds = c.Route.PeerLoadDelaySeconds
	d.Index = config.IndexConfig{Capacity: c.IndexCapacity, HistoryTTL: config.Duration(c.HistoryTTL),
		SpeculativeTTL: config.Duration(c.SpeculativeTTL)}
	if err := d.Validate(); err != nil {
		return d, fmt.Errorf("%w: the gateway's config is not a valid cluster routing config: %w", ErrInvalidConfig, err)
	}
	return d, nil
}

// specFromDocument converts an applied raft document into a routing spec
// (models in name order, so every gateway builds the same table).
func specFromDocument(version uint64, d *config.RoutingConfig) routingSpec {
	spec := routingSpec{version: version, strategy: d.Strategy, mode: d.IndexMode, route: d.Route()}
	for _, name := range d.ModelNames() {
		m := d.Models[name]
		mc := ModelConfig{Name: name, Strategy: m.Strategy, IndexMode: m.IndexMode, Tokenizer: m.Tokenizer,
			Adapters: append([]string(nil), m.Adapters...), SharedResponseStore: m.SharedResponseStore}
		for _, r := range m.Replicas {
			mc.Replicas = append(mc.Replicas, ReplicaConfig{Name: r.Name, URL: r.URL,
				KVEndpoint: r.KV, KVBind: r.KVBind, ReplayEndpoint: r.Replay, DataParallelSize: r.DataParallelSize})
		}
		spec.models = append(spec.models, mc)
	}
	return spec
}

// memberView adapts the gossip membership (sync.Cluster) to the config
// store's Membership: raft server id = gossip node name, with the raft and
// admin addresses from the node metadata. It refreshes on every membership
// event and closes the Changed channel then.
type memberView struct {
	mu      sync.Mutex
	c       *kvsync.Cluster
	changed chan struct{}
	members atomic.Pointer[[]config.Member]
}

var _ config.Membership = (*memberView)(nil)

func newMemberView() *memberView { return &memberView{changed: make(chan struct{})} }

func (v *memberView) bind(c *kvsync.Cluster) {
	v.mu.Lock()
	v.c = c
	v.mu.Unlock()
}

// MemberEvent implements sync.MemberListener.
func (v *memberView) MemberEvent(kvsync.MemberEvent) { v.refresh() }

// refresh rebuilds the member list from the gossip view and wakes waiters.
func (v *memberView) refresh() {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.c == nil {
		return
	}
	ms := v.c.Members()
	out := make([]config.Member, 0, len(ms))
	for _, m := range ms {
		if m.Meta.RaftAddr == "" {
			continue
		}
		out = append(out, config.Member{ID: m.Name, RaftAddr: m.Meta.RaftAddr, AdminAddr: m.Meta.AdminAddr,
			ForwardAddr: m.Meta.PeerAddr,
			Meta: map[string]string{"version": m.Meta.Version, "http": m.Meta.HTTPAddr, "gossip": m.Addr,
				"peer": m.Meta.PeerAddr, "index_modes": m.Meta.IndexModes}})
	}
	v.members.Store(&out)
	close(v.changed)
	v.changed = make(chan struct{})
}

// Members implements config.Membership.
func (v *memberView) Members() []config.Member {
	if p := v.members.Load(); p != nil {
		return *p
	}
	return nil
}

// Changed implements config.Membership.
func (v *memberView) Changed() <-chan struct{} {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.changed
}

// peerForwarder serves peers' forwarded writes and status probes on the
// peer port through the admin server (config.PeerForwarder), which exists
// once startCluster created it: the peer port opens before it, so a call
// that comes earlier is told to retry.
type peerForwarder struct {
	adminpb.UnimplementedAdminServer // every other admin method: Unimplemented
	cl                               *clusterParts
}

var _ adminpb.AdminServer = peerForwarder{}

// Forward implements adminpb.AdminServer.
func (p peerForwarder) Forward(ctx context.Context, req *adminpb.ForwardRequest) (*adminpb.ApplyResponse, error) {
	f, err := p.forwarder()
	if err != nil {
		return nil, err
	}
	return f.Forward(ctx, req)
}

// Status implements adminpb.AdminServer.
func (p peerForwarder) Status(ctx context.Context, req *adminpb.StatusRequest) (*adminpb.StatusResponse, error) {
	f, err := p.forwarder()
	if err != nil {
		return nil, err
	}
	return f.Status(ctx, req)
}

func (p peerForwarder) forwarder() (*config.PeerForwarder, error) {
	if s := p.cl.adminSrv.Load(); s != nil {
		return config.NewPeerForwarder(s), nil
	}
	return nil, status.Error(codes.Unavailable, "node: admin service not ready")
}

// loadSource reports this gateway's exact in-flight counts and queued
// prefill tokens (uncached prompt tokens sent, first byte not yet seen) to
// the cluster; peers read them as PeerLoad.InFlight and
// PeerQueuedPrefill.QueuedPrefill.
type loadSource struct{ n *Node }

var _ kvsync.LoadSource = loadSource{}

// The cluster installed by SetPeerLoad reports peers' queued prefill too.
var (
	_ PeerLoad          = (*kvsync.Cluster)(nil)
	_ PeerQueuedPrefill = (*kvsync.Cluster)(nil)
)

// AppendInFlight implements sync.LoadSource.
func (l loadSource) AppendInFlight(dst []kvsync.ReplicaLoad) []kvsync.ReplicaLoad {
	for _, r := range l.n.tbl.Load().replicas {
		dst = append(dst, kvsync.ReplicaLoad{
			Replica:             r.name,
			InFlight:            int(r.inflight.Load()),
			QueuedPrefillTokens: int(max(r.queuedPrefill.Load(), 0)),
		})
	}
	return dst
}

// decisionPublisher publishes every recorded routing decision to peers.
type decisionPublisher struct{ c *kvsync.Cluster }

var _ RecordListener = decisionPublisher{}

// Recorded implements RecordListener.
func (p decisionPublisher) Recorded(_, replica string, ledger index.Ledger, keys []index.BlockKey, now int64) {
	p.c.PublishDecision(replica, ledger, keys, now)
}

// adminProviders serves the admin API's diagnostics from the Node.
type adminProviders struct{ n *Node }

var (
	_ config.IndexStatsProvider = adminProviders{}
	_ config.RouteExplainer     = adminProviders{}
	_ config.IndexSnapshotter   = adminProviders{}
)

// IndexStats implements config.IndexStatsProvider: the Node has one index
// shared by every model.
func (a adminProviders) IndexStats(context.Context) ([]config.IndexStat, error) {
	n := a.n
	return []config.IndexStat{{Name: "gateway", Mode: n.cfg.IndexMode, Capacity: n.cfg.IndexCapacity,
		Stats: n.index.Stats()}}, nil
}

// WriteIndexSnapshot implements config.IndexSnapshotter.
func (a adminProviders) WriteIndexSnapshot(_ context.Context, w io.Writer) error {
	_, err := w.Write(a.n.index.AppendSnapshot(nil, nil, a.n.ids.ReplicaName))
	return err
}

// ExplainRoute implements config.RouteExplainer through the same code as
// GET/POST /debug/route.
func (a adminProviders) ExplainRoute(ctx context.Context, req config.ExplainRequest) ([]byte, error) {
	var hr *http.Request
	var err error
	if len(req.Body) > 0 {
		hr, err = http.NewRequestWithContext(ctx, http.MethodPost, "/debug/route", bytes.NewReader(req.Body))
	} else {
		q := url.Values{"model": {req.Model}, "prompt": {req.Prompt}}
		hr, err = http.NewRequestWithContext(ctx, http.MethodGet, "/debug/route?"+q.Encode(), nil)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %w", config.ErrBadRequest, err)
	}
	if req.Strategy != "" {
		hr.Header.Set(HeaderStrategy, req.Strategy)
	}
	rec := &bufferWriter{h: http.Header{}, status: http.StatusOK}
	a.n.serveDebugRoute(rec, hr)
	switch {
	case rec.status == http.StatusNotFound:
		return nil, fmt.Errorf("%w: %s", config.ErrNotFound, rec.buf.String())
	case rec.status >= 400 && rec.status < 500:
		return nil, fmt.Errorf("%w: %s", config.ErrBadRequest, rec.buf.String())
	case rec.status != http.StatusOK:
		return nil, fmt.Errorf("node: explain: status %d: %s", rec.status, rec.buf.String())
	}
	return rec.buf.Bytes(), nil
}

// bufferWriter is an in-memory http.ResponseWriter for in-process calls
// of the Node's own handlers.
type bufferWriter struct {
	h      http.Header
	status int
	buf    bytes.Buffer
}

func (b *bufferWriter) Header() http.Header         { return b.h }
func (b *bufferWriter) WriteHeader(code int)        { b.status = code }
func (b *bufferWriter) Write(p []byte) (int, error) { return b.buf.Write(p) }

// version is the gateway version advertised to peers: the main module's
// version from the build info, else "dev".
func version() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}
