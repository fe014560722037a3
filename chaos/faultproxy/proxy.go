package faultproxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Direction names one way of a link.
type Direction uint8

const (
	// Up is client to target.
	Up Direction = iota
	// Down is target to client.
	Down
	numDirections
)

// Both is a convenience for faults set on both directions.
var Both = []Direction{Up, Down}

func (d Direction) String() string {
	switch d {
	case Up:
		return "up"
	case Down:
		return "down"
	}
	return fmt.Sprintf("Direction(%d)", uint8(d))
}

// Config configures a Proxy.
type Config struct {
	// Name labels the proxy in logs ("gw0->engine1/http").
	Name string
	// Listen is the address to accept on. Default "127.0.0.1:0": a free
	// loopback port, see Addr.
	Listen string
	// Target is the host:port every connection is forwarded to. Required.
	Target string
	// DialTimeout bounds the dial to Target. Default 2s: loopback targets
	// answer in microseconds; a target that is down refuses at once.
	DialTimeout time.Duration
	// ChunkBytes is the read buffer per direction and connection. Default
	// 32 KiB.
	ChunkBytes int
	// QueueChunks bounds the chunks held in a direction's delay line before
	// the reader waits (back-pressure). Default 256.
	QueueChunks int
	// Logger receives connection logs at debug level; nil discards.
	Logger *slog.Logger
}

// DefaultConfig returns the defaults documented on Config; Target must
// still be set.
func DefaultConfig() Config {
	return Config{Listen: "127.0.0.1:0", DialTimeout: 2 * time.Second, ChunkBytes: 32 << 10, QueueChunks: 256}
}

// Validate reports the first invalid field, wrapping ErrInvalidConfig.
func (c Config) Validate() error {
	switch {
	case c.Listen == "":
		return fmt.Errorf("%w: empty listen address", ErrInvalidConfig)
	case c.Target == "":
		return fmt.Errorf("%w: empty target", ErrInvalidConfig)
	case c.DialTimeout <= 0:
		return fmt.Errorf("%w: dial timeout %v", ErrInvalidConfig, c.DialTimeout)
	case c.ChunkBytes <= 0:
		return fmt.Errorf("%w: chunk bytes %d", ErrInvalidConfig, c.ChunkBytes)
	case c.QueueChunks <= 0:
		return fmt.Errorf("%w: queue chunks %d", ErrInvalidConfig, c.QueueChunks)
	}
	return nil
}

// Stats are the proxy's counters since Start.
type Stats struct {
	Accepted  uint64 // connections accepted
	DialFails uint64 // connections whose dial to the target failed
	Cut       uint64 // connections closed by Cut
	HalfOpen  uint64 // connections made half-open by HalfOpen
	Active    int    // connections open now
	// Forwarded and Dropped count bytes per direction.
	Forwarded [numDirections]uint64
	Dropped   [numDirections]uint64
}

// Proxy is one faulty TCP link. Create with New, Start, then switch faults
// at any time from any goroutine; Close when done.
type Proxy struct {
	cfg Config
	log *slog.Logger
	// target is where new connections are dialled: cfg.Target until
	// SetTarget.
	target atomic.Pointer[string]

	delay   [numDirections]atomic.Int64 // nanoseconds
	jitter  [numDirections]atomic.Int64 // nanoseconds
	rate    [numDirections]atomic.Int64 // bytes per second, 0 unlimited
	drop    [numDirections]atomic.Bool
	mu      sync.Mutex
	ln      net.Listener // nil while refusing
	hold    *portHold    // while refusing: the port, bound but not listening
	addr    string       // the bound address, kept across refusals
	refuse  bool
	conns   map[*link]struct{}
	holdCh  chan struct{} // non-nil while held; closed on release
	closed  bool
	started bool

	done chan struct{}
	wg   sync.WaitGroup

	accepted, dialFails, cut, halfOpened atomic.Uint64
	forwarded, dropped                   [numDirections]atomic.Uint64
}

// New validates cfg; nothing listens before Start.
func New(cfg Config) (*Proxy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p := &Proxy{cfg: cfg, log: log.With("proxy", cfg.Name), conns: make(map[*link]struct{}), done: make(chan struct{})}
	p.target.Store(&cfg.Target)
	return p, nil
}

// Start listens and starts accepting. It returns once the listener is open.
// A second Start is a no-op; Start after Close returns ErrClosed.
func (p *Proxy) Start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return ErrClosed
	}
	if p.started {
		return nil
	}
	ln, err := net.Listen("tcp", p.cfg.Listen)
	if err != nil {
		return fmt.Errorf("faultproxy: %s: listen: %w", p.cfg.Name, err)
	}
	p.ln, p.addr, p.started = ln, ln.Addr().String(), true
	p.wg.Add(1)
	go p.acceptLoop(ln)
	return nil
}

// Addr is the listening host:port ("" before Start); it stays the same
// while the proxy refuses.
func (p *Proxy) Addr() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.addr
}

// Target is the forwarded-to address.
func (p *Proxy) Target() string { return *p.target.Load() }

// SetTarget forwards the connections accepted from now on to addr
// (host:port); open ones keep their upstream. It stands for an address
// that outlives what serves it, as a Service in front of a restarted pod.
func (p *Proxy) SetTarget(addr string) { p.target.Store(&addr) }

// SetDelay sets the latency added to each chunk in the given directions;
// 0 removes it. It applies to chunks read from now on.
func (p *Proxy) SetDelay(d time.Duration, dirs ...Direction) {
	for _, dir := range dirs {
		p.delay[dir].Store(int64(d))
	}
}

// SetJitter adds to each chunk's delay a uniformly random extra in [0, d)
// in the given directions; 0 removes it. Chunks keep their order (a chunk
// due earlier than the one before it waits for that one), as on one TCP
// connection.
func (p *Proxy) SetJitter(d time.Duration, dirs ...Direction) {
	for _, dir := range dirs {
		p.jitter[dir].Store(int64(d))
	}
}

// SetBandwidth limits each connection's throughput in the given directions
// to bytesPerSec (0 removes the limit): chunks are written in slices paced
// at that rate, each connection on its own.
func (p *Proxy) SetBandwidth(bytesPerSec int64, dirs ...Direction) {
	for _, dir := range dirs {
		p.rate[dir].Store(max(0, bytesPerSec))
	}
}

// HalfOpen turns every connection open now into a half-open one and
// returns how many: the proxy closes its connection to the target (the
// target sees the peer go away) but keeps the client's open, swallowing
// what the client sends and sending nothing back, as a peer that vanished
// without a FIN (a crashed host, an expired NAT entry) looks to the client.
// The client notices only by its own timeouts. Cut or Close ends them.
func (p *Proxy) HalfOpen() int {
	p.mu.Lock()
	ls := make([]*link, 0, len(p.conns))
	for l := range p.conns {
		ls = append(ls, l)
	}
	p.mu.Unlock()
	for _, l := range ls {
		l.halfOpen()
	}
	p.halfOpened.Add(uint64(len(ls)))
	return len(ls)
}

// SetDrop turns the blackhole on or off in the given directions.
func (p *Proxy) SetDrop(on bool, dirs ...Direction) {
	for _, dir := range dirs {
		p.drop[dir].Store(on)
	}
}

// SetRefuse makes the target look down (on): the listener closes, so new
// connections are refused by the kernel, as by a host with nothing on the
// port; existing connections are untouched (Cut them too for a crash).
// While refusing, the port stays bound without a listener (on Linux), so
// that nothing else on the machine takes it. Off listens on the same
// address again. It returns an error only if that address cannot be bound
// again.
func (p *Proxy) SetRefuse(on bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.started || p.closed || p.refuse == on {
		p.refuse = on
		return nil
	}
	p.refuse = on
	if on {
		err := p.ln.Close()
		p.ln = nil
		if errors.Is(err, net.ErrClosed) {
			err = nil
		}
		if h, herr := holdPort(p.addr); herr == nil {
			p.hold = h
		} else {
			// Listening again binds afresh, as on other platforms.
			p.log.Debug("faultproxy: cannot hold the port while refusing", "addr", p.addr, "err", herr)
		}
		return err
	}
	var ln net.Listener
	var err error
	if p.hold != nil {
		ln, err = p.hold.listen()
		p.hold = nil
	} else {
		ln, err = net.Listen("tcp", p.addr)
	}
	if err != nil {
		return fmt.Errorf("faultproxy: %s: listen again on %s: %w", p.cfg.Name, p.addr, err)
	}
	p.ln = ln
	p.wg.Add(1)
	go p.acceptLoop(ln)
	return nil
}

// Hold makes new connections wait without being forwarded or closed until
// Release (or Close).
func (p *Proxy) Hold() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.holdCh == nil {
		p.holdCh = make(chan struct{})
	}
}

// Release lets held and new connections through.
func (p *Proxy) Release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.holdCh != nil {
		close(p.holdCh)
		p.holdCh = nil
	}
}

// Cut closes every connection open now and returns how many it closed.
func (p *Proxy) Cut() int {
	p.mu.Lock()
	ls := make([]*link, 0, len(p.conns))
	for l := range p.conns {
		ls = append(ls, l)
	}
	p.mu.Unlock()
	for _, l := range ls {
		l.close()
	}
	p.cut.Add(uint64(len(ls)))
	return len(ls)
}

// Heal removes every fault: no delay, jitter, bandwidth limit or drop, no
// refusal, no hold. Half-open connections stay as they are (Cut them).
func (p *Proxy) Heal() error {
	p.SetDelay(0, Both...)
	p.SetJitter(0, Both...)
	p.SetBandwidth(0, Both...)
	p.SetDrop(false, Both...)
	p.Release()
	return p.SetRefuse(false)
}

// Stats returns the counters.
func (p *Proxy) Stats() Stats {
	p.mu.Lock()
	active := len(p.conns)
	p.mu.Unlock()
	s := Stats{Accepted: p.accepted.Load(), DialFails: p.dialFails.Load(), Cut: p.cut.Load(), HalfOpen: p.halfOpened.Load(), Active: active}
	for d := range numDirections {
		s.Forwarded[d] = p.forwarded[d].Load()
		s.Dropped[d] = p.dropped[d].Load()
	}
	return s
}

// Close stops accepting, closes every connection and waits for all the
// proxy's goroutines. Idempotent.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	close(p.done)
	ln := p.ln
	p.ln = nil
	if p.hold != nil {
		_ = p.hold.release()
		p.hold = nil
	}
	if p.holdCh != nil {
		close(p.holdCh)
		p.holdCh = nil
	}
	p.mu.Unlock()
	var err error
	if ln != nil {
		err = ln.Close()
	}
	p.Cut()
	p.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

func (p *Proxy) acceptLoop(ln net.Listener) {
	defer p.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			return // closed
		}
		p.accepted.Add(1)
		l := newLink(c)
		if !p.track(l) {
			_ = c.Close()
			return
		}
		p.wg.Add(1)
		go p.serve(l)
	}
}

// track registers l; false once the proxy is closing.
func (p *Proxy) track(l *link) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.conns[l] = struct{}{}
	return true
}

func (p *Proxy) untrack(l *link) {
	p.mu.Lock()
	delete(p.conns, l)
	p.mu.Unlock()
}

func (p *Proxy) holdChan() chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.holdCh
}

// serve dials the target and pumps both directions until either side ends.
func (p *Proxy) serve(l *link) {
	defer p.wg.Done()
	defer p.untrack(l)
	defer l.close()
	if h := p.holdChan(); h != nil {
		select {
		case <-h:
		case <-l.closed:
			return
		case <-p.done:
			return
		}
	}
	ctx, cancel := context.WithTimeout(l.ctx, p.cfg.DialTimeout)
	var d net.Dialer
	target := p.Target()
	up, err := d.DialContext(ctx, "tcp", target)
	cancel()
	if err != nil {
		p.dialFails.Add(1)
		p.log.Debug("dial failed", "target", target, "err", err)
		return
	}
	if !l.setUpstream(up) {
		_ = up.Close()
		return
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); p.pump(l, Up, l.client, up) }()
	go func() { defer wg.Done(); p.pump(l, Down, up, l.client) }()
	wg.Wait()
}

type chunk struct {
	b   []byte
	due time.Time
}

// pump copies src to dst through the direction's faults. A reader goroutine
// fills a bounded delay line; this goroutine writes each chunk when due.
// Either side failing closes the whole link (a TCP proxy cannot half-close
// portably without losing the fault semantics).
func (p *Proxy) pump(l *link, dir Direction, src, dst net.Conn) {
	q := make(chan chunk, p.cfg.QueueChunks)
	var rwg sync.WaitGroup
	rwg.Add(1)
	go func() {
		defer rwg.Done()
		defer close(q)
		for {
			buf := make([]byte, p.cfg.ChunkBytes)
			n, err := src.Read(buf)
			if n > 0 {
				if p.drop[dir].Load() {
					p.dropped[dir].Add(uint64(n))
				} else {
					c := chunk{b: buf[:n]}
					d := time.Duration(p.delay[dir].Load())
					if j := p.jitter[dir].Load(); j > 0 {
						d += time.Duration(rand.Int64N(j))
					}
					if d > 0 {
						c.due = time.Now().Add(d)
					}
					select {
					case q <- c:
					case <-l.closed:
						return
					}
				}
			}
			if err != nil {
				return
			}
		}
	}()
	defer func() {
		// A half-open link's target side ended: keep the client's side
		// (the Up pump swallows what it sends until it or Cut closes it).
		if dir != Down || !l.half.Load() {
			l.close() // unblocks the reader's Read
		}
		rwg.Wait()
	}()
	var paced time.Time // when the bandwidth limit lets the next byte out
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for c := range q {
		if wait := time.Until(c.due); !c.due.IsZero() && wait > 0 {
			timer.Reset(wait)
			select {
			case <-timer.C:
			case <-l.closed:
				return
			}
		}
		if p.drop[dir].Load() { // dropped while queued
			p.dropped[dir].Add(uint64(len(c.b)))
			continue
		}
		if l.half.Load() {
			p.dropped[dir].Add(uint64(len(c.b)))
			continue
		}
		if !p.write(l, dir, dst, c.b, &paced, timer) {
			if l.half.Load() {
				p.dropped[dir].Add(uint64(len(c.b)))
				continue
			}
			return
		}
	}
}

// write writes b to dst, in slices paced at the direction's bandwidth limit
// if one is set; false if the write failed or the link closed meanwhile.
func (p *Proxy) write(l *link, dir Direction, dst net.Conn, b []byte, paced *time.Time, timer *time.Timer) bool {
	for len(b) > 0 {
		rate := p.rate[dir].Load()
		n := len(b)
		if rate > 0 {
			// Slices of about 10 ms at the rate keep the pace smooth.
			n = min(n, int(max(1, rate/100)))
			now := time.Now()
			if paced.Before(now) {
				*paced = now
			}
			if wait := paced.Sub(now); wait > 0 {
				timer.Reset(wait)
				select {
				case <-timer.C:
				case <-l.closed:
					return false
				}
			}
			*paced = paced.Add(time.Duration(int64(n) * int64(time.Second) / rate))
		}
		if _, err := dst.Write(b[:n]); err != nil {
			return false
		}
		p.forwarded[dir].Add(uint64(n))
		b = b[n:]
	}
	return true
}

// link is one proxied connection.
type link struct {
	client net.Conn
	ctx    context.Context // done once the link is closed
	cancel context.CancelFunc
	closed <-chan struct{}
	mu     sync.Mutex
	up     net.Conn
	once   sync.Once
	half   atomic.Bool // target side closed by HalfOpen, client side kept
}

func newLink(c net.Conn) *link {
	ctx, cancel := context.WithCancel(context.Background())
	return &link{client: c, ctx: ctx, cancel: cancel, closed: ctx.Done()}
}

// setUpstream records the target connection; false if already closed.
func (l *link) setUpstream(c net.Conn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	select {
	case <-l.closed:
		return false
	default:
	}
	l.up = c
	return true
}

// halfOpen closes the target side only (see Proxy.HalfOpen).
func (l *link) halfOpen() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.half.Store(true)
	if l.up != nil {
		_ = l.up.Close()
	}
}

func (l *link) close() {
	l.once.Do(func() {
		l.mu.Lock()
		l.cancel()
		up := l.up
		l.mu.Unlock()
		_ = l.client.Close()
		if up != nil {
			_ = up.Close()
		}
	})
}
