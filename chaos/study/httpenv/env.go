// Package httpenv implements study.Engine over HTTP: requests go to gateways
// (with the routing-strategy header) or straight to engines through the
// study's streaming client; engine gauges and counters come from the
// engines' Prometheus /metrics (vLLM's names), selection counts from the
// gateways' /metrics, and caches are reset with vLLM's dev endpoint POST
// /reset_prefix_cache. It works against anything that speaks those
// protocols: the in-process simulators and gateways of package live, or a
// real vLLM + kvmesh deployment.
//
// Model time is wall time multiplied by Config.Speed (the simulators' time
// compression); all outcomes and schedule times are model time.
//
// Env follows study.Engine's threading contract: callbacks run on the
// goroutine that calls Run; the goroutines it starts (one per request or
// sample, one per timer) are owned by Env and waited for when Run ends or
// aborts and on Close.
package httpenv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/chaos/study/client"
)

var (
	// ErrInvalidConfig is returned by Config.Validate.
	ErrInvalidConfig = errors.New("httpenv: invalid config")
	// ErrMetrics is returned for an unreadable /metrics page.
	ErrMetrics = errors.New("httpenv: bad metrics")
	// ErrReset is returned when an engine refuses to reset its cache.
	ErrReset = errors.New("httpenv: prefix cache reset failed")
	// ErrNotIdle is returned by WaitIdle when engines stay busy past the
	// deadline.
	ErrNotIdle = errors.New("httpenv: engines not idle")
	// ErrClosed is returned by control operations after Close.
	ErrClosed = errors.New("httpenv: closed")
)

// Metric names read from the engines and gateways.
const (
	MetricRunning   = "vllm:num_requests_running"
	MetricWaiting   = "vllm:num_requests_waiting"
	MetricQueries   = "vllm:prefix_cache_queries_total"
	MetricHits      = "vllm:prefix_cache_hits_total"
	MetricSuccess   = "vllm:request_success_total"
	MetricSelection = "kvmesh_route_decisions_total"
)

// Endpoint is one engine replica.
type Endpoint struct {
	// Name is the replica name, as the gateways' x-kvmesh-replica header
	// spells it.
	Name string
	// URL is the engine's base URL (http://host:port).
	URL string
}

// Config configures an Env.
type Config struct {
	// Engines are the replicas, in the study's order (A, B, ...).
	Engines []Endpoint
	// Gateways are the gateways' base URLs.
	Gateways []string
	// Model is the model name sent in every request.
	Model string
	// Speed is the engines' time compression: model time = wall × Speed.
	Speed float64
	// RequestTimeout bounds one request in model time. Default 300 s: ten
	// times the SLO's E2E bound, so only a stuck request hits it.
	RequestTimeout time.Duration
	// ControlTimeout bounds one scrape or reset in wall time. Default 5 s.
	ControlTimeout time.Duration
	// IdleTimeout bounds WaitIdle in wall time. Default 2 min.
	IdleTimeout time.Duration
	// IdlePoll is WaitIdle's polling period in wall time. Default 10 ms.
	IdlePoll time.Duration
	// SelectionLabels orders the gateway metric labels that make a
	// selection key ("prefix-cache/prefix_match"); labels not listed follow
	// in name order. Default ["strategy", "selection"].
	SelectionLabels []string
	// SelectionSkipLabels are gateway metric labels left out of selection
	// keys (e.g. the model name). Default ["model"].
	SelectionSkipLabels []string
}

// DefaultConfig returns the defaults for everything but the endpoints and
// the model.
func DefaultConfig() Config {
	return Config{
		Speed:               1,
		RequestTimeout:      300 * time.Second,
		ControlTimeout:      5 * time.Second,
		IdleTimeout:         2 * time.Minute,
		IdlePoll:            10 * time.Millisecond,
		SelectionLabels:     []string{"strategy", "selection"},
		SelectionSkipLabels: []string{"model"},
	}
}

// Validate reports the first problem with c.
func (c *Config) Validate() error {
	switch {
	case len(c.Engines) == 0:
		return fmt.Errorf("%w: no engines", ErrInvalidConfig)
	case len(c.Gateways) == 0:
		return fmt.Errorf("%w: no gateways", ErrInvalidConfig)
	case c.Model == "":
		return fmt.Errorf("%w: no model", ErrInvalidConfig)
	case !(c.Speed > 0):
		return fmt.Errorf("%w: speed must be > 0", ErrInvalidConfig)
	case c.RequestTimeout <= 0 || c.ControlTimeout <= 0 || c.IdleTimeout <= 0 || c.IdlePoll <= 0:
		return fmt.Errorf("%w: timeouts must be > 0", ErrInvalidConfig)
	}
	seen := map[string]bool{}
	for _, e := range c.Engines {
		if e.Name == "" || e.URL == "" {
			return fmt.Errorf("%w: engine needs a name and a URL", ErrInvalidConfig)
		}
		if seen[e.Name] {
			return fmt.Errorf("%w: duplicate engine name %q", ErrInvalidConfig, e.Name)
		}
		seen[e.Name] = true
	}
	return nil
}

// Env is a study.Engine over HTTP.
type Env struct {
	cfg    Config
	names  []string
	tr     *http.Transport
	hc     *http.Client
	client *client.Client
	epoch  time.Time

	posts   chan func()
	pending int
	abort   chan struct{}
	sendCtx context.Context
	cancel  context.CancelFunc
	timers  []*time.Timer
	wg      sync.WaitGroup

	closeOnce sync.Once
	closed    chan struct{}

	// salt is sent as cache_salt with every request ("" : none).
	salt string
}

var _ study.Engine = (*Env)(nil)

// New returns an Env for cfg.
func New(cfg Config) (*Env, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	tr := &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        1024,
		MaxIdleConnsPerHost: 256,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
	e := &Env{
		cfg:    cfg,
		tr:     tr,
		hc:     &http.Client{Transport: tr},
		epoch:  time.Now(),
		posts:  make(chan func(), 1024),
		closed: make(chan struct{}),
	}
	e.client = &client.Client{HTTP: e.hc, Model: cfg.Model}
	for _, en := range cfg.Engines {
		e.names = append(e.names, en.Name)
	}
	e.resetRun()
	return e, nil
}

func (e *Env) resetRun() {
	e.abort = make(chan struct{})
	e.sendCtx, e.cancel = context.WithCancel(context.Background())
	e.timers = e.timers[:0]
	e.pending = 0
}

// Replicas implements study.Engine.
func (e *Env) Replicas() []string { return e.names }

// Gateways implements study.Engine.
func (e *Env) Gateways() int { return len(e.cfg.Gateways) }

func (e *Env) model(wall time.Duration) time.Duration {
	return time.Duration(float64(wall) * e.cfg.Speed)
}

func (e *Env) wall(model time.Duration) time.Duration {
	return time.Duration(float64(model) / e.cfg.Speed)
}

// Now implements study.Engine.
func (e *Env) Now() time.Duration { return e.model(time.Since(e.epoch)) }

// post delivers fn to the loop unless the run was aborted.
func (e *Env) post(abort chan struct{}, fn func()) {
	select {
	case e.posts <- fn:
	case <-abort:
	}
}

// At implements study.Engine.
func (e *Env) At(t time.Duration, fn func()) {
	e.pending++
	e.wg.Add(1)
	abort := e.abort
	d := e.wall(t - e.Now())
	if d < 0 {
		d = 0
	}
	e.timers = append(e.timers, time.AfterFunc(d, func() {
		defer e.wg.Done()
		e.post(abort, fn)
	}))
}

// Send implements study.Engine.
func (e *Env) Send(req study.Request, done func(study.Outcome)) {
	e.pending++
	e.wg.Add(1)
	abort, ctx := e.abort, e.sendCtx
	creq := client.Request{Prompt: req.Prompt, MaxTokens: req.MaxTokens, Session: req.Session, CacheSalt: e.salt}
	if req.Target.Direct {
		en := e.cfg.Engines[req.Target.Replica]
		creq.URL = strings.TrimRight(en.URL, "/") + "/v1/completions"
		creq.Replica = en.Name
	} else {
		creq.URL = strings.TrimRight(e.cfg.Gateways[req.Target.Gateway], "/") + "/v1/completions"
		creq.Strategy = req.Target.Strategy
	}
	go func() {
		defer e.wg.Done()
		rctx, cancel := context.WithTimeout(ctx, e.wall(e.cfg.RequestTimeout))
		o, start := e.client.Do(rctx, creq)
		cancel()
		o = client.Scale(o, e.cfg.Speed, e.model(start.Sub(e.epoch)))
		e.post(abort, func() { done(o) })
	}()
}

// SetCacheSalt makes every later request carry salt as vLLM's cache_salt
// ("" sends none): a fresh salt starts a phase on caches that share
// nothing with earlier phases, on engines that cannot be reset. Like
// every method it must not be called while Run is running.
func (e *Env) SetCacheSalt(salt string) { e.salt = salt }

// Observe implements study.Engine.
func (e *Env) Observe(done func(study.Observation)) {
	e.pending++
	e.wg.Add(1)
	abort, ctx := e.abort, e.sendCtx
	go func() {
		defer e.wg.Done()
		o := study.Observation{At: e.Now()}
		for _, en := range e.cfg.Engines {
			run, wait := -1, -1
			if s, err := e.scrape(ctx, en.URL, 1); err == nil {
				if v, ok := Sum(s, MetricRunning); ok {
					run = int(v)
				}
				if v, ok := Sum(s, MetricWaiting); ok {
					wait = int(v)
				}
			}
			o.Running = append(o.Running, run)
			o.Waiting = append(o.Waiting, wait)
		}
		e.post(abort, func() { done(o) })
	}()
}

// Run implements study.Engine.
func (e *Env) Run(ctx context.Context) error {
	if e.isClosed() {
		return ErrClosed
	}
	for e.pending > 0 {
		select {
		case fn := <-e.posts:
			e.pending--
			fn()
		case <-ctx.Done():
			e.abortRun()
			return ctx.Err()
		}
	}
	e.timers = e.timers[:0]
	return nil
}

// abortRun stops timers, cancels requests, waits for every goroutine and
// forgets pending work.
func (e *Env) abortRun() {
	close(e.abort)
	e.cancel()
	for _, t := range e.timers {
		if t.Stop() {
			e.wg.Done() // the timer's function will never run
		}
	}
	e.wg.Wait()
	for len(e.posts) > 0 {
		<-e.posts
	}
	e.resetRun()
}

func (e *Env) controlCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, e.cfg.ControlTimeout)
}

// scrapeAttempts is how many times Counters tries one /metrics page.
const scrapeAttempts = 3

// scrape reads base's /metrics, trying up to attempts times: a scrape
// changes nothing, so one that fails in transport (a timeout included) or
// answers 5xx may be tried again, each try bounded by ControlTimeout.
// Counters does (one slow answer of a busy gateway or engine must not cost
// the phase whose counters it reads: ci623, ci624, where a gateway under
// five concurrent CI runs missed the 5 s bound once); a timeline sample
// (Observe) and WaitIdle's poll try once: a late answer would be filed
// under the sample's earlier time, and WaitIdle polls again anyway.
func (e *Env) scrape(ctx context.Context, base string, attempts int) ([]Sample, error) {
	var err error
	for range max(attempts, 1) {
		var s []Sample
		var retry bool
		if s, retry, err = e.scrapeOnce(ctx, base); err == nil || !retry || ctx.Err() != nil {
			return s, err
		}
	}
	return nil, err
}

// scrapeOnce reads base's /metrics once; retry says whether the failure
// may pass (transport error or 5xx).
func (e *Env) scrapeOnce(ctx context.Context, base string) (s []Sample, retry bool, err error) {
	ctx, cancel := e.controlCtx(ctx)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(base, "/")+"/metrics", nil)
	if err != nil {
		return nil, false, err
	}
	resp, err := e.hc.Do(req)
	if err != nil {
		return nil, true, err
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil, resp.StatusCode >= 500, fmt.Errorf("%w: %s: HTTP %d", ErrMetrics, base, resp.StatusCode)
	}
	s, err = ParseMetrics(resp.Body)
	return s, err != nil && ctx.Err() != nil, err // a body cut off by the deadline may pass too
}

func (e *Env) isClosed() bool {
	select {
	case <-e.closed:
		return true
	default:
		return false
	}
}

// ResetCaches implements study.Engine: POST /reset_prefix_cache on every
// engine, one by one, requiring HTTP 200 and, when the body is JSON with a
// "success" field, success=true.
func (e *Env) ResetCaches(ctx context.Context) error {
	if e.isClosed() {
		return ErrClosed
	}
	for _, en := range e.cfg.Engines {
		if err := e.resetOne(ctx, en); err != nil {
			return fmt.Errorf("%w: %w", study.ErrEngine, err)
		}
	}
	return nil
}

func (e *Env) resetOne(ctx context.Context, en Endpoint) error {
	ctx, cancel := e.controlCtx(ctx)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(en.URL, "/")+"/reset_prefix_cache", nil)
	if err != nil {
		return err
	}
	resp, err := e.hc.Do(req)
	if err != nil {
		return fmt.Errorf("%w: %s: %v", ErrReset, en.Name, err)
	}
	defer func() { _ = resp.Body.Close() }()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%w: %s: HTTP %d", ErrReset, en.Name, resp.StatusCode)
	}
	var body struct {
		Success *bool `json:"success"`
	}
	if json.Unmarshal(b, &body) == nil && body.Success != nil && !*body.Success {
		return fmt.Errorf("%w: %s: success=false", ErrReset, en.Name)
	}
	return nil
}

// Counters implements study.Engine.
func (e *Env) Counters(ctx context.Context) (study.Counters, error) {
	var c study.Counters
	if e.isClosed() {
		return c, ErrClosed
	}
	for _, en := range e.cfg.Engines {
		s, err := e.scrape(ctx, en.URL, scrapeAttempts)
		if err != nil {
			return c, fmt.Errorf("%w: %s: %w", study.ErrEngine, en.Name, err)
		}
		q, _ := Sum(s, MetricQueries)
		h, _ := Sum(s, MetricHits)
		ok, _ := Sum(s, MetricSuccess)
		c.Queries = append(c.Queries, q)
		c.Hits = append(c.Hits, h)
		c.Success = append(c.Success, ok)
	}
	for _, g := range e.cfg.Gateways {
		s, err := e.scrape(ctx, g, scrapeAttempts)
		if err != nil {
			return c, fmt.Errorf("%w: gateway %s: %w", study.ErrEngine, g, err)
		}
		if _, ok := Sum(s, MetricSelection); !ok {
			continue
		}
		if c.Selections == nil {
			c.Selections = map[string]float64{}
		}
		for k, v := range ByLabels(s, MetricSelection, e.cfg.SelectionLabels, e.cfg.SelectionSkipLabels) {
			c.Selections[k] += v
		}
	}
	return c, nil
}

// WaitIdle implements study.Engine.
func (e *Env) WaitIdle(ctx context.Context) error {
	deadline := time.Now().Add(e.cfg.IdleTimeout)
	tick := time.NewTicker(e.cfg.IdlePoll)
	defer tick.Stop()
	for {
		if e.isClosed() {
			return ErrClosed
		}
		busy, err := e.busy(ctx)
		if err == nil && busy == "" {
			return nil
		}
		if time.Now().After(deadline) {
			if err != nil {
				return fmt.Errorf("%w: %w: %w", study.ErrEngine, ErrNotIdle, err)
			}
			return fmt.Errorf("%w: %w: %s", study.ErrEngine, ErrNotIdle, busy)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}

func (e *Env) busy(ctx context.Context) (string, error) {
	for _, en := range e.cfg.Engines {
		s, err := e.scrape(ctx, en.URL, 1)
		if err != nil {
			return "", err
		}
		r, _ := Sum(s, MetricRunning)
		w, _ := Sum(s, MetricWaiting)
		if r+w > 0 {
			return fmt.Sprintf("%s has %v running, %v waiting", en.Name, r, w), nil
		}
	}
	return "", nil
}

// Close implements study.Engine: it abandons pending work, waits for Env's
// goroutines and closes idle connections. It is idempotent and, like every
// method, must not run concurrently with Run.
func (e *Env) Close() error {
	e.closeOnce.Do(func() {
		close(e.closed)
		e.abortRun()
		e.tr.CloseIdleConnections()
	})
	return nil
}
