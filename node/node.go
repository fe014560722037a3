package node

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/node/tokenizer"
	"github.com/kvmesh/kvmesh/route"
	"github.com/kvmesh/kvmesh/sync/config"
)

// Node is one gateway: the OpenAI-compatible proxy, its index, load view,
// health checks and KV-event subscribers. Several Nodes may run in one
// process; each has its own metrics registry.
type Node struct {
	cfg Config
	// owners maps Responses API ids to the replica that stored them.
	owners *responseOwners
	log    *slog.Logger
	mode   index.Mode // default; pools may override

	index    *index.Index
	hasher   index.Hasher
	tokName  string
	tok      tokenizer.Tokenizer
	tokCache *tokenizer.Cached // nil unless tok is a prefix-cached tiktoken or hf
	hf       *tokenizer.HF     // the hf:<dir> tokenizer (also wrapped in tok), or nil
	// modelToks caches the models' own tokenizers (ModelConfig.Tokenizer)
	// by name, so a config apply loads each at most once; guarded by
	// reloadMu. Each pool points at its own (pool.tok).
	modelToks map[string]*keyTokenizer
	remote    *remoteTokenizer
	// engineRemote tokenizes the prompts of models whose replicas disagree
	// with tok (agreement.go); agree holds the verdicts.
	engineRemote *remoteTokenizer
	agree        agreementState

	// HTTP edges (edges.go): the admin token of the debug views and the
	// pin header, and the in-flight limit.
	admin    adminAuth
	inflight limiter

	// tbl is the current routing table (pools, models, replicas), swapped
	// atomically on a config apply; ids names replicas for the index.
	tbl      atomic.Pointer[table]
	ids      *replicaIDs
	reloadMu sync.Mutex // serialises table rebuilds
	// probeDone closes when a replica's current probe loop has returned
	// (runProbeLoop); guarded by reloadMu.
	probeDone    map[*replica]chan struct{}
	tableVersion atomic.Uint64
	running      atomic.Bool // background work runs; changed under reloadMu

	// Cluster mode (nil/zero standalone): see cluster.go.
	cl *clusterParts
	// epp is the endpoint picker (epp.go); nil when Config.EPP.Addr is "".
	epp *eppParts
	// disc holds the discovered replicas (discovery.go); baseSpec is the
	// last spec applied from config, before they were merged in. Both
	// guarded by reloadMu.
	disc     discoveryState
	baseSpec routingSpec

	transport *http.Transport
	up        *upstreamClient // the proxy's client for http:// replicas; nil with UpstreamHTTP2
	client    *http.Client    // probes and remote tokenize
	m         *metrics
	kvMetrics *kvevents.Metrics
	handler   http.Handler
	rngSeed   atomic.Uint64
	peers     atomic.Pointer[peerHolder]
	// othersSeenAt is when (Unix ns) a scrape last showed an engine
	// running more requests than this gateway had open there, with no
	// peer reporting load; 0: never (see sharesEngines).
	othersSeenAt atomic.Int64
	// shareWake is closed (and replaced) when the gateway starts sharing
	// its engines, so every probe loop reschedules its next scrape at
	// once (see sharedWake).
	shareWake atomic.Pointer[chan struct{}]
	recorder  atomic.Pointer[recordHolder]

	mu       sync.Mutex
	started  bool
	shutdown bool
	srv      *http.Server
	ln       net.Listener
	bgCtx    context.Context
	bgCancel context.CancelFunc
	reqBase  context.Context
	reqAbort context.CancelCauseFunc // errShutdownCut past Shutdown's deadline
	active   activeCount             // inference handlers running
	conns    connTracker             // the HTTP server's connections
	wg       sync.WaitGroup

	shutOnce sync.Once
	shutErr  error
	stopping atomic.Bool
}

type peerHolder struct{ p PeerLoad }

type recordHolder struct{ l RecordListener }

// modelRef resolves a request's "model": its pool and LoRA adapter ("" for
// the base model).
type modelRef struct {
	pool *pool
	lora string
}

// New builds a Node from cfg (validated here) without starting anything.
// logger may be nil (logs are discarded).
func New(cfg Config, logger *slog.Logger) (*Node, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.IndexMode = cfg.EffectiveIndexMode() // auto, resolved once
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	n := &Node{cfg: cfg, log: logger, mode: cfg.Mode(), ids: newReplicaIDs()}
	n.rngSeed.Store(uint64(time.Now().UnixNano()))

	icfg := index.DefaultConfig()
	icfg.Seed = cfg.HashSeed
	icfg.BlockTokens = cfg.EffectiveBlockSize()
	icfg.Capacity = cfg.IndexCapacity
	icfg.HistoryTTL = cfg.HistoryTTL
	icfg.SpeculativeTTL = cfg.SpeculativeTTL
	ix, err := index.New(icfg)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	n.index = ix
	n.hasher = ix.Hasher()

	n.tokName = cfg.EffectiveTokenizer()
	local := n.tokName
	if local == TokenizerRemote {
		local = TokenizerTiktoken
	}
	kt, cached, err := newKeyTokenizer(local, cfg.TokenizerCacheBytes)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	n.tok, n.hf, n.tokCache = kt.tok, kt.hf, cached
	n.modelToks = map[string]*keyTokenizer{} // filled by applySpec
	n.probeDone = map[*replica]chan struct{}{}

	n.m = newMetrics()
	n.m.reg.MustRegister(queuedPrefillCollector{n})
	n.owners = newResponseOwners(cfg.MaxResponseOwners, cfg.ResponseTTL)
	n.transport = newTransport(cfg)
	if !cfg.UpstreamHTTP2 {
		n.up = newUpstreamClient(cfg)
	}
	n.client = &http.Client{Transport: n.transport, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}
	if n.tokName == TokenizerRemote {
		n.remote = newRemoteTokenizer(n.client, cfg.RemoteTokenizeCacheSize)
	}
	n.engineRemote = n.remote
	if n.engineRemote == nil {
		n.engineRemote = newRemoteTokenizer(n.client, cfg.RemoteTokenizeCacheSize)
	}
	tok := cfg.AdminToken
	if tok == "" {
		if tok, err = config.LoadToken(cfg.Cluster.AdminToken, cfg.Cluster.AdminTokenFile); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
	}
	n.admin = newAdminAuth(tok)
	n.inflight.max = int64(cfg.MaxInFlight)
	n.agree.reports = map[string]AgreementReport{}
	n.agree.warned = map[string]bool{}

	n.kvMetrics = kvevents.NewMetrics()
	if err := n.kvMetrics.Register(n.m.reg); err != nil {
		return nil, fmt.Errorf("node: register KV-event metrics: %w", err)
	}
	if cfg.Cluster.Active() {
		if n.cl, err = newClusterParts(&cfg); err != nil {
			return nil, err
		}
	}
	n.registerTrustMetrics()
	if err := n.initDiscovery(); err != nil {
		return nil, err
	}
	if err := n.applySpec(specFromConfig(&cfg)); err != nil {
		return nil, err
	}
	n.registerIndexMetrics()
	n.m.registerEdges(n)
	n.registerTokenizerMetrics()
	if n.cl == nil {
		// In cluster mode the config store registers the same gauge.
		n.m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvmesh_config_version",
			Help: "Version of the routing config in force (0: the gateway's own flags or file; standalone).",
		}, func() float64 { return float64(n.tableVersion.Load()) }))
	}
	n.handler = n.routes()
	return n, nil
}

// closeUpstreamIdle closes the proxy client's idle connections for good.
func (n *Node) closeUpstreamIdle() {
	if n.up != nil {
		n.up.closeIdle(true)
	}
}

// newTransport builds the one upstream transport: keep-alives sized for
// hundreds of concurrent streams per replica, no transparent compression
// (bytes are relayed as the engine sent them), HTTP/1.1 unless asked.
func newTransport(cfg Config) *http.Transport {
	d := &net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second}
	t := &http.Transport{
		DialContext:           d.DialContext,
		MaxIdleConns:          0, // no global cap; per host below
		MaxIdleConnsPerHost:   cfg.MaxIdleConnsPerHost,
		IdleConnTimeout:       90 * time.Second,
		ResponseHeaderTimeout: cfg.FirstByteTimeout,
		DisableCompression:    true,
		ForceAttemptHTTP2:     cfg.UpstreamHTTP2,
		WriteBufferSize:       32 << 10,
		ReadBufferSize:        32 << 10,
	}
	if !cfg.UpstreamHTTP2 {
		// A non-nil empty map disables HTTP/2 upgrades over TLS.
		t.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	}
	return t
}

// SetPeerLoad installs the source of peers' in-flight counts. Safe to call
// at any time; nil removes it.
func (n *Node) SetPeerLoad(p PeerLoad) {
	if p == nil {
		n.peers.Store(nil)
		return
	}
	n.peers.Store(&peerHolder{p: p})
}

func (n *Node) peerLoad() PeerLoad {
	if h := n.peers.Load(); h != nil {
		return h.p
	}
	return nil
}

// peerQueuedPrefill is the peers' reported queued prefill to the replica
// named replica: 0 without peers' reports or where they carry none.
func (n *Node) peerQueuedPrefill(replica string) int {
	if q, ok := n.peerLoad().(PeerQueuedPrefill); ok {
		return q.QueuedPrefill(replica)
	}
	return 0
}

// SetRecordListener installs the listener told about every decision the
// Node records in its index. Safe to call at any time; nil removes it.
func (n *Node) SetRecordListener(l RecordListener) {
	if l == nil {
		n.recorder.Store(nil)
		return
	}
	n.recorder.Store(&recordHolder{l: l})
}

// Registry is the Node's private metrics registry (served on /metrics).
func (n *Node) Registry() *prometheus.Registry { return n.m.reg }

// Handler is the Node's HTTP handler, for embedding in another server or
// httptest. Start serves the same handler.
func (n *Node) Handler() http.Handler { return n.handler }

// Index is the Node's prefix index (for replication and tests).
func (n *Node) Index() *index.Index { return n.index }

// Config returns the configuration the Node was built with.
func (n *Node) Config() Config { return n.cfg }

// ReplicaID returns the process-local handle of the replica called name.
func (n *Node) ReplicaID(name string) (index.ReplicaID, bool) {
	r, ok := n.tbl.Load().byName[name]
	if !ok {
		return 0, false
	}
	return r.id, true
}

// ReplicaName returns the name of the replica with process-local handle
// id (also for replicas that left the routing table: IDs are never
// reused).
func (n *Node) ReplicaName(id index.ReplicaID) (string, bool) { return n.ids.ReplicaName(id) }

// Replicas returns the names of the replicas in the current routing table.
func (n *Node) Replicas() []string {
	t := n.tbl.Load()
	out := make([]string, len(t.replicas))
	for i, r := range t.replicas {
		out[i] = r.name
	}
	return out
}

// ConfigVersion is the version of the routing config in force: the raft
// config version once one was applied, 0 while the Node routes on its own
// Config.
func (n *Node) ConfigVersion() uint64 { return n.tableVersion.Load() }

// Start listens on HTTPAddr, starts the health checkers, scrapers, index
// expiry and KV-event subscribers, and returns once the listener accepts
// connections. ctx bounds the start only; the Node runs until Shutdown.
func (n *Node) Start(ctx context.Context) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.shutdown {
		return ErrShutdown
	}
	if n.started {
		return ErrAlreadyStarted
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := n.checkDiscovery(); err != nil {
		return err
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", n.cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("node: listen %s: %w", n.cfg.HTTPAddr, err)
	}
	// Client connections read and write without waking sysmon (rawio.go).
	ln = rawIOListener{ln}
	n.ln = ln
	epp, err := n.listenEPP(ctx)
	if err != nil {
		_ = ln.Close()
		return err
	}
	n.bgCtx, n.bgCancel = context.WithCancel(context.Background())
	n.reqBase, n.reqAbort = context.WithCancelCause(context.Background())
	n.srv = &http.Server{
		Handler:           n.handler,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       120 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return n.reqBase },
		ConnState:         n.conns.track,
		ErrorLog:          slog.NewLogLogger(n.log.Handler(), slog.LevelWarn),
	}
	if n.cl != nil {
		if err := n.startCluster(ctx, ln.Addr().String()); err != nil {
			n.bgCancel()
			n.reqAbort(nil)
			_ = ln.Close()
			epp.close()
			n.wg.Wait()
			return err
		}
	}
	// A config apply (cluster mode) may rebuild the table from here on:
	// reloadMu makes it see either the table before the background work
	// started (and start its new replicas itself) or after.
	n.reloadMu.Lock()
	if err := n.startKVEvents(ctx); err != nil {
		n.reloadMu.Unlock()
		if n.cl != nil {
			n.closeCluster(context.Background(), nil)
		}
		n.bgCancel()
		n.reqAbort(nil)
		_ = ln.Close()
		epp.close()
		n.wg.Wait()
		return err
	}
	t := n.tbl.Load()
	for _, r := range t.replicas {
		ctx, cancel := context.WithCancel(n.bgCtx)
		r.cancel = cancel
		n.runProbeLoop(ctx, r)
	}
	n.running.Store(true)
	n.reloadMu.Unlock()
	n.started = true
	n.goFunc(func() {
		if err := n.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			n.log.Error("http server stopped", "err", err)
		}
	})
	n.serveEPP(epp)
	n.startDiscovery()
	n.goFunc(n.expireLoop)
	n.log.Info("gateway listening", "addr", ln.Addr().String(), "models", len(t.pools),
		"replicas", len(t.replicas), "index_mode", n.cfg.IndexMode, "tokenizer", n.tokName,
		"block_size", n.hasher.BlockTokens(), "strategy", n.cfg.Strategy)
	return nil
}

// goFunc runs f on a goroutine the Node owns and waits for at Shutdown.
func (n *Node) goFunc(f func()) {
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		f()
	}()
}

// HTTPAddr is the address the Node listens on (with the real port when
// HTTPAddr asked for port 0), or "" before Start.
func (n *Node) HTTPAddr() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.ln == nil {
		return ""
	}
	return n.ln.Addr().String()
}

// Shutdown stops the Node in order, logging each step with its duration:
// /health and /ready turn 503 (load balancers drain the gateway); in
// cluster mode the gateway gossips its leave (peers take over its KV-event
// streams at once) and leaves raft (a leader transfers leadership to
// another voter first); connections without a request in flight (idle
// keep-alives, or new ones that sent nothing yet) are closed at once, the
// HTTP server stops accepting and in-flight requests and streams finish
// until ctx is done, the rest are cut: a cut
// stream ends with an SSE error event (code gateway_shutdown) written
// before its connection is closed, a cut request that has no response yet
// gets a 503 gateway_shutdown, and a response that can carry no error (a
// non-streaming body already started, or a connection that takes no more
// bytes) is aborted, never terminated as if complete; the cut takes at
// most cutWriteTimeout past ctx's deadline; then the admin API, the config store and the cluster
// stop, and subscribers, scrapers and health checkers, and every goroutine
// the Node started is waited for. It is idempotent: later calls return
// the first call's result. Safe before Start.
func (n *Node) Shutdown(ctx context.Context) error {
	n.shutOnce.Do(func() {
		n.mu.Lock()
		n.shutdown = true
		started := n.started
		n.mu.Unlock()
		n.stopping.Store(true)
		if !started {
			n.stopKVEvents()
			n.transport.CloseIdleConnections()
			n.closeUpstreamIdle()
			return
		}
		t0 := time.Now()
		step := func(what string, f func()) {
			t := time.Now()
			f()
			n.log.Info("shutdown: "+what, "took", time.Since(t).Round(time.Microsecond))
		}
		if n.cl != nil {
			step("left gossip", func() {
				if err := n.cl.cluster.Leave(n.cfg.Cluster.LeaveTimeout); err != nil {
					n.log.Warn("gossip leave", "err", err)
				}
			})
			leader := n.cl.store.IsLeader()
			step("left raft (leadership transferred if leader)", func() {
				if err := n.cl.store.Leave(); err != nil {
					n.log.Warn("raft leave", "leader", leader, "err", err)
				}
			})
		}
		if n.epp != nil {
			step("drained endpoint-picker streams", func() { n.stopEPP(ctx) })
		}
		var err error
		step("drained HTTP requests and streams", func() {
			// Connections without a request in flight would hold Shutdown
			// for Go's 5 s allowance: close them first.
			if c := n.conns.closeQuiet(); c > 0 {
				n.log.Info("shutdown: closed connections without a request", "conns", c)
			}
			err = n.srv.Shutdown(ctx)
			if err != nil {
				// Deadline: cut the remaining requests. Each cut handler
				// ends its stream with a gateway_shutdown error event (or
				// aborts its connection) within cutWriteTimeout; the
				// connections are closed once they all returned or that
				// time is up, whichever comes first.
				left := n.active.load()
				n.reqAbort(errShutdownCut)
				t := time.NewTimer(cutWriteTimeout + 50*time.Millisecond)
				select {
				case <-n.active.zero():
				case <-t.C:
				}
				t.Stop()
				_ = n.srv.Close()
				n.log.Warn("shutdown deadline reached, cut the remaining streams", "requests", left, "err", err)
			}
		})
		n.reqAbort(nil)
		if n.cl != nil {
			cctx, cancel := context.WithTimeout(context.Background(), n.cfg.Cluster.LeaveTimeout)
			n.closeCluster(cctx, step)
			cancel()
		}
		step("stopped probes and KV-event subscribers", func() {
			n.reloadMu.Lock() // no table rebuild is half done past here
			n.running.Store(false)
			n.reloadMu.Unlock()
			n.bgCancel()
			n.wg.Wait()
			n.stopKVEvents()
		})
		n.transport.CloseIdleConnections()
		n.closeUpstreamIdle()
		n.shutErr = err
		n.log.Info("gateway stopped", "took", time.Since(t0).Round(time.Millisecond))
	})
	return n.shutErr
}

// lookupModel resolves a request's model name in table t.
func (t *table) lookupModel(name string) (*pool, string, *apiError) {
	ref, ok := t.models[name]
	if !ok {
		return nil, "", &apiError{status: http.StatusNotFound, code: CodeModelNotFound,
			message: fmt.Sprintf("model %q is not served by this gateway", name)}
	}
	return ref.pool, ref.lora, nil
}

// strategyFor returns the strategy named by the routing-strategy header,
// else the pool's, else the node's default.
func (t *table) strategyFor(p *pool, header string) (route.Strategy, *apiError) {
	name := header
	if name == "" {
		name = p.strategy
	}
	if name == "" {
		name = t.strategy
	}
	s, err := p.set.Get(name)
	if err != nil {
		return nil, errBadRequest(CodeUnknownStrategy, fmt.Sprintf("unknown routing strategy %q (want one of %v)", name, route.Names()))
	}
	return s, nil
}

// expireLoop drops expired history and speculative entries in bounded
// slices so that Match never waits long for the write lock.
func (n *Node) expireLoop() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-n.bgCtx.Done():
			return
		case <-t.C:
			n.index.Expire(time.Now().UnixNano(), 1<<16)
		}
	}
}

// registerTokenizerMetrics exposes the prefix-cached tokenizer's counters.
func (n *Node) registerTokenizerMetrics() {
	if n.tokCache == nil {
		return
	}
	c := n.tokCache
	n.m.reg.MustRegister(
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kvmesh_tokenize_cache_hits_total",
			Help: "Local tokenizations that reused a cached prompt prefix.",
		}, func() float64 { return float64(c.Stats().Hits) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kvmesh_tokenize_cache_misses_total",
			Help: "Local tokenizations that found no cached prefix.",
		}, func() float64 { return float64(c.Stats().Misses + c.Stats().Uncacheable) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kvmesh_tokenize_cache_hit_bytes_total",
			Help: "Prompt bytes whose tokens came from the prefix cache.",
		}, func() float64 { return float64(c.Stats().HitBytes) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "kvmesh_tokenize_encoded_bytes_total",
			Help: "Prompt bytes the local tokenizer encoded.",
		}, func() float64 { return float64(c.Stats().EncodedBytes) }),
	)
}

func nowNanos() int64 { return time.Now().UnixNano() }

// registerIndexMetrics exposes the index's entry counts per ledger.
func (n *Node) registerIndexMetrics() {
	for _, l := range []index.Ledger{index.History, index.Speculative, index.Confirmed} {
		n.m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "kvmesh_index_entries",
			Help:        "(block, replica) entries in the prefix index, by ledger.",
			ConstLabels: prometheus.Labels{"ledger": l.String()},
		}, func() float64 { return float64(n.index.Stats().Entries[l]) }))
	}
	n.m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvmesh_index_blocks",
		Help: "Distinct block keys in the prefix index.",
	}, func() float64 { return float64(n.index.Stats().Blocks) }))
}
