package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/route"
)

// Response headers the gateway adds.
const (
	// HeaderReplica names the replica that served the request.
	HeaderReplica = "x-kvmesh-replica"
	// HeaderTargetPod is AIBrix's header: the replica's host:port.
	HeaderTargetPod = "target-pod"
	// HeaderStrategy is the request header that selects a strategy.
	HeaderStrategy = "routing-strategy"
	// HeaderSession is the request header whose value is the
	// consistent-hash session key (else the body's "user" field).
	HeaderSession = "x-session-id"
)

var (
	errIdleTimeout = fmt.Errorf("%w: no bytes for longer than the idle timeout", ErrUpstream)
)

// hopHeaders are connection-scoped and never forwarded (RFC 9110 §7.6.1).
var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

func isHopHeader(h http.Header, k string) bool {
	for _, hk := range hopHeaders {
		if k == hk {
			return true
		}
	}
	for _, v := range h.Values("Connection") {
		for _, f := range bytes.Split([]byte(v), []byte(",")) {
			if http.CanonicalHeaderKey(string(bytes.TrimSpace(f))) == k {
				return true
			}
		}
	}
	return false
}

// copyHeaders copies src to dst without hop-by-hop headers. The value
// slices are shared, not copied: src is a request or response the caller
// owns and no longer changes.
func copyHeaders(dst, src http.Header) {
	for k, vs := range src {
		if isHopHeader(src, k) {
			continue
		}
		dst[k] = vs
	}
}

// The gateway's request headers in net/http's canonical form: looking them
// up directly spares Header.Get canonicalising (and allocating) the
// lower-case constants on every request.
var (
	canonStrategy = http.CanonicalHeaderKey(HeaderStrategy)
	canonSession  = http.CanonicalHeaderKey(HeaderSession)
	canonPin      = http.CanonicalHeaderKey(HeaderPinReplica)
)

// headerValue is h.Get for a key already in canonical form.
func headerValue(h http.Header, canonical string) string {
	if v := h[canonical]; len(v) > 0 {
		return v[0]
	}
	return ""
}

// bufPool holds the relay buffers: 32 KiB is a few dozen SSE events, and
// one read per Flush keeps latency per chunk, not per buffer.
var bufPool = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// attemptResult says what the caller should do after one proxy attempt.
type attemptResult uint8

const (
	attemptDone  attemptResult = iota // a response (or error) was written
	attemptRetry                      // connect failed, nothing written: retry elsewhere
)

// serveInference is the handler of /v1/completions and /v1/chat/completions.
func (n *Node) serveInference(kind apiKind) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		arrived := time.Now()
		n.active.add()
		defer n.active.done()
		if r.Method != http.MethodPost {
			w.Header().Set("Allow", http.MethodPost)
			n.refuse(w, &apiError{status: http.StatusMethodNotAllowed, code: CodeMethodNotAllowed, message: "use POST"})
			return
		}
		body, aerr := readBody(w, r, n.cfg.MaxBodyBytes, n.cfg.BodyReadTimeout)
		if aerr != nil {
			n.refuse(w, aerr)
			return
		}
		req, aerr := parseInference(kind, body)
		if aerr != nil {
			n.refuse(w, aerr)
			return
		}
		req.arrived = arrived
		if sid := headerValue(r.Header, canonSession); sid != "" {
			req.user = sid
		}
		t := n.tbl.Load()
		p, lora, aerr := t.lookupModel(req.model)
		if aerr != nil {
			n.refuse(w, aerr)
			return
		}
		strat, aerr := t.strategyFor(p, headerValue(r.Header, canonStrategy))
		if aerr != nil {
			n.refuse(w, aerr)
			return
		}
		pin, aerr := n.pinFor(r, p)
		if aerr != nil {
			n.refuse(w, aerr)
			return
		}
		if pin != nil {
			strat = pin
		}
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
				n.refuse(w, &apiError{status: http.StatusServiceUnavailable, code: CodeNoHealthyReplica,
					message:    fmt.Sprintf("no healthy replica for model %q", req.model),
					retryAfter: retryAfterSeconds(rr.Now, earliest)})
				return
			}
			n.observeDecision(p, dec, time.Since(t0))
			if n.log.Enabled(r.Context(), slog.LevelDebug) {
				// The prompt itself is never logged: its first block key
				// identifies the prefix, the last one the whole prompt.
				var first, last index.BlockKey
				if len(keys) > 0 {
					first, last = keys[0], keys[len(keys)-1]
				}
				n.log.Debug("routed", "model", req.model, "strategy", strat.Name(), "replica", dec.rep.name,
					"selection", dec.Decision.Selection.String(), "matched_blocks", dec.Matched, "blocks", len(keys),
					"prefix_key", fmt.Sprintf("%016x", uint64(first)), "prompt_key", fmt.Sprintf("%016x", uint64(last)),
					"attempt", attempt)
			}
			canRetry := attempt == 0 && n.cfg.RetryConnectFailures && s.available > 1
			if n.proxy(w, r, req, body, dec, keys, canRetry) == attemptRetry {
				n.m.retries.Inc()
				exclude = dec.rep
				continue
			}
			return
		}
	}
}

// newRand returns a generator for one routing decision. Seeds step by an
// odd constant other than SplitMix64's own increment, so that consecutive
// requests' streams do not overlap.
func (n *Node) newRand() route.Rand {
	return route.NewRand(n.rngSeed.Add(1) * 0xbf58476d1ce4e5b9)
}

// refuse answers a client error and counts it.
func (n *Node) refuse(w http.ResponseWriter, e *apiError) {
	n.m.clientErrors.WithLabelValues(e.code).Inc()
	writeError(w, e)
}

func (n *Node) observeDecision(p *pool, dec decision, took time.Duration) {
	if dec.failOpen {
		n.m.failOpen.WithLabelValues(p.model).Inc()
	}
	// A pinned decision speaks for its replica alone, not for the model.
	if _, pinned := dec.strategy.(pinStrategy); !pinned && p.failingOpen.Load() != dec.failOpen && p.failingOpen.CompareAndSwap(!dec.failOpen, dec.failOpen) {
		if dec.failOpen {
			n.log.Warn("no replica of the model passes its health checks; routing among those failing them (health_fail_open)",
				"model", p.model, "replicas", dec.pool.failingHealth(dec.req.Now))
		} else {
			n.log.Info("a replica of the model passes its health checks again; fail-open routing ended", "model", p.model)
		}
	}
	s := n.m.decisionSeries(decisionKey{p.model, dec.strategy.Name(), dec.Decision.Selection.String()})
	s.took.Observe(took.Seconds())
	s.decisions.Inc()
	dec.rep.mPicked.Inc()
	if est := dec.Decision.EstimatedTTFT; est > 0 {
		if target := dec.pool.set.Model().TTFTTarget(); target > 0 && est > target {
			dec.rep.mPast.Inc()
		}
	}
	frac := 0.0
	if dec.req.TotalBlocks > 0 {
		frac = float64(dec.Matched) / float64(dec.req.TotalBlocks)
	}
	s.match.Observe(frac)
}

// proxy forwards one attempt to dec.rep and relays the response. When
// canRetry is set and the connection could not be made, it writes nothing
// and returns attemptRetry.
func (n *Node) proxy(w http.ResponseWriter, r *http.Request, req *inferenceRequest, body []byte,
	dec decision, keys []index.BlockKey, canRetry bool) attemptResult {
	rep := dec.rep
	// A plain-http replica goes through the proxy's own client
	// (upstream.go), which needs no context of its own: the client's
	// leaving and the idle timeout act on the connection's deadlines. It
	// sends buffered POST bodies only; other methods and streamed bodies
	// (multipart forms read only as far as their model field) take the
	// Transport.
	direct := n.up != nil && rep.dialAddr != "" && req.upstream == nil && req.upstreamMethod() == http.MethodPost
	ctx := r.Context()
	var (
		cancel context.CancelCauseFunc
		up     *http.Request
	)
	if !direct {
		ctx, cancel = context.WithCancelCause(r.Context())
		defer cancel(nil)
		target := rep.endpoint(req.upstreamPath())
		if r.URL.RawQuery != "" {
			target += "?" + r.URL.RawQuery
		}
		upBody, upLen := upstreamBody(req, body)
		var err error
		up, err = http.NewRequestWithContext(ctx, req.upstreamMethod(), target, upBody)
		if err != nil {
			n.refuse(w, &apiError{status: http.StatusInternalServerError, code: CodeInternal, message: "cannot build upstream request"})
			return attemptDone
		}
		copyHeaders(up.Header, r.Header)
		up.Header.Del(HeaderStrategy)
		up.Header.Del(HeaderPinReplica)
		up.Header.Del(HeaderAdminToken)
		if rep.dpRank != "" {
			up.Header.Set(HeaderDataParallelRank, rep.dpRank)
		}
		up.ContentLength = upLen
		up.Header.Set("Content-Length", strconv.FormatInt(upLen, 10))
	}

	// The self-check's prediction is read before the request is sent, so
	// that the request's own KV events cannot be part of it.
	confirmed := n.confirmedPrediction(dec, keys)

	start := time.Now()
	sentAt := start.UnixNano()
	rep.inflight.Add(1)
	rep.sent(sentAt, dec.Uncached)
	rep.mInflight.Inc()
	queued := int64(dec.Uncached)
	rep.queuedPrefill.Add(queued)
	prefilled := false // relayResult.prefilled, once a response came
	releaseQueued := func() {
		if queued != 0 {
			rep.queuedPrefill.Add(-queued)
			queued = 0
		}
	}
	defer func() {
		releaseQueued()
		rep.inflight.Add(-1)
		rep.ended(sentAt, dec.Uncached, prefilled)
		rep.mInflight.Dec()
	}()

	if !req.arrived.IsZero() {
		n.m.addedLatency.Observe(start.Sub(req.arrived).Seconds())
	}
	var (
		resp *http.Response
		uc   *upConn
		err  error
	)
	if direct {
		resp, uc, err = n.up.roundTrip(ctx, &upstreamReq{addr: rep.dialAddr, host: rep.base.Host,
			path: rep.pathPrefix + req.upstreamPath(), rawQuery: r.URL.RawQuery, hdr: r.Header, body: body, dpRank: rep.dpRank})
	} else {
		resp, err = n.transport.RoundTrip(up)
	}
	if err != nil {
		releaseQueued()
		if shutdownCut(r) {
			n.m.request(rep.model, "error").Inc()
			writeError(w, &apiError{status: http.StatusServiceUnavailable, code: CodeGatewayShutdown,
				message: "gateway shutting down: request cut before the replica answered", retryAfter: 1})
			return attemptDone
		}
		if r.Context().Err() != nil {
			return attemptDone // the client left; nobody to answer
		}
		reason := classifyRoundTripError(ctx, err)
		n.upstreamFailure(rep, reason)
		if reason == reasonConnect && canRetry {
			n.log.Warn("upstream connect failed, retrying on another replica",
				"replica", rep.name, "err", err)
			return attemptRetry
		}
		n.log.Warn("upstream request failed", "replica", rep.name, "reason", reason, "err", err)
		e := &apiError{status: http.StatusBadGateway, code: CodeUpstreamError,
			message: fmt.Sprintf("replica %s: %s", rep.name, reason)}
		if reason == reasonFirstByte {
			e.status, e.code = http.StatusGatewayTimeout, CodeUpstreamTimeout
		}
		n.m.request(rep.model, "error").Inc()
		writeError(w, e)
		return attemptDone
	}
	clean := false // the body was read to its end: the connection may be reused
	if direct {
		defer func() { n.up.release(uc, clean && !resp.Close) }()
	} else {
		defer resp.Body.Close()
	}

	ok := resp.StatusCode >= 200 && resp.StatusCode < 300
	if ok {
		n.recordDecision(rep, dec.Ledger, keys, start.UnixNano())
	}
	h := w.Header()
	copyHeaders(h, resp.Header)
	h.Set(HeaderReplica, rep.name)
	h.Set(HeaderTargetPod, rep.targetPod)
	w.WriteHeader(resp.StatusCode)
	flusher, _ := w.(http.Flusher)
	// The head is flushed at once unless body bytes came with it: then it
	// leaves with the first chunk, in one write (as nginx does).
	if flusher != nil && (uc == nil || uc.br.Buffered() == 0) {
		flusher.Flush()
	}

	streaming := isEventStream(resp.Header)
	// The queued prefill is released at the first body byte: for a stream
	// that is the first token, so the prefill is done.
	var res relayResult
	if rawRelayable(uc, resp) {
		res = n.relayRaw(r.Context(), uc, resp, w, flusher, streaming, rep, queued)
		if res.firstAt != 0 {
			queued = 0 // relayRaw released it
		}
	} else {
		res = n.relay(ctx, r.Context(), cancel, uc, w, flusher, resp.Body, streaming, rep, releaseQueued)
	}
	clean = !res.clientGone && res.err == nil && !res.dirty
	prefilled = res.prefilled(resp.StatusCode)
	n.m.request(rep.model, statusClass(resp.StatusCode)).Inc()
	if !req.arrived.IsZero() {
		n.m.duration(rep.model).Observe(time.Since(req.arrived).Seconds())
	}

	switch {
	case res.clientGone && shutdownCut(r):
		// Shutdown's deadline cut the stream: the client must be able to
		// tell it from a complete answer. The deferred cancel aborts the
		// upstream request.
		if streaming && !res.writeFailed {
			writeCutEvent(w, res.tail, res.bytes)
			return attemptDone
		}
		abortResponse()
	case res.clientGone:
		// The client left: the deferred cancel aborts the upstream request.
		return attemptDone
	case res.err != nil:
		reason := reasonMidStream
		if res.idle || errors.Is(context.Cause(ctx), errIdleTimeout) {
			reason = reasonIdle
		}
		n.upstreamFailure(rep, reason)
		n.log.Warn("upstream body failed", "replica", rep.name, "reason", reason,
			"relayed_bytes", res.bytes, "err", res.err)
		if streaming {
			writeStreamError(w, flusher, res.tail, fmt.Sprintf("replica %s: %s after %d bytes", rep.name, reason, res.bytes))
			return attemptDone
		}
		// A non-streaming body cannot carry an error: abort the connection so
		// the client sees a truncated response, not a short "complete" one.
		panic(http.ErrAbortHandler)
	}
	if resp.StatusCode >= 500 {
		n.upstreamFailure(rep, reasonStatus5xx)
	} else {
		rep.onSuccess()
	}
	if ok {
		u := res.sse.usage
		if !streaming {
			u = parseUsage(res.body.bytes())
		}
		n.checkPrediction(dec, confirmed, u)
	}
	if ok && streaming && res.firstAt != 0 && req.firstByteIsToken() {
		ttft := time.Duration(res.firstAt - start.UnixNano())
		rep.mTTFT.Observe(ttft.Seconds())
		n.observeCost(rep, dec, ttft, res)
	}
	return attemptDone
}

// relayResult is what relay saw of a response body.
type relayResult struct {
	bytes       int64
	firstAt     int64    // unix nanos of the first body byte, 0 if none
	lastAt      int64    // unix nanos of the last body byte
	sse         sseTally // what the SSE events said (streaming only)
	body        bodyTail // the body's last bytes (non-streaming only)
	tail        [2]byte
	clientGone  bool
	writeFailed bool // clientGone because a write to the client failed
	idle        bool // err is the idle timeout (the proxy's own client)
	dirty       bool // relayRaw: the replica sent bytes after the body
	err         error
}

// prefilled says the replica computed the prompt of a request it answered
// with status and res: a successful response's first body byte came (a
// stream's first token, or a whole answer). The send log keeps the
// prompt of such a request, and takes back any other's
// (route.SendLog.Remove).
func (res *relayResult) prefilled(status int) bool {
	return status >= 200 && status < 300 && res.firstAt != 0
}

// relay copies body to w, flushing after every read so that each upstream
// chunk reaches the client as soon as it arrives; the bytes are never
// modified or held back. A read returns every complete chunk the upstream
// connection has buffered (net/http's chunked reader stops only where the
// next chunk is not all there yet), so there is one write and one flush per
// burst of upstream chunks, not per chunk or line. Silence longer than
// IdleTimeout ends the relay: with uc (the proxy's own client) through the
// connection's read deadline (res.idle; see below), else by cancelling ctx
// with errIdleTimeout. onFirst runs when the first body byte arrives.
func (n *Node) relay(ctx, clientCtx context.Context, cancel context.CancelCauseFunc, uc *upConn, w io.Writer, flusher http.Flusher,
	body io.Reader, streaming bool, rep *replica, onFirst func()) relayResult {
	var res relayResult
	bp := bufPool.Get().(*[]byte)
	defer bufPool.Put(bp)
	buf := *bp
	var idle *time.Timer
	if uc == nil {
		idle = time.AfterFunc(n.cfg.IdleTimeout, func() { cancel(errIdleTimeout) })
		defer idle.Stop()
	}
	// With uc the read deadline is moved only when it is less than
	// IdleTimeout after the last byte, and then to 9/8 of it: the relay
	// ends after a silence of IdleTimeout to 1.125·IdleTimeout, and a
	// stream of many chunks re-arms the deadline once in a while instead
	// of per chunk.
	last := time.Now()
	var deadline time.Time
	for {
		if uc != nil && deadline.Sub(last) < n.cfg.IdleTimeout {
			deadline = last.Add(n.cfg.IdleTimeout + n.cfg.IdleTimeout/8)
			_ = uc.SetReadDeadline(deadline)
			// Had the client left before the deadline was set, the past
			// deadline its leaving set would be overwritten.
			if clientCtx.Err() != nil {
				res.clientGone = true
				return res
			}
		}
		nr, rerr := body.Read(buf)
		if nr > 0 {
			last = time.Now()
			now := last.UnixNano()
			if res.firstAt == 0 {
				res.firstAt = now
				onFirst()
			}
			res.lastAt = now
			if idle != nil {
				idle.Reset(n.cfg.IdleTimeout)
			}
			chunk := buf[:nr]
			if streaming {
				res.sse.feed(chunk, now, rep)
			} else {
				res.body.feed(chunk)
			}
			if _, werr := w.Write(chunk); werr != nil {
				res.clientGone, res.writeFailed = true, true
				return res
			}
			if flusher != nil {
				flusher.Flush()
			}
			res.bytes += int64(nr)
			if nr >= 2 {
				res.tail = [2]byte{chunk[nr-2], chunk[nr-1]}
			} else {
				res.tail = [2]byte{res.tail[1], chunk[0]}
			}
		}
		if rerr == io.EOF {
			return res
		}
		if rerr != nil {
			if clientCtx.Err() != nil {
				// The client disconnected (or a forced shutdown cut it).
				res.clientGone = true
				return res
			}
			var ne net.Error
			res.idle = uc != nil && errors.As(rerr, &ne) && ne.Timeout()
			res.err = rerr
			return res
		}
	}
}

// writeStreamError ends a broken SSE stream with an error event the client
// can parse: it first terminates a partially relayed event.
func writeStreamError(w io.Writer, flusher http.Flusher, tail [2]byte, msg string) {
	_, _ = w.Write(streamErrorEvent(tail, http.StatusBadGateway, CodeStreamBroken, msg))
	if flusher != nil {
		flusher.Flush()
	}
}

func isEventStream(h http.Header) bool {
	ct := h.Get("Content-Type")
	return len(ct) >= 17 && ct[:17] == "text/event-stream"
}

func statusClass(code int) string {
	switch {
	case code < 300:
		return "2xx"
	case code < 400:
		return "3xx"
	case code < 500:
		return "4xx"
	}
	return "5xx"
}

// classifyRoundTripError names why a round trip failed before a response.
func classifyRoundTripError(ctx context.Context, err error) string {
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return reasonConnect
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return reasonFirstByte
	}
	if errors.Is(context.Cause(ctx), errIdleTimeout) {
		return reasonIdle
	}
	return reasonReset
}

// upstreamFailure counts a failure against rep and ejects it after
// EjectAfter in a row.
func (n *Node) upstreamFailure(rep *replica, reason string) {
	n.m.upstreamErrors.WithLabelValues(rep.name, reason).Inc()
	ejected, d := rep.onFailure(time.Now().UnixNano(), n.cfg.EjectAfter, n.cfg.EjectBackoff, n.cfg.EjectMaxBackoff)
	if ejected {
		n.m.ejections.WithLabelValues(rep.name).Inc()
		n.log.Warn("replica ejected after consecutive failures", "replica", rep.name,
			"failures", n.cfg.EjectAfter, "for", d, "last_reason", reason)
	}
}

// recordDecision writes the routing decision into the index, in the
// ledger the routing core chose (route.LedgerFor).
func (n *Node) recordDecision(rep *replica, ledger index.Ledger, keys []index.BlockKey, now int64) {
	if len(keys) == 0 {
		return
	}
	if err := n.index.Record(keys, rep.id, ledger, now); err != nil {
		n.log.Error("index record failed", "replica", rep.name, "err", err)
		return
	}
	if h := n.recorder.Load(); h != nil {
		h.l.Recorded(rep.model, rep.name, ledger, keys, now)
	}
}

// observeCost feeds the cost model with what a finished stream showed:
// the routing core's observation, completed with the stream's TTFT and
// output (the usage figure when the engine sent one, else the content
// events) spread over its content events. Where cost made the decision,
// the TTFT over its estimate goes to kvmesh_route_ttft_estimate_ratio.
func (n *Node) observeCost(rep *replica, dec decision, ttft time.Duration, res relayResult) {
	if est := dec.Decision.EstimatedTTFT; est > 0 && ttft > 0 {
		rep.mTTFTEst.Observe(ttft.Seconds() / est)
	}
	t := &res.sse
	out := t.content
	if t.hasUsage {
		out = t.usageTokens
	}
	obs := dec.Observation.Stream(ttft.Seconds(), out, t.content, time.Duration(t.lastAt-t.firstAt).Seconds()).
		Engine(t.usage.prompt, t.usage.cached, t.usage.promptOK && t.usage.cachedOK)
	if t.usage.promptOK && !dec.keyCut {
		// A prompt keyed in part (media parts, a batch keyed by its
		// longest prompt) has more engine tokens than its keyed characters
		// account for: no sample of the characters per token.
		obs = obs.Prompt(t.usage.prompt)
	}
	dec.pool.set.Model().Observe(rep.id, obs)
}
