package studytest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"sync"
	"time"
)

// FakeEngine is an httptest vLLM stand-in: POST /v1/completions streams
// max_tokens one-word chunks, usage and [DONE]; GET /metrics exposes the
// vllm:* gauges and counters the study reads; POST /reset_prefix_cache
// clears its prefix memory. It caches by document prefix (DocPrefix), like
// Toy. Close it with Close.
type FakeEngine struct {
	*httptest.Server
	// TokenDelay is the wall time between two tokens.
	TokenDelay time.Duration
	// Truncate, if set, cuts the stream (no usage, no [DONE]) of requests
	// for which it returns true.
	Truncate func(prompt string) bool

	mu       sync.Mutex
	running  int
	cache    map[string]bool
	queries  float64
	hits     float64
	success  float64
	requests int
}

// NewFakeEngine starts a FakeEngine on 127.0.0.1.
func NewFakeEngine() *FakeEngine {
	f := &FakeEngine{TokenDelay: 200 * time.Microsecond, cache: map[string]bool{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", f.complete)
	mux.HandleFunc("GET /metrics", f.metrics)
	mux.HandleFunc("POST /reset_prefix_cache", func(w http.ResponseWriter, _ *http.Request) {
		f.mu.Lock()
		f.cache = map[string]bool{}
		f.mu.Unlock()
		_, _ = io.WriteString(w, `{"success":true}`)
	})
	f.Server = httptest.NewServer(mux)
	return f
}

// Requests returns how many completions the engine has served.
func (f *FakeEngine) Requests() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.requests
}

type completionBody struct {
	Model     string `json:"model"`
	Prompt    string `json:"prompt"`
	MaxTokens int    `json:"max_tokens"`
	Stream    bool   `json:"stream"`
}

func (f *FakeEngine) complete(w http.ResponseWriter, r *http.Request) {
	var b completionBody
	if err := json.NewDecoder(r.Body).Decode(&b); err != nil || !b.Stream || b.MaxTokens < 1 {
		http.Error(w, `{"error":{"message":"bad request"}}`, http.StatusBadRequest)
		return
	}
	doc := DocPrefix(b.Prompt)
	f.mu.Lock()
	f.running++
	f.requests++
	f.queries += float64(len(b.Prompt))
	if f.cache[doc] {
		f.hits += float64(len(doc))
	}
	f.cache[doc] = true
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		f.running--
		f.mu.Unlock()
	}()
	w.Header().Set("Content-Type", "text/event-stream")
	fl, _ := w.(http.Flusher)
	for i := range b.MaxTokens {
		if i > 0 && f.TokenDelay > 0 {
			select {
			case <-time.After(f.TokenDelay):
			case <-r.Context().Done():
				return
			}
		}
		fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"text\":\" w%d\"}]}\n\n", i)
		if fl != nil {
			fl.Flush()
		}
	}
	if f.Truncate != nil && f.Truncate(b.Prompt) {
		return
	}
	fmt.Fprintf(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d}}\n\ndata: [DONE]\n\n",
		len(b.Prompt)/4, b.MaxTokens)
	f.mu.Lock()
	f.success++
	f.mu.Unlock()
}

func (f *FakeEngine) metrics(w http.ResponseWriter, _ *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fmt.Fprintf(w, "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n")
	fmt.Fprintf(w, "vllm:num_requests_running{model_name=\"m\"} %d\n", f.running)
	fmt.Fprintf(w, "vllm:num_requests_waiting{model_name=\"m\"} 0\n")
	fmt.Fprintf(w, "vllm:prefix_cache_queries_total{model_name=\"m\"} %g\n", f.queries)
	fmt.Fprintf(w, "vllm:prefix_cache_hits_total{model_name=\"m\"} %g\n", f.hits)
	fmt.Fprintf(w, "vllm:request_success_total{finished_reason=\"length\",model_name=\"m\"} %g\n", f.success)
}

// FakeGateway is an httptest gateway stand-in: it routes POST
// /v1/completions by the routing-strategy header (random, least-request,
// and a history prefix-cache; anything else is least-request), names the
// replica in x-kvmesh-replica and streams the engine's response through.
// /metrics exposes kvmesh_route_decisions_total{strategy,selection}.
type FakeGateway struct {
	*httptest.Server
	engines []*FakeEngine
	names   []string

	mu       sync.Mutex
	rng      *rand.Rand
	inflight []int
	history  map[string]int
	picks    map[[2]string]int
}

// NewFakeGateway starts a FakeGateway over engines named names.
func NewFakeGateway(names []string, engines []*FakeEngine) *FakeGateway {
	g := &FakeGateway{
		engines: engines, names: names, rng: rand.New(rand.NewPCG(1, 2)),
		inflight: make([]int, len(engines)), history: map[string]int{}, picks: map[[2]string]int{},
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", g.complete)
	mux.HandleFunc("GET /metrics", g.metrics)
	g.Server = httptest.NewServer(mux)
	return g
}

func (g *FakeGateway) least() int {
	best := 0
	for i := range g.inflight {
		if g.inflight[i] < g.inflight[best] || (g.inflight[i] == g.inflight[best] && g.rng.IntN(2) == 0) {
			best = i
		}
	}
	return best
}

func (g *FakeGateway) pick(strategy, doc string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	r, sel := 0, "least_request"
	switch strategy {
	case "random":
		r, sel = g.rng.IntN(len(g.engines)), "random"
	case "prefix-cache":
		if h, ok := g.history[doc]; ok {
			r, sel = h, "prefix_match"
		} else {
			r, sel = g.least(), "least_request_fallback"
		}
	default:
		r = g.least()
	}
	g.history[doc] = r
	g.inflight[r]++
	g.picks[[2]string{strategy, sel}]++
	return r
}

func (g *FakeGateway) complete(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, "read", http.StatusBadRequest)
		return
	}
	var b completionBody
	_ = json.Unmarshal(body, &b)
	i := g.pick(r.Header.Get("routing-strategy"), DocPrefix(b.Prompt))
	defer func() {
		g.mu.Lock()
		g.inflight[i]--
		g.mu.Unlock()
	}()
	req, _ := http.NewRequestWithContext(r.Context(), http.MethodPost, g.engines[i].URL+"/v1/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := g.engines[i].Client().Do(req)
	if err != nil {
		http.Error(w, `{"error":{"code":"upstream"}}`, http.StatusBadGateway)
		return
	}
	defer func() { _ = resp.Body.Close() }()
	w.Header().Set("Content-Type", resp.Header.Get("Content-Type"))
	w.Header().Set("x-kvmesh-replica", g.names[i])
	w.WriteHeader(resp.StatusCode)
	fl, _ := w.(http.Flusher)
	buf := make([]byte, 4096)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			_, _ = w.Write(buf[:n])
			if fl != nil {
				fl.Flush()
			}
		}
		if err != nil {
			return
		}
	}
}

func (g *FakeGateway) metrics(w http.ResponseWriter, _ *http.Request) {
	g.mu.Lock()
	defer g.mu.Unlock()
	fmt.Fprintf(w, "# TYPE kvmesh_route_decisions_total counter\n")
	for k, v := range g.picks {
		fmt.Fprintf(w, "kvmesh_route_decisions_total{model=\"m\",selection=%q,strategy=%q} %d\n", k[1], k[0], v)
	}
}
