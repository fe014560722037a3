// Package live is kvbench's live engine: for each grid cell it starts
// in-process simulated vLLM replicas (chaos/sim) and kvmesh gateways
// (node.Node) on 127.0.0.1 with port 0, wired through their Go APIs, with KV
// events on loopback ZMQ when the index mode uses them, and drives them over
// HTTP with package httpenv. Model time is wall time multiplied by the
// simulators' speed factor; the gateways' time-based settings (scrape
// interval, speculative TTL, stream timeouts, the cost strategy's share
// window) are scaled by the same factor so that they mean the same in
// model time at any speed.
//
// Several gateways (Config.Gateways > 1) form one real cluster unless
// Config.Isolated is set: node's cluster mode with real memberlist gossip,
// an embedded NATS server per gateway, raft for the routing config and the
// peer gRPC snapshot service, all on 127.0.0.1 port 0 with node's local
// timing profile, the raft data in a temporary directory removed at Close.
// They share the index (routing-decision deltas, KV events ingested by one
// owner gateway per engine and republished) and per-replica load reports.
// Start returns once every gateway is ready (joined, index bootstrapped,
// raft config applied) and, with KV events, each engine's stream has
// exactly one owner. World.Settle (study.Settler) waits after each
// scenario's initialisation until every gateway's index holds the same
// history and confirmed entries as gateway 0's. Isolated gateways share
// nothing: the --no-sync baseline.
//
// Time scaling: node's per-gateway settings are scaled by the speed
// factor; the cluster's own periods (load-report interval 100 ms, delta
// flush 2 ms, gossip) are sync's local profile in wall time, which node
// does not expose, so at speed S peers' load is up to S×100 ms stale in
// model time.
package live

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/chaos/study/httpenv"
	"github.com/kvmesh/kvmesh/node"
	"github.com/kvmesh/kvmesh/route"
	"github.com/kvmesh/kvmesh/sync/trust"
)

// ErrInvalidConfig is returned by Config.Validate.
var ErrInvalidConfig = errors.New("live: invalid config")

// Config configures the live engine for one cell.
type Config struct {
	// Replicas is the number of simulated engines, named A, B, C, ...
	Replicas int
	// Gateways is the number of gateways; more than one form a cluster
	// unless Isolated is set.
	Gateways int
	// Isolated keeps several gateways independent: no gossip, no shared
	// index, no load reports (the study's --no-sync baseline).
	Isolated bool
	// ClusterTimeout bounds, in wall time, the cluster's formation at
	// Start and each Settle. Default 60 s.
	ClusterTimeout time.Duration
	// SettlePoll is how often Settle compares the gateways' indexes (wall
	// time). Default 2 ms.
	SettlePoll time.Duration
	// Mode is the gateways' index mode: history, kv-events or hybrid.
	Mode string
	// Profile is the simulators' step-time profile (sim.LookupProfile).
	Profile string
	// Speed divides all modelled time in the simulators.
	Speed float64
	// Model is the served model name.
	Model string
	// EngineBlockSize is the simulators' KV block size in tokens. Default
	// 16 (vLLM's default); with KV events the gateways use the same size.
	EngineBlockSize int
	// EngineTokens is the simulators' KV pool in tokens (rounded down to
	// whole blocks). Default 200,000: what an L20 48 GB has left for KV
	// next to 27 GB of FP8 weights (sim's default).
	EngineTokens int
	// Tokenizer is the simulators' tokenizer. Default "tiktoken": prompts
	// of the seed's ~5K tokens.
	Tokenizer string
	// Logger receives the simulators' and gateways' logs; nil discards.
	Logger *slog.Logger
	// TuneSim and TuneNode, if set, adjust each simulator's and gateway's
	// config last (tests use them).
	TuneSim  func(*sim.Config)
	TuneNode func(*node.Config)
	// EPP puts the gateways behind Envoy-style data planes as endpoint
	// pickers instead of proxies: each gateway serves ext_proc
	// (node.EPPConfig) and the study's requests go to one data plane per
	// gateway (chaos/extproc, the stand-in for Envoy), which asks its own
	// gateway first and the others on failure.
	EPP bool
}

// DefaultConfig returns two replicas behind one gateway in history mode,
// on the calibrated L20 profile at speed 10.
func DefaultConfig() Config {
	return Config{
		Replicas:        2,
		Gateways:        1,
		Mode:            "history",
		Profile:         sim.ProfileL20Qwen27BFP8.Name,
		Speed:           10,
		Model:           "qwen38-27b-fp8",
		EngineBlockSize: 16,
		EngineTokens:    200_000,
		Tokenizer:       "tiktoken",
		ClusterTimeout:  60 * time.Second,
		SettlePoll:      2 * time.Millisecond,
	}
}

// Validate reports the first problem with c.
func (c *Config) Validate() error {
	switch {
	case c.Replicas < 1 || c.Replicas > 26:
		return fmt.Errorf("%w: replicas %d not in 1..26", ErrInvalidConfig, c.Replicas)
	case c.Gateways < 1:
		return fmt.Errorf("%w: gateways %d < 1", ErrInvalidConfig, c.Gateways)
	case !(c.Speed > 0):
		return fmt.Errorf("%w: speed must be > 0", ErrInvalidConfig)
	case c.Model == "":
		return fmt.Errorf("%w: no model name", ErrInvalidConfig)
	case c.ClusterTimeout <= 0 || c.SettlePoll <= 0:
		return fmt.Errorf("%w: cluster timeout and settle poll must be > 0", ErrInvalidConfig)
	case c.EngineBlockSize < 1 || c.EngineTokens < c.EngineBlockSize:
		return fmt.Errorf("%w: engine block size %d / tokens %d", ErrInvalidConfig, c.EngineBlockSize, c.EngineTokens)
	}
	if _, err := sim.LookupProfile(c.Profile); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	switch c.Mode {
	case "history", "kv-events", "hybrid":
	default:
		return fmt.Errorf("%w: mode %q", ErrInvalidConfig, c.Mode)
	}
	return nil
}

// World is one cell's running engines and gateways; it is a study.Engine.
type World struct {
	*httpenv.Env
	cfg     Config
	sims    []*sim.Server
	nodes   []*node.Node
	names   []string // replica names, in order
	dataDir string   // raft data of a cluster ("" otherwise)
	planes  []*plane // Config.EPP's data planes
	once    sync.Once
}

var (
	_ study.Engine      = (*World)(nil)
	_ study.HostChecker = (*World)(nil)
	_ study.Settler     = (*World)(nil)
)

// Clustered reports whether the World's gateways form a cluster.
func (c *Config) Clustered() bool { return c.Gateways > 1 && !c.Isolated }

// scaled returns model-time d as wall time at speed, but at least floor.
func scaled(d time.Duration, speed float64, floor time.Duration) time.Duration {
	return max(time.Duration(float64(d)/speed), floor)
}

// Start starts the simulators and gateways of one cell and returns them
// wired into an Env. On error everything already started is shut down.
func Start(ctx context.Context, cfg Config) (*World, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	prof, _ := sim.LookupProfile(cfg.Profile)
	events := cfg.Mode != "history"
	w := &World{cfg: cfg}
	fail := func(err error) (*World, error) {
		_ = w.shutdown()
		return nil, err
	}
	var replicas []node.ReplicaConfig
	var endpoints []httpenv.Endpoint
	for i := range cfg.Replicas {
		name := string(rune('A' + i))
		sc := sim.DefaultConfig()
		sc.Host, sc.Port = "127.0.0.1", 0
		sc.ServedModelName = cfg.Model
		sc.Profile = prof
		sc.Speed = cfg.Speed
		sc.Tokenizer = cfg.Tokenizer
		sc.BlockSize = cfg.EngineBlockSize
		sc.NumGPUBlocks = cfg.EngineTokens / cfg.EngineBlockSize
		sc.EnableResetEndpoint = true
		sc.Logger = log.With("sim", name)
		sc.KVEvents.EnableKVCacheEvents = events
		sc.KVEvents.Endpoint = "tcp://127.0.0.1:0"
		sc.KVEvents.ReplayEndpoint = "tcp://127.0.0.1:0"
		sc.KVEvents.AlwaysBind = true
		if cfg.TuneSim != nil {
			cfg.TuneSim(&sc)
		}
		s, err := sim.NewServer(sc)
		if err != nil {
			return fail(fmt.Errorf("live: simulator %s: %w", name, err))
		}
		if err := s.Start(ctx); err != nil {
			return fail(fmt.Errorf("live: start simulator %s: %w", name, err))
		}
		w.sims = append(w.sims, s)
		rc := node.ReplicaConfig{Name: name, URL: s.URL()}
		if events {
			rc.KVEndpoint = s.KVEventsAddr()
			rc.ReplayEndpoint = s.KVReplayAddr()
		}
		replicas = append(replicas, rc)
		w.names = append(w.names, name)
		endpoints = append(endpoints, httpenv.Endpoint{Name: name, URL: s.URL()})
	}
	var gateways []string
	var clusterName, token, clusterKey string
	if cfg.Clustered() {
		dir, err := os.MkdirTemp("", "kvbench-cluster-")
		if err != nil {
			return fail(fmt.Errorf("live: cluster data dir: %w", err))
		}
		w.dataDir = dir
		var b [12]byte
		_, _ = rand.Read(b[:])
		clusterName = "kvbench-" + hex.EncodeToString(b[:4])
		token = hex.EncodeToString(b[4:])
		if clusterKey, err = trust.Generate(); err != nil {
			return fail(fmt.Errorf("live: cluster key: %w", err))
		}
	}
	for g := range cfg.Gateways {
		nc := node.LocalConfig()
		if cfg.Clustered() {
			nc.Cluster.Enabled = true
			nc.Cluster.Name = clusterName
			nc.Cluster.NodeID = fmt.Sprintf("gw%d", g)
			nc.Cluster.DataDir = filepath.Join(w.dataDir, nc.Cluster.NodeID)
			nc.Cluster.BootstrapExpect = cfg.Gateways
			nc.Cluster.AdminToken = token
			nc.Cluster.ClusterKey = clusterKey
			nc.Cluster.StartTimeout = cfg.ClusterTimeout
			if g > 0 {
				nc.Cluster.Join = []string{w.nodes[0].Cluster().GossipAddr()}
			}
		}
		nc.Models = []node.ModelConfig{{Name: cfg.Model, Replicas: replicas}}
		nc.IndexMode = cfg.Mode
		if events {
			// Confirmed entries are keyed by the engine's tokens: same
			// tokenizer, same block size.
			nc.Tokenizer = node.TokenizerTiktoken
			if cfg.Tokenizer != "tiktoken" {
				nc.Tokenizer = node.TokenizerCharacter
			}
			nc.BlockSize = cfg.EngineBlockSize
		}
		nc.ScrapeInterval = scaled(500*time.Millisecond, cfg.Speed, 5*time.Millisecond)
		nc.SpeculativeTTL = scaled(10*time.Second, cfg.Speed, 100*time.Millisecond)
		nc.FirstByteTimeout = scaled(300*time.Second, cfg.Speed, 5*time.Second)
		nc.IdleTimeout = scaled(300*time.Second, cfg.Speed, 5*time.Second)
		nc.HealthInterval = scaled(2*time.Second, cfg.Speed, 50*time.Millisecond)
		nc.UnhealthyInterval = scaled(250*time.Millisecond, cfg.Speed, 10*time.Millisecond)
		// The cost strategy's memory of prefix shares is model time too:
		// unscaled, at speed 10 it spanned the previous phases' requests.
		// (TuneNode, below, may still set its own.)
		nc.Route.Cost.ShareTauSeconds = route.DefaultShareTauSeconds / cfg.Speed
		// The operator's SLO: the study's TTFT target, in wall time.
		nc.Route.Cost.TTFTTargetSeconds = study.DefaultSLO().TTFT.Seconds() / cfg.Speed
		nc.HealthTimeout = max(nc.HealthTimeout, time.Second)
		nc.ScrapeTimeout = max(nc.ScrapeTimeout, time.Second)
		if cfg.EPP {
			nc.EPP.Addr = "127.0.0.1:0"
		}
		if cfg.TuneNode != nil {
			cfg.TuneNode(&nc)
		}
		n, err := node.New(nc, log.With("gateway", g))
		if err != nil {
			return fail(fmt.Errorf("live: gateway %d: %w", g, err))
		}
		if err := n.Start(ctx); err != nil {
			return fail(fmt.Errorf("live: start gateway %d: %w", g, err))
		}
		w.nodes = append(w.nodes, n)
		gateways = append(gateways, "http://"+n.HTTPAddr())
	}
	if cfg.Clustered() {
		if err := w.waitCluster(ctx); err != nil {
			return fail(err)
		}
	}
	if cfg.EPP {
		var err error
		if gateways, err = w.startDataPlanes(); err != nil {
			return fail(err)
		}
	}
	ec := httpenv.DefaultConfig()
	ec.Engines = endpoints
	ec.Gateways = gateways
	ec.Model = cfg.Model
	ec.Speed = cfg.Speed
	env, err := httpenv.New(ec)
	if err != nil {
		return fail(err)
	}
	w.Env = env
	return w, nil
}

// probeBatch and probeTokens shape the host check: a full batch
// (max-num-seqs 8 in the seed) of short prompts decoding probeTokens each.
const (
	probeBatch  = 8
	probeTokens = 48
)

// HostCheck implements study.HostChecker: it sends a batch of short
// prompts straight to each engine and compares their mean TPOT with the
// profile's decode step time for that batch. Under host contention the
// simulators' steps stretch by the scheduling delay times the speed factor.
func (w *World) HostCheck(ctx context.Context) (study.HostCheck, error) {
	var reqs []study.Request
	for r := range w.sims {
		for i := range probeBatch {
			reqs = append(reqs, study.Request{
				Prompt:    fmt.Sprintf("host check %d/%d", r, i),
				MaxTokens: probeTokens,
				Target:    study.Target{Direct: true, Replica: r},
			})
		}
	}
	outs, err := study.Do(ctx, w, reqs...)
	if err != nil {
		return study.HostCheck{}, err
	}
	c := study.HostCheck{}
	for r, s := range w.sims {
		batch := min(probeBatch, s.Config().MaxNumSeqs)
		c.ModelledTPOTms = max(c.ModelledTPOTms, float64(s.Config().Profile.StepTime(0, batch))/float64(time.Millisecond))
		var sum time.Duration
		for _, o := range outs[r*probeBatch : (r+1)*probeBatch] {
			if !study.Complete(o, probeTokens) {
				return c, fmt.Errorf("live: host check request to %s failed: status %d %s", w.Replicas()[r], o.Status, o.Err)
			}
			sum += study.TPOT(o)
		}
		c.MeasuredTPOTms = max(c.MeasuredTPOTms, float64(sum/probeBatch)/float64(time.Millisecond))
	}
	if c.ModelledTPOTms > 0 {
		c.Ratio = c.MeasuredTPOTms / c.ModelledTPOTms
	}
	c.OK = c.Ratio <= study.HostCheckTolerance
	return c, w.WaitIdle(ctx)
}

// Sims returns the simulators, in replica order.
func (w *World) Sims() []*sim.Server { return w.sims }

// Nodes returns the gateways.
func (w *World) Nodes() []*node.Node { return w.nodes }

// Close stops the Env, then the gateways, then the simulators. It is
// idempotent.
func (w *World) Close() error {
	var err error
	w.once.Do(func() { err = w.shutdown() })
	return err
}

func (w *World) shutdown() error {
	var errs []error
	if w.Env != nil {
		errs = append(errs, w.Env.Close())
	}
	for _, d := range w.planes {
		errs = append(errs, d.close())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, n := range w.nodes {
		errs = append(errs, n.Shutdown(ctx))
	}
	for _, s := range w.sims {
		errs = append(errs, s.Shutdown(ctx))
	}
	if w.dataDir != "" {
		errs = append(errs, os.RemoveAll(w.dataDir))
	}
	return errors.Join(errs...)
}

// Factory returns a study.EngineFactory that starts a World per cell from
// base, taking the mode, gateway and replica counts from the cell.
func Factory(base Config) study.EngineFactory {
	return func(ctx context.Context, cell study.Cell) (study.Engine, error) {
		c := base
		c.Mode = cell.Mode
		c.Gateways = cell.Gateways
		c.Replicas = cell.Replicas
		c.Isolated = cell.Isolated
		return Start(ctx, c)
	}
}
