package cluster

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/node"
)

// Outcome is how one client request ended.
type Outcome uint8

const (
	// OK: a complete response (a stream that ended with [DONE]).
	OK Outcome = iota
	// Failed: an error the client can see: an error status with a body,
	// an SSE error event, a refused connection (reason "connect"), or a
	// connection that broke under the client's HTTP library, which reports
	// it as an error (reason "conn_error": a reset, or a chunked body cut
	// before its terminator, as when a gateway dies). Scenarios that kill
	// no gateway require conn_error == 0.
	Failed
	// Lost: no answer before the deadline (reason "hung"), a stream that
	// ended cleanly without [DONE] and without an error event
	// ("truncated"), or a 200 whose body is not a completion ("bad_body").
	Lost
)

func (o Outcome) String() string {
	switch o {
	case OK:
		return "ok"
	case Failed:
		return "failed"
	case Lost:
		return "lost"
	}
	return fmt.Sprintf("Outcome(%d)", uint8(o))
}

// LoadConfig bounds and shapes a client load.
type LoadConfig struct {
	// Requests bounds the number of requests. Required (> 0).
	Requests int
	// Concurrency is the number of requests in flight. Default 4.
	Concurrency int
	// MaxDuration bounds the load in time: no request starts after it.
	// Default 60s.
	MaxDuration time.Duration
	// RequestTimeout is how long one request may take end to end before it
	// counts as lost (hung). Default 15s, above the gateway's idle and
	// first-byte timeouts so that the gateway's own errors arrive first.
	RequestTimeout time.Duration
	// MaxTokens per request. Default 4.
	MaxTokens int
	// Stream asks for SSE streams. Default true.
	Stream bool
	// Model is the model name. Required.
	Model string
	// Prompt returns request i's prompt. Required.
	Prompt func(i int) string
	// Target returns the base URL request i goes to. Required.
	Target func(i int) string
	// Header, if set, adds headers to request i (e.g. routing-strategy).
	Header func(i int, h http.Header)
	// Pace, if set, is called before request i is sent and may block (it
	// must return when ctx ends); it lets a scenario interleave faults.
	Pace func(ctx context.Context, i int)
}

// DefaultLoadConfig returns the defaults documented on LoadConfig.
func DefaultLoadConfig() LoadConfig {
	return LoadConfig{Concurrency: 4, MaxDuration: 60 * time.Second, RequestTimeout: 15 * time.Second, MaxTokens: 4, Stream: true}
}

// Validate reports the first invalid field, wrapping ErrInvalidConfig.
func (c LoadConfig) Validate() error {
	switch {
	case c.Requests <= 0:
		return fmt.Errorf("%w: load of %d requests", ErrInvalidConfig, c.Requests)
	case c.Concurrency <= 0 || c.MaxDuration <= 0 || c.RequestTimeout <= 0 || c.MaxTokens <= 0:
		return fmt.Errorf("%w: load concurrency %d, duration %v, timeout %v, max tokens %d",
			ErrInvalidConfig, c.Concurrency, c.MaxDuration, c.RequestTimeout, c.MaxTokens)
	case c.Model == "" || c.Prompt == nil || c.Target == nil:
		return fmt.Errorf("%w: load needs Model, Prompt and Target", ErrInvalidConfig)
	}
	return nil
}

// Result is one request's outcome.
type Result struct {
	I       int
	Outcome Outcome
	// Reason says why a request failed or was lost ("" when ok): the
	// gateway's error code, "http_503", "connect", "truncated", "hung", ...
	Reason string
	// Replica is the gateway's x-kvmesh-replica header.
	Replica string
	// Target is the base URL the request was sent to.
	Target   string
	Start    time.Time
	Duration time.Duration
}

// LoadResult sums a load.
type LoadResult struct {
	Sent, OK, Failed, Lost int
	// Reasons counts failed and lost requests by outcome/reason.
	Reasons map[string]int
	// Results has every request's outcome, by index.
	Results  []Result
	Duration time.Duration
}

// String is "sent/ok/failed/lost" with the reasons.
func (r LoadResult) String() string {
	keys := make([]string, 0, len(r.Reasons))
	for k := range r.Reasons {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%d", k, r.Reasons[k])
	}
	return fmt.Sprintf("sent=%d ok=%d failed=%d lost=%d%s", r.Sent, r.OK, r.Failed, r.Lost, b.String())
}

// Add merges another load's counts into r (Results are appended).
func (r *LoadResult) Add(o LoadResult) {
	r.Sent += o.Sent
	r.OK += o.OK
	r.Failed += o.Failed
	r.Lost += o.Lost
	if r.Reasons == nil {
		r.Reasons = map[string]int{}
	}
	for k, v := range o.Reasons {
		r.Reasons[k] += v
	}
	r.Results = append(r.Results, o.Results...)
	r.Duration += o.Duration
}

// Load is a running client load. Its workers are its goroutines: Wait (or
// Stop) waits for all of them.
type Load struct {
	cfg    LoadConfig
	cancel context.CancelFunc
	tr     *http.Transport
	wg     sync.WaitGroup
	start  time.Time

	mu      sync.Mutex
	results []Result
	once    sync.Once
	res     LoadResult
}

// StartLoad validates cfg and starts the workers. Requests run until
// Requests are sent, MaxDuration passes, ctx ends or Stop.
func StartLoad(ctx context.Context, cfg LoadConfig) (*Load, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.MaxDuration)
	l := &Load{
		cfg: cfg, cancel: cancel, start: time.Now(),
		tr: &http.Transport{MaxIdleConnsPerHost: cfg.Concurrency, DialContext: (&net.Dialer{Timeout: 2 * time.Second}).DialContext},
	}
	next := make(chan int)
	l.wg.Add(1)
	go func() { // feeder: bounded by Requests and ctx
		defer l.wg.Done()
		defer close(next)
		for i := range cfg.Requests {
			if cfg.Pace != nil {
				cfg.Pace(ctx, i)
			}
			select {
			case next <- i:
			case <-ctx.Done():
				return
			}
		}
	}()
	for range cfg.Concurrency {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			for i := range next {
				r := l.one(i)
				l.mu.Lock()
				l.results = append(l.results, r)
				l.mu.Unlock()
			}
		}()
	}
	return l, nil
}

// Completed is the number of requests that have ended so far.
func (l *Load) Completed() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.results)
}

// RunLoad runs a load to its end.
func RunLoad(ctx context.Context, cfg LoadConfig) (LoadResult, error) {
	l, err := StartLoad(ctx, cfg)
	if err != nil {
		return LoadResult{}, err
	}
	return l.Wait(), nil
}

// Wait waits until the load ends by itself and returns its result.
func (l *Load) Wait() LoadResult {
	l.once.Do(func() {
		l.wg.Wait()
		l.cancel()
		l.tr.CloseIdleConnections()
		l.res = l.sum()
	})
	return l.res
}

// Stop stops issuing requests, waits for those in flight and returns the
// result. Idempotent.
func (l *Load) Stop() LoadResult {
	l.cancel()
	return l.Wait()
}

func (l *Load) sum() LoadResult {
	l.mu.Lock()
	defer l.mu.Unlock()
	r := LoadResult{Reasons: map[string]int{}, Duration: time.Since(l.start)}
	sort.Slice(l.results, func(a, b int) bool { return l.results[a].I < l.results[b].I })
	r.Results = l.results
	for _, x := range l.results {
		r.Sent++
		switch x.Outcome {
		case OK:
			r.OK++
		case Failed:
			r.Failed++
			r.Reasons["failed/"+x.Reason]++
		case Lost:
			r.Lost++
			r.Reasons["lost/"+x.Reason]++
		}
	}
	return r
}

// one sends request i and classifies it. The request's own deadline (not
// the load's) decides "hung": stopping the load never cuts a request.
// one sends request i. res is named so that the deferred Duration lands in
// the value returned (set on a local copy, it was always 0, and the
// scenarios' "ended after the gateway's stop began" allowance never held).
func (l *Load) one(i int) (res Result) {
	res = Result{I: i, Start: time.Now()}
	defer func() { res.Duration = time.Since(res.Start) }()
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.RequestTimeout)
	defer cancel()
	body, err := json.Marshal(map[string]any{
		"model": l.cfg.Model, "prompt": l.cfg.Prompt(i), "max_tokens": l.cfg.MaxTokens, "stream": l.cfg.Stream,
	})
	if err != nil {
		res.Outcome, res.Reason = Failed, "marshal"
		return res
	}
	res.Target = l.cfg.Target(i)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, res.Target+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		res.Outcome, res.Reason = Failed, "request"
		return res
	}
	req.Header.Set("Content-Type", "application/json")
	if l.cfg.Header != nil {
		l.cfg.Header(i, req.Header)
	}
	resp, err := l.tr.RoundTrip(req)
	if err != nil {
		res.Outcome, res.Reason = classifyTransportError(ctx, err)
		return res
	}
	defer resp.Body.Close()
	res.Replica = resp.Header.Get(node.HeaderReplica)
	if resp.StatusCode != http.StatusOK {
		res.Outcome, res.Reason = Failed, errorCode(resp)
		return res
	}
	if !l.cfg.Stream {
		var out struct {
			Choices []json.RawMessage `json:"choices"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || len(out.Choices) == 0 {
			if errors.Is(err, io.ErrUnexpectedEOF) { // a JSON body cut short
				_, err = io.Copy(io.Discard, resp.Body)
			}
			res.Outcome, res.Reason = bodyOutcome(ctx, err, "bad_body")
			return res
		}
		return res
	}
	res.Outcome, res.Reason = classifyStream(ctx, resp.Body)
	return res
}

// classifyTransportError: a dial that failed means nothing was sent
// ("connect"); a deadline means no answer came ("hung", lost); any other
// error broke the connection and the client's library reported it
// ("conn_error", visible).
func classifyTransportError(ctx context.Context, err error) (Outcome, string) {
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return Failed, "connect"
	}
	if ctx.Err() != nil {
		return Lost, "hung"
	}
	return Failed, "conn_error"
}

// bodyOutcome classifies a body that ended without a complete answer:
// past the deadline it hung (lost); a read error (reset, chunked body cut
// short) is visible to the client; a clean end is a silent truncation
// (lost).
func bodyOutcome(ctx context.Context, err error, clean string) (Outcome, string) {
	switch {
	case ctx.Err() != nil:
		return Lost, "hung"
	case err != nil && !errors.Is(err, io.EOF):
		return Failed, "conn_error"
	}
	return Lost, clean
}

// errorCode reads an OpenAI-style error body's code, else "http_<status>".
func errorCode(resp *http.Response) string {
	var e struct {
		Error struct {
			Code any `json:"code"`
		} `json:"error"`
	}
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if json.Unmarshal(raw, &e) == nil && e.Error.Code != nil {
		if s, ok := e.Error.Code.(string); ok && s != "" {
			return s
		}
	}
	return fmt.Sprintf("http_%d", resp.StatusCode)
}

// classifyStream reads an SSE stream to its end.
func classifyStream(ctx context.Context, body io.Reader) (Outcome, string) {
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data:") {
			continue
		}
		data := strings.TrimSpace(strings.TrimPrefix(line, "data:"))
		if data == "[DONE]" {
			return OK, ""
		}
		if strings.HasPrefix(data, `{"error"`) {
			var e struct {
				Error struct {
					Code any `json:"code"`
				} `json:"error"`
			}
			code := "stream_error"
			if json.Unmarshal([]byte(data), &e) == nil {
				if s, ok := e.Error.Code.(string); ok && s != "" {
					code = "stream_error/" + s
				}
			}
			return Failed, code
		}
	}
	return bodyOutcome(ctx, sc.Err(), "truncated")
}
