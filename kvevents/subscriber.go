package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
)

// discardStdLogger silences zmq4's own stderr logging; connection trouble is
// reported through slog by the loops that see it.
var discardStdLogger = log.New(io.Discard, "", 0)

// ResetReason says why a replica's confirmed state became unknown.
type ResetReason uint8

const (
	// ResetRewind: the sequence went backwards, i.e. the engine restarted.
	ResetRewind ResetReason = iota + 1
	// ResetGapUnrecoverable: batches were missed and replay could not
	// supply them (no replay endpoint, buffer rolled over, timeout).
	ResetGapUnrecoverable
	// ResetOverflow: the delivery queue was full and batches were dropped.
	ResetOverflow
	// ResetMalformed: a batch failed to decode and no decodable copy could
	// be replayed, so its events (stores and removals) are lost.
	ResetMalformed
	// ResetSourceChanged: the replica's KV-event source now names another
	// publisher (a config change), so what the old one reported is not
	// the new one's state. The gateway raises it, not a Subscriber.
	ResetSourceChanged
)

func (r ResetReason) String() string {
	switch r {
	case ResetRewind:
		return "rewind"
	case ResetGapUnrecoverable:
		return "gap_unrecoverable"
	case ResetOverflow:
		return "overflow"
	case ResetMalformed:
		return "malformed"
	case ResetSourceChanged:
		return "source_changed"
	}
	return fmt.Sprintf("ResetReason(%d)", uint8(r))
}

// Handler receives one replica's stream in order. A Subscriber calls it from
// a single goroutine, so calls for one replica never overlap; Handlers shared
// by several Subscribers must be safe for concurrent use across replicas.
// A slow Handler delays only its own replica (its queue fills, then resets).
type Handler interface {
	// HandleBatch delivers the batch with sequence number seq. b and
	// everything it points to are reused after HandleBatch returns: copy
	// what you keep.
	HandleBatch(replica string, seq Seq, b *Batch)
	// HandleReset says the replica's confirmed state is unknown (engine
	// restart, unrecoverable gap, queue overflow, undecodable batch): drop
	// it and rebuild from the batches that follow.
	HandleReset(replica string, reason ResetReason)
}

// SubscriberConfig configures the consumer of one engine replica's events.
type SubscriberConfig struct {
	// Replica names the engine in Handler calls, metrics and logs.
	Replica string
	// Endpoint is the engine's PUB address, dialled (tcp://10.0.0.5:5557).
	Endpoint string
	// Bind listens on Endpoint instead, for engines whose publisher connects
	// (kvmesh's kv-bind=); e.g. tcp://127.0.0.1:0 in tests.
	Bind bool
	// ReplayEndpoint is the engine's ROUTER for replay; "" = no replay, so
	// every gap resets.
	ReplayEndpoint string
	// Topic is the subscription prefix; "" receives every topic.
	Topic string
	// ReconnectMin and ReconnectMax bound the exponential backoff between
	// dial attempts after the publisher goes away (100ms..5s: quick after a
	// blip, gentle on an engine that is down for a while).
	ReconnectMin, ReconnectMax time.Duration
	// QueueSize bounds the batches decoded but not yet handled; beyond it
	// batches are dropped and the replica is reset. 1024 steps is several
	// seconds of a busy engine.
	QueueSize int
	// ReplayTimeout bounds one replay request end to end (2s); live batches
	// queue meanwhile.
	ReplayTimeout time.Duration
	// JoinReplay: when the first batch seen has seq > 0 (the subscriber
	// started after the engine), first replay from seq 0 to learn what is
	// already cached, as far as the engine's buffer reaches. Default true.
	JoinReplay bool
	// Resume, with a ReplayEndpoint, starts the subscriber where the
	// Handler's view of the engine already is, for a gateway that takes
	// over an engine's stream (its view kept up through the previous
	// owner, or restored from a peer): as if it had delivered Resume.Seq
	// and then reconnected. The first catch-up asks the engine's replay
	// buffer from Resume.Seq instead of from 0 and delivers only what
	// follows; if the engine holds another batch at Resume.Seq, it
	// restarted since, and the replica is reset (see the catch-up rule in
	// the package doc). Ignored without a ReplayEndpoint.
	Resume *ResumePoint
}

// ResumePoint is what a Handler's view already holds of an engine's
// stream: every batch up to and including Seq, the last one stamped
// EngineTS (Batch.TS).
type ResumePoint struct {
	Seq      Seq
	EngineTS float64
}

// DefaultSubscriberConfig returns defaults; Replica and Endpoint must be set.
func DefaultSubscriberConfig() SubscriberConfig {
	return SubscriberConfig{
		ReconnectMin:  100 * time.Millisecond,
		ReconnectMax:  5 * time.Second,
		QueueSize:     1024,
		ReplayTimeout: 2 * time.Second,
		JoinReplay:    true,
	}
}

// Validate reports the first invalid field, wrapping ErrBadConfig.
func (c SubscriberConfig) Validate() error {
	switch {
	case c.Replica == "":
		return fmt.Errorf("%w: Replica is empty", ErrBadConfig)
	case !strings.Contains(c.Endpoint, "://"):
		return fmt.Errorf("%w: Endpoint %q is not a ZMQ address", ErrBadConfig, c.Endpoint)
	case c.ReplayEndpoint != "" && !strings.Contains(c.ReplayEndpoint, "://"):
		return fmt.Errorf("%w: ReplayEndpoint %q is not a ZMQ address", ErrBadConfig, c.ReplayEndpoint)
	case c.ReconnectMin <= 0 || c.ReconnectMax < c.ReconnectMin:
		return fmt.Errorf("%w: reconnect backoff %v..%v", ErrBadConfig, c.ReconnectMin, c.ReconnectMax)
	case c.QueueSize < 1:
		return fmt.Errorf("%w: QueueSize %d < 1", ErrBadConfig, c.QueueSize)
	case c.ReplayTimeout <= 0:
		return fmt.Errorf("%w: ReplayTimeout %v <= 0", ErrBadConfig, c.ReplayTimeout)
	}
	return nil
}

// item is one live message on its way from the reader to the writer.
type item struct {
	seq     Seq
	b       *Batch // nil when err != nil
	err     error
	ignored int
	// afterOverflow: messages before this one were dropped on a full queue.
	afterOverflow bool
	// afterReconnect: the first message after the publisher went away. A
	// new connection only carries new messages, so a seq not above the last
	// one seen means a restarted engine, never a duplicate.
	afterReconnect bool
	// connected marks a control item without a message: the SUB has just
	// (re)connected, so the writer catches up through replay.
	connected bool
}

// Subscriber consumes one engine replica's KV events: a reader goroutine
// receives and decodes into a bounded queue (it never waits on the
// Handler), a writer goroutine tracks sequence numbers, replays gaps through
// a DEALER, resets on rewinds, and calls the Handler in order.
type Subscriber struct {
	cfg   SubscriberConfig
	h     Handler
	log   *slog.Logger
	topic []byte
	q     chan item
	pool  sync.Pool

	mu       sync.Mutex
	started  bool
	closed   bool
	cancel   context.CancelFunc
	sock     zmq4.Socket
	addr     string
	wg       sync.WaitGroup
	closeErr error
	once     sync.Once

	// dropLive is a test hook: live messages whose seq it accepts are
	// discarded by the reader as if never received.
	dropLive func(Seq) bool
	// mangle is a test hook: it may replace a payload before it is decoded,
	// live (replayed false) or from a replay, as corruption in transit would.
	mangle func(seq Seq, replayed bool, payload []byte) []byte

	// Writer state, owned by the writer goroutine.
	hasLast  bool
	last     Seq // last seq delivered (or accounted as malformed)
	hasLive  bool
	lastLive Seq // last live seq seen, for rewind detection
	// caughtUp: a catch-up replay after a (re)connect delivered batches, so
	// the next live message may repeat one of them rather than mean a
	// restart.
	caughtUp bool
	// lastTS is the engine clock of the batch at last, when hasTS: a
	// catch-up checks that the engine still holds that very batch.
	lastTS float64
	hasTS  bool
	dec    *Decoder

	mBatches, mIgnored, mMalformed, mNoEvents, mGaps, mDup, mReplayed, mDropped, mReconnects prometheus.Counter
	mEvents                                                                                  [4]prometheus.Counter
	mResets                                                                                  [5]prometheus.Counter
	mReplays                                                                                 map[string]prometheus.Counter
	mTolFromOne                                                                              prometheus.Counter
}

// NewSubscriber validates cfg; nothing is opened before Start. m may be
// nil (counters are then kept but not exported); logger may be nil.
func NewSubscriber(cfg SubscriberConfig, h Handler, m *Metrics, logger *slog.Logger) (*Subscriber, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if h == nil {
		return nil, fmt.Errorf("%w: nil Handler", ErrBadConfig)
	}
	if m == nil {
		m = NewMetrics()
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	r := cfg.Replica
	s := &Subscriber{
		cfg:         cfg,
		h:           h,
		log:         logger.With("component", "kvevents.subscriber", "replica", r),
		topic:       []byte(cfg.Topic),
		q:           make(chan item, cfg.QueueSize),
		pool:        sync.Pool{New: func() any { return new(Batch) }},
		dec:         NewDecoder(),
		mBatches:    m.Batches.WithLabelValues(r),
		mIgnored:    m.IgnoredEvents.WithLabelValues(r),
		mMalformed:  m.Malformed.WithLabelValues(r),
		mNoEvents:   m.NoEventBatches.WithLabelValues(r),
		mGaps:       m.Gaps.WithLabelValues(r),
		mDup:        m.Duplicates.WithLabelValues(r),
		mReplayed:   m.Replayed.WithLabelValues(r),
		mDropped:    m.Dropped.WithLabelValues(r),
		mReconnects: m.Reconnects.WithLabelValues(r),
		mReplays:    map[string]prometheus.Counter{},
		mTolFromOne: m.Tolerated.WithLabelValues(r, TolReplayFromOne),
	}
	for _, k := range []Kind{KindBlockStored, KindBlockRemoved, KindAllBlocksCleared} {
		s.mEvents[k] = m.Events.WithLabelValues(r, k.String())
	}
	for _, rr := range []ResetReason{ResetRewind, ResetGapUnrecoverable, ResetOverflow, ResetMalformed} {
		s.mResets[rr] = m.Resets.WithLabelValues(r, rr.String())
	}
	for _, res := range []string{replayComplete, replayPartial, replayFailed} {
		s.mReplays[res] = m.Replays.WithLabelValues(r, res)
	}
	return s, nil
}

const (
	replayComplete = "complete"
	replayPartial  = "partial"
	replayFailed   = "failed"
)

// Start opens the SUB socket (listening on Endpoint in Bind mode, which is
// where an error can come from) and starts the reader and writer. Dialling
// happens in the background with backoff, so an engine that is not up yet
// is not an error. Cancelling ctx stops receiving and delivery; Close must
// still be called to release the socket. A second Start is a no-op; Start
// after Close returns ErrClosed.
func (s *Subscriber) Start(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	if s.started {
		return nil
	}
	runCtx, cancel := context.WithCancel(ctx)
	sock := zmq4.NewSub(runCtx, zmq4.WithDialerMaxRetries(0), zmq4.WithLogger(discardStdLogger))
	if err := sock.SetOption(zmq4.OptionSubscribe, s.cfg.Topic); err != nil {
		cancel()
		_ = sock.Close()
		return fmt.Errorf("kvevents: subscribe: %w", err)
	}
	s.addr = s.cfg.Endpoint
	if s.cfg.Bind {
		if err := sock.Listen(s.cfg.Endpoint); err != nil {
			cancel()
			_ = sock.Close()
			return fmt.Errorf("kvevents: bind SUB %s: %w", s.cfg.Endpoint, err)
		}
		s.addr = sockAddr(sock, s.cfg.Endpoint)
	}
	s.sock, s.cancel, s.started = sock, cancel, true
	resumed := false
	if r := s.cfg.Resume; r != nil && s.cfg.ReplayEndpoint != "" {
		// Set before the goroutines start; the writer owns them from here.
		s.hasLast, s.last, s.hasTS, s.lastTS, resumed = true, r.Seq, true, r.EngineTS, true
		s.log.Info("kv-event subscriber resumes an existing view", "after_seq", uint64(r.Seq))
	}
	s.wg.Add(2)
	go s.readLoop(runCtx, resumed)
	go s.writeLoop(runCtx)
	s.log.Info("kv-event subscriber started", "endpoint", s.addr, "bind", s.cfg.Bind, "replay", s.cfg.ReplayEndpoint)
	return nil
}

// Addr is the SUB's resolved listening address in Bind mode (after Start),
// else Endpoint.
func (s *Subscriber) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.addr
}

// Close stops both goroutines and closes the socket, waiting for a Handler
// call in progress (so never call Close from a Handler). Idempotent.
func (s *Subscriber) Close() error {
	s.once.Do(func() {
		s.mu.Lock()
		s.closed = true
		started := s.started
		s.mu.Unlock()
		if !started {
			return
		}
		s.cancel()
		s.closeErr = s.sock.Close()
		s.wg.Wait()
		// zmq4 adds a connection whose Dial was in flight during Close
		// after closing the others; close again now that nothing dials.
		_ = s.sock.Close()
		drainClosed(s.sock)
		s.log.Info("kv-event subscriber closed")
	})
	return s.closeErr
}

// readLoop receives, decodes and enqueues; it never blocks on the writer.
// A resumed subscriber treats its first connection as a reconnect: it
// carries only batches the engine publishes from now on, so a seq not
// above the resumed one means a restart.
func (s *Subscriber) readLoop(ctx context.Context, resumed bool) {
	defer s.wg.Done()
	backoff := s.cfg.ReconnectMin
	wait := func() bool {
		t := time.NewTimer(backoff)
		defer t.Stop()
		backoff = min(2*backoff, s.cfg.ReconnectMax)
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
			return true
		}
	}
	connected := s.cfg.Bind
	overflow, reconnected := false, resumed
	dec := NewDecoder()
	if s.cfg.Bind {
		// A bound SUB cannot see its publisher connect: catch up now (the
		// writer retries until the engine's ROUTER answers).
		s.signalConnected()
	}
	for ctx.Err() == nil {
		if !connected {
			if err := s.sock.Dial(s.cfg.Endpoint); err != nil {
				s.log.Debug("kv-event dial failed", "endpoint", s.cfg.Endpoint, "err", err, "retry_in", backoff)
				if !wait() {
					return
				}
				continue
			}
			connected, backoff = true, s.cfg.ReconnectMin
			s.mReconnects.Inc()
			s.log.Info("kv-event subscriber connected", "endpoint", s.cfg.Endpoint)
			s.signalConnected()
		}
		msg, err := s.sock.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			// zmq4 reports a publisher going away as an error (io.EOF):
			// redial. A bound SUB keeps listening for the publisher to
			// come back.
			s.log.Info("kv-event publisher went away", "err", err)
			reconnected = true
			if !s.cfg.Bind {
				connected = false
			} else {
				if !wait() {
					return
				}
				s.signalConnected()
			}
			continue
		}
		backoff = s.cfg.ReconnectMin
		f := msg.Frames
		if len(f) != 3 || len(f[1]) != 8 || !bytes.HasPrefix(f[0], s.topic) {
			s.mMalformed.Inc()
			s.log.Warn("kv-event message with unexpected frames", "frames", len(f))
			continue
		}
		it := item{seq: Seq(binary.BigEndian.Uint64(f[1]))}
		if s.dropLive != nil && s.dropLive(it.seq) {
			continue
		}
		payload := f[2]
		if s.mangle != nil {
			payload = s.mangle(it.seq, false, payload)
		}
		b := s.pool.Get().(*Batch)
		it.ignored, it.err = dec.Decode(payload, b)
		if it.err != nil {
			s.pool.Put(b)
		} else {
			it.b = b
		}
		it.afterOverflow, it.afterReconnect = overflow, reconnected
		select {
		case s.q <- it:
			overflow, reconnected = false, false
		default:
			if it.b != nil {
				s.pool.Put(it.b)
			}
			s.mDropped.Inc()
			if !overflow {
				s.log.Warn("kv-event queue full, dropping batches", "seq", uint64(it.seq), "queue", s.cfg.QueueSize)
			}
			overflow = true
		}
	}
}

// signalConnected tells the writer that the SUB (re)connected. It never
// blocks: on a full queue the overflow reset and the live batches behind it
// take care of the stream.
func (s *Subscriber) signalConnected() {
	select {
	case s.q <- item{connected: true}:
	default:
	}
}

// writeLoop delivers queued batches in order, replaying gaps, and catches
// up after each (re)connect.
func (s *Subscriber) writeLoop(ctx context.Context) {
	defer s.wg.Done()
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	var retryC <-chan time.Time
	backoff := s.cfg.ReconnectMin
	catchUp := func() {
		retryC = nil
		if !s.catchUp(ctx) || ctx.Err() != nil {
			return
		}
		// Until a live batch arrives, the subscription may not have
		// reached the publisher yet (ZMQ's slow joiner): batches published
		// meanwhile are lost to this SUB and, if the engine then goes
		// idle, nothing would reveal them. So catch up again, with
		// backoff, until the first live batch hands over to the sequence
		// rules (or the engine's ROUTER, not up yet, answers).
		if timer == nil {
			timer = time.NewTimer(backoff)
		} else {
			timer.Reset(backoff)
		}
		retryC = timer.C
		backoff = min(2*backoff, s.cfg.ReconnectMax)
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-retryC:
			catchUp()
		case it := <-s.q:
			if it.connected {
				// A new connection: what an earlier catch-up delivered
				// is no longer on its way live.
				backoff, s.caughtUp = s.cfg.ReconnectMin, false
				catchUp()
				continue
			}
			if retryC != nil {
				// A live batch: the sequence rules (join replay, gap
				// replay) take over.
				timer.Stop()
				retryC = nil
			}
			s.live(ctx, it)
		}
	}
}

// catchUp replays, after the SUB (re)connects and until the first live
// batch, what the engine published that was not delivered yet: from seq 0
// on the first connection (when JoinReplay is set), from last+1 after a
// reconnect. Without it an engine that published before the subscriber
// connected and then went idle would never reveal the gap, and its blocks
// would never be confirmed. Live batches that repeat replayed ones are
// dropped as duplicates. It reports whether catching up applies at all (a
// replay endpoint, and JoinReplay or something delivered before).
func (s *Subscriber) catchUp(ctx context.Context) bool {
	if s.cfg.ReplayEndpoint == "" {
		return false
	}
	from := Seq(0)
	switch {
	case s.hasLast && s.hasTS:
		from = s.last // the last delivered batch itself: checked, not delivered
	case s.hasLast:
		from = s.last + 1
	case !s.cfg.JoinReplay:
		return false
	}
	had := s.hasLast
	_, delivered := s.replayRange(ctx, from, ReplayEnd, true)
	if had && !s.hasLast && s.cfg.JoinReplay && ctx.Err() == nil {
		// The engine restarted: rebuild from what it holds, as a join does.
		_, n := s.replayRange(ctx, 0, ReplayEnd, true)
		delivered += n
	}
	if delivered > 0 {
		// Live messages of this connection may repeat what was replayed.
		s.caughtUp = true
	}
	return true
}

// live applies the sequence rules to one live message.
func (s *Subscriber) live(ctx context.Context, it item) {
	if s.caughtUp {
		// The catch-up ran on this connection, so seqs it delivered may
		// also arrive live: not a restart.
		it.afterReconnect, s.caughtUp = false, false
	}
	joinReplay := s.cfg.JoinReplay
	if it.afterOverflow {
		s.reset(ResetOverflow)
		s.hasLive = false
		// A replay now would feed more into a handler that just fell behind.
		joinReplay = false
	}
	switch {
	case s.hasLive:
		switch {
		case it.seq < s.lastLive, it.afterReconnect && it.seq == s.lastLive:
			s.log.Info("kv-event sequence rewound: engine restarted", "seq", uint64(it.seq), "last", uint64(s.lastLive))
			s.reset(ResetRewind)
			s.hasLive = false
		case it.seq == s.lastLive:
			s.mDup.Inc()
			s.recycle(it.b)
			return
		}
	case it.afterReconnect && s.hasLast && it.seq <= s.last:
		// Only a catch-up replay delivered before (no live message yet),
		// and a new connection carries only new messages: a restart.
		s.log.Info("kv-event sequence rewound: engine restarted", "seq", uint64(it.seq), "last", uint64(s.last))
		s.reset(ResetRewind)
	}
	s.hasLive, s.lastLive = true, it.seq

	if !s.hasLast {
		if joinReplay && it.seq > 0 && s.cfg.ReplayEndpoint != "" {
			s.replay(ctx, 0, it.seq)
		}
	} else if it.seq > s.last+1 {
		s.mGaps.Inc()
		s.log.Info("kv-event gap", "expected", uint64(s.last+1), "got", uint64(it.seq))
		if s.cfg.ReplayEndpoint != "" {
			s.replay(ctx, s.last+1, it.seq)
		}
	}
	if ctx.Err() != nil {
		return
	}
	if s.hasLast {
		switch {
		case it.seq <= s.last:
			// Already delivered by a replay.
			s.mDup.Inc()
			s.recycle(it.b)
			return
		case it.seq > s.last+1:
			s.reset(ResetGapUnrecoverable)
		}
	}
	s.deliverLive(ctx, it)
}

// deliverLive delivers a live batch in sequence. A payload that failed to
// decode may have been damaged on its way (a relay, a bad link): the
// engine's replay buffer keeps what it published, so one replay of that
// seq is tried before the batch is declared lost.
func (s *Subscriber) deliverLive(ctx context.Context, it item) {
	if it.err == nil || errors.Is(it.err, ErrNoEvents) || s.cfg.ReplayEndpoint == "" {
		s.deliver(it.seq, it.b, it.err, it.ignored, false)
		return
	}
	s.recycle(it.b)
	s.mMalformed.Inc()
	s.log.Warn("kv-event batch failed to decode, asking for a replayed copy", "seq", uint64(it.seq), "err", it.err)
	s.replay(ctx, it.seq, it.seq+1)
	if ctx.Err() != nil {
		return
	}
	if s.hasLast && s.last == it.seq {
		// The replayed copy was delivered, or it failed too and replay
		// already reset.
		return
	}
	s.lost(it.seq, fmt.Errorf("%w; replay did not return seq %d", it.err, it.seq))
}

// replay asks the engine's ROUTER for batches from `from` on and delivers
// those before `until` (the live batch that revealed the gap) in order.
// Batches it cannot place after the last delivered one trigger a reset.
func (s *Subscriber) replay(ctx context.Context, from, until Seq) {
	s.replayRange(ctx, from, until, false)
}

// replayRange is replay; until == ReplayEnd means everything the engine
// still has. It reports whether the ROUTER answered (the end marker
// arrived) and how many batches it delivered. Catch-ups repeat until live
// traffic arrives, so only those that deliver something or fail after
// reaching the engine are counted in replays_total.
func (s *Subscriber) replayRange(ctx context.Context, from, until Seq, catchUp bool) (answered bool, delivered int) {
	rctx, cancel := context.WithTimeout(ctx, s.cfg.ReplayTimeout)
	defer cancel()
	result, count := replayFailed, true
	fromOne := false
	defer func() {
		if catchUp && answered && delivered == 0 {
			count = false // nothing new: a poll, not a replay
		}
		if ctx.Err() == nil && count {
			s.mReplays[result].Inc()
			if fromOne && result == replayComplete {
				s.mTolFromOne.Inc()
			}
		}
	}()
	d := zmq4.NewDealer(rctx, zmq4.WithDialerMaxRetries(0), zmq4.WithLogger(discardStdLogger))
	// A replay cut off mid-stream (timeout, cancel) can leave replies queued
	// in zmq4's reader: drain them so its goroutine does not block forever.
	defer func() { _ = d.Close(); drainClosed(d) }()
	if err := d.Dial(s.cfg.ReplayEndpoint); err != nil {
		if catchUp {
			count = false
			s.log.Debug("kv-event catch-up: replay dial failed", "endpoint", s.cfg.ReplayEndpoint, "err", err)
		} else {
			s.log.Warn("kv-event replay: dial failed", "endpoint", s.cfg.ReplayEndpoint, "err", err)
		}
		return false, 0
	}
	if err := d.SendMulti(zmq4.NewMsgFrom([]byte{}, seqBytes(from))); err != nil {
		s.log.Warn("kv-event replay: request failed", "err", err)
		return false, 0
	}
	contiguous := true
	// verify: a catch-up asked from the last delivered batch, to check
	// that the engine still holds that very batch; deliveries start after
	// it. refused: it does not (the engine restarted), so the rest of this
	// answer is read and dropped, and catchUp rebuilds from seq 0.
	verify, start, refused := catchUp && s.hasLast && s.hasTS && from == s.last, from, false
	// fromOne (declared above): a replay from 0 before anything was delivered whose first
	// answer is seq 1. A publisher that numbers from 1 (llm-d-inference-
	// sim) never published seq 0, so nothing is missing: counted as
	// replay_from_one, not as a failed or partial replay. (A vLLM ring that
	// dropped exactly seq 0 and no more reads the same; one batch at most.)
	first, joining := true, from == 0 && !s.hasLast
	for {
		msg, err := d.Recv()
		if err != nil {
			if ctx.Err() == nil {
				s.log.Warn("kv-event replay incomplete", "from", uint64(from), "until", uint64(until), "delivered", delivered, "err", err)
			}
			break
		}
		seq, payload, ok := parseReplayReply(msg.Frames)
		if !ok {
			s.mMalformed.Inc()
			continue
		}
		if seq == ReplayEnd {
			answered = true
			break
		}
		if first {
			first, fromOne = false, joining && seq == 1
		}
		if refused {
			continue // read to the end marker; catchUp rebuilds from 0
		}
		if verify {
			verify, start = false, from+1
			if seq == from {
				b := s.pool.Get().(*Batch)
				_, derr := s.dec.Decode(payload, b)
				ts := b.TS
				s.recycle(b)
				if derr == nil && ts == s.lastTS {
					continue // the same batch: the stream goes on
				}
				s.log.Info("kv-event sequence rewound: the engine restarted (its batch at the last delivered seq has another clock)",
					"seq", uint64(seq), "clock", ts, "delivered_clock", s.lastTS)
				s.reset(ResetRewind)
				refused = true
				continue
			}
			// The engine no longer holds that batch. A later one is a gap
			// (the rules below); nothing at all leaves the first live seq
			// to tell a restart, as without the check.
		}
		if seq >= until {
			// The live queue has these. Read on to the end marker anyway:
			// closing a zmq4 socket with unread messages strands its
			// connection goroutine on a full channel.
			continue
		}
		if s.hasLast && seq <= s.last {
			continue
		}
		if s.hasLast && seq != s.last+1 {
			// The engine's buffer no longer holds what we missed.
			s.log.Info("kv-event replay cannot cover the gap", "expected", uint64(s.last+1), "oldest", uint64(seq))
			s.reset(ResetGapUnrecoverable)
			contiguous = false
		}
		if delivered == 0 && seq != start && !(fromOne && seq == 1) {
			contiguous = false
		}
		if s.mangle != nil {
			payload = s.mangle(seq, true, payload)
		}
		b := s.pool.Get().(*Batch)
		ignored, derr := s.dec.Decode(payload, b)
		s.deliver(seq, b, derr, ignored, true)
		delivered++
	}
	switch {
	case until == ReplayEnd && answered && contiguous,
		until != ReplayEnd && contiguous && s.hasLast && s.last+1 == until,
		fromOne && until == 1 && answered && delivered == 0:
		result = replayComplete
	case delivered > 0, until == ReplayEnd && answered:
		result = replayPartial
	}
	s.log.Debug("kv-event replay done", "from", uint64(from), "until", uint64(until), "delivered", delivered,
		"result", result, "catch_up", catchUp)
	return answered, delivered
}

// drainClosed reads what a closed zmq4 socket still has queued. zmq4's
// connection goroutine hands messages to a 10-slot channel without watching
// the socket's context, so one that holds a message when its socket closes
// with a full channel would block forever. A closed socket's Recv picks at
// random between the queue and the cancelled context; sixteen cancelled
// answers in a row leave a non-empty queue with probability 2^-16.
func drainClosed(sock zmq4.Socket) {
	for quiet, i := 0, 0; quiet < 16 && i < 1024; i++ {
		if _, err := sock.Recv(); errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			quiet++
		} else {
			quiet = 0
		}
	}
}

// parseReplayReply accepts both reply forms as a DEALER sees them: an empty
// delimiter frame, then [seq, payload] (vLLM <= v0.25) or [topic, seq,
// payload] (v0.26). A leading empty frame is dropped when at least three
// frames arrive; that also reads an undelimited [topic="", seq, payload]
// correctly.
func parseReplayReply(f [][]byte) (Seq, []byte, bool) {
	if len(f) >= 3 && len(f[0]) == 0 {
		f = f[1:]
	}
	var seqFrame, payload []byte
	switch len(f) {
	case 2:
		seqFrame, payload = f[0], f[1]
	case 3:
		seqFrame, payload = f[1], f[2]
	default:
		return 0, nil, false
	}
	if len(seqFrame) != 8 {
		return 0, nil, false
	}
	return Seq(binary.BigEndian.Uint64(seqFrame)), payload, true
}

// deliver hands one batch (replayed: from the engine's replay buffer) to
// the Handler and advances the delivered sequence. A batch with no known
// event (ErrNoEvents) consumes its seq and loses nothing the index uses;
// any other decode error loses the batch's events, so the replica is
// reset. It counts a batch before handing it over, as reset counts a
// reset, so that the counters never trail what the Handler has seen (a
// test that waits for the Handler's batches and then reads them; an
// operator comparing the two).
func (s *Subscriber) deliver(seq Seq, b *Batch, err error, ignored int, replayed bool) {
	s.hasLast, s.last, s.hasTS = true, seq, err == nil
	if err == nil {
		s.lastTS = b.TS
	}
	if ignored > 0 {
		s.mIgnored.Add(float64(ignored))
	}
	if err != nil {
		s.recycle(b)
		if errors.Is(err, ErrNoEvents) {
			// Only event types this version does not know (or none at
			// all): nothing the index tracks was in it.
			s.mNoEvents.Inc()
			s.log.Debug("kv-event batch without known events", "seq", uint64(seq), "ignored", ignored)
			return
		}
		s.mMalformed.Inc()
		s.lost(seq, err)
		return
	}
	s.mBatches.Inc()
	if replayed {
		s.mReplayed.Inc()
	}
	for i := range b.Events {
		if k := b.Events[i].Kind; int(k) < len(s.mEvents) && s.mEvents[k] != nil {
			s.mEvents[k].Inc()
		}
	}
	s.h.HandleBatch(s.cfg.Replica, seq, b)
	s.recycle(b)
}

// lost resets the replica for an undecodable batch and consumes its seq, so
// the batches after it continue the stream rather than look like a gap.
func (s *Subscriber) lost(seq Seq, err error) {
	s.log.Warn("kv-event batch lost: cannot decode it", "seq", uint64(seq), "err", err)
	s.reset(ResetMalformed)
	s.hasLast, s.last, s.hasTS = true, seq, false
}

func (s *Subscriber) reset(r ResetReason) {
	s.mResets[r].Inc()
	s.log.Warn("kv-event replica state reset", "reason", r.String())
	s.h.HandleReset(s.cfg.Replica, r)
	s.hasLast, s.hasTS = false, false
}

func (s *Subscriber) recycle(b *Batch) {
	if b != nil {
		s.pool.Put(b)
	}
}
