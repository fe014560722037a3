package node

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/route"
)

// HTTP edges: who may see the debug views, who may pin a request to a
// replica, and how much work one gateway accepts at once.

// Request headers of the HTTP edges.
const (
	// HeaderAdminToken carries the admin token on requests that are not
	// admin API calls: a pinned inference request (it is removed before
	// the request goes upstream, unlike Authorization, which an engine
	// with --api-key needs). The debug views also accept
	// "Authorization: Bearer <token>".
	HeaderAdminToken = "x-kvmesh-admin-token"
	// HeaderPinReplica names the replica an inference request must go to,
	// bypassing the strategy (kvmesh doctor's KV-stream identity probe).
	// It requires the admin token in HeaderAdminToken.
	HeaderPinReplica = "x-kvmesh-pin-replica"
)

// Client error codes of the HTTP edges.
const (
	CodeUnauthorized = "unauthorized"
	CodeOverloaded   = "gateway_overloaded"
	CodeUnknownPin   = "unknown_replica"
)

// adminAuth holds the SHA-256 of the admin token; the zero value refuses
// everything.
type adminAuth struct {
	set  bool
	want [32]byte
}

func newAdminAuth(token string) adminAuth {
	if token == "" {
		return adminAuth{}
	}
	return adminAuth{set: true, want: sha256.Sum256([]byte(token))}
}

// allows reports whether r carries the admin token, in HeaderAdminToken or
// as a bearer token. Comparison is constant-time over hashes.
func (a adminAuth) allows(r *http.Request) bool {
	if !a.set {
		return false
	}
	tok := r.Header.Get(HeaderAdminToken)
	if tok == "" {
		h := r.Header.Get("Authorization")
		if len(h) > 7 && strings.EqualFold(h[:7], "bearer ") {
			tok = strings.TrimSpace(h[7:])
		}
	}
	if tok == "" {
		return false
	}
	got := sha256.Sum256([]byte(tok))
	return subtle.ConstantTimeCompare(got[:], a.want[:]) == 1
}

// debugGate serves h only to holders of the admin token, unless
// Config.DebugPublic.
func (n *Node) debugGate(h http.HandlerFunc) http.HandlerFunc {
	return n.tokenGate(h, n.cfg.DebugPublic, "debug views", ", or --debug-public")
}

// profileGate serves h only to holders of the admin token, whatever
// Config.DebugPublic says: a CPU profile or an execution trace keeps the
// gateway busy for as long as the caller asks, and goroutine stacks and
// the command line describe the deployment.
func (n *Node) profileGate(h http.HandlerFunc) http.HandlerFunc {
	return n.tokenGate(h, false, "profiles", "")
}

// tokenGate serves h to holders of the admin token, and to anyone when
// public. The 401 names the views (what) and, on a gateway without a
// token, how to open them (the token, then orElse).
func (n *Node) tokenGate(h http.HandlerFunc, public bool, what, orElse string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !public && !n.admin.allows(r) {
			msg := what + " require the admin token (Authorization: Bearer <token>)"
			if !n.admin.set {
				msg = what + " require the admin token, and this gateway has none: set KVMESH_ADMIN_TOKEN (or --admin-token-file)" + orElse
			}
			n.refuse(w, &apiError{status: http.StatusUnauthorized, code: CodeUnauthorized, message: msg})
			return
		}
		h(w, r)
	}
}

// limiter bounds the requests a gateway handles at once (Config.MaxInFlight).
type limiter struct {
	max int64
	cur atomic.Int64
}

// limit answers 429 with Retry-After when MaxInFlight requests are already
// running, before reading the body.
func (n *Node) limit(h http.Handler) http.Handler {
	if n.cfg.MaxInFlight <= 0 {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.inflight.cur.Add(1) > n.inflight.max {
			n.inflight.cur.Add(-1)
			w.Header().Set("Connection", "close") // the body is not read
			n.refuse(w, &apiError{status: http.StatusTooManyRequests, code: CodeOverloaded,
				message: fmt.Sprintf("gateway at its in-flight limit of %d requests", n.inflight.max), retryAfter: 1})
			return
		}
		defer n.inflight.cur.Add(-1)
		h.ServeHTTP(w, r)
	})
}

func (m *metrics) registerEdges(n *Node) {
	m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvmesh_http_inflight_requests",
		Help: "Inference and /debug/route requests this gateway handles now (bounded by --max-in-flight; refusals count in kvmesh_http_client_errors_total{code=\"gateway_overloaded\"}).",
	}, func() float64 { return float64(n.inflight.cur.Load()) }))
}

// pinStrategy routes to one named replica: the pin header's, or the one
// that stored a Responses API response. routeOnce makes that replica the
// only candidate; Pick returns the first candidate when it is not among
// them.
type pinStrategy struct{ name string }

var _ route.Strategy = pinStrategy{}

func (pinStrategy) Name() string { return "pinned" }

func (s pinStrategy) Pick(req *route.Request, cands []route.Candidate, _ *route.Rand, explain *route.Explanation) route.Decision {
	var d route.Decision
	for i := range cands {
		if cands[i].Name == s.name {
			d.Index = i
			break
		}
	}
	if explain != nil {
		explain.RecordPick(s.Name(), req, cands, d)
	}
	return d
}

// pinFor resolves a request's HeaderPinReplica: (nil, nil) without one.
func (n *Node) pinFor(r *http.Request, p *pool) (route.Strategy, *apiError) {
	name := headerValue(r.Header, canonPin)
	if name == "" {
		return nil, nil
	}
	if !n.admin.allows(r) {
		return nil, &apiError{status: http.StatusUnauthorized, code: CodeUnauthorized,
			message: HeaderPinReplica + " requires the admin token in " + HeaderAdminToken}
	}
	for _, rep := range p.replicas {
		if rep.name == name {
			return pinStrategy{name: name}, nil
		}
	}
	return nil, errBadRequest(CodeUnknownPin, fmt.Sprintf("replica %q does not serve model %q", name, p.model))
}

// specDigest identifies a routing spec: the first 16 hex digits of the
// SHA-256 of its JSON form (version excluded).
func specDigest(s routingSpec) string {
	data, err := json.Marshal(struct {
		Strategy string
		Mode     string
		Route    route.Config
		Models   []ModelConfig
	}{s.strategy, s.mode, s.route, s.models})
	if err != nil {
		return "unknown"
	}
	sum := sha256.Sum256(data)
	return fmt.Sprintf("%x", sum[:8])
}
