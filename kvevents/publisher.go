package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// ErrClosed is returned by Publish after Close.
var ErrClosed = errors.New("kvevents: closed")

// ErrBadConfig wraps every configuration validation failure.
var ErrBadConfig = errors.New("kvevents: invalid config")

// ReplayForm selects the frames of a replay reply (after the DEALER's empty
// delimiter frame).
type ReplayForm uint8

const (
	// ReplayWithTopic replies [topic, seq, payload], as vLLM v0.26 does. The
	// default.
	ReplayWithTopic ReplayForm = iota
	// ReplayNoTopic replies [seq, payload], as vLLM <= v0.25 does.
	ReplayNoTopic
)

func (f ReplayForm) String() string {
	switch f {
	case ReplayWithTopic:
		return "with-topic"
	case ReplayNoTopic:
		return "no-topic"
	}
	return fmt.Sprintf("ReplayForm(%d)", uint8(f))
}

// ParseReplayForm maps "with-topic" and "no-topic" to a ReplayForm.
func ParseReplayForm(s string) (ReplayForm, error) {
	switch s {
	case "with-topic":
		return ReplayWithTopic, nil
	case "no-topic":
		return ReplayNoTopic, nil
	}
	return 0, fmt.Errorf("%w: replay form %q (want with-topic or no-topic)", ErrBadEncoding, s)
}

// PublisherConfig configures a Publisher the way vLLM's --kv-events-config
// configures its ZmqEventPublisher.
type PublisherConfig struct {
	// Endpoint is the PUB socket's address. As in vLLM, the socket binds when
	// the address contains "*" or "::" or is ipc:// or inproc:// (e.g.
	// tcp://*:5557, which zmq4 binds as 0.0.0.0:5557), and otherwise connects
	// to a consumer that binds (kvmesh's kv-bind=), redialling when that
	// consumer goes away.
	Endpoint string
	// AlwaysBind binds Endpoint even without a wildcard, e.g.
	// tcp://127.0.0.1:0 in tests. Not a vLLM option.
	AlwaysBind bool
	// ReplayEndpoint is the ROUTER socket serving replay requests; it always
	// binds. "" disables replay.
	ReplayEndpoint string
	// Topic is the first frame of every message; "" (vLLM's default) is fine.
	Topic string
	// BufferSteps is the replay ring size in batches (vLLM default 10000).
	BufferSteps int
	// HWM is the send queue bound in messages; beyond it messages are dropped
	// rather than blocking Publish (vLLM default 100000). 0 = unbounded.
	HWM int
	// Encoding is the payload form (default EncodingMap, vLLM v0.26).
	Encoding Encoding
	// ReplayForm is the replay reply form (default ReplayWithTopic, v0.26).
	ReplayForm ReplayForm
	// RedialInterval is how often a connecting publisher checks that its
	// consumer is still connected and subscribed, and redials if not
	// (0 = 500ms; about a second to notice a restarted consumer).
	RedialInterval time.Duration
	// FirstSeq is the first batch's sequence number: 0 as in vLLM;
	// llm-d-inference-sim numbers from 1. Not a vLLM option.
	FirstSeq Seq
}

// DefaultPublisherConfig returns vLLM's defaults: bind tcp://*:5557, no
// replay, topic "", 10000 buffered batches, HWM 100000, v0.26 forms.
func DefaultPublisherConfig() PublisherConfig {
	return PublisherConfig{
		Endpoint:       "tcp://*:5557",
		BufferSteps:    10000,
		HWM:            100000,
		Encoding:       EncodingMap,
		ReplayForm:     ReplayWithTopic,
		RedialInterval: 500 * time.Millisecond,
	}
}

// Validate reports the first invalid field, wrapping ErrBadConfig.
func (c PublisherConfig) Validate() error {
	switch {
	case !strings.Contains(c.Endpoint, "://"):
		return fmt.Errorf("%w: Endpoint %q is not a ZMQ address", ErrBadConfig, c.Endpoint)
	case c.ReplayEndpoint != "" && !strings.Contains(c.ReplayEndpoint, "://"):
		return fmt.Errorf("%w: ReplayEndpoint %q is not a ZMQ address", ErrBadConfig, c.ReplayEndpoint)
	case c.ReplayEndpoint != "" && c.BufferSteps < 1:
		return fmt.Errorf("%w: BufferSteps %d < 1 with replay enabled", ErrBadConfig, c.BufferSteps)
	case c.BufferSteps < 0:
		return fmt.Errorf("%w: BufferSteps %d < 0", ErrBadConfig, c.BufferSteps)
	case c.HWM < 0:
		return fmt.Errorf("%w: HWM %d < 0", ErrBadConfig, c.HWM)
	case !c.Encoding.Valid():
		return fmt.Errorf("%w: Encoding %v", ErrBadConfig, c.Encoding)
	case c.ReplayForm > ReplayNoTopic:
		return fmt.Errorf("%w: ReplayForm %v", ErrBadConfig, c.ReplayForm)
	case c.RedialInterval < 0:
		return fmt.Errorf("%w: RedialInterval %v < 0", ErrBadConfig, c.RedialInterval)
	}
	return nil
}

// endpointBinds is vLLM's heuristic: wildcard or local transports bind.
func endpointBinds(ep string) bool {
	return strings.Contains(ep, "*") || strings.Contains(ep, "::") ||
		strings.HasPrefix(ep, "ipc://") || strings.HasPrefix(ep, "inproc://")
}

type replayEntry struct {
	seq     Seq
	payload []byte
}

// Publisher is vLLM's ZMQ KV-event publisher: PUB socket with
// [topic, seq, payload] messages, plus an optional ROUTER that replays its
// ring of recent batches. The engine simulator publishes through it.
type Publisher struct {
	cfg      PublisherConfig
	log      *slog.Logger
	topic    []byte
	binds    bool
	addr     string
	rAddr    string
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	closeErr error
	once     sync.Once

	mu     sync.Mutex // orders Publish: seq, encoder, ring, send
	closed bool
	enc    *Encoder
	next   Seq
	ring   []replayEntry
	pub    zmq4.Socket
	router zmq4.Socket
	// redials counts a connecting PUB's dials after its first.
	redials atomic.Uint64
}

// NewPublisher validates cfg and opens the sockets: bound sockets are
// listening when it returns; a connecting PUB dials in the background
// (messages published before the consumer is there are dropped, as with
// libzmq, and can be replayed). logger may be nil.
func NewPublisher(cfg PublisherConfig, logger *slog.Logger) (*Publisher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if cfg.RedialInterval == 0 {
		cfg.RedialInterval = DefaultPublisherConfig().RedialInterval
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Publisher{
		cfg:    cfg,
		log:    logger.With("component", "kvevents.publisher"),
		topic:  []byte(cfg.Topic),
		binds:  cfg.AlwaysBind || endpointBinds(cfg.Endpoint),
		cancel: cancel,
		enc:    NewEncoder(cfg.Encoding),
		next:   cfg.FirstSeq,
	}
	var err error
	if p.pub, err = p.newPub(ctx); err != nil {
		cancel()
		return nil, err
	}
	if p.binds {
		if err := p.pub.Listen(cfg.Endpoint); err != nil {
			cancel()
			_ = p.pub.Close()
			return nil, fmt.Errorf("kvevents: bind PUB %s: %w", cfg.Endpoint, err)
		}
		p.addr = sockAddr(p.pub, cfg.Endpoint)
	} else {
		p.addr = cfg.Endpoint
		p.wg.Add(1)
		go p.dialLoop(ctx)
	}
	if cfg.ReplayEndpoint != "" {
		p.ring = make([]replayEntry, cfg.BufferSteps)
		p.router = zmq4.NewRouter(ctx, zmq4.WithLogger(discardStdLogger))
		if err := p.router.Listen(cfg.ReplayEndpoint); err != nil {
			cancel()
			_ = p.pub.Close()
			_ = p.router.Close()
			p.wg.Wait()
			return nil, fmt.Errorf("kvevents: bind ROUTER %s: %w", cfg.ReplayEndpoint, err)
		}
		p.rAddr = sockAddr(p.router, cfg.ReplayEndpoint)
		p.wg.Add(1)
		go p.serveReplay(ctx)
	}
	p.log.Info("kv-event publisher ready", "endpoint", p.addr, "binds", p.binds,
		"replay", p.rAddr, "encoding", cfg.Encoding.String())
	return p, nil
}

// newPub opens a PUB socket with the configured options.
func (p *Publisher) newPub(ctx context.Context) (zmq4.Socket, error) {
	pub := zmq4.NewPub(ctx, zmq4.WithDialerMaxRetries(0), zmq4.WithLogger(discardStdLogger))
	if p.cfg.HWM > 0 {
		if err := pub.SetOption(zmq4.OptionHWM, p.cfg.HWM); err != nil {
			_ = pub.Close()
			return nil, fmt.Errorf("kvevents: set HWM: %w", err)
		}
	}
	return pub, nil
}

// Publish encodes b, assigns it the next sequence number (FirstSeq, +1, ...),
// keeps it for replay and queues it for sending. It never blocks on slow
// subscribers (beyond HWM queued messages are dropped, to be replayed). Safe
// for concurrent use; batches go out in seq order.
func (p *Publisher) Publish(b Batch) (Seq, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, ErrClosed
	}
	payload, err := p.enc.Append(nil, &b)
	if err != nil {
		return 0, err
	}
	seq := p.next
	p.next++
	if len(p.ring) > 0 {
		p.ring[uint64(seq)%uint64(len(p.ring))] = replayEntry{seq: seq, payload: payload}
	}
	if err := p.pub.SendMulti(zmq4.NewMsgFrom(p.topic, seqBytes(seq), payload)); err != nil {
		return seq, fmt.Errorf("kvevents: send seq %d: %w", seq, err)
	}
	return seq, nil
}

// Addr is the PUB address: the resolved listener address when bound (so
// port 0 resolves; tcp://*:P reads tcp://0.0.0.0:P), else Endpoint.
func (p *Publisher) Addr() string { return p.addr }

// ReplayAddr is the resolved ROUTER address, or "" without replay.
func (p *Publisher) ReplayAddr() string { return p.rAddr }

// Close stops replay service and closes both sockets; queued messages not
// yet written are dropped. Idempotent; Publish returns ErrClosed afterwards.
func (p *Publisher) Close() error {
	p.once.Do(func() {
		p.mu.Lock()
		p.closed = true
		pub := p.pub
		p.mu.Unlock()
		p.cancel()
		err := ignoreClosedConn(pub.Close())
		if p.router != nil {
			// A replay client that already hung up leaves a connection
			// whose close reports net.ErrClosed: not a failure to close.
			err = errors.Join(err, ignoreClosedConn(p.router.Close()))
		}
		p.wg.Wait()
		// zmq4 adds a connection whose Dial was in flight during Close
		// after closing the others; close again now that nothing dials.
		_ = p.pub.Close()
		p.closeErr = err
		p.log.Info("kv-event publisher closed", "next_seq", uint64(p.next))
	})
	return p.closeErr
}

// dialLoop keeps a connecting PUB connected: zmq4 does not reconnect by
// itself (its auto-reconnect redials from inside a failing send and can
// deadlock), so this loop dials, then watches that some peer is connected
// and subscribed, and redials when none has been for two checks.
//
// A redial starts from a fresh socket. A consumer whose subscription is
// only slow to arrive (a loaded gateway) looks lost too, and dialling
// again on the same socket would keep its first connection beside the
// new one: the consumer would then get every batch once per connection,
// interleaved, and read the seqs going backwards as an engine restart.
func (p *Publisher) dialLoop(ctx context.Context) {
	defer p.wg.Done()
	t := time.NewTicker(p.cfg.RedialInterval)
	defer t.Stop()
	connected, idle := false, 0
	for {
		p.mu.Lock()
		pub := p.pub
		p.mu.Unlock()
		if !connected {
			if err := pub.Dial(p.cfg.Endpoint); err != nil {
				p.log.Debug("kv-event publisher dial failed", "endpoint", p.cfg.Endpoint, "err", err)
			} else {
				connected, idle = true, 0
				p.log.Info("kv-event publisher connected", "endpoint", p.cfg.Endpoint)
			}
		} else if len(pub.(zmq4.Topics).Topics()) == 0 {
			idle++
			if idle >= 2 {
				if !p.replacePub(ctx) {
					return
				}
				connected = false
				p.redials.Add(1)
				p.log.Info("kv-event publisher lost its consumer, redialling", "endpoint", p.cfg.Endpoint)
				continue
			}
		} else {
			idle = 0
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// replacePub swaps the PUB socket for a fresh one and closes the old one
// with its connections; batches published meanwhile go to the new socket
// (and, without a consumer there yet, are dropped as before, to be
// replayed). It reports false once the publisher is closed.
func (p *Publisher) replacePub(ctx context.Context) bool {
	pub, err := p.newPub(ctx)
	if err != nil {
		p.log.Warn("kv-event publisher cannot open a new socket; redialling on the old one", "err", err)
		return true
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		_ = pub.Close()
		return false
	}
	old := p.pub
	p.pub = pub
	p.mu.Unlock()
	_ = old.Close()
	return true
}

// serveReplay answers DEALER requests: a ROUTER receives [identity, "",
// start_seq(8)] and replies [identity, "", (topic,) seq, payload] for every
// buffered batch with seq >= start_seq, then [identity, "", (topic,)
// ReplayEnd, ""].
func (p *Publisher) serveReplay(ctx context.Context) {
	defer p.wg.Done()
	for {
		msg, err := p.router.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			p.log.Debug("kv-event replay recv", "err", err)
			continue
		}
		f := msg.Frames
		// vLLM requires exactly [identity, "", seq]; tolerate a missing
		// delimiter.
		if len(f) < 2 || len(f) > 3 || (len(f) == 3 && len(f[1]) != 0) || len(f[len(f)-1]) != 8 {
			p.log.Warn("kv-event replay: invalid request", "frames", len(f))
			continue
		}
		id := f[0]
		start := Seq(binary.BigEndian.Uint64(f[len(f)-1]))
		entries := p.replayFrom(start)
		sent := 0
		for _, e := range entries {
			if err := p.router.SendMulti(p.replayMsg(id, e.seq, e.payload)); err != nil {
				break
			}
			sent++
		}
		if err := p.router.SendMulti(p.replayMsg(id, ReplayEnd, nil)); err != nil && ctx.Err() == nil {
			p.log.Debug("kv-event replay send", "err", err)
		}
		p.log.Debug("kv-event replay served", "start", uint64(start), "batches", sent)
	}
}

func (p *Publisher) replayMsg(id []byte, seq Seq, payload []byte) zmq4.Msg {
	if payload == nil {
		payload = []byte{}
	}
	if p.cfg.ReplayForm == ReplayNoTopic {
		return zmq4.NewMsgFrom(id, []byte{}, seqBytes(seq), payload)
	}
	return zmq4.NewMsgFrom(id, []byte{}, p.topic, seqBytes(seq), payload)
}

// replayFrom copies the ring entries with seq >= start, oldest first.
func (p *Publisher) replayFrom(start Seq) []replayEntry {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := Seq(len(p.ring))
	oldest := p.cfg.FirstSeq
	if p.next-p.cfg.FirstSeq > n {
		oldest = p.next - n
	}
	start = max(start, oldest)
	if start >= p.next {
		return nil
	}
	out := make([]replayEntry, 0, p.next-start)
	for s := start; s < p.next; s++ {
		out = append(out, p.ring[uint64(s)%uint64(n)])
	}
	return out
}

func seqBytes(s Seq) []byte {
	return binary.BigEndian.AppendUint64(make([]byte, 0, 8), uint64(s))
}

// sockAddr renders a bound socket's listener address as a ZMQ endpoint.
func sockAddr(s zmq4.Socket, ep string) string {
	a := s.Addr()
	if a == nil {
		return ep
	}
	if i := strings.Index(ep, "://"); i > 0 && ep[:i] == "tcp" {
		return "tcp://" + a.String()
	}
	return ep
}

// ignoreClosedConn drops net.ErrClosed from a socket's Close error: zmq4
// reports closing a connection its peer already closed that way.
func ignoreClosedConn(err error) error {
	if err == nil || errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}
