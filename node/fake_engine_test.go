package node

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeEngine is a small vLLM look-alike for proxy tests: SSE streams with
// vLLM's framing, JSON completions, /health, /metrics, /tokenize and
// /v1/models. Knobs are atomics so tests may change them while it serves.
type fakeEngine struct {
	t    testing.TB
	name string
	srv  *httptest.Server

	chunks       atomic.Int64 // content events per stream
	chunkDelay   atomic.Int64 // nanoseconds between events
	firstDelay   atomic.Int64 // nanoseconds before the first event
	tailDelay    atomic.Int64 // nanoseconds before the usage event and before [DONE]
	status       atomic.Int64 // 0 = 200
	breakAfter   atomic.Int64 // >0: drop the connection after this many events
	healthStatus atomic.Int64 // 0 = 200
	tokStatus    atomic.Int64 // 0 = 200 for /tokenize
	running      atomic.Int64
	waiting      atomic.Int64
	// usagePrompt > 0: the usage event reports usagePrompt prompt tokens
	// and usageCached of them cached (prompt_tokens_details).
	usagePrompt, usageCached atomic.Int64

	requests  atomic.Int64
	scrapes   atomic.Int64 // GET /metrics served
	cancelled atomic.Int64 // requests whose context ended before the stream did
	started   chan struct{}

	mu      sync.Mutex
	headers []http.Header
	bodies  [][]byte
}

func newFakeEngine(t testing.TB, name string) *fakeEngine {
	e := &fakeEngine{t: t, name: name, started: make(chan struct{}, 1024)}
	e.chunks.Store(5)
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/completions", e.serveCompletion)
	mux.HandleFunc("/v1/chat/completions", e.serveCompletion)
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {
		if s := e.healthStatus.Load(); s != 0 {
			w.WriteHeader(int(s))
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, r *http.Request) {
		e.scrapes.Add(1)
		fmt.Fprintf(w, "# HELP vllm:num_requests_running Number of requests in model execution batches.\n")
		fmt.Fprintf(w, "# TYPE vllm:num_requests_running gauge\n")
		fmt.Fprintf(w, "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} %d\n", e.running.Load())
		fmt.Fprintf(w, "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} %d\n", e.waiting.Load())
		fmt.Fprintf(w, "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n")
	})
	mux.HandleFunc("/tokenize", func(w http.ResponseWriter, r *http.Request) {
		if s := e.tokStatus.Load(); s != 0 {
			w.WriteHeader(int(s))
			return
		}
		var req struct {
			Prompt string `json:"prompt"`
		}
		_ = json.NewDecoder(r.Body).Decode(&req)
		toks := make([]int, 0, len(req.Prompt))
		for i := 0; i < len(req.Prompt); i++ {
			toks = append(toks, int(req.Prompt[i])+1000)
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"count": len(toks), "max_model_len": 32768, "tokens": toks})
	})
	mux.HandleFunc("/v1/models", func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": []map[string]any{
			{"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 32768, "root": "/models/" + name},
		}})
	})
	e.srv = httptest.NewServer(mux)
	t.Cleanup(e.srv.Close)
	return e
}

func (e *fakeEngine) url() string { return e.srv.URL }

// streamBody is the exact byte stream a fake engine sends for n events.
func streamBody(name string, n int) string {
	var b strings.Builder
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, "data: {\"id\":\"cmpl-%s\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"tok%d\"}]}\n\n", name, i)
	}
	fmt.Fprintf(&b, "data: {\"id\":\"cmpl-%s\",\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":%d}}\n\n", name, n)
	b.WriteString("data: [DONE]\n\n")
	return b.String()
}

func (e *fakeEngine) serveCompletion(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	e.requests.Add(1)
	e.mu.Lock()
	e.headers = append(e.headers, r.Header.Clone())
	e.bodies = append(e.bodies, body)
	e.mu.Unlock()
	select {
	case e.started <- struct{}{}:
	default:
	}
	if s := e.status.Load(); s != 0 {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(int(s))
		fmt.Fprintf(w, `{"error":{"message":"engine says %d","type":"server_error","code":%d}}`, s, s)
		return
	}
	var req struct {
		Stream bool `json:"stream"`
	}
	_ = json.Unmarshal(body, &req)
	n := int(e.chunks.Load())
	if !req.Stream {
		if d := e.firstDelay.Load(); d > 0 {
			select {
			case <-time.After(time.Duration(d)):
			case <-r.Context().Done():
				e.cancelled.Add(1)
				return
			}
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"cmpl-%s","object":"text_completion","choices":[{"index":0,"text":"done"}],"usage":{"prompt_tokens":10,"completion_tokens":%d}}`, e.name, n)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.Header().Set("X-Engine", e.name)
	w.WriteHeader(http.StatusOK)
	fl := w.(http.Flusher)
	fl.Flush()
	events := strings.SplitAfter(streamBody(e.name, n), "\n\n")
	if p := e.usagePrompt.Load(); p > 0 {
		events[n] = fmt.Sprintf("data: {\"id\":\"cmpl-%s\",\"choices\":[],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"prompt_tokens_details\":{\"cached_tokens\":%d}}}\n\n",
			e.name, p, n, e.usageCached.Load())
	}
	brk := int(e.breakAfter.Load())
	for i, ev := range events {
		if ev == "" {
			continue
		}
		d := time.Duration(e.chunkDelay.Load())
		if i == 0 {
			d = time.Duration(e.firstDelay.Load())
		}
		if i >= n {
			d = time.Duration(e.tailDelay.Load())
		}
		if d > 0 {
			select {
			case <-time.After(d):
			case <-r.Context().Done():
				e.cancelled.Add(1)
				return
			}
		}
		if brk > 0 && i == brk {
			// Send half an event, then kill the connection.
			_, _ = io.WriteString(w, ev[:len(ev)/2])
			fl.Flush()
			panic(http.ErrAbortHandler)
		}
		if _, err := io.WriteString(w, ev); err != nil {
			e.cancelled.Add(1)
			return
		}
		fl.Flush()
	}
}
