package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"

	"github.com/kvmesh/kvmesh/chaos/faultproxy"
	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/chaos/truth"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node"
	kvsync "github.com/kvmesh/kvmesh/sync"
	"github.com/kvmesh/kvmesh/sync/config"
	"github.com/kvmesh/kvmesh/sync/trust"
)

// KVLink says how gateways receive an engine's KV events.
type KVLink uint8

const (
	// KVDirect: gateways subscribe to the engine's PUB directly.
	KVDirect KVLink = iota
	// KVProxy: through a faultproxy.Proxy (TCP faults) per engine.
	KVProxy
	// KVRelay: through a faultproxy.Relay (message faults) per engine.
	KVRelay
	// KVNone: no KV events (history mode).
	KVNone
)

// Config describes a cluster.
type Config struct {
	// Gateways is the number of gateways. Default 1.
	Gateways int
	// Engines is the number of simulated engines. Default 2.
	Engines int
	// Model is the served model name. Default "m".
	Model string
	// EngineBlockTokens is the engines' KV block size. Default 16 (vLLM).
	EngineBlockTokens int
	// IndexBlockTokens is the gateways' index block size; it must divide
	// EngineBlockTokens for confirmed keys to line up. Default 16.
	IndexBlockTokens int
	// NumGPUBlocks is each engine's pool. Default 256: small enough that a
	// few hundred distinct prompts evict.
	NumGPUBlocks int
	// ProxyHTTP puts a faultproxy.Proxy on each engine's HTTP API (shared by
	// all gateways). Default false.
	ProxyHTTP bool
	// KVLink is how KV events travel. Default KVDirect.
	KVLink KVLink
	// IndexMode is the gateways' index mode. Default "kv-events".
	IndexMode string
	// Strategy is the gateways' default routing strategy. Default
	// "prefix-cache".
	Strategy string
	// ClusterMode makes the gateways one kvmesh cluster: gossip, index and
	// load replication over NATS, raft config store, admin API, with
	// node.LocalClusterConfig (loopback, port 0, local timing). Only each
	// engine's owner gateway subscribes to it; peers get its events
	// through NATS. Default false: standalone gateways that each subscribe
	// to every engine.
	ClusterMode bool
	// ClusterKey is the gateways' cluster key (key text, as kvmesh keygen
	// prints). Default "": Start generates one per cluster, as an
	// operator would (Cluster.ClusterKey returns it).
	ClusterKey string
	// DataDir is the base directory for the gateways' raft data (one
	// subdirectory per gateway id). Required with ClusterMode.
	DataDir string
	// NATSURL points every gateway at an external NATS server instead of
	// an embedded one each. Default "".
	NATSURL string
	// ExternalNATS starts one NATS server for the cluster with a
	// faultproxy.Proxy in front (Cluster.NATS), and points every gateway
	// at the proxy, so a scenario can cut NATS off. Overrides NATSURL.
	ExternalNATS bool
	// BootstrapExpect is the number of raft voters. Default min(3,
	// Gateways).
	BootstrapExpect int
	// FrontProxies puts a faultproxy.Proxy in front of every gateway's HTTP
	// port (Gateway.Front) and makes Gateway.URL point at it, so that
	// KillGateway can cut clients' connections the way a process death
	// does (a reset, not a response). Default false.
	FrontProxies bool
	// Partitionable puts the gateways' peer links where a scenario can
	// cut them (Cluster.Partition, Isolate, Heal): gossip over an
	// in-memory sync.MemNetwork, raft over raft.InmemTransport (through
	// node.ClusterConfig's GossipTransport and RaftTransport), and with
	// ExternalNATS one faultproxy.Proxy per gateway in front of the shared
	// NATS proxy (Gateway.NATSLink). Needs ClusterMode. The peer gRPC
	// (index snapshots) and admin gRPC (forwarded config writes) links
	// stay on loopback TCP and are not cut. Default false: real UDP and
	// TCP transports.
	Partitionable bool
	// Sim, if set, adjusts engine i's config before it starts.
	Sim func(i int, c *sim.Config)
	// Node, if set, adjusts gateway i's config before it starts.
	Node func(i int, c *node.Config)
	// Logger receives the components' logs; nil discards.
	Logger *slog.Logger
}

// DefaultConfig returns the defaults documented on Config.
func DefaultConfig() Config {
	return Config{
		Gateways: 1, Engines: 2, Model: "m",
		EngineBlockTokens: 16, IndexBlockTokens: 16, NumGPUBlocks: 256,
		IndexMode: "kv-events", Strategy: "prefix-cache",
	}
}

// Validate reports the first invalid field, wrapping ErrInvalidConfig.
func (c Config) Validate() error {
	switch {
	case c.Gateways < 1 || c.Engines < 1:
		return fmt.Errorf("%w: %d gateways, %d engines", ErrInvalidConfig, c.Gateways, c.Engines)
	case c.Model == "":
		return fmt.Errorf("%w: empty model", ErrInvalidConfig)
	case c.IndexBlockTokens < 1 || c.EngineBlockTokens < 1 || c.EngineBlockTokens%c.IndexBlockTokens != 0:
		return fmt.Errorf("%w: engine block %d, index block %d", ErrInvalidConfig, c.EngineBlockTokens, c.IndexBlockTokens)
	case c.NumGPUBlocks < 1:
		return fmt.Errorf("%w: %d GPU blocks", ErrInvalidConfig, c.NumGPUBlocks)
	case c.KVLink > KVNone:
		return fmt.Errorf("%w: KV link %d", ErrInvalidConfig, c.KVLink)
	case c.ClusterMode && c.DataDir == "":
		return fmt.Errorf("%w: cluster mode needs a data dir", ErrInvalidConfig)
	case c.Partitionable && !c.ClusterMode:
		return fmt.Errorf("%w: partitions need cluster mode", ErrInvalidConfig)
	case c.BootstrapExpect < 0:
		return fmt.Errorf("%w: bootstrap expect %d", ErrInvalidConfig, c.BootstrapExpect)
	}
	return nil
}

// Cluster is a running set of gateways and engines.
type Cluster struct {
	cfg     Config
	log     *slog.Logger
	emu     sync.Mutex
	engines []*Engine
	hc      *http.Client
	// NATS is the fault proxy in front of the cluster's NATS server (nil
	// unless Config.ExternalNATS).
	NATS    *faultproxy.Proxy
	natsSrv *natsserver.Server
	mesh    *mesh // nil unless Config.Partitionable

	gmu      sync.Mutex
	gateways []*Gateway // live gateways, in start order
	nextGW   int
	closing  atomic.Bool // set by Shutdown before it takes gmu

	mu       sync.Mutex
	shutdown bool
	err      error
}

// Engine is one simulated replica with its fault points.
type Engine struct {
	// Name is the replica name gateways know it by ("e0", "e1", ...).
	Name string
	// HTTP is the fault proxy in front of the API (nil unless ProxyHTTP).
	HTTP *faultproxy.Proxy
	// KV is the fault proxy on the PUB link (nil unless KVLink == KVProxy).
	KV *faultproxy.Proxy
	// Relay is the message relay on the PUB link (nil unless KVRelay).
	Relay *faultproxy.Relay

	c       *Cluster
	retired atomic.Bool
	mu      sync.Mutex
	srv     *sim.Server
}

// Gateway is one kvmesh node. A restarted gateway is a new Gateway with
// the same Name.
type Gateway struct {
	Name string
	Node *node.Node
	// Front is the proxy clients reach the gateway through (nil unless
	// Config.FrontProxies).
	Front *faultproxy.Proxy
	// NATSLink is the gateway's own proxy to the NATS server (nil unless
	// Config.Partitionable with ExternalNATS); Partition cuts it.
	NATSLink *faultproxy.Proxy
	cfg      node.Config
	detach   func() error // releases the partitionable links; nil without
}

// URL is the gateway's base URL for clients (through Front if any).
func (g *Gateway) URL() string {
	if g.Front != nil {
		return "http://" + g.Front.Addr()
	}
	return "http://" + g.Node.HTTPAddr()
}

// Start builds and starts engines, fault points and gateways. On error
// everything already started is shut down.
func Start(ctx context.Context, cfg Config) (*Cluster, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	l := cfg.Logger
	if l == nil {
		l = slog.New(slog.DiscardHandler)
	}
	c := &Cluster{cfg: cfg, log: l, hc: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 8}, Timeout: 10 * time.Second}}
	if c.cfg.ClusterMode && c.cfg.ClusterKey == "" {
		k, err := trust.Generate()
		if err != nil {
			return nil, err
		}
		c.cfg.ClusterKey = k
	}
	if cfg.Partitionable {
		c.mesh = newMesh()
	}
	if err := c.start(ctx); err != nil {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return nil, errors.Join(err, c.Shutdown(sctx))
	}
	return c, nil
}

func (c *Cluster) start(ctx context.Context) error {
	if c.cfg.ClusterMode && c.cfg.ExternalNATS {
		if err := c.startNATS(); err != nil {
			return err
		}
	}
	for range c.cfg.Engines {
		if _, err := c.startEngine(ctx); err != nil {
			return err
		}
	}
	for range c.cfg.Gateways {
		if _, err := c.AddGateway(ctx); err != nil {
			return err
		}
	}
	return c.WaitReady(ctx)
}

// startEngine starts engine e<N> with its fault points and adds it to the
// cluster's engines (gateways started later include it).
func (c *Cluster) startEngine(ctx context.Context) (*Engine, error) {
	c.emu.Lock()
	i := len(c.engines)
	e := &Engine{Name: fmt.Sprintf("e%d", i), c: c}
	c.engines = append(c.engines, e) // listed at once so Shutdown stops it
	c.emu.Unlock()
	scfg := sim.LocalConfig()
	scfg.ServedModelName = c.cfg.Model
	scfg.BlockSize = c.cfg.EngineBlockTokens
	scfg.NumGPUBlocks = c.cfg.NumGPUBlocks
	scfg.KVEvents.EnableKVCacheEvents = c.cfg.KVLink != KVNone
	scfg.Logger = c.log.With("engine", e.Name)
	if c.cfg.Sim != nil {
		c.cfg.Sim(i, &scfg)
	}
	srv, err := sim.NewServer(scfg)
	if err != nil {
		return nil, err
	}
	if err := srv.Start(ctx); err != nil {
		return nil, err
	}
	e.mu.Lock()
	e.srv = srv
	e.mu.Unlock()
	if c.cfg.ProxyHTTP {
		if e.HTTP, err = startProxy(e.Name+"/http", srv.Addr(), c.log); err != nil {
			return nil, err
		}
	}
	switch c.cfg.KVLink {
	case KVProxy:
		if e.KV, err = startProxy(e.Name+"/kv", strings.TrimPrefix(srv.KVEventsAddr(), "tcp://"), c.log); err != nil {
			return nil, err
		}
	case KVRelay:
		rc := faultproxy.DefaultRelayConfig()
		rc.Name, rc.Upstream, rc.Logger = e.Name+"/relay", srv.KVEventsAddr(), c.log
		if e.Relay, err = faultproxy.NewRelay(rc); err != nil {
			return nil, err
		}
		if err := e.Relay.Start(); err != nil {
			return nil, err
		}
	}
	return e, nil
}

// AddEngine starts one more engine (engine scale-out) that no gateway
// routes to yet: add it through the config store (AddReplicaToConfig) or
// start new gateways.
func (c *Cluster) AddEngine(ctx context.Context) (*Engine, error) {
	return c.startEngine(ctx)
}

// ReplicaConfig is e as the raft config store describes a replica.
func (e *Engine) ReplicaConfig() config.ReplicaConfig {
	rc := e.replicaConfig()
	return config.ReplicaConfig{Name: rc.Name, URL: rc.URL, KV: rc.KVEndpoint, Replay: rc.ReplayEndpoint}
}

// leaderStore returns the config store of the gateway leading raft now.
func (c *Cluster) leaderStore() *config.Store {
	for _, g := range c.Gateways() {
		if st := g.Node.ConfigStore(); st != nil && st.IsLeader() {
			return st
		}
	}
	return nil
}

// hasReplica reports whether v's model pool lists name.
func hasReplica(v *config.Versioned, model, name string) bool {
	if v == nil || v.Config == nil {
		return false
	}
	for _, r := range v.Config.Models[model].Replicas {
		if r.Name == name {
			return true
		}
	}
	return false
}

// writeConfig runs op on the raft leader's store until done reports the
// leader's config holds the change, retrying while there is no leader or
// a write's outcome is unknown (leadership lost mid-commit, which raft's
// short local timeouts make likely on a loaded machine). It returns the
// version that holds the change.
func (c *Cluster) writeConfig(ctx context.Context, op func(*config.Store) (uint64, error), done func(*config.Versioned) bool) (uint64, error) {
	if !c.cfg.ClusterMode {
		return 0, fmt.Errorf("%w: config writes need ClusterMode", ErrInvalidConfig)
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var last error
	for {
		if st := c.leaderStore(); st != nil {
			if cur := st.Current(); done(cur) {
				return cur.Version, nil
			}
			v, err := op(st)
			if err == nil {
				return v, nil
			}
			last = err
		}
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("cluster: config write: %w (last error: %v)", ctx.Err(), last)
		case <-tick.C:
		}
	}
}

// AddReplicaToConfig adds e to the model's pool through the raft config
// (engine scale-out) and returns the version that holds it.
func (c *Cluster) AddReplicaToConfig(ctx context.Context, e *Engine) (uint64, error) {
	model := c.cfg.Model
	return c.writeConfig(ctx, func(st *config.Store) (uint64, error) {
		return st.AddReplica(ctx, model, e.ReplicaConfig())
	}, func(v *config.Versioned) bool { return hasReplica(v, model, e.Name) })
}

// RemoveReplicaFromConfig removes e from the model's pool through the raft
// config (engine scale-in), marks it retired and returns the version that
// no longer holds it.
func (c *Cluster) RemoveReplicaFromConfig(ctx context.Context, e *Engine) (uint64, error) {
	model := c.cfg.Model
	v, err := c.writeConfig(ctx, func(st *config.Store) (uint64, error) {
		return st.RemoveReplica(ctx, model, e.Name)
	}, func(v *config.Versioned) bool { return !hasReplica(v, model, e.Name) })
	if err == nil {
		e.Retire()
	}
	return v, err
}

// Retire marks e as no longer routed to (after removing it from the
// config): Compare leaves it out. The engine keeps running until Shutdown.
func (e *Engine) Retire() { e.retired.Store(true) }

// startNATS starts the cluster's NATS server on a free loopback port and
// a fault proxy in front of it.
func (c *Cluster) startNATS() error {
	s, err := natsserver.NewServer(&natsserver.Options{
		Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true, MaxPayload: kvsync.MaxMessageBytes,
	})
	if err != nil {
		return fmt.Errorf("cluster: NATS: %w", err)
	}
	s.Start()
	c.natsSrv = s
	if !s.ReadyForConnections(10 * time.Second) {
		return fmt.Errorf("cluster: NATS did not start")
	}
	c.NATS, err = startProxy("nats", s.Addr().String(), c.log)
	if err != nil {
		return err
	}
	c.cfg.NATSURL = "nats://" + c.NATS.Addr()
	return nil
}

// ClusterKey is the gateways' cluster key ("" unless ClusterMode).
func (c *Cluster) ClusterKey() string { return c.cfg.ClusterKey }

// AdminToken is the admin API token of gateways in ClusterMode.
const AdminToken = "kvmesh-chaos-admin-token"

// gatewayConfig is gateway i's config: every engine as a replica and, in
// ClusterMode, cluster membership that joins the live gateways.
func (c *Cluster) gatewayConfig(i int, name string) node.Config {
	ncfg := node.LocalConfig()
	ncfg.IndexMode = c.cfg.IndexMode
	ncfg.Strategy = c.cfg.Strategy
	ncfg.Tokenizer = node.TokenizerCharacter // the simulator's byte tokenizer
	ncfg.BlockSize = c.cfg.IndexBlockTokens
	// Health and scrape timing for a loaded test machine (the chaos suite
	// runs beside other packages, often under -race): LocalConfig's 250 ms
	// timeouts and 2-poll threshold flap when CPU is scarce, and a flapping
	// replica is a harness artefact, not the fault under test.
	ncfg.HealthInterval = 200 * time.Millisecond
	ncfg.UnhealthyInterval = 100 * time.Millisecond
	ncfg.HealthTimeout = 2 * time.Second
	ncfg.UnhealthyAfter = 3
	ncfg.ScrapeTimeout = time.Second
	var reps []node.ReplicaConfig
	for _, e := range c.Engines() {
		reps = append(reps, e.replicaConfig())
	}
	ncfg.Models = []node.ModelConfig{{Name: c.cfg.Model, Replicas: reps}}
	if c.cfg.ClusterMode {
		cc := node.LocalClusterConfig()
		cc.Enabled = true
		cc.NodeID = name
		cc.DataDir = filepath.Join(c.cfg.DataDir, name)
		cc.AdminToken = AdminToken
		cc.ClusterKey = c.cfg.ClusterKey
		cc.NATSURL = c.cfg.NATSURL
		cc.BootstrapExpect = c.cfg.BootstrapExpect
		if cc.BootstrapExpect == 0 {
			cc.BootstrapExpect = min(3, c.cfg.Gateways)
		}
		for _, g := range c.Gateways() {
			cc.Join = append(cc.Join, g.Node.Cluster().GossipAddr())
		}
		ncfg.Cluster = cc
	}
	if c.cfg.Node != nil {
		c.cfg.Node(i, &ncfg)
	}
	return ncfg
}

// AddGateway starts one more gateway (scale-out), named g<N>. In
// ClusterMode it joins the live gateways; call WaitReady before relying on
// its index.
func (c *Cluster) AddGateway(ctx context.Context) (*Gateway, error) {
	c.gmu.Lock()
	i := c.nextGW
	c.nextGW++
	c.gmu.Unlock()
	name := fmt.Sprintf("g%d", i)
	return c.startGateway(ctx, name, c.gatewayConfig(i, name))
}

func (c *Cluster) startGateway(ctx context.Context, name string, cfg node.Config) (*Gateway, error) {
	g := &Gateway{Name: name, cfg: cfg}
	if c.mesh != nil {
		var err error
		if g.detach, err = c.attachLinks(name, g); err != nil {
			return nil, err
		}
	}
	n, err := node.New(g.cfg, c.log.With("gateway", name))
	if err != nil {
		return nil, errors.Join(err, g.release())
	}
	if err := n.Start(ctx); err != nil {
		return nil, errors.Join(err, g.release())
	}
	g.Node = n
	if c.cfg.FrontProxies {
		if g.Front, err = startProxy(name+"/front", n.HTTPAddr(), c.log); err != nil {
			sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			return nil, errors.Join(err, n.Shutdown(sctx), g.release())
		}
	}
	c.gmu.Lock()
	defer c.gmu.Unlock()
	if c.closing.Load() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return nil, errors.Join(ErrShutdown, n.Shutdown(sctx), g.release())
	}
	c.gateways = append(c.gateways, g)
	return g, nil
}

// Gateway returns the live gateway called name, or nil.
func (c *Cluster) Gateway(name string) *Gateway {
	for _, g := range c.Gateways() {
		if g.Name == name {
			return g
		}
	}
	return nil
}

// remove takes g out of the live set; false if it was not live.
func (c *Cluster) remove(g *Gateway) bool {
	c.gmu.Lock()
	defer c.gmu.Unlock()
	for i, x := range c.gateways {
		if x == g {
			c.gateways = append(c.gateways[:i:i], c.gateways[i+1:]...)
			return true
		}
	}
	return false
}

// StopGateway shuts g down gracefully: it stops accepting, lets in-flight
// streams finish until ctx ends, leaves the cluster, and is no longer
// live. (scale-in, SIGTERM)
func (c *Cluster) StopGateway(ctx context.Context, g *Gateway) error {
	if !c.remove(g) {
		return fmt.Errorf("cluster: gateway %s is not live", g.Name)
	}
	err := g.Node.Shutdown(ctx)
	return errors.Join(err, g.release())
}

// release closes what the harness opened around a stopped gateway: its
// front proxy and its partitionable links.
func (g *Gateway) release() error {
	var errs []error
	if g.Front != nil {
		errs = append(errs, g.Front.Close())
	}
	if g.detach != nil {
		errs = append(errs, g.detach())
	}
	return errors.Join(errs...)
}

// KillGateway stops g at once, the in-process stand-in for kill -9. With a
// Front proxy, every client connection is cut first (clients see a reset,
// as when the process dies) and new ones are refused; then the node is
// shut down with an expired context (no drain). Without one, clients see
// the node's own cut path (Shutdown past its deadline). The expected
// deadline error is not returned.
func (c *Cluster) KillGateway(g *Gateway) {
	if !c.remove(g) {
		return
	}
	if g.Front != nil {
		_ = g.Front.SetRefuse(true) // the proxy is closed right after anyway
		g.Front.Cut()
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_ = g.Node.Shutdown(ctx)
	_ = g.release()
}

// RestartGateway starts a stopped or killed gateway again: same name,
// node id and data dir (so raft keeps its log), new HTTP port, joining the
// live gateways. Call WaitReady before relying on it.
func (c *Cluster) RestartGateway(ctx context.Context, old *Gateway) (*Gateway, error) {
	cfg := old.cfg
	cfg.HTTPAddr = "127.0.0.1:0"
	if c.cfg.ClusterMode {
		cfg.Cluster.Join = nil
		for _, g := range c.Gateways() {
			cfg.Cluster.Join = append(cfg.Cluster.Join, g.Node.Cluster().GossipAddr())
		}
	}
	return c.startGateway(ctx, old.Name, cfg)
}

// WaitReady waits until every live gateway reports ready (in ClusterMode:
// joined, index bootstrapped from a peer, raft config applied).
func (c *Cluster) WaitReady(ctx context.Context) error {
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		var waiting []string
		for _, g := range c.Gateways() {
			if !g.Node.Ready() {
				waiting = append(waiting, g.Name)
			}
		}
		if len(waiting) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster: gateways %s not ready: %w", strings.Join(waiting, ", "), ctx.Err())
		case <-tick.C:
		}
	}
}

// ConfigVersions lists each live gateway's raft config version
// ("g0=v3 g1=v3"), or "" outside ClusterMode.
func (c *Cluster) ConfigVersions() string {
	if !c.cfg.ClusterMode {
		return ""
	}
	var parts []string
	for _, g := range c.Gateways() {
		parts = append(parts, fmt.Sprintf("%s=v%d", g.Name, g.Node.ConfigVersion()))
	}
	return strings.Join(parts, " ")
}

// ConfigConverged reports whether every live gateway applies the same
// non-zero config version.
func (c *Cluster) ConfigConverged() bool {
	var v uint64
	for i, g := range c.Gateways() {
		gv := g.Node.ConfigVersion()
		if gv == 0 || (i > 0 && gv != v) {
			return false
		}
		v = gv
	}
	return true
}

func startProxy(name, target string, l *slog.Logger) (*faultproxy.Proxy, error) {
	pc := faultproxy.DefaultConfig()
	pc.Name, pc.Target, pc.Logger = name, target, l
	p, err := faultproxy.New(pc)
	if err != nil {
		return nil, err
	}
	return p, p.Start()
}

// replicaConfig is how gateways reach e.
func (e *Engine) replicaConfig() node.ReplicaConfig {
	s := e.Server()
	rc := node.ReplicaConfig{Name: e.Name, URL: s.URL()}
	if e.HTTP != nil {
		rc.URL = "http://" + e.HTTP.Addr()
	}
	switch {
	case e.KV != nil:
		rc.KVEndpoint = "tcp://" + e.KV.Addr()
	case e.Relay != nil:
		rc.KVEndpoint = e.Relay.Addr()
	case e.c.cfg.KVLink == KVDirect:
		rc.KVEndpoint = s.KVEventsAddr()
	}
	if rc.KVEndpoint != "" {
		rc.ReplayEndpoint = s.KVReplayAddr()
	}
	return rc
}

// Config returns the cluster's configuration.
func (c *Cluster) Config() Config { return c.cfg }

// Engines returns the engines that are not retired, in name order.
func (c *Cluster) Engines() []*Engine {
	c.emu.Lock()
	defer c.emu.Unlock()
	out := make([]*Engine, 0, len(c.engines))
	for _, e := range c.engines {
		if !e.retired.Load() && e.Server() != nil {
			out = append(out, e)
		}
	}
	return out
}

// Gateways returns the live gateways, in start order.
func (c *Cluster) Gateways() []*Gateway {
	c.gmu.Lock()
	defer c.gmu.Unlock()
	return append([]*Gateway(nil), c.gateways...)
}

// Server is the engine's current simulator (a restart replaces it).
func (e *Engine) Server() *sim.Server {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.srv
}

// URL is the engine's API, bypassing any proxy.
func (e *Engine) URL() string { return e.Server().URL() }

// Restart stops the engine and starts a new one on the same HTTP, PUB and
// replay addresses, with an empty cache, a new hash seed and sequence
// numbers from 0: what a vLLM restart looks like to gateways.
func (e *Engine) Restart(ctx context.Context) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	old := e.srv
	cfg := old.Config()
	_, port, err := net.SplitHostPort(old.Addr())
	if err != nil {
		return err
	}
	if cfg.Port, err = strconv.Atoi(port); err != nil {
		return err
	}
	cfg.KVEvents.Endpoint = old.KVEventsAddr()
	cfg.KVEvents.ReplayEndpoint = old.KVReplayAddr()
	cfg.HashSeed = 0
	if err := old.Shutdown(ctx); err != nil {
		return fmt.Errorf("cluster: engine %s: stop: %w", e.Name, err)
	}
	srv, err := sim.NewServer(cfg)
	if err != nil {
		return err
	}
	// The old listeners are closed; binding the same ports can still race
	// the kernel briefly, so retry until ctx ends.
	for {
		if err = srv.Start(ctx); err == nil {
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("cluster: engine %s: restart: %w", e.Name, err)
		}
		if srv, err = sim.NewServer(cfg); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
	e.srv = srv
	// The harness's own keep-alive connections died with the old engine.
	e.c.hc.CloseIdleConnections()
	return nil
}

// ResetCache posts /reset_prefix_cache to the engine until it succeeds (vLLM
// refuses while requests hold blocks) or ctx ends.
func (e *Engine) ResetCache(ctx context.Context) error {
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, err := e.c.resetOnce(ctx, e.URL())
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cluster: engine %s: reset refused until deadline: %w", e.Name, ctx.Err())
		case <-tick.C:
		}
	}
}

func (c *Cluster) resetOnce(ctx context.Context, url string) (bool, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/reset_prefix_cache", nil)
	if err != nil {
		return false, err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	var r struct {
		Success bool `json:"success"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		return false, fmt.Errorf("cluster: reset answer: %w", err)
	}
	return resp.StatusCode == http.StatusOK && r.Success, nil
}

// Pair is one gateway's view of one engine measured against the engine.
type Pair struct {
	Gateway, Engine string
	truth.Comparison
}

// Compare measures every gateway's confirmed index for every engine.
func (c *Cluster) Compare() ([]Pair, error) {
	gws := c.Gateways()
	engines := c.Engines()
	out := make([]Pair, 0, len(gws)*len(engines))
	for _, e := range engines {
		blocks := e.Server().CachedBlocks()
		for _, g := range gws {
			ix := g.Node.Index()
			id, ok := g.Node.ReplicaID(e.Name)
			if !ok {
				continue
			}
			t, err := truth.FromBlocks(blocks, ix.Hasher(), ix.Hasher().Root(c.cfg.Model, "", ""))
			if err != nil {
				return nil, err
			}
			out = append(out, Pair{Gateway: g.Name, Engine: e.Name, Comparison: truth.Compare(t, ix, id)})
		}
	}
	return out, nil
}

// Summary condenses pairs: the worst precision and recall.
type Summary struct {
	Pairs                   int
	MinPrecision, MinRecall float64
	// Worst is the pair with the lowest precision (then recall).
	Worst Pair
}

// Summarize returns the worst figures over pairs (1, 1 for none).
func Summarize(ps []Pair) Summary {
	s := Summary{Pairs: len(ps), MinPrecision: 1, MinRecall: 1}
	if len(ps) > 0 {
		s.Worst = ps[0]
	}
	for _, p := range ps {
		pr, rc := p.Precision(), p.Recall()
		if pr < s.MinPrecision || (pr == s.MinPrecision && rc < s.MinRecall) {
			s.Worst = p
		}
		s.MinPrecision = min(s.MinPrecision, pr)
		s.MinRecall = min(s.MinRecall, rc)
	}
	return s
}

// String is "precision P recall R over N pairs".
func (s Summary) String() string {
	return fmt.Sprintf("precision %.4f recall %.4f over %d pairs (worst %s/%s: %s)", s.MinPrecision, s.MinRecall, s.Pairs, s.Worst.Gateway, s.Worst.Engine, s.Worst.Comparison)
}

// AwaitTruth polls Compare every poll until ok holds for every pair, and
// returns the summary and how long it took; after ctx ends it returns the
// last summary and ErrNotConverged.
func (c *Cluster) AwaitTruth(ctx context.Context, poll time.Duration, ok func(Pair) bool) (Summary, time.Duration, error) {
	start := time.Now()
	tick := time.NewTicker(poll)
	defer tick.Stop()
	for {
		ps, err := c.Compare()
		if err != nil {
			return Summary{}, time.Since(start), err
		}
		all := true
		for _, p := range ps {
			if !ok(p) {
				all = false
				break
			}
		}
		s := Summarize(ps)
		if all {
			return s, time.Since(start), nil
		}
		select {
		case <-ctx.Done():
			return s, time.Since(start), fmt.Errorf("%w after %v: %s", ErrNotConverged, time.Since(start).Round(time.Millisecond), s)
		case <-tick.C:
		}
	}
}

// Exact is an AwaitTruth predicate: confirmed set equal to the engine's.
// With index blocks smaller than engine blocks it tolerates the inner keys
// the index loses by design (truth.IsExactButSharedInner).
func (c *Cluster) Exact(p Pair) bool {
	if c.cfg.EngineBlockTokens != c.cfg.IndexBlockTokens {
		return truth.IsExactButSharedInner(p.Comparison)
	}
	return p.Exact()
}

// EngineExact reports whether every gateway's view of e is exact (see
// Exact); a Compare error counts as not exact.
func (c *Cluster) EngineExact(e *Engine) bool {
	ps, err := c.Compare()
	if err != nil {
		return false
	}
	for _, p := range ps {
		if p.Engine == e.Name && !c.Exact(p) {
			return false
		}
	}
	return true
}

// WarmUp sends prompts straight to each engine until every gateway has
// heard its events (PUB/SUB drops what is published before a subscription
// takes effect, and an idle engine publishes nothing that would reveal the
// gap). It sends at most 200 prompts per engine.
func (c *Cluster) WarmUp(ctx context.Context) error {
	if c.cfg.KVLink == KVNone {
		return nil
	}
	for _, e := range c.Engines() {
		if err := c.WaitHeard(ctx, e, nil); err != nil {
			return err
		}
	}
	return nil
}

// WaitHeard sends prompts straight to e until every gateway holds engine
// hashes for e and done (if non-nil) returns true; for example until the
// entries of a restarted engine's predecessor are gone. After each prompt
// it polls the condition for up to 20 ms before sending another, and it
// sends at most 1,000 prompts; ctx bounds it in time.
func (c *Cluster) WaitHeard(ctx context.Context, e *Engine, done func() bool) error {
	cond := func() bool {
		for _, g := range c.Gateways() {
			id, ok := g.Node.ReplicaID(e.Name)
			if ok && len(g.Node.Index().AppendEngineHashes(nil, id)) == 0 {
				return false
			}
		}
		return done == nil || done()
	}
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for i := 0; i < 1000; i++ {
		if cond() {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("cluster: engine %s not heard by every gateway: %w", e.Name, err)
		}
		prompt := fmt.Sprintf("warm-up %s %d %s", e.Name, i, strings.Repeat("w", 40))
		if _, err := c.Complete(ctx, e.URL(), prompt, 1); err != nil {
			return err
		}
		for range 10 {
			if cond() {
				return nil
			}
			select {
			case <-ctx.Done():
			case <-tick.C:
			}
		}
	}
	return fmt.Errorf("cluster: engine %s not heard by every gateway after 1000 prompts", e.Name)
}

// Complete sends one non-streaming completion to base (an engine or a
// gateway) and returns the replica header (gateways) or "".
func (c *Cluster) Complete(ctx context.Context, base, prompt string, maxTokens int) (string, error) {
	return c.CompleteWithHeader(ctx, base, prompt, maxTokens, nil)
}

// CompleteWithHeader is Complete with extra request headers (for example
// node.HeaderStrategy).
func (c *Cluster) CompleteWithHeader(ctx context.Context, base, prompt string, maxTokens int, h http.Header) (string, error) {
	body, err := json.Marshal(map[string]any{"model": c.cfg.Model, "prompt": prompt, "max_tokens": maxTokens})
	if err != nil {
		return "", err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(string(body)))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	for k, vs := range h {
		for _, v := range vs {
			req.Header.Add(k, v)
		}
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var out struct {
		Choices []json.RawMessage `json:"choices"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != http.StatusOK || len(out.Choices) == 0 {
		return "", fmt.Errorf("cluster: completion via %s: status %d: %v", base, resp.StatusCode, err)
	}
	return resp.Header.Get(node.HeaderReplica), nil
}

// ReplicaMatch returns how many leading blocks of prompt gateway g's index
// attributes to engine e in its confirmed and speculative ledgers (what
// kv-events routing trusts).
func (c *Cluster) ReplicaMatch(g *Gateway, e *Engine, prompt string, now time.Time) int {
	ix := g.Node.Index()
	id, ok := g.Node.ReplicaID(e.Name)
	if !ok {
		return 0
	}
	keys := ix.Hasher().AppendKeysString(nil, ix.Hasher().Root(c.cfg.Model, "", ""), prompt)
	out := make([]int32, 1)
	ix.Match(keys, []index.ReplicaID{id}, index.ModeKVEvents, now.UnixNano(), out)
	return int(out[0])
}

// Shutdown stops gateways, then fault points, then engines, and waits for
// each. Idempotent: later calls return the first result.
func (c *Cluster) Shutdown(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.shutdown {
		return c.err
	}
	c.shutdown = true
	c.closing.Store(true)
	// Idle client connections first: an http.Server counts a connection
	// that never carried a request as active for 5 s during Shutdown.
	c.hc.CloseIdleConnections()
	var errs []error
	c.gmu.Lock()
	gws := c.gateways
	c.gateways = nil
	c.gmu.Unlock()
	for _, g := range gws {
		if err := g.Node.Shutdown(ctx); err != nil {
			errs = append(errs, fmt.Errorf("gateway %s: %w", g.Name, err))
		}
		errs = append(errs, g.release())
	}
	c.emu.Lock()
	engines := c.engines
	c.emu.Unlock()
	for _, e := range engines {
		if e.HTTP != nil {
			errs = append(errs, e.HTTP.Close())
		}
		if e.KV != nil {
			errs = append(errs, e.KV.Close())
		}
		if e.Relay != nil {
			errs = append(errs, e.Relay.Close())
		}
		if s := e.Server(); s != nil {
			if err := s.Shutdown(ctx); err != nil {
				errs = append(errs, fmt.Errorf("engine %s: %w", e.Name, err))
			}
		}
	}
	if c.NATS != nil {
		errs = append(errs, c.NATS.Close())
	}
	if c.natsSrv != nil {
		c.natsSrv.Shutdown()
		c.natsSrv.WaitForShutdown()
	}
	c.err = errors.Join(errs...)
	return c.err
}
