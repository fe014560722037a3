package faultproxy

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// Action is what a Relay does with one ZMQ message.
type Action uint8

const (
	// Forward passes the message on unchanged.
	Forward Action = iota
	// Drop loses the message.
	Drop
	// Duplicate sends the message twice.
	Duplicate
	// Swap holds the message and sends it right after the next one (a
	// reorder of two neighbours). A held message waits for that next
	// message; Close discards it.
	Swap
	// Garble replaces the payload (last frame) with random bytes of the
	// same length, keeping topic and sequence frames.
	Garble
)

func (a Action) String() string {
	switch a {
	case Forward:
		return "forward"
	case Drop:
		return "drop"
	case Duplicate:
		return "duplicate"
	case Swap:
		return "swap"
	case Garble:
		return "garble"
	}
	return fmt.Sprintf("Action(%d)", uint8(a))
}

// Fault decides each message's fate from its sequence number (the 8-byte
// big-endian second frame of a vLLM KV-event message; 0 if absent) and its
// position n (0, 1, 2, ... in the order the relay received them). It is
// called from the relay's one goroutine.
type Fault func(seq uint64, n uint64) Action

// RelayConfig configures a Relay.
type RelayConfig struct {
	// Name labels the relay in logs.
	Name string
	// Upstream is the PUB endpoint to subscribe to (tcp://127.0.0.1:5557).
	Upstream string
	// Listen is where the relay's own PUB binds. Default
	// "tcp://127.0.0.1:0"; see Addr.
	Listen string
	// Redial is the pause before redialling an upstream that went away.
	// Default 50ms: the relay should be back before the consumer notices.
	Redial time.Duration
	// Logger receives debug logs; nil discards.
	Logger *slog.Logger
}

// DefaultRelayConfig returns defaults; Upstream must be set.
func DefaultRelayConfig() RelayConfig {
	return RelayConfig{Listen: "tcp://127.0.0.1:0", Redial: 50 * time.Millisecond}
}

// Validate reports the first invalid field, wrapping ErrInvalidConfig.
func (c RelayConfig) Validate() error {
	switch {
	case c.Upstream == "":
		return fmt.Errorf("%w: empty upstream", ErrInvalidConfig)
	case c.Listen == "":
		return fmt.Errorf("%w: empty listen endpoint", ErrInvalidConfig)
	case c.Redial <= 0:
		return fmt.Errorf("%w: redial %v", ErrInvalidConfig, c.Redial)
	}
	return nil
}

// RelayStats counts messages by what the relay did with them.
type RelayStats struct {
	Received, Forwarded, Dropped, Duplicated, Swapped, Garbled uint64
	// Redials counts upstream connections re-established.
	Redials uint64
}

// Relay is a ZMQ PUB/SUB relay that injects message-level faults: it
// subscribes to an upstream PUB and republishes every message on its own
// PUB, dropping, duplicating, reordering or garbling the ones its Fault
// says. Unlike a TCP fault, the ZMTP framing stays intact, so consumers see
// exactly lost, repeated or reordered batches. Replay (a ROUTER) is not
// relayed: point consumers at the upstream's replay endpoint directly.
type Relay struct {
	cfg RelayConfig
	log *slog.Logger

	fault atomic.Pointer[Fault]

	mu      sync.Mutex
	started bool
	closed  bool
	addr    string
	sub     zmq4.Socket
	pub     zmq4.Socket
	cancel  context.CancelFunc
	wg      sync.WaitGroup

	received, forwarded, dropped, duplicated, swapped, garbled, redials atomic.Uint64
}

var quietZMQ = log.New(io.Discard, "", 0)

// NewRelay validates cfg; nothing opens before Start.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	l := cfg.Logger
	if l == nil {
		l = slog.New(slog.DiscardHandler)
	}
	return &Relay{cfg: cfg, log: l.With("relay", cfg.Name)}, nil
}

// SetFault installs f (nil forwards everything). Safe at any time.
func (r *Relay) SetFault(f Fault) {
	if f == nil {
		r.fault.Store(nil)
		return
	}
	r.fault.Store(&f)
}

// Start binds the relay's PUB and starts relaying; the upstream is dialled
// in the background (redialled when it goes away). A second Start is a no-op;
// Start after Close returns ErrClosed.
func (r *Relay) Start() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	if r.started {
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	pub := zmq4.NewPub(ctx, zmq4.WithLogger(quietZMQ))
	if err := pub.Listen(r.cfg.Listen); err != nil {
		cancel()
		_ = pub.Close()
		return fmt.Errorf("faultproxy: relay %s: listen %s: %w", r.cfg.Name, r.cfg.Listen, err)
	}
	sub := zmq4.NewSub(ctx, zmq4.WithDialerMaxRetries(0), zmq4.WithLogger(quietZMQ))
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		cancel()
		_ = pub.Close()
		_ = sub.Close()
		return fmt.Errorf("faultproxy: relay %s: subscribe: %w", r.cfg.Name, err)
	}
	r.addr = r.cfg.Listen
	if a := pub.Addr(); a != nil && strings.HasPrefix(r.cfg.Listen, "tcp://") {
		r.addr = "tcp://" + a.String()
	}
	r.sub, r.pub, r.cancel, r.started = sub, pub, cancel, true
	r.wg.Add(1)
	go r.run(ctx)
	return nil
}

// Addr is the relay's PUB endpoint for consumers ("" before Start).
func (r *Relay) Addr() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.addr
}

// Stats returns the counters.
func (r *Relay) Stats() RelayStats {
	return RelayStats{
		Received: r.received.Load(), Forwarded: r.forwarded.Load(), Dropped: r.dropped.Load(),
		Duplicated: r.duplicated.Load(), Swapped: r.swapped.Load(), Garbled: r.garbled.Load(),
		Redials: r.redials.Load(),
	}
}

// Close stops relaying, closes both sockets and waits. Idempotent.
func (r *Relay) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	started := r.started
	r.mu.Unlock()
	if !started {
		return nil
	}
	r.cancel()
	errSub := r.sub.Close()
	errPub := r.pub.Close()
	r.wg.Wait()
	_ = r.sub.Close() // a dial in flight during Close may add a connection afterwards
	drainSocket(r.sub)
	return errors.Join(ignoreClosed(errSub), ignoreClosed(errPub))
}

func ignoreClosed(err error) error {
	if err == nil || errors.Is(err, context.Canceled) || strings.Contains(err.Error(), "closed") {
		return nil
	}
	return err
}

// drainSocket reads what a closed zmq4 socket still has queued, so that
// zmq4's per-connection goroutine blocked on a full queue can exit (it does
// not watch the socket's context). A closed socket's Recv picks at random
// between the queue and the cancelled context; sixteen cancelled answers in
// a row mean the queue is empty with high probability.
func drainSocket(s zmq4.Socket) {
	for quiet, i := 0, 0; quiet < 16 && i < 1024; i++ {
		if _, err := s.Recv(); errors.Is(err, context.Canceled) {
			quiet++
		} else {
			quiet = 0
		}
	}
}

func (r *Relay) run(ctx context.Context) {
	defer r.wg.Done()
	connected := false
	var held *zmq4.Msg
	var n uint64
	pause := func() bool {
		t := time.NewTimer(r.cfg.Redial)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
			return true
		}
	}
	for ctx.Err() == nil {
		if !connected {
			if err := r.sub.Dial(r.cfg.Upstream); err != nil {
				r.log.Debug("relay dial failed", "upstream", r.cfg.Upstream, "err", err)
				if !pause() {
					return
				}
				continue
			}
			connected = true
			r.redials.Add(1)
		}
		msg, err := r.sub.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			r.log.Debug("relay upstream went away", "err", err)
			connected = false
			if !pause() {
				return
			}
			continue
		}
		r.received.Add(1)
		var seq uint64
		if len(msg.Frames) >= 2 && len(msg.Frames[1]) == 8 {
			seq = binary.BigEndian.Uint64(msg.Frames[1])
		}
		act := Forward
		if f := r.fault.Load(); f != nil {
			act = (*f)(seq, n)
		}
		n++
		switch act {
		case Drop:
			r.dropped.Add(1)
			continue
		case Swap:
			if held == nil {
				r.swapped.Add(1)
				m := msg.Clone()
				held = &m
				continue
			}
		case Garble:
			r.garbled.Add(1)
			m := msg.Clone()
			last := m.Frames[len(m.Frames)-1]
			for i := range last {
				last[i] = byte(rand.Uint32())
			}
			msg = m
		}
		r.send(msg)
		if act == Duplicate {
			r.duplicated.Add(1)
			r.send(msg)
		}
		if held != nil {
			r.send(*held)
			held = nil
		}
	}
}

func (r *Relay) send(m zmq4.Msg) {
	if err := r.pub.Send(m); err != nil {
		r.log.Debug("relay send failed", "err", err)
		return
	}
	r.forwarded.Add(1)
}
