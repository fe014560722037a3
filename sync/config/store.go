package config

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	wal "github.com/hashicorp/raft-wal"
	"github.com/hashicorp/raft-wal/metadb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Store is one gateway's replica of the routing config: a raft node whose
// FSM holds the document. Reads (Current, OnApply) are local and never
// block on the network; writes (Apply and its helpers) go through the
// leader, forwarded over gRPC when this node is a follower.
//
// All methods are safe for concurrent use. Open starts the store's
// goroutines; Shutdown stops them and waits.
type Store struct {
	cfg     StoreConfig
	log     *slog.Logger
	metrics *metrics
	fsm     *FSM

	raft      *raft.Raft
	wal       *wal.WAL
	meta      *metadb.BoltMetaDB     // closed by us: WAL.Close leaves it open
	unlock    func() error           // releases the data dir lock
	netTrans  *raft.NetworkTransport // nil when cfg.Transport was given
	guard     *noPipelineTransport   // netTrans as raft has it (nil likewise)
	trans     raft.Transport         // what raft was given
	raftAddr  string
	leaderObs chan bool

	applied chan struct{} // cap 1: "the FSM swapped"

	subsMu  sync.Mutex
	subs    map[int]*subscriber
	nextSub int

	clientsMu sync.Mutex
	clients   map[string]*Client

	absentSince map[string]time.Time // reconcile state; run goroutine only
	seeded      bool                 // run goroutine only
	bootKey     string               // run goroutine only: candidate voter set
	bootSince   time.Time            // run goroutine only: when bootKey was first seen

	stop      chan struct{}
	wg        sync.WaitGroup
	closeOnce sync.Once
	closeErr  error
}

type subscriber struct {
	fn   func(*Versioned)
	last uint64
}

// Open creates or reopens the store in cfg.DataDir, starts raft and the
// store's goroutines (bootstrap, leader duties, apply notifications) and
// returns without waiting for a leader.
func Open(cfg StoreConfig) (*Store, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	log = log.With("component", "config", "node", cfg.NodeID)
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	s := &Store{
		cfg:         cfg,
		log:         log,
		metrics:     m,
		applied:     make(chan struct{}, 1),
		subs:        map[int]*subscriber{},
		clients:     map[string]*Client{},
		absentSince: map[string]time.Time{},
		leaderObs:   make(chan bool, 1),
		stop:        make(chan struct{}),
	}
	s.fsm = newFSM(m, log, s.signalApplied)
	if err := s.openRaft(); err != nil {
		s.closeStorage()
		return nil, err
	}
	s.wg.Add(2)
	go s.notifyLoop()
	go s.runLoop()
	return s, nil
}

func (s *Store) openRaft() error {
	hlog := hclog.New(&hclog.LoggerOptions{
		Name:       "raft",
		Level:      hclog.LevelFromString(s.cfg.RaftLogLevel),
		JSONFormat: true, // slogWriter turns each line into one structured record
		Output:     slogWriter{log: s.log, gone: peerGone(s.cfg.Membership)},
	})
	dir := filepath.Join(s.cfg.DataDir, "raft")
	if err := os.MkdirAll(filepath.Join(dir, "wal"), 0o750); err != nil {
		return fmt.Errorf("config: data dir: %w", err)
	}
	unlock, err := lockDir(dir)
	if err != nil {
		return err
	}
	s.unlock = unlock
	s.meta = &metadb.BoltMetaDB{}
	w, err := openWAL(filepath.Join(dir, "wal"), s.meta)
	if err != nil {
		return fmt.Errorf("config: open raft log in %s: %w", dir, err)
	}
	s.wal = w
	snaps, err := raft.NewFileSnapshotStoreWithLogger(dir, s.cfg.SnapshotRetain, hlog)
	if err != nil {
		return fmt.Errorf("config: snapshot store: %w", err)
	}
	trans := s.cfg.Transport
	if trans == nil {
		if s.netTrans, err = s.newNetworkTransport(hlog); err != nil {
			return err
		}
		s.guard = &noPipelineTransport{NetworkTransport: s.netTrans}
		trans = s.guard
	}
	s.trans = trans
	s.raftAddr = string(trans.LocalAddr())
	rc := s.cfg.raftConfig()
	rc.Logger = hlog
	rc.NotifyCh = s.leaderObs
	logs := walLog{WAL: w, truncated: s.tailTruncated}
	r, err := raft.NewRaft(rc, s.fsm, logs, w, snaps, trans)
	if err != nil {
		return fmt.Errorf("config: start raft: %w", err)
	}
	s.raft = r
	return nil
}

// noPipelineTransport is the store's raft NetworkTransport with pipelined
// replication off. hashicorp/raft v1.8.0's pipeline can deadlock a
// leader's Shutdown: when a follower answers with a newer term or a
// failure (which a leadership transfer at graceful shutdown provokes), the
// pipeline's decoder returns while the replication loop still pushes one
// more AppendEntries into the full in-flight channel, nobody drains it,
// and Raft.Shutdown waits forever. Without a pipeline raft replicates
// with one synchronous AppendEntries at a time, which is plenty for a
// config document.
//
// It also keeps heartbeats from outliving Shutdown. The NetworkTransport
// runs raft's heartbeat handler (Raft.processHeartbeat) on its own
// connection goroutine, outside raft's loop, so Raft.Shutdown does not
// wait for one in progress: a heartbeat that passed the handler's
// shutdown check could still be saving the term when Shutdown closed the
// log, and raft panics on that failed save ("failed to save current term:
// database not open", seen once in CI). stopHeartbeats refuses new ones
// and waits for those running; Shutdown calls it before it closes the
// log. Every other method (including pre-vote and Close) is the
// NetworkTransport's.
type noPipelineTransport struct {
	*raft.NetworkTransport

	hbMu      sync.Mutex
	hbStopped bool
	hbRunning sync.WaitGroup
}

// SetHeartbeatHandler registers cb behind the guard stopHeartbeats closes.
func (t *noPipelineTransport) SetHeartbeatHandler(cb func(raft.RPC)) {
	if cb == nil {
		t.NetworkTransport.SetHeartbeatHandler(nil)
		return
	}
	t.NetworkTransport.SetHeartbeatHandler(func(rpc raft.RPC) {
		t.hbMu.Lock()
		if t.hbStopped {
			t.hbMu.Unlock()
			rpc.Respond(nil, raft.ErrTransportShutdown)
			return
		}
		t.hbRunning.Add(1)
		t.hbMu.Unlock()
		defer t.hbRunning.Done()
		cb(rpc)
	})
}

// stopHeartbeats answers every later heartbeat with ErrTransportShutdown
// and returns once none is running.
func (t *noPipelineTransport) stopHeartbeats() {
	t.hbMu.Lock()
	t.hbStopped = true
	t.hbMu.Unlock()
	t.hbRunning.Wait()
}

// AppendEntriesPipeline reports that pipelining is not supported, so raft
// replicates synchronously.
func (*noPipelineTransport) AppendEntriesPipeline(raft.ServerID, raft.ServerAddress) (raft.AppendPipeline, error) {
	return nil, raft.ErrPipelineReplicationNotSupported
}

func (s *Store) newNetworkTransport(hlog hclog.Logger) (*raft.NetworkTransport, error) {
	var adv net.Addr
	if s.cfg.RaftAdvertiseAddr != "" {
		a, err := net.ResolveTCPAddr("tcp", s.cfg.RaftAdvertiseAddr)
		if err != nil {
			return nil, fmt.Errorf("%w: RaftAdvertiseAddr: %w", ErrInvalidStoreConfig, err)
		}
		adv = a
	}
	tc := &raft.NetworkTransportConfig{
		ServerAddressProvider: addressProvider{s.cfg.Membership},
		Logger:                transportLogger{Logger: hlog.Named("transport"), errs: s.metrics.raftTransportErrors},
		MaxPool:               3,
		Timeout:               10 * time.Second,
	}
	unauthenticated := func(error) { s.metrics.raftTransportErrors.WithLabelValues("unauthenticated").Inc() }
	var srv, cli *tls.Config
	switch {
	case s.cfg.RaftTLS.Enabled():
		var err error
		if srv, err = s.cfg.RaftTLS.ServerConfig(); err != nil {
			return nil, err
		}
		if cli, err = s.cfg.RaftTLS.ClientConfig(); err != nil {
			return nil, err
		}
		if len(cli.Certificates) == 0 {
			cli.Certificates = srv.Certificates
		}
	case s.cfg.Trust != nil:
		srv, cli = s.cfg.Trust.TLSConfig(), s.cfg.Trust.TLSConfig()
	default:
		layer, err := newTCPStreamLayer(s.cfg.RaftBindAddr, adv)
		if err != nil {
			return nil, fmt.Errorf("config: raft transport: %w", err)
		}
		tc.Stream = countingLayer{StreamLayer: layer, errs: s.metrics.raftTransportErrors}
		return raft.NewNetworkTransportWithConfig(tc), nil
	}
	layer, err := newTLSStreamLayer(s.cfg.RaftBindAddr, adv, srv, cli, unauthenticated)
	if err != nil {
		return nil, fmt.Errorf("config: raft transport: %w", err)
	}
	tc.Stream = countingLayer{StreamLayer: layer, errs: s.metrics.raftTransportErrors}
	return raft.NewNetworkTransportWithConfig(tc), nil
}

// Shutdown stops raft and the store's goroutines, closes the log and the
// transport it created, and waits. Idempotent; the config stays on disk.
func (s *Store) Shutdown() error {
	s.closeOnce.Do(func() {
		close(s.stop)
		var errs []error
		if s.raft != nil {
			errs = append(errs, s.raft.Shutdown().Error())
		}
		if s.guard != nil {
			s.guard.stopHeartbeats() // before the log closes
		}
		s.wg.Wait()
		s.clientsMu.Lock()
		for addr, c := range s.clients {
			errs = append(errs, c.Close())
			delete(s.clients, addr)
		}
		s.clientsMu.Unlock()
		errs = append(errs, s.closeStorage())
		s.metrics.leader.Set(0)
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}

func (s *Store) closeStorage() error {
	var errs []error
	if s.netTrans != nil {
		// Close the pooled outgoing connections too, so peers' handlers
		// (and ours, once peers do the same) exit.
		s.netTrans.CloseStreams()
		errs = append(errs, s.netTrans.Close())
	}
	if s.wal != nil {
		errs = append(errs, s.wal.Close())
	}
	if s.meta != nil {
		errs = append(errs, s.meta.Close())
	}
	if s.unlock != nil {
		errs = append(errs, s.unlock())
	}
	return errors.Join(errs...)
}

// Leave prepares a graceful stop: a leader hands leadership to another
// voter (raft leadership transfer) so writes pause for one round trip
// instead of an election timeout. It does not remove the node from the
// raft configuration (a restart keeps its vote; the leader removes a
// gateway that stays away for DeadServerGrace). Call it before Shutdown.
func (s *Store) Leave() error {
	if !s.IsLeader() {
		return nil
	}
	err := s.raft.LeadershipTransfer().Error()
	if err != nil && !errors.Is(err, raft.ErrNotLeader) {
		return fmt.Errorf("config: leadership transfer: %w", err)
	}
	return nil
}

// WaitLeader blocks until this node knows a raft leader, or ctx ends. It
// polls every 10 ms (raft has no leader-change subscription that cannot
// drop a signal).
func (s *Store) WaitLeader(ctx context.Context) error {
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		if id, _ := s.Leader(); id != "" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: waiting for a leader: %w", ErrNoQuorum, ctx.Err())
		case <-s.stop:
			return ErrClosed
		case <-t.C:
		}
	}
}

// CaughtUp reports whether this node's config is as current as the
// cluster's: a leader has contacted it (or it leads) and its FSM has taken
// every entry it knows to be committed. A node restarted from its data
// directory has its last snapshot applied before any leader speaks, and
// raft replays the rest of its log only once a leader tells it the commit
// index, so until then Current may be several versions old.
func (s *Store) CaughtUp() bool {
	state := s.raft.State()
	switch {
	case state == raft.Follower && s.raft.LastContact().IsZero():
		return false
	case state != raft.Leader && state != raft.Follower:
		return false
	}
	stats := s.raft.Stats()
	statIndex := func(key string) uint64 {
		i, _ := strconv.ParseUint(stats[key], 10, 64)
		return i
	}
	// A new leader's commit index trails until its first entry of the
	// term commits; everything in its own log will commit.
	target := s.raft.LastIndex()
	if state == raft.Follower {
		if target = statIndex("commit_index"); target == 0 {
			return false
		}
	}
	if s.raft.AppliedIndex() < target {
		return false
	}
	// raft counts an entry applied once it is queued for the FSM; Current
	// moves when the FSM takes it. Entries past the FSM's last one must be
	// ones it never sees (a new leader's no-op) or already in the snapshot
	// it restored.
	floor := max(s.fsm.Index(), statIndex("last_snapshot_index"))
	for i := target; i > floor; i-- {
		var l raft.Log
		if err := s.wal.GetLog(i, &l); err != nil {
			return errors.Is(err, raft.ErrLogNotFound) // compacted: in the snapshot
		}
		if l.Type == raft.LogCommand || l.Type == raft.LogConfiguration {
			return false
		}
	}
	return true
}

// NodeID returns this node's id.
func (s *Store) NodeID() string { return s.cfg.NodeID }

// RaftAddr returns the address raft listens on (advertise this in
// Member.RaftAddr).
func (s *Store) RaftAddr() string { return s.raftAddr }

// Current returns the last applied config; Version 0 and a nil Config
// before the first apply. Never blocks.
func (s *Store) Current() *Versioned { return s.fsm.Current() }

// IsLeader reports whether this node is the raft leader now.
func (s *Store) IsLeader() bool { return s.raft.State() == raft.Leader }

// Leader returns the current leader's id and raft address as this node
// knows them ("" when none).
func (s *Store) Leader() (id, raftAddr string) {
	addr, lid := s.raft.LeaderWithID()
	return string(lid), string(addr)
}

// OnApply registers fn to receive every newly applied config, in version
// order, from one store goroutine: a subscriber sees either the old or the
// new *Versioned, never a partial one. If configs are applied faster than
// fn returns, intermediate versions are skipped (fn always ends up with the
// latest). fn is called first with the current config if one exists. fn
// must not block for long (it delays other subscribers, never raft) and
// must not modify the config. cancel unregisters fn; a call already in
// progress may still complete after cancel returns.
func (s *Store) OnApply(fn func(*Versioned)) (cancel func()) {
	s.subsMu.Lock()
	id := s.nextSub
	s.nextSub++
	s.subs[id] = &subscriber{fn: fn}
	s.subsMu.Unlock()
	s.signalApplied()
	return func() {
		s.subsMu.Lock()
		delete(s.subs, id)
		s.subsMu.Unlock()
	}
}

func (s *Store) signalApplied() {
	select {
	case s.applied <- struct{}{}:
	default:
	}
}

func (s *Store) notifyLoop() {
	defer s.wg.Done()
	for {
		select {
		case <-s.stop:
			return
		case <-s.applied:
		}
		v := s.fsm.Current()
		if v.Config == nil {
			continue
		}
		s.subsMu.Lock()
		due := make([]*subscriber, 0, len(s.subs))
		ids := make([]int, 0, len(s.subs))
		for id := range s.subs {
			ids = append(ids, id)
		}
		sort.Ints(ids)
		for _, id := range ids {
			if sub := s.subs[id]; sub.last < v.Version {
				sub.last = v.Version
				due = append(due, sub)
			}
		}
		s.subsMu.Unlock()
		for _, sub := range due {
			sub.fn(v)
		}
	}
}

// Set replaces the whole config; expected, if non-nil, makes it a
// compare-and-set against the current version. Returns the applied
// version. See Apply for errors.
func (s *Store) Set(ctx context.Context, cfg RoutingConfig, expected *uint64) (uint64, error) {
	return s.Apply(ctx, SetCommand(cfg, expected))
}

// Patch applies an RFC 7386 JSON merge patch to the config.
func (s *Store) Patch(ctx context.Context, patch []byte, expected *uint64) (uint64, error) {
	return s.Apply(ctx, PatchCommand(patch, expected))
}

// AddReplica adds r to model's pool (engine scale-out).
func (s *Store) AddReplica(ctx context.Context, model string, r ReplicaConfig) (uint64, error) {
	return s.Apply(ctx, AddReplicaCommand(model, r))
}

// RemoveReplica removes the named replica from model's pool (scale-in).
func (s *Store) RemoveReplica(ctx context.Context, model, name string) (uint64, error) {
	return s.Apply(ctx, RemoveReplicaCommand(model, name))
}

// Apply commits cmd through the raft leader (forwarding it when this node
// is a follower) and returns the version it produced, once the leader has
// applied it. Errors wrap ErrInvalidConfig (field-named; nothing reached
// the log, or the FSM rejected it), ErrVersionConflict, ErrNotFound,
// ErrNoQuorum (no leader could commit within ApplyTimeout or ctx's
// deadline; the last applied config stays in force; or the answer was
// lost, to the deadline or to a connection closed during the call, and
// the write may still apply), ErrUnauthenticated
// (peers refused this node's token) or ErrClosed.
func (s *Store) Apply(ctx context.Context, cmd Command) (uint64, error) {
	if err := precheck(cmd); err != nil {
		return 0, err
	}
	data, err := encodeCommand(cmd)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ApplyTimeout)
	defer cancel()
	var last error
	backoff := 10 * time.Millisecond
	for {
		select {
		case <-s.stop:
			return 0, ErrClosed
		default:
		}
		var v uint64
		var err error
		if s.IsLeader() {
			v, err = s.applyLocal(cmd, data)
		} else {
			v, err = s.forward(ctx, data)
		}
		switch {
		case err == nil:
			return v, nil
		case errors.Is(err, context.DeadlineExceeded) || status.Code(err) == codes.DeadlineExceeded:
			// The leader may have committed it: report, never resend.
			return 0, fmt.Errorf("%w: no answer from the leader before the deadline (the write may still apply)", ErrNoQuorum)
		case cutMidCall(ctx, err):
			select {
			case <-s.stop:
				return 0, ErrClosed
			default:
			}
			// The connection to the leader was closed under the call
			// (pruneClients, when membership briefly lost the leader): the
			// leader may have the command. Report, never resend.
			return 0, fmt.Errorf("%w: the connection to the leader closed during the call (the write may still apply)", ErrNoQuorum)
		case !retryable(err):
			return 0, err
		}
		last = err
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return 0, fmt.Errorf("%w: after %v: %w", ErrNoQuorum, s.cfg.ApplyTimeout, last)
		case <-s.stop:
			t.Stop()
			return 0, ErrClosed
		case <-t.C:
		}
		backoff = min(2*backoff, 200*time.Millisecond)
	}
}

// cutMidCall reports whether a forwarded write failed because its gRPC
// call was cancelled while the caller's ctx was still live: this node
// closed the connection under it (grpc.ErrClientConnClosing), so the
// outcome is unknown.
func cutMidCall(ctx context.Context, err error) bool {
	return ctx.Err() == nil && status.Code(err) == codes.Canceled
}

// errNoLeader: no leader is known yet (retryable).
var errNoLeader = errors.New("no raft leader known")

// retryable reports whether a failed attempt certainly did not apply, so
// sending the command again cannot apply it twice: no leader was known, the
// node asked was not the leader, or the transport could not deliver the
// call. A leader that lost leadership while committing (ErrNoQuorum)
// leaves the outcome unknown and is reported instead; use ExpectedVersion
// for exactly-once writes.
func retryable(err error) bool {
	if errors.Is(err, ErrNotLeader) || errors.Is(err, errNoLeader) {
		return true
	}
	var re *remoteError
	if errors.As(err, &re) {
		return errors.Is(err, ErrClosed) // the leader was shutting down
	}
	return status.Code(err) == codes.Unavailable
}

// precheck rejects what is invalid regardless of the current config, so
// such a command never reaches the raft log.
func precheck(cmd Command) error {
	switch cmd.Op {
	case OpSet:
		if cmd.Config == nil {
			return fmt.Errorf("%w: set without config", ErrBadCommand)
		}
		return cmd.Config.Validate()
	case OpPatch:
		var probe any
		if err := decodeNumbers(cmd.Patch, &probe); err != nil {
			return &FieldError{Path: "(patch)", Err: err}
		}
		if _, ok := probe.(map[string]any); !ok {
			return &FieldError{Path: "(patch)", Err: errors.New("a merge patch of the document must be a JSON object")}
		}
	case OpAddReplica:
		if cmd.Replica == nil {
			return fmt.Errorf("%w: add_replica without replica", ErrBadCommand)
		}
		if err := cmd.Replica.validate(); err != nil {
			var fe *FieldError
			if errors.As(err, &fe) {
				return &FieldError{Path: "replica." + fe.Path, Err: fe.Err}
			}
			return err
		}
	case OpRemoveReplica:
	default:
		return fmt.Errorf("%w: unknown op %q", ErrBadCommand, cmd.Op)
	}
	return nil
}

// applyLocal proposes data on this node, which believes it is the leader.
// The command is first checked against the leader's current config, so an
// invalid result rarely reaches the log (the FSM re-checks it on apply,
// where the leader may have moved on).
func (s *Store) applyLocal(cmd Command, data []byte) (uint64, error) {
	if _, err := cmd.apply(s.fsm.Current()); err != nil && !errors.Is(err, ErrVersionConflict) {
		return 0, err
	}
	f := s.raft.Apply(data, s.cfg.ApplyTimeout)
	if err := f.Error(); err != nil {
		switch {
		case errors.Is(err, raft.ErrNotLeader):
			return 0, ErrNotLeader
		case errors.Is(err, raft.ErrLeadershipLost):
			return 0, fmt.Errorf("%w: leadership lost while committing (the write may still apply)", ErrNoQuorum)
		case errors.Is(err, raft.ErrEnqueueTimeout):
			return 0, fmt.Errorf("%w: %w", ErrNoQuorum, err)
		case errors.Is(err, raft.ErrRaftShutdown):
			return 0, ErrClosed
		}
		return 0, fmt.Errorf("config: raft apply: %w", err)
	}
	res, ok := f.Response().(applyResult)
	if !ok {
		return 0, fmt.Errorf("%w: unexpected FSM response %T", ErrBadCommand, f.Response())
	}
	return res.version, res.err
}

// ApplyForwarded is the leader side of forwarding: it applies an encoded
// command received from a follower. A node that is not the leader answers
// ErrNotLeader and never forwards again.
func (s *Store) ApplyForwarded(data []byte) (uint64, error) {
	cmd, err := decodeCommand(data)
	if err != nil {
		return 0, err
	}
	if !s.IsLeader() {
		return 0, ErrNotLeader
	}
	return s.applyLocal(cmd, data)
}

func (s *Store) forward(ctx context.Context, data []byte) (uint64, error) {
	lid, _ := s.Leader()
	if lid == "" {
		return 0, errNoLeader
	}
	m, ok := lookup(s.cfg.Membership, lid)
	if !ok || m.forwardAddr() == "" {
		return 0, fmt.Errorf("%w: leader %s has no admin address in membership", errNoLeader, lid)
	}
	c, err := s.client(m.forwardAddr())
	if err != nil {
		return 0, err
	}
	v, err := c.forward(ctx, data)
	if err != nil {
		s.metrics.forwarded.WithLabelValues("error").Inc()
		return 0, err
	}
	s.metrics.forwarded.WithLabelValues("ok").Inc()
	return v, nil
}

// client returns the cached admin client for addr.
func (s *Store) client(addr string) (*Client, error) {
	s.clientsMu.Lock()
	defer s.clientsMu.Unlock()
	select {
	case <-s.stop:
		return nil, ErrClosed
	default:
	}
	if c, ok := s.clients[addr]; ok {
		return c, nil
	}
	c, err := Dial(addr, s.cfg.Forward)
	if err != nil {
		return nil, err
	}
	s.clients[addr] = c
	return c, nil
}

// pruneClients closes peer clients whose address no live member has (a
// gateway that left or restarted on another port).
func (s *Store) pruneClients() {
	live := map[string]bool{}
	for _, m := range s.cfg.Membership.Members() {
		live[m.forwardAddr()] = true
	}
	s.clientsMu.Lock()
	defer s.clientsMu.Unlock()
	for addr, c := range s.clients {
		if !live[addr] {
			_ = c.Close()
			delete(s.clients, addr)
		}
	}
}

// runLoop owns bootstrap, leader duties (seed, voter reconciliation) and
// the raft gauges. It wakes on leadership changes, membership changes and
// every ReconcileInterval.
func (s *Store) runLoop() {
	defer s.wg.Done()
	t := time.NewTicker(s.cfg.ReconcileInterval)
	defer t.Stop()
	needBootstrap := true
	var bootWake *time.Timer
	defer func() {
		if bootWake != nil {
			bootWake.Stop()
		}
	}()
	var bootC <-chan time.Time
	for {
		changed := s.cfg.Membership.Changed()
		s.pruneClients()
		if needBootstrap {
			done, wait := s.tryBootstrap(time.Now())
			needBootstrap = !done
			bootC = nil
			if needBootstrap && wait > 0 {
				if bootWake == nil {
					bootWake = time.NewTimer(wait)
				} else {
					bootWake.Reset(wait)
				}
				bootC = bootWake.C
			}
		}
		s.observe()
		select {
		case <-s.stop:
			return
		case <-s.leaderObs:
		case <-changed:
		case <-t.C:
		case <-bootC:
		}
	}
}

func (s *Store) observe() {
	leader := s.IsLeader()
	if leader {
		s.metrics.leader.Set(1)
	} else {
		s.metrics.leader.Set(0)
		s.seeded = false
	}
	f := s.raft.GetConfiguration()
	if f.Error() != nil {
		return
	}
	servers := f.Configuration().Servers
	voters := 0
	for _, srv := range servers {
		if srv.Suffrage == raft.Voter {
			voters++
		}
	}
	s.metrics.voters.Set(float64(voters))
	if !leader {
		clear(s.absentSince)
		return
	}
	s.seed()
	s.reconcile(servers, time.Now())
}

// inConfiguration reports whether this node is in the raft configuration.
func (s *Store) inConfiguration() bool {
	f := s.raft.GetConfiguration()
	if f.Error() != nil {
		return false
	}
	return slices.ContainsFunc(f.Configuration().Servers, func(srv raft.Server) bool {
		return srv.ID == raft.ServerID(s.cfg.NodeID)
	})
}

// tryBootstrap forms a fresh cluster. Exactly one node bootstraps: the
// member with the smallest ID among the BootstrapExpect smallest it sees,
// once that set has stayed the same for BootstrapSettle and no peer
// reports that it already belongs to a cluster. The others of the set are
// in its configuration and simply wait for the leader to contact them; a
// single bootstrapper cannot write two different initial configurations
// when views of membership differ for a moment. It returns done once
// nothing is left to do (the node has state or is in a configuration),
// else how long to wait before trying again (0: until something changes).
func (s *Store) tryBootstrap(now time.Time) (done bool, wait time.Duration) {
	if s.inConfiguration() || s.raft.LastIndex() > 0 {
		return true, 0
	}
	members := s.cfg.Membership.Members()
	if len(members) < s.cfg.BootstrapExpect {
		s.bootKey = ""
		return false, 0
	}
	set := smallestIDs(members, s.cfg.BootstrapExpect)
	if set[0].ID != s.cfg.NodeID {
		s.bootKey = ""
		return false, 0 // another node bootstraps; the leader will contact us
	}
	servers := make([]raft.Server, 0, len(set))
	ids := make([]string, len(set))
	for i, m := range set {
		if m.RaftAddr == "" {
			return false, 0 // wait for its metadata
		}
		servers = append(servers, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(m.ID), Address: raft.ServerAddress(m.RaftAddr)})
		ids[i] = m.ID
	}
	key := strings.Join(ids, ",")
	if key != s.bootKey {
		s.bootKey, s.bootSince = key, now
	}
	if settled := now.Sub(s.bootSince); settled < s.cfg.BootstrapSettle {
		return false, s.cfg.BootstrapSettle - settled
	}
	if p := s.formedPeer(members); p != "" {
		s.log.Info("not bootstrapping: a peer already belongs to a cluster", "peer", p)
		return false, 0
	}
	err := s.raft.BootstrapCluster(raft.Configuration{Servers: servers}).Error()
	if err != nil && !errors.Is(err, raft.ErrCantBootstrap) {
		s.log.Error("raft bootstrap failed", "err", err)
		return false, s.cfg.BootstrapSettle
	}
	s.log.Info("raft bootstrapped", "voters", key)
	return true, 0
}

// formedPeer asks the other members whether they already belong to a raft
// configuration, so a late gateway whose ID sorts low does not bootstrap a
// second cluster. It returns such a peer's id, or "". Unreachable peers
// count as not formed.
func (s *Store) formedPeer(members []Member) string {
	timeout := min(s.cfg.ApplyTimeout/4, time.Second)
	for _, m := range members {
		if m.ID == s.cfg.NodeID || m.forwardAddr() == "" {
			continue
		}
		c, err := s.client(m.forwardAddr())
		if err != nil {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		st, err := c.Status(ctx)
		cancel()
		if err == nil && st.InConfiguration {
			return m.ID
		}
	}
	return ""
}

// seed proposes cfg.Seed once per leadership when the config is empty.
func (s *Store) seed() {
	if s.seeded || s.cfg.Seed == nil {
		return
	}
	s.seeded = true
	// The barrier makes the FSM catch up with every committed entry, so
	// an existing config is seen and no doomed seed is proposed.
	if err := s.raft.Barrier(s.cfg.ApplyTimeout).Error(); err != nil {
		s.seeded = false
		return
	}
	if s.fsm.Current().Version != 0 {
		return
	}
	cmd := SetCommand(*s.cfg.Seed, Version(0))
	data, err := encodeCommand(cmd)
	if err != nil {
		return
	}
	v, err := s.applyLocal(cmd, data)
	switch {
	case err == nil:
		s.log.Info("seed config applied", "version", v)
	case errors.Is(err, ErrVersionConflict):
	default:
		s.seeded = false
		s.log.Warn("seed config not applied", "err", err)
	}
}

// reconcile makes the raft configuration follow membership: live members
// not in it join as non-voters, servers missing for DeadServerGrace are
// removed, and non-voters are promoted (smallest ID first) while there are
// fewer than BootstrapExpect voters.
func (s *Store) reconcile(servers []raft.Server, now time.Time) {
	live := map[string]Member{}
	for _, m := range s.cfg.Membership.Members() {
		live[m.ID] = m
	}
	timeout := s.cfg.ApplyTimeout
	self := raft.ServerID(s.cfg.NodeID)
	voters := 0
	inConf := map[string]raft.Server{}
	for _, srv := range servers {
		inConf[string(srv.ID)] = srv
		if srv.Suffrage == raft.Voter {
			voters++
		}
		if srv.ID == self {
			continue
		}
		// A server that came back on another address keeps its old
		// address in the configuration: the transport dials through
		// membership (addressProvider), and rewriting a live server's
		// address trips a data race inside raft v1.8.0's replication
		// (hashicorp/raft#681).
		if _, ok := live[string(srv.ID)]; ok {
			delete(s.absentSince, string(srv.ID))
			continue
		}
		since, seen := s.absentSince[string(srv.ID)]
		if !seen {
			s.absentSince[string(srv.ID)] = now
			continue
		}
		if now.Sub(since) < s.cfg.DeadServerGrace {
			continue
		}
		if err := s.raft.RemoveServer(srv.ID, 0, timeout).Error(); err != nil {
			s.log.Warn("raft remove server failed", "server", srv.ID, "err", err)
			continue
		}
		s.log.Info("raft server removed after grace", "server", srv.ID, "absent", now.Sub(since).Round(time.Millisecond))
		delete(s.absentSince, string(srv.ID))
		delete(inConf, string(srv.ID))
		if srv.Suffrage == raft.Voter {
			voters--
		}
	}
	ids := make([]string, 0, len(live))
	for id := range live {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		m := live[id]
		if _, ok := inConf[id]; ok || m.RaftAddr == "" {
			continue
		}
		if s.change("add non-voter", raft.ServerID(id), m.RaftAddr, raft.Nonvoter, timeout) {
			inConf[id] = raft.Server{ID: raft.ServerID(id), Address: raft.ServerAddress(m.RaftAddr), Suffrage: raft.Nonvoter}
		}
	}
	for _, id := range ids {
		if voters >= s.cfg.BootstrapExpect {
			break
		}
		srv, ok := inConf[id]
		if !ok || srv.Suffrage == raft.Voter {
			continue
		}
		if s.change("promote", srv.ID, string(srv.Address), raft.Voter, timeout) {
			voters++
		}
	}
}

func (s *Store) change(what string, id raft.ServerID, addr string, suffrage raft.ServerSuffrage, timeout time.Duration) bool {
	var f raft.IndexFuture
	if suffrage == raft.Voter {
		f = s.raft.AddVoter(id, raft.ServerAddress(addr), 0, timeout)
	} else {
		f = s.raft.AddNonvoter(id, raft.ServerAddress(addr), 0, timeout)
	}
	if err := f.Error(); err != nil {
		s.log.Warn("raft membership change failed", "change", what, "server", id, "err", err)
		return false
	}
	s.log.Info("raft membership change", "change", what, "server", id, "addr", addr)
	return true
}

// StatusInfo is this node's raft view.
type StatusInfo struct {
	NodeID          string
	State           string
	LeaderID        string
	LeaderRaftAddr  string
	AppliedIndex    uint64
	ConfigVersion   uint64
	InConfiguration bool
}

// Status returns this node's raft view.
func (s *Store) Status() StatusInfo {
	lid, laddr := s.Leader()
	return StatusInfo{
		NodeID:          s.cfg.NodeID,
		State:           s.raft.State().String(),
		LeaderID:        lid,
		LeaderRaftAddr:  laddr,
		AppliedIndex:    s.raft.AppliedIndex(),
		ConfigVersion:   s.fsm.Current().Version,
		InConfiguration: s.inConfiguration(),
	}
}

// Suffrage is a member's raft role.
type Suffrage string

// Suffrage values.
const (
	SuffrageNone     Suffrage = "none"
	SuffrageVoter    Suffrage = "voter"
	SuffrageNonvoter Suffrage = "nonvoter"
)

// MemberStatus is one gateway in the cluster view: live members and raft
// servers, merged.
type MemberStatus struct {
	Member
	// Alive: the membership layer currently sees the gateway.
	Alive bool
	// Suffrage is its raft role (none: not in the raft configuration).
	Suffrage Suffrage
	// Leader marks the raft leader.
	Leader bool
}

// Members returns live members and raft servers merged, sorted by ID.
func (s *Store) Members() []MemberStatus {
	byID := map[string]*MemberStatus{}
	for _, m := range s.cfg.Membership.Members() {
		byID[m.ID] = &MemberStatus{Member: m, Alive: true, Suffrage: SuffrageNone}
	}
	if f := s.raft.GetConfiguration(); f.Error() == nil {
		for _, srv := range f.Configuration().Servers {
			ms, ok := byID[string(srv.ID)]
			if !ok {
				ms = &MemberStatus{Member: Member{ID: string(srv.ID), RaftAddr: string(srv.Address)}}
				byID[string(srv.ID)] = ms
			}
			ms.Suffrage = SuffrageNonvoter
			if srv.Suffrage == raft.Voter {
				ms.Suffrage = SuffrageVoter
			}
		}
	}
	lid, _ := s.Leader()
	out := make([]MemberStatus, 0, len(byID))
	for _, ms := range byID {
		ms.Leader = ms.ID == lid && lid != ""
		out = append(out, *ms)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}
