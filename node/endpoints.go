package node

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sort"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/route"
)

// The gateway serves every endpoint a vLLM server serves: each request is
// routed by its model to one replica of the model's pool, its body is
// forwarded byte for byte and the response relayed as it streams (proxy).
// Endpoints with a prompt prefix (completions, chat, responses) are routed
// by the pool's strategy on their block keys; the others carry no prefix
// the engine caches, so they are routed by load (least-request) unless the
// routing-strategy header names another strategy.

// shape is how the gateway reads an endpoint's request.
type shape uint8

const (
	shapeCompletions  shape = iota + 1 // JSON, "prompt" keyed
	shapeChat                          // JSON, "messages" keyed
	shapeResponses                     // JSON, "input"/"instructions" keyed; response ids learned
	shapeJSON                          // JSON, "model" read, routed by load
	shapeMultipart                     // multipart form, "model" field read, routed by load
	shapeResponseByID                  // /v1/responses/{id}[/cancel]: routed to the id's owner
)

// endpoint is one served path.
type endpoint struct {
	// pattern is the ServeMux pattern (no method: the handler answers a
	// wrong method with the gateway's JSON error).
	pattern string
	methods []string
	shape   shape
}

// endpoints is the route table. vLLM's OpenAI-compatible server serves
// these paths (vllm/entrypoints/openai/api_server.py and the pooling,
// score, speech-to-text and Responses routers).
var endpoints = []endpoint{
	{"/v1/completions", []string{http.MethodPost}, shapeCompletions},
	{"/v1/chat/completions", []string{http.MethodPost}, shapeChat},
	{"/v1/responses", []string{http.MethodPost}, shapeResponses},
	{"/v1/responses/{id}", []string{http.MethodGet, http.MethodDelete}, shapeResponseByID},
	{"/v1/responses/{id}/cancel", []string{http.MethodPost}, shapeResponseByID},
	{"/v1/embeddings", []string{http.MethodPost}, shapeJSON},
	{"/pooling", []string{http.MethodPost}, shapeJSON},
	{"/classify", []string{http.MethodPost}, shapeJSON},
	{"/score", []string{http.MethodPost}, shapeJSON},
	{"/v1/score", []string{http.MethodPost}, shapeJSON},
	{"/rerank", []string{http.MethodPost}, shapeJSON},
	{"/v1/rerank", []string{http.MethodPost}, shapeJSON},
	{"/v2/rerank", []string{http.MethodPost}, shapeJSON},
	{"/tokenize", []string{http.MethodPost}, shapeJSON},
	{"/detokenize", []string{http.MethodPost}, shapeJSON},
	{"/v1/audio/transcriptions", []string{http.MethodPost}, shapeMultipart},
	{"/v1/audio/translations", []string{http.MethodPost}, shapeMultipart},
}

// servedPaths lists the paths a 404 names: the route table plus the
// gateway's own.
func servedPaths() []string {
	out := make([]string, 0, len(endpoints)+8)
	for _, e := range endpoints {
		out = append(out, strings.Join(e.methods, ",")+" "+e.pattern)
	}
	out = append(out, "GET /v1/models", "GET /health", "GET /ready", "GET /metrics",
		"GET,POST /debug/route", "GET /debug/replicas", "/admin/v1/...")
	sort.Strings(out[len(endpoints):])
	return out
}

func (e *endpoint) allows(method string) bool {
	for _, m := range e.methods {
		if m == method {
			return true
		}
	}
	return false
}

// routed reports whether the endpoint keys a prompt prefix.
func (e *endpoint) prefixRouted() bool {
	return e.shape == shapeCompletions || e.shape == shapeChat || e.shape == shapeResponses
}

// findEndpoint returns the route table's entry for an upstream path
// (/v1/responses/x and /v1/responses/x/cancel included), or nil.
func findEndpoint(path string) *endpoint {
	for i := range endpoints {
		if endpoints[i].pattern == path {
			return &endpoints[i]
		}
	}
	if id, ok := strings.CutPrefix(path, "/v1/responses/"); ok && id != "" {
		if strings.HasSuffix(id, "/cancel") {
			return findEndpoint("/v1/responses/{id}/cancel")
		}
		return findEndpoint("/v1/responses/{id}")
	}
	return nil
}

// parseEndpoint reads a JSON request of ep (shapes other than multipart and
// by-id) for routing. path is the upstream path.
func parseEndpoint(ep *endpoint, path string, body []byte) (*inferenceRequest, *apiError) {
	var req *inferenceRequest
	var aerr *apiError
	switch ep.shape {
	case shapeCompletions:
		req, aerr = parseInference(kindCompletions, body)
	case shapeChat:
		req, aerr = parseInference(kindChat, body)
	case shapeResponses:
		req, aerr = parseResponses(body)
	case shapeJSON:
		req, aerr = parseModelOnly(body)
	default:
		return nil, &apiError{status: http.StatusInternalServerError, code: CodeInternal, message: "endpoint has no JSON body"}
	}
	if aerr != nil {
		return nil, aerr
	}
	if path != "/v1/completions" && path != "/v1/chat/completions" {
		req.path = path
	}
	return req, nil
}

// parseModelOnly reads a load-routed JSON request: only its model (and
// user, for consistent-hash) matter. A missing model is left empty: the
// gateway routes it to its only pool, as vLLM takes its served model.
func parseModelOnly(body []byte) (*inferenceRequest, *apiError) {
	f, isObject, err := scanBody(body)
	if err != nil || !isObject {
		return nil, errBadRequest(CodeInvalidJSON, "request body must be a JSON object")
	}
	req := &inferenceRequest{kind: kindCompletions, partial: true}
	var ok bool
	if req.model, ok, err = f.model.string(); err != nil || (ok && req.model == "") {
		return nil, errBadRequest(CodeInvalidField, `field "model" must be a non-empty string`)
	}
	if req.user, _, err = f.user.string(); err != nil {
		req.user = "" // an engine-specific "user": not the gateway's business
	}
	req.stream, _ = f.stream.bool()
	return req, nil
}

// poolOf resolves the request's model; an empty model means the only
// pool's model when there is exactly one.
func (t *table) poolOf(model string) (*pool, string, *apiError) {
	if model == "" {
		if len(t.pools) == 1 {
			return t.pools[0], "", nil
		}
		return nil, "", errBadRequest(CodeMissingModel, fmt.Sprintf(`"model" is required: this gateway serves %d models`, len(t.pools)))
	}
	return t.lookupModel(model)
}

// serveEndpoint is the handler of every route-table entry but completions
// and chat (serveInference): it reads the request as ep's shape says,
// routes it and proxies it.
func (n *Node) serveEndpoint(ep *endpoint) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		arrived := time.Now()
		n.active.add()
		defer n.active.done()
		if !ep.allows(r.Method) {
			w.Header().Set("Allow", strings.Join(ep.methods, ", "))
			n.refuse(w, &apiError{status: http.StatusMethodNotAllowed, code: CodeMethodNotAllowed,
				message: "use " + strings.Join(ep.methods, " or ")})
			return
		}
		var req *inferenceRequest
		var body []byte
		var aerr *apiError
		switch ep.shape {
		case shapeMultipart:
			req, aerr = n.readMultipart(w, r)
		case shapeResponseByID:
			req = &inferenceRequest{kind: kindCompletions, partial: true, method: r.Method,
				path: r.URL.Path, responseID: r.PathValue("id")}
		default:
			if body, aerr = readBody(w, r, n.cfg.MaxBodyBytes, n.cfg.BodyReadTimeout); aerr == nil {
				req, aerr = parseEndpoint(ep, r.URL.Path, body)
			}
		}
		if aerr != nil {
			n.refuse(w, aerr)
			return
		}
		req.arrived = arrived
		p, lora, strat, pinned, aerr := n.endpointRoute(r.Context(), r, ep, req)
		if aerr != nil {
			n.refuse(w, aerr)
			return
		}
		n.forward(w, r, ep, req, body, p, lora, strat, pinned)
	}
}

// endpointRoute resolves where a parsed request of ep goes, for the proxy
// and the endpoint picker alike: the session header, the model's pool and
// adapter, the strategy, and the replica the request is pinned to (by the
// pin header, or as the owner of the stored response it names; "" when
// none), whose pin strategy then replaces the pool's.
func (n *Node) endpointRoute(ctx context.Context, r *http.Request, ep *endpoint, req *inferenceRequest) (
	p *pool, lora string, strat route.Strategy, pinned string, aerr *apiError) {
	if sid := r.Header.Get(HeaderSession); sid != "" {
		req.user = sid
	}
	t := n.tbl.Load()
	var owner *replica
	if p, lora, owner, aerr = n.endpointTarget(ctx, t, ep, req); aerr != nil {
		return
	}
	if strat, aerr = n.endpointStrategy(r, t, p, ep); aerr != nil {
		return
	}
	pin, aerr := n.pinFor(r, p)
	switch {
	case aerr != nil:
	case pin != nil:
		strat, pinned = pin, r.Header.Get(HeaderPinReplica)
	case owner != nil:
		strat, pinned = pinStrategy{name: owner.name}, owner.name
	}
	return
}

// responseIDOf is the response id of a /v1/responses/{id}[/cancel] path.
func responseIDOf(path string) string {
	id, _ := strings.CutPrefix(path, "/v1/responses/")
	id, _ = strings.CutSuffix(id, "/cancel")
	return id
}

// endpointStrategy is the strategy for a request of ep: the header's, else
// the pool's for prefix-routed endpoints and least-request for the others.
func (n *Node) endpointStrategy(r *http.Request, t *table, p *pool, ep *endpoint) (route.Strategy, *apiError) {
	name := r.Header.Get(HeaderStrategy)
	if name == "" && !ep.prefixRouted() {
		name = loadStrategy
	}
	return t.strategyFor(p, name)
}

// loadStrategy routes the endpoints without a prompt prefix.
const loadStrategy = "least-request"

// forward routes req to a replica of p with strat (retrying once on a
// connect failure when the body can be resent) and proxies it. pinned, when
// set, is the only acceptable replica.
func (n *Node) forward(w http.ResponseWriter, r *http.Request, ep *endpoint, req *inferenceRequest, body []byte,
	p *pool, lora string, strat route.Strategy, pinned string) {
	s := getScratch()
	defer putScratch(s)
	rr, keys := n.prepare(r.Context(), p, lora, req, s)
	var exclude *replica
	for attempt := 0; ; attempt++ {
		rr.Now = time.Now().UnixNano()
		s.rng = n.newRand()
		t0 := time.Now()
		dec, earliest, err := n.routeOnce(p, strat, keys, &rr, s, exclude, nil)
		if err != nil {
			msg := fmt.Sprintf("no healthy replica for model %q", p.model)
			code := CodeNoHealthyReplica
			if pinned != "" && r.Header.Get(HeaderPinReplica) == "" {
				msg = fmt.Sprintf("replica %s, which stored the response, is not available", pinned)
				code = CodeResponseOwnerUnavailable
				n.m.responseAffinity.WithLabelValues("owner_unavailable").Inc()
			}
			n.refuse(w, &apiError{status: http.StatusServiceUnavailable, code: code, message: msg,
				retryAfter: retryAfterSeconds(rr.Now, earliest)})
			return
		}
		n.observeDecision(p, dec, time.Since(t0))
		if n.log.Enabled(r.Context(), slog.LevelDebug) {
			n.log.Debug("routed", "path", r.URL.Path, "model", p.model, "strategy", strat.Name(),
				"replica", dec.rep.name, "selection", dec.Decision.Selection.String(), "matched_blocks", dec.Matched,
				"blocks", len(keys), "batch", req.batch, "attempt", attempt)
		}
		canRetry := attempt == 0 && n.cfg.RetryConnectFailures && s.available > 1 && req.upstream == nil && pinned == ""
		out := http.ResponseWriter(w)
		if ep.shape == shapeResponses || (ep.shape == shapeResponseByID && r.Method == http.MethodDelete) {
			cw := n.responseLearner(p, dec.rep, req)
			cw.ResponseWriter = w
			out = cw
		}
		if n.proxy(out, r, req, body, dec, keys, canRetry) == attemptRetry {
			n.m.retries.Inc()
			exclude = dec.rep
			continue
		}
		return
	}
}

// firstByteIsToken reports whether a stream's first body byte is its first
// token (completions and chat), so that its arrival is the TTFT. A
// Responses API stream opens with response.created before any prefill.
func (r *inferenceRequest) firstByteIsToken() bool { return r.path == "" }

// upstreamBody is the body proxy sends: the streamed one of a multipart
// request, else the buffered bytes (none for GET and DELETE).
func upstreamBody(req *inferenceRequest, body []byte) (io.Reader, int64) {
	if req.upstream != nil {
		return req.upstream, req.upstreamLen
	}
	if body == nil && req.method != "" && req.method != http.MethodPost {
		return http.NoBody, 0
	}
	return bytes.NewReader(body), int64(len(body))
}

// notFound answers an unknown path with the list of served ones.
func (n *Node) notFound(w http.ResponseWriter, r *http.Request) {
	n.refuse(w, &apiError{status: http.StatusNotFound, code: CodeNotFound,
		message: fmt.Sprintf("no such endpoint %q; this gateway serves: %s", truncatePath(r.URL.Path), strings.Join(servedPaths(), "; "))})
}

func truncatePath(p string) string {
	if len(p) > 128 {
		return p[:128] + "..."
	}
	return p
}

// debugEndpoint explains the routing of a request to path (POST
// /debug/route?path=...): body is the request body the endpoint would get
// (for multipart endpoints, the model comes from the model query
// parameter; /v1/responses/{id} needs none).
func (n *Node) debugEndpoint(w http.ResponseWriter, r *http.Request, path string, body []byte) {
	ep := findEndpoint(path)
	if ep == nil {
		n.notFound(w, r)
		return
	}
	var req *inferenceRequest
	var aerr *apiError
	switch ep.shape {
	case shapeMultipart:
		req = &inferenceRequest{kind: kindCompletions, partial: true, path: path, model: r.URL.Query().Get("model")}
	case shapeResponseByID:
		req = &inferenceRequest{kind: kindCompletions, partial: true, path: path, responseID: responseIDOf(path)}
	default:
		req, aerr = parseEndpoint(ep, path, body)
	}
	if aerr != nil {
		n.refuse(w, aerr)
		return
	}
	if sid := r.Header.Get(HeaderSession); sid != "" {
		req.user = sid
	}
	t := n.tbl.Load()
	p, lora, owner, aerr := n.endpointTarget(r.Context(), t, ep, req)
	if aerr != nil {
		n.refuse(w, aerr)
		return
	}
	strat, aerr := n.endpointStrategy(r, t, p, ep)
	if q := r.URL.Query().Get("strategy"); q != "" && aerr == nil {
		strat, aerr = t.strategyFor(p, q)
	}
	if aerr != nil {
		n.refuse(w, aerr)
		return
	}
	rep := RouteReport{Path: path}
	if owner != nil {
		strat, rep.ResponseOwner = pinStrategy{name: owner.name}, owner.name
	}
	n.explainRoute(w, r, p, lora, req, strat, body, rep)
}

// endpointTarget resolves where req goes: the pool of its model (and the
// LoRA adapter), and the replica that owns the stored response it names,
// for a request by response id or with previous_response_id (nil owner
// otherwise).
func (n *Node) endpointTarget(ctx context.Context, t *table, ep *endpoint, req *inferenceRequest) (p *pool, lora string, owner *replica, aerr *apiError) {
	if ep.shape == shapeResponseByID {
		p, owner, aerr = n.responseTarget(ctx, t, req.responseID)
		return p, "", owner, aerr
	}
	if p, lora, aerr = t.poolOf(req.model); aerr == nil && req.previousResponseID != "" {
		owner, aerr = n.responseOwnerIn(ctx, t, p, req.previousResponseID)
	}
	return p, lora, owner, aerr
}
