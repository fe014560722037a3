package node

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/pprof"
	"runtime/debug"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// routes builds the Node's HTTP API.
func (n *Node) routes() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/v1/completions", n.limit(n.serveInference(kindCompletions)))
	mux.Handle("/v1/chat/completions", n.limit(n.serveInference(kindChat)))
	for i := range endpoints {
		if ep := &endpoints[i]; ep.shape != shapeCompletions && ep.shape != shapeChat {
			mux.Handle(ep.pattern, n.limit(n.serveEndpoint(ep)))
		}
	}
	mux.HandleFunc("/v1/models", n.serveModels)
	mux.HandleFunc("/health", n.serveHealth)
	mux.HandleFunc("/ready", n.serveReady)
	mux.HandleFunc("/admin/", n.serveAdmin)
	mux.Handle("/debug/route", n.limit(n.debugGate(n.serveDebugRoute)))
	mux.HandleFunc("/debug/replicas", n.debugGate(n.serveDebugReplicas))
	// Go's profiles (net/http/pprof's handlers, mounted here only; nothing
	// serves http.DefaultServeMux, where its import also registers them).
	mux.HandleFunc("/debug/pprof/", n.profileGate(pprof.Index))
	mux.HandleFunc("/debug/pprof/cmdline", n.profileGate(pprof.Cmdline))
	mux.HandleFunc("/debug/pprof/profile", n.profileGate(pprof.Profile))
	mux.HandleFunc("/debug/pprof/symbol", n.profileGate(pprof.Symbol))
	mux.HandleFunc("/debug/pprof/trace", n.profileGate(pprof.Trace))
	mux.Handle("/metrics", promhttp.HandlerFor(n.m.reg, promhttp.HandlerOpts{Registry: n.m.reg}))
	mux.HandleFunc("/", n.notFound)
	return n.recoverer(mux)
}

// trackingWriter remembers whether the response has started, so that the
// recoverer knows whether it can still answer 500.
type trackingWriter struct {
	http.ResponseWriter
	started bool
}

func (t *trackingWriter) WriteHeader(code int) {
	t.started = true
	t.ResponseWriter.WriteHeader(code)
}

func (t *trackingWriter) Write(b []byte) (int, error) {
	t.started = true
	return t.ResponseWriter.Write(b)
}

func (t *trackingWriter) Flush() {
	if f, ok := t.ResponseWriter.(http.Flusher); ok {
		t.started = true
		f.Flush()
	}
}

func (t *trackingWriter) Unwrap() http.ResponseWriter { return t.ResponseWriter }

// recoverer turns a handler panic into a logged 500 (or, once the response
// has started, an aborted connection) instead of a crashed gateway.
func (n *Node) recoverer(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tw := &trackingWriter{ResponseWriter: w}
		defer func() {
			v := recover()
			if v == nil {
				return
			}
			if v == http.ErrAbortHandler {
				panic(v)
			}
			n.log.Error("handler panic", "path", r.URL.Path, "panic", v, "stack", string(debug.Stack()))
			if tw.started {
				panic(http.ErrAbortHandler)
			}
			n.refuse(w, &apiError{status: http.StatusInternalServerError, code: CodeInternal, message: "internal error"})
		}()
		next.ServeHTTP(tw, r)
	})
}

// serveHealth is the gateway's own liveness: 200 while serving, 503 once
// shutting down (so load balancers drain it).
func (n *Node) serveHealth(w http.ResponseWriter, r *http.Request) {
	if n.stopping.Load() {
		n.refuse(w, &apiError{status: http.StatusServiceUnavailable, code: CodeShuttingDown, message: "gateway is shutting down", retryAfter: 1})
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write([]byte(`{"status":"ok"}`))
}

// serveReady is readiness: 200 once the gateway serves and, in cluster
// mode, has joined, bootstrapped its index and applied a raft config
// version; 503 before and while shutting down.
func (n *Node) serveReady(w http.ResponseWriter, r *http.Request) {
	if !n.Ready() {
		msg := "gateway is not ready"
		switch {
		case n.stopping.Load():
			msg = "gateway is shutting down"
		case n.cfg.Discovery.Source != "" && !n.disc.seen.Load():
			msg = "waiting for the discovery source's first endpoints"
		case n.cl != nil && !n.cl.joined.Load():
			msg = "gateway has not joined the cluster yet"
		case n.cl != nil && !n.cl.configApplied.Load():
			msg = "no cluster routing config applied yet"
		case n.cl != nil:
			msg = "routing config not yet caught up with the raft leader"
		}
		n.refuse(w, &apiError{status: http.StatusServiceUnavailable, code: CodeNotReady, message: msg, retryAfter: 1})
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(n.readyReport())
}

// ReadyReport is GET /ready's answer once ready. Suspect replicas and
// tokenizer disagreements annotate readiness without failing it: routing
// still works (a suspect replica's cache is only mispredicted), and
// failing every gateway's readiness over one engine's event stream would
// take the whole ingress down.
type ReadyReport struct {
	Status        string `json:"status"`
	ConfigVersion uint64 `json:"config_version"`
	// ConfigDigest identifies the routing config in force (models,
	// replicas, strategies, parameters); equal on gateways that route alike.
	ConfigDigest string `json:"config_digest"`
	// Suspect lists replicas whose index predictions disagree with their
	// engine (see selfcheck.go).
	Suspect []SuspectReport `json:"suspect,omitempty"`
	// TokenizerDisagreements lists replicas whose /tokenize disagreed with
	// the gateway's tokenizer at their last probe (see agreement.go).
	TokenizerDisagreements []AgreementReport `json:"tokenizer_disagreements,omitempty"`
	// ConfigUnconfirmed is set when no raft leader has confirmed that the
	// routing config in force is the cluster's current one (the gateway
	// waited its catch-up grace and serves with the last version it
	// applied; a cluster without quorum still routes).
	ConfigUnconfirmed bool `json:"config_unconfirmed,omitempty"`
	// FailOpen lists models none of whose replicas passes its health
	// checks: the gateway routes among those failing them
	// (Config.HealthFailOpen).
	FailOpen []string `json:"fail_open,omitempty"`
	// NoAvailableReplica lists models whose requests get 503
	// (no_healthy_replica): every replica is ejected, or fails its health
	// checks without HealthFailOpen.
	NoAvailableReplica []string `json:"no_available_replica,omitempty"`
}

func (n *Node) readyReport() ReadyReport {
	t := n.tbl.Load()
	rep := ReadyReport{Status: "ready", ConfigVersion: n.tableVersion.Load(), ConfigDigest: t.digest, Suspect: n.Suspects()}
	rep.ConfigUnconfirmed = n.cl != nil && !n.cl.caughtUp.Load()
	now := nowNanos()
	for _, p := range t.pools {
		switch ok, failOpen := p.routable(now, n.cfg.HealthFailOpen); {
		case failOpen:
			rep.FailOpen = append(rep.FailOpen, p.model)
		case !ok:
			rep.NoAvailableReplica = append(rep.NoAvailableReplica, p.model)
		}
	}
	for _, a := range n.Agreement() {
		if a.Verdict == AgreementDisagree {
			rep.TokenizerDisagreements = append(rep.TokenizerDisagreements, a)
		}
	}
	return rep
}

// serveAdmin serves the admin HTTP/JSON API (cluster mode) under
// /admin/v1/, on the gateway's own listener.
func (n *Node) serveAdmin(w http.ResponseWriter, r *http.Request) {
	if n.cl == nil {
		n.refuse(w, &apiError{status: http.StatusNotFound, code: CodeNotFound,
			message: "the admin API runs in cluster mode only"})
		return
	}
	h := n.cl.adminHTTP.Load()
	if h == nil {
		n.refuse(w, &apiError{status: http.StatusServiceUnavailable, code: CodeNotReady,
			message: "the admin API is not up yet", retryAfter: 1})
		return
	}
	(*h).ServeHTTP(w, r)
}

// modelEntry is one entry of GET /v1/models.
type modelEntry map[string]any

// serveModels lists every model name this gateway routes (each pool's
// model and LoRA adapters), merged across pools. Each entry is the engine's
// own /v1/models entry when the pool's first available replica lists that
// name (asked within HealthTimeout), else a minimal OpenAI model object.
func (n *Node) serveModels(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		w.Header().Set("Allow", http.MethodGet)
		n.refuse(w, &apiError{status: http.StatusMethodNotAllowed, code: CodeMethodNotAllowed, message: "use GET"})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), n.cfg.HealthTimeout)
	defer cancel()
	t := n.tbl.Load()
	lists := make([][]modelEntry, len(t.pools))
	var wg sync.WaitGroup
	for i, p := range t.pools {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lists[i] = n.poolModels(ctx, t, p)
		}()
	}
	wg.Wait()
	seen := map[string]bool{}
	var data []modelEntry
	for _, l := range lists {
		for _, m := range l {
			id, _ := m["id"].(string)
			if id == "" || seen[id] {
				continue
			}
			seen[id] = true
			data = append(data, m)
		}
	}
	sort.Slice(data, func(i, j int) bool { return data[i]["id"].(string) < data[j]["id"].(string) })
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": data})
}

func (n *Node) poolModels(ctx context.Context, t *table, p *pool) []modelEntry {
	names := []string{p.model}
	for name, ref := range t.models {
		if ref.pool == p && ref.lora != "" {
			names = append(names, name)
		}
	}
	engine := n.engineModels(ctx, p)
	out := make([]modelEntry, 0, len(names))
	for _, name := range names {
		if e, ok := engine[name]; ok {
			out = append(out, e)
			continue
		}
		e := modelEntry{"id": name, "object": "model", "owned_by": "kvmesh", "created": time.Now().Unix()}
		if name != p.model {
			e["parent"] = p.model
		}
		out = append(out, e)
	}
	return out
}

// engineModels asks the pool's first available replica for its models.
func (n *Node) engineModels(ctx context.Context, p *pool) map[string]modelEntry {
	now := nowNanos()
	for _, rep := range p.replicas {
		if !rep.available(now) {
			continue
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, rep.endpoint("/v1/models"), nil)
		if err != nil {
			return nil
		}
		resp, err := n.client.Do(req)
		if err != nil {
			return nil
		}
		defer resp.Body.Close()
		var body struct {
			Data []modelEntry `json:"data"`
		}
		if resp.StatusCode != http.StatusOK || json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&body) != nil {
			return nil
		}
		out := make(map[string]modelEntry, len(body.Data))
		for _, e := range body.Data {
			if id, ok := e["id"].(string); ok {
				out[id] = e
			}
		}
		return out
	}
	return nil
}
