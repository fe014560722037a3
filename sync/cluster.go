package sync

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

// Replicas maps replica names, which travel between gateways, to the
// index's process-local ReplicaIDs and back. Both methods are called
// concurrently and must not block.
type Replicas interface {
	ReplicaID(name string) (index.ReplicaID, bool)
	ReplicaName(id index.ReplicaID) (string, bool)
}

// LoadSource reports this gateway's exact in-flight counts. It is called
// every Config.LoadInterval from the Cluster's load goroutine.
type LoadSource interface {
	// AppendInFlight appends one entry per replica to dst and returns it.
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
	// Transport replaces memberlist's UDP/TCP transport (a MockNetwork
	// transport in tests); nil binds Config.GossipAddr.
	Transport memberlist.Transport
}

// Cluster makes this gateway one of N that share an index and a load view.
// See the package documentation for the contract.
type Cluster struct {
	cfg  Config
	deps Deps
	log  *slog.Logger
	m    *metrics
	ms   *membership

	mu       sync.Mutex
	started  bool
	stopped  bool
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
	c := &Cluster{cfg: cfg, deps: deps, log: log, m: newMetrics()}
	if err := c.m.register(deps.Registerer); err != nil {
		return nil, err
	}
	c.ms = newMembership(cfg, log, c.m, c.onGossip)
	return c, nil
}

// Config returns the configuration the Cluster was built with.
func (c *Cluster) Config() Config { return c.cfg }

// Start opens the transports, joins the seeds, bootstraps the index from a
// peer and starts the background goroutines; it returns when this gateway
// is a member and its index is restored (or the bootstrap gave up: it is
// then logged and retried by anti-entropy). ctx bounds Start only.
func (c *Cluster) Start(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return ErrShutdown
	}
	if c.started {
		return ErrAlreadyStarted
	}
	bg, cancel := context.WithCancel(context.Background())
	c.cancel = cancel
	if err := c.start(ctx, bg); err != nil {
		cancel()
		c.wg.Wait()
		c.closeTransports()
		c.stopped = true
		return err
	}
	c.started = true
	return nil
}

func (c *Cluster) start(ctx context.Context, bg context.Context) error {
	meta, err := c.encodeMeta()
	if err != nil {
		return err
	}
	if err := c.ms.start(meta, c.deps.Transport); err != nil {
		return err
	}
	c.goFunc(func() { c.ms.eventLoop(bg) })
	if n, err := c.ms.join(c.cfg.Join); err != nil {
		c.log.Warn("no seed answered; retrying in the background", "err", err)
	} else if n > 0 {
		c.log.Info("joined cluster", "seeds_answered", n)
	}
	if len(c.cfg.Join) > 0 {
		c.goFunc(func() { c.ms.joinLoop(bg) })
	}
	return ctx.Err()
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
	m := NodeMeta{
		Cluster:    c.cfg.ClusterName,
		Version:    c.cfg.Version,
		HTTPAddr:   c.cfg.HTTPAddr,
		RaftAddr:   c.cfg.RaftAddr,
		IndexModes: c.cfg.IndexModes,
		Leaving:    c.leaving.Load(),
	}
	return AppendMeta(nil, m, memberlist.MetaMaxSize)
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
				timeout = max(time.Until(d)/2, 10*time.Millisecond)
			}
			if lerr := c.leave(timeout); lerr != nil {
				c.log.Debug("leave", "err", lerr)
			}
		}
		if c.cancel != nil {
			c.cancel()
		}
		c.wg.Wait()
		err = c.closeTransports()
	})
	return err
}

// kill stops the Cluster without a graceful leave, as a crash would: peers
// detect the failure. Tests only.
func (c *Cluster) kill() {
	c.mu.Lock()
	c.stopped = true
	c.mu.Unlock()
	c.stopOnce.Do(func() {
		if c.cancel != nil {
			c.cancel()
		}
		c.wg.Wait()
		_ = c.closeTransports()
	})
}

func (c *Cluster) closeTransports() error {
	var errs []error
	if err := c.ms.shutdown(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Members returns the live members of the cluster, this gateway included,
// sorted by name.
func (c *Cluster) Members() []Member { return c.ms.snapshot() }

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

// leave gossips metadata marked Leaving, then memberlist's leave.
func (c *Cluster) leave(timeout time.Duration) error {
	c.leaving.Store(true)
	if meta, err := c.encodeMeta(); err == nil {
		if err := c.ms.updateMeta(meta, timeout/2); err != nil {
			c.log.Debug("gossiping leave intent", "err", err)
		}
	}
	return c.ms.leave(timeout / 2)
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

// onGossip receives memberlist user messages (the NATS-outage fallback).
func (c *Cluster) onGossip(b []byte) {}
