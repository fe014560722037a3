package sim

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// reqEvent is what the driver hands a request's HTTP handler: one output
// token, or the request's completion.
type reqEvent struct {
	out Output
	fin *Finished
}

type pending struct {
	ch chan reqEvent // capacity MaxTokens+1: the driver never blocks
	// last is the model time of the request's previous output token.
	last time.Time
}

// arrival is a submitted request the driver has not handed to the engine
// yet: it joins the first step that starts at or after at (model time).
type arrival struct {
	req Request
	at  time.Time
}

// driverLag accumulates how late the driver released step outputs against
// the model schedule (wall time); guarded by Server.mu.
type driverLag struct {
	steps          uint64
	last, max, sum time.Duration
}

// Server is one simulated vLLM replica: engine, real-time driver, HTTP API,
// metrics and KV-event publisher. Create with NewServer, then Start; call
// Shutdown once done (it is idempotent). Methods are safe for concurrent use.
type Server struct {
	cfg     Config
	log     *slog.Logger
	tok     tokenizer.Tokenizer
	hf      *tokenizer.HF // tok when it is an hf:<dir> tokenizer, else nil
	metrics *metrics

	mu      sync.Mutex // guards eng, pending, inbox, lag, shown, unshown, pub publishing order
	eng     *Engine
	pending map[RequestID]*pending
	inbox   []arrival // in arrival order (model time never goes back)
	lag     driverLag
	// shown are the gauges as of the last step that ended: vLLM takes
	// them from the scheduler when a step ends (Scheduler.make_stats),
	// so while a step runs a scrape reads the one before. unshown counts
	// the requests handed to the engine for the step running, which they
	// do not show yet.
	shown   Gauges
	unshown int
	nextID  uint64
	pub     EventPublisher
	zmq     *kvevents.Publisher // the publisher Start built, if any
	// lastSeq is the sequence number of the last batch published (valid
	// when published); guarded by mu.
	lastSeq   kvevents.Seq
	published bool

	epoch time.Time // wall time at model time epoch
	wake  chan struct{}
	// responses is the Responses API store (endpoints.go), in process as
	// vLLM's default store.
	responses responseStore
	// afterWake, if set (tests only), runs in the driver goroutine each
	// time it wakes from a wait: it stands for a late wake-up.
	afterWake func()
	// hold, when set, stalls long streaming answers (HoldStreams).
	hold     atomic.Pointer[streamHold]
	stop     chan struct{}
	driverWG sync.WaitGroup
	httpSrv  *http.Server
	ln       net.Listener
	serveErr chan error
	// newConns tracks connections that have not sent a request yet:
	// net/http's Shutdown waits up to 5 s for those, so Shutdown closes
	// them (and any that arrive once closing is set).
	connMu    sync.Mutex
	newConns  map[net.Conn]struct{}
	closing   bool
	startOnce sync.Once
	started   bool
	shutOnce  sync.Once
	stopOnce  sync.Once
	shutErr   error
}

// streamHold is one HoldStreams: streaming answers of at least min
// tokens wait on release after their first content chunk.
type streamHold struct {
	min     int
	release chan struct{}
}

// HoldStreams stalls every streaming answer of at least minTokens tokens
// (max_tokens as granted) after its first content chunk, until release is
// called: the answer's connection stays open and silent, as an engine's
// does while a step stalls. The engine keeps generating meanwhile (its
// tokens wait for the answer; none is lost), and answers shorter than
// minTokens are not held. A test holds the streams it started so that
// they are certainly in flight at a gateway for as long as it needs (a
// replica's removal, say), however slowly the rest of the test runs.
// release is idempotent; a later HoldStreams replaces this one (its
// streams stay held until its own release).
func (s *Server) HoldStreams(minTokens int) (release func()) {
	h := &streamHold{min: minTokens, release: make(chan struct{})}
	s.hold.Store(h)
	return sync.OnceFunc(func() {
		s.hold.CompareAndSwap(h, nil)
		close(h.release)
	})
}

// held waits while a HoldStreams holds an answer of mt tokens whose
// content chunk index is about to be sent; it reports false when ctx
// ended first.
func (s *Server) held(ctx context.Context, mt, index int) bool {
	h := s.hold.Load()
	if h == nil || index < 1 || mt < h.min {
		return true
	}
	select {
	case <-h.release:
		return true
	case <-ctx.Done():
		return false
	}
}

// NewServer validates cfg and builds a Server; nothing runs until Start.
func NewServer(cfg Config) (*Server, error) {
	if cfg.HashSeed == 0 {
		var b [8]byte
		_, _ = rand.Read(b[:])
		cfg.HashSeed = binary.LittleEndian.Uint64(b[:]) | 1
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	tok, err := newTokenizer(cfg.Tokenizer)
	if err != nil {
		return nil, err
	}
	eng, err := NewEngine(cfg.engineConfig())
	if err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	s := &Server{
		cfg:      cfg,
		log:      log.With("component", "vllmsim", "model", cfg.ServedModelName),
		tok:      tok,
		hf:       asHF(tok),
		eng:      eng,
		pending:  make(map[RequestID]*pending),
		pub:      cfg.Publisher,
		wake:     make(chan struct{}, 1),
		stop:     make(chan struct{}),
		serveErr: make(chan error, 1),
	}
	engine := -1
	if cfg.DataParallelSize > 1 {
		engine = cfg.DataParallelRank
	}
	s.metrics = newMetrics(cfg.ServedModelName, engine, s.Stats)
	return s, nil
}

// Start opens the listener and the publisher and starts the driver and the
// HTTP server. It returns once the server accepts connections. ctx only
// bounds startup.
func (s *Server) Start(ctx context.Context) error {
	err := fmt.Errorf("%w: Start called twice", ErrInvalidConfig)
	s.startOnce.Do(func() { err = s.start(ctx) })
	return err
}

func (s *Server) start(ctx context.Context) error {
	if s.cfg.zmqEvents() {
		pcfg, err := s.cfg.KVEvents.publisherConfig()
		if err != nil {
			return err
		}
		pub, err := kvevents.NewPublisher(pcfg, s.log)
		if err != nil {
			return fmt.Errorf("sim: start kv events publisher: %w", err)
		}
		s.pub, s.zmq = pub, pub
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", s.cfg.listenAddr())
	if err != nil {
		if s.pub != nil {
			_ = s.pub.Close()
		}
		return fmt.Errorf("sim: listen: %w", err)
	}
	s.ln = ln
	s.httpSrv = &http.Server{Handler: s.Handler(), ReadHeaderTimeout: 10 * time.Second, ConnState: s.trackConn}
	s.startDriver()
	s.driverWG.Add(1)
	go func() {
		defer s.driverWG.Done()
		if err := s.httpSrv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.serveErr <- err
		}
	}()
	s.log.Info("vllmsim started", "addr", ln.Addr().String(), "profile", s.cfg.Profile.Name, "speed", s.cfg.Speed,
		"block_size", s.cfg.BlockSize, "num_gpu_blocks", s.cfg.NumGPUBlocks, "max_num_seqs", s.cfg.MaxNumSeqs,
		"hybrid_sliding_window", s.cfg.HybridSlidingWindow, "kv_offload_blocks", s.cfg.KVOffloadBlocks)
	return nil
}

// startDriver anchors model time at wall now and starts the driver.
func (s *Server) startDriver() {
	s.epoch = time.Now()
	s.mu.Lock()
	s.started = true
	s.mu.Unlock()
	s.driverWG.Add(1)
	go func() {
		defer s.driverWG.Done()
		s.drive()
	}()
}

// Addr is the HTTP listen address ("" before Start).
func (s *Server) Addr() string {
	if s.ln == nil {
		return ""
	}
	return s.ln.Addr().String()
}

// KVEventsAddr is the bound PUB address of the ZMQ publisher Start built
// (e.g. tcp://127.0.0.1:41234), or "" when it connects or there is none.
func (s *Server) KVEventsAddr() string {
	if s.zmq == nil {
		return ""
	}
	return s.zmq.Addr()
}

// KVReplayAddr is the bound replay ROUTER address, or "".
func (s *Server) KVReplayAddr() string {
	if s.zmq == nil {
		return ""
	}
	return s.zmq.ReplayAddr()
}

// URL is "http://" + Addr().
func (s *Server) URL() string { return "http://" + s.Addr() }

// Shutdown stops accepting requests, waits for in-flight HTTP handlers until
// ctx ends (then closes their connections), stops the driver and closes the
// publisher. It is idempotent; later calls return the first result.
func (s *Server) Shutdown(ctx context.Context) error {
	s.shutOnce.Do(func() {
		var errs []error
		if s.httpSrv != nil {
			// Handlers waiting on the engine end when the driver stops, so
			// stop the driver if the grace period runs out.
			done := make(chan struct{})
			go func() {
				select {
				case <-ctx.Done():
					s.stopDriver()
				case <-done:
				}
			}()
			s.closeNewConns()
			if err := s.httpSrv.Shutdown(ctx); err != nil {
				errs = append(errs, err)
				_ = s.httpSrv.Close()
			}
			close(done)
		}
		s.stopDriver()
		s.driverWG.Wait()
		s.mu.Lock()
		if s.pub != nil {
			// zmq4 reports closing a peer connection that the peer already
			// closed as net.ErrClosed: nothing is lost, so not an error.
			if err := s.pub.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
				errs = append(errs, err)
			}
		}
		s.mu.Unlock()
		select {
		case err := <-s.serveErr:
			errs = append(errs, err)
		default:
		}
		s.shutErr = errors.Join(errs...)
	})
	return s.shutErr
}

func (s *Server) trackConn(c net.Conn, st http.ConnState) {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	if st != http.StateNew {
		delete(s.newConns, c)
		return
	}
	if s.closing {
		_ = c.Close()
		return
	}
	if s.newConns == nil {
		s.newConns = make(map[net.Conn]struct{})
	}
	s.newConns[c] = struct{}{}
}

// closeNewConns closes connections that have not sent a request, so that a
// client's spare pooled connections do not hold up Shutdown.
func (s *Server) closeNewConns() {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	s.closing = true
	for c := range s.newConns {
		_ = c.Close()
	}
	clear(s.newConns)
}

func (s *Server) stopDriver() { s.stopOnce.Do(func() { close(s.stop) }) }

// modelNow maps wall time to model time: Speed model seconds per wall
// second from the epoch. Only arrivals read it: the engine's own clock
// advances by modelled step durations (see drive).
func (s *Server) modelNow() time.Time {
	el := time.Since(s.epoch)
	return s.epoch.Add(time.Duration(float64(el) * s.cfg.Speed))
}

// wallTime maps a model time back to wall time.
func (s *Server) wallTime(model time.Time) time.Time {
	return s.epoch.Add(time.Duration(float64(model.Sub(s.epoch)) / s.cfg.Speed))
}

// drive runs engine steps in real time until stop.
//
// The engine has its own model clock: while it has work, each step starts
// at the previous step's model end, back to back, and an idle engine
// restarts at the model time of the arrival that woke it, never at the
// moment the goroutine happened to wake. A request joins the first step
// that starts at or after its arrival. After computing a step the driver
// sleeps until the wall time its model end is due and then releases its
// outputs; if it is already late (the host did not schedule it in time) it
// releases them at once and computes the next step without sleeping, so it
// catches up instead of stretching model time. How late each release was
// is recorded (Stats.DriverLag*, kvmesh_sim_driver_lag_seconds).
func (s *Server) drive() {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	clock := s.epoch // model time from which the engine is free
	for {
		s.mu.Lock()
		s.unshown = s.admitLocked(clock)
		res := s.eng.Step(clock)
		s.publishLocked(res.Events)
		next := s.eng.Gauges() // shown when the step ends
		if res.Idle() {
			s.shown, s.unshown = next, 0
		}
		if res.Idle() && len(s.inbox) > 0 {
			// Idle until the next arrival: jump to it (admitLocked left
			// only arrivals after clock).
			clock = s.inbox[0].at
			s.mu.Unlock()
			continue
		}
		s.mu.Unlock()
		if res.Idle() {
			select {
			case <-s.wake:
				s.woke()
				continue
			case <-s.stop:
				s.failPending()
				return
			}
		}
		clock = res.End()
		due := s.wallTime(clock)
		if d := time.Until(due); d > 0 {
			timer.Reset(d)
			select {
			case <-timer.C:
				s.woke()
			case <-s.stop:
				timer.Stop()
				s.failPending()
				return
			}
		} else {
			select {
			case <-s.stop:
				s.failPending()
				return
			default:
			}
		}
		s.deliver(res, next, max(time.Since(due), 0))
	}
}

func (s *Server) woke() {
	if s.afterWake != nil {
		s.afterWake()
	}
}

// admitLocked hands the engine every submitted request that has arrived by
// model time now and returns how many.
func (s *Server) admitLocked(now time.Time) int {
	n, added := 0, 0
	for ; n < len(s.inbox) && !s.inbox[n].at.After(now); n++ {
		a := s.inbox[n]
		if err := s.eng.Add(a.req, a.at); err != nil {
			// Cannot happen: submit checked the request and IDs are unique.
			s.log.Error("vllmsim: engine refused a checked request", "err", err)
			if p := s.pending[a.req.ID]; p != nil {
				close(p.ch)
				delete(s.pending, a.req.ID)
			}
			continue
		}
		added++
	}
	if n > 0 {
		s.inbox = append(s.inbox[:0], s.inbox[n:]...)
	}
	return added
}

// deliver shows a finished step's gauges and hands its outputs to the
// waiting handlers; lag is how late (wall time) that is against the
// step's model end.
func (s *Server) deliver(res StepResult, gauges Gauges, lag time.Duration) {
	s.metrics.driverLag.Observe(lag.Seconds())
	for _, o := range res.Outputs {
		if o.Index == 0 {
			s.metrics.ttft.Observe(o.TTFT.Seconds())
		}
	}
	s.metrics.genTokens.Add(float64(len(res.Outputs)))
	for _, f := range res.Finished {
		s.metrics.success.WithLabelValues(string(f.Reason)).Inc()
		s.metrics.e2e.Observe(f.E2E.Seconds())
		s.metrics.prompt.Add(float64(f.PromptTokens))
	}
	end := res.End()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.shown, s.unshown = gauges, 0
	s.lag.steps++
	s.lag.last = lag
	s.lag.sum += lag
	s.lag.max = max(s.lag.max, lag)
	for _, o := range res.Outputs {
		if p := s.pending[o.ID]; p != nil {
			if o.Index > 0 {
				s.metrics.tpot.Observe(end.Sub(p.last).Seconds())
			}
			p.last = end
			s.send(p, reqEvent{out: o})
		}
	}
	for i := range res.Finished {
		f := res.Finished[i] // a copy: the engine reuses res.Finished next step
		if p := s.pending[f.ID]; p != nil {
			s.send(p, reqEvent{fin: &f})
			delete(s.pending, f.ID)
		}
	}
}

func (s *Server) send(p *pending, ev reqEvent) {
	select {
	case p.ch <- ev:
	default:
		// Cannot happen: capacity is MaxTokens+1. Never block the driver.
		s.log.Error("vllmsim: request channel full, dropping event")
	}
}

// failPending closes every waiting handler's channel on stop.
func (s *Server) failPending() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, p := range s.pending {
		close(p.ch)
		delete(s.pending, id)
	}
}

// publishLocked publishes evs as one batch; s.mu is held so batches leave
// in engine order.
func (s *Server) publishLocked(evs []kvevents.Event) {
	if len(evs) == 0 || s.pub == nil {
		return
	}
	b := kvevents.Batch{TS: float64(time.Now().UnixNano()) / 1e9, Events: evs}
	if s.cfg.DataParallelSize > 1 {
		rank := int64(s.cfg.DataParallelRank)
		b.DataParallelRank = &rank
	}
	seq, err := s.pub.Publish(b)
	if err != nil {
		s.metrics.pubErrors.Inc()
		s.log.Warn("vllmsim: publish kv events", "err", err)
		return
	}
	s.lastSeq, s.published = seq, true
	s.metrics.published.Inc()
}

// KVPublished returns the sequence number of the last KV event batch the
// server published, ok false before the first: what a subscriber that
// missed nothing has applied once it is idle.
func (s *Server) KVPublished() (seq kvevents.Seq, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastSeq, s.published
}

// submit adds a request to the engine; the returned channel yields its
// outputs then its Finished, or is closed if the server stops.
func (s *Server) submit(prefix string, prompt []uint32, maxTokens int) (RequestID, <-chan reqEvent, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.stop:
		return "", nil, ErrClosed
	default:
	}
	if !s.started {
		return "", nil, ErrClosed
	}
	if err := s.eng.Check(len(prompt), maxTokens); err != nil {
		return "", nil, err
	}
	s.nextID++
	id := RequestID(fmt.Sprintf("%s-%016x", prefix, s.nextID))
	s.inbox = append(s.inbox, arrival{req: Request{ID: id, Prompt: prompt, MaxTokens: maxTokens}, at: s.modelNow()})
	p := &pending{ch: make(chan reqEvent, maxTokens+1)}
	s.pending[id] = p
	select {
	case s.wake <- struct{}{}:
	default:
	}
	return id, p.ch, nil
}

// abort drops a request whose client went away, freeing its blocks.
func (s *Server) abort(id RequestID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.pending[id]; !ok {
		return
	}
	delete(s.pending, id)
	for i, a := range s.inbox {
		if a.req.ID == id {
			s.inbox = append(s.inbox[:i], s.inbox[i+1:]...)
			s.metrics.aborted.Inc()
			return
		}
	}
	if s.eng.Abort(id) {
		s.metrics.aborted.Inc()
	}
}

// Stats returns the engine's counters, its gauges as of the last step
// that ended (as vLLM's: a running step's requests show once it ends) and
// the driver's lag. Queued includes the requests the gauges do not show
// yet: submitted and not yet handed to the engine, or handed to it for
// the step running.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.eng.Stats()
	st.Running, st.Waiting, st.KVUsage = s.shown.Running, s.shown.Waiting, s.shown.KVUsage
	st.Queued += len(s.inbox) + s.unshown
	st.DriverSteps = s.lag.steps
	st.DriverLag, st.DriverLagMax, st.DriverLagSum = s.lag.last, s.lag.max, s.lag.sum
	return st
}

// CachedBlocks returns the blocks the engine can currently reuse (hash,
// parent, token chain): the truth a KV-event consumer's index should match
// once it has caught up.
func (s *Server) CachedBlocks() []CachedBlock {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.eng.CachedBlocks()
}

// WindowCachedBlocks returns the blocks a hybrid engine's sliding-window
// group can reuse (nil without one).
func (s *Server) WindowCachedBlocks() []CachedBlock {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.eng.WindowCachedBlocks()
}

// OffloadedBlocks returns the blocks the engine's CPU offload tier holds
// (nil without one).
func (s *Server) OffloadedBlocks() []CachedBlock {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.eng.OffloadedBlocks()
}

// PrefixHit is Engine.PrefixHit under the server's lock: the blocks a new
// request with tokens would take from the GPU cache (by vLLM's rule for
// the engine's groups) and load from the offload tier, right now.
func (s *Server) PrefixHit(tokens []uint32) (gpu, offloaded int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.eng.PrefixHit(tokens)
}

// HashTokens returns the engine hashes of the full blocks of tokens.
func (s *Server) HashTokens(tokens []uint32) []kvevents.EngineHash {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.eng.HashTokens(tokens)
}

// ResetPrefixCache clears the engine's cached blocks and publishes
// AllBlocksCleared. It refuses (false) while requests hold blocks.
func (s *Server) ResetPrefixCache() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	ok, evs := s.eng.ResetPrefixCache()
	s.publishLocked(evs)
	return ok
}

// Tokenize encodes text with the server's tokenizer.
func (s *Server) Tokenize(text string) []uint32 { return s.tok.Encode(nil, text) }

// Config returns the server's configuration (with the chosen hash seed).
func (s *Server) Config() Config { return s.cfg }
