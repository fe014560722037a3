package node

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"math/big"
	"mime"
	"mime/multipart"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/route"
)

// The endpoint-picker protocol of the Gateway API Inference Extension
// (GIE, docs/proposals/004-endpoint-picker-protocol, v1.0.0): the names the
// data plane and the picker agree on.
const (
	// EPPDestinationHeader carries the pick, "ip:port[,ip:port...]": the
	// first is the primary, the rest are fallbacks in order.
	EPPDestinationHeader = "x-gateway-destination-endpoint"
	// EPPSubsetNamespace/EPPSubsetKey: the filter metadata in which the
	// data plane may restrict the endpoints to pick from.
	EPPSubsetNamespace = "envoy.lb.subset_hint"
	EPPSubsetKey       = "x-gateway-destination-endpoint-subset"
	// EPPPickNamespace: the dynamic metadata namespace of the pick, and the
	// filter metadata namespace in which the data plane reports the
	// endpoint that served the request (EPPServedKey).
	EPPPickNamespace = "envoy.lb"
	EPPServedKey     = "x-gateway-destination-endpoint-served"
	// Health services the protocol names, besides the overall "".
	EPPHealthLiveness  = "liveness"
	EPPHealthReadiness = "readiness"
)

// EPPConfig configures the endpoint picker (Config.EPP): an Envoy ext_proc
// gRPC server that answers where each request goes instead of proxying it.
// Every gateway of a cluster answers as an active picker over the one
// shared index.
type EPPConfig struct {
	// Addr is the listen address of the picker; "" turns it off.
	Addr string `yaml:"addr"`
	// CertFile is the picker's TLS certificate (PEM), with KeyFile. With
	// neither, the picker makes a self-signed certificate at start:
	// Envoy-based gateways talk TLS to a GIE picker and, by default,
	// verify nothing, so this matches them out of the box.
	CertFile string `yaml:"cert_file"`
	// KeyFile is the key of CertFile (PEM).
	KeyFile string `yaml:"key_file"`
	// Plaintext turns the picker's TLS off (a service mesh that wraps the
	// connection in its own mTLS). Default false.
	Plaintext bool `yaml:"plaintext"`
	// Fallbacks is how many further endpoints follow the pick, in the order
	// the strategy ranks them, for the data plane's retries. 0 sends the
	// pick alone.
	Fallbacks int `yaml:"fallbacks"`
}

func (c *EPPConfig) validate(bad func(string, ...any)) {
	if c.Fallbacks < 0 || c.Fallbacks > 8 {
		bad("epp.fallbacks %d is out of range [0, 8]", c.Fallbacks)
	}
	if (c.CertFile == "") != (c.KeyFile == "") {
		bad("epp.cert_file and epp.key_file go together")
	}
	if c.Plaintext && c.CertFile != "" {
		bad("epp.plaintext contradicts epp.cert_file")
	}
}

// eppParts is the running picker.
type eppParts struct {
	srv    *grpc.Server
	ln     net.Listener
	health *health.Server
	m      eppMetrics
}

type eppMetrics struct {
	requests *prometheus.CounterVec // result
	served   *prometheus.CounterVec // which pick served the request
	streams  prometheus.Gauge
}

// EPP results (kvmesh_epp_requests_total{result}).
const (
	eppPicked     = "picked"
	eppNoEndpoint = "no_endpoint"
	eppShed       = "shed"
	eppRejected   = "rejected" // the request itself was refused (4xx)
)

func newEPPMetrics(reg prometheus.Registerer) eppMetrics {
	m := eppMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_epp_requests_total",
			Help: "Endpoint-picker requests by result: picked, no_endpoint (503), shed (429), rejected (4xx).",
		}, []string{"result"}),
		served: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_epp_served_total",
			Help: "Picked requests by the endpoint the data plane reported as served: primary, fallback, other (not one of the picks) or unreported.",
		}, []string{"by"}),
		streams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvmesh_epp_streams",
			Help: "ext_proc streams open on the endpoint picker.",
		}),
	}
	reg.MustRegister(m.requests, m.served, m.streams)
	return m
}

// listenEPP makes the picker's certificate and listener (nil when the
// picker is off); serveEPP starts serving on it once the Node runs.
func (n *Node) listenEPP(ctx context.Context) (*eppParts, error) {
	c := n.cfg.EPP
	if c.Addr == "" {
		return nil, nil
	}
	var opts []grpc.ServerOption
	if !c.Plaintext {
		cert, err := eppCertificate(c)
		if err != nil {
			return nil, err
		}
		opts = append(opts, grpc.Creds(credentials.NewTLS(&tls.Config{
			Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12})))
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", c.Addr)
	if err != nil {
		return nil, fmt.Errorf("node: epp listen %s: %w", c.Addr, err)
	}
	return &eppParts{srv: grpc.NewServer(opts...), ln: ln, health: health.NewServer()}, nil
}

// close closes a picker listener that never served (a failed Start).
func (e *eppParts) close() {
	if e != nil {
		_ = e.ln.Close()
	}
}

// serveEPP serves the picker and the gRPC health services on e.
func (n *Node) serveEPP(e *eppParts) {
	if e == nil {
		return
	}
	c := n.cfg.EPP
	e.m = newEPPMetrics(n.m.reg)
	extprocv3.RegisterExternalProcessorServer(e.srv, &eppServer{n: n, m: &e.m})
	healthpb.RegisterHealthServer(e.srv, e.health)
	n.epp = e
	// Start holds n.mu, which Ready takes: readiness comes with the
	// first tick.
	e.health.SetServingStatus(EPPHealthLiveness, healthpb.HealthCheckResponse_SERVING)
	for _, svc := range []string{EPPHealthReadiness, extprocv3.ExternalProcessor_ServiceDesc.ServiceName, ""} {
		e.health.SetServingStatus(svc, healthpb.HealthCheckResponse_NOT_SERVING)
	}
	n.goFunc(func() {
		if err := e.srv.Serve(e.ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			n.log.Error("endpoint picker stopped", "err", err)
		}
	})
	n.goFunc(func() {
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-n.bgCtx.Done():
				return
			case <-t.C:
				n.updateEPPHealth()
			}
		}
	})
	n.log.Info("endpoint picker listening", "addr", e.ln.Addr().String(), "tls", !c.Plaintext,
		"self_signed", !c.Plaintext && c.CertFile == "", "fallbacks", c.Fallbacks)
}

// EPPAddr is the picker's address (with the real port), or "" when off.
func (n *Node) EPPAddr() string {
	if n.epp == nil {
		return ""
	}
	return n.epp.ln.Addr().String()
}

// updateEPPHealth publishes liveness (serving until shutdown) and
// readiness (Node.Ready) on the gRPC health services the protocol names.
func (n *Node) updateEPPHealth() {
	live, ready := healthpb.HealthCheckResponse_SERVING, healthpb.HealthCheckResponse_NOT_SERVING
	if n.stopping.Load() {
		live = healthpb.HealthCheckResponse_NOT_SERVING
	}
	if n.Ready() {
		ready = healthpb.HealthCheckResponse_SERVING
	}
	h := n.epp.health
	h.SetServingStatus(EPPHealthLiveness, live)
	h.SetServingStatus(EPPHealthReadiness, ready)
	h.SetServingStatus(extprocv3.ExternalProcessor_ServiceDesc.ServiceName, ready)
	h.SetServingStatus("", ready)
}

// stopEPP lets open streams finish until ctx is done, then cuts them.
func (n *Node) stopEPP(ctx context.Context) {
	if n.epp == nil {
		return
	}
	n.updateEPPHealth()
	done := make(chan struct{})
	go func() {
		n.epp.srv.GracefulStop()
		close(done)
	}()
	select {
	case <-done:
	case <-ctx.Done():
		n.epp.srv.Stop()
		<-done
	}
}

// eppCertificate loads the configured certificate or makes a self-signed
// one valid for a day past any plausible process lifetime.
func eppCertificate(c EPPConfig) (tls.Certificate, error) {
	if c.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(c.CertFile, c.KeyFile)
		if err != nil {
			return tls.Certificate{}, fmt.Errorf("node: epp certificate: %w", err)
		}
		return cert, nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return tls.Certificate{}, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "kvmesh-epp"},
		DNSNames:     []string{"kvmesh-epp", "localhost"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.AddDate(10, 0, 0),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

// eppServer is the ext_proc service: one Process stream per HTTP request.
type eppServer struct {
	extprocv3.UnimplementedExternalProcessorServer
	n *Node
	m *eppMetrics
}

// Process serves one HTTP request's exchange. The request's body is
// gathered (bounded by MaxBodyBytes) and routed as the proxy routes it;
// then, in the order the protocol requires, the headers response carries
// the pick (header and envoy.lb dynamic metadata) and the body goes back
// unchanged. On the response path the served endpoint is read back to
// confirm which replica took the request: that is the one whose in-flight
// count it holds and whose ledger records the prompt. Full-duplex streamed
// bodies are the protocol's mode and the default; buffered and header-only
// exchanges are served too when Envoy's protocol_config says so.
func (e *eppServer) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	e.m.streams.Inc()
	defer e.m.streams.Dec()
	x := &eppExchange{n: e.n, m: e.m, stream: stream, reqStreamed: true, respStreamed: true}
	defer x.finish()
	for {
		msg, err := stream.Recv()
		if err == io.EOF || status.Code(err) == codes.Canceled {
			return nil
		}
		if err != nil {
			return err
		}
		if pc := msg.GetProtocolConfig(); pc != nil {
			x.reqStreamed = pc.GetRequestBodyMode() == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
			x.respStreamed = pc.GetResponseBodyMode() == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
		}
		done, err := x.handle(msg)
		if err != nil || done {
			return err
		}
	}
}

// eppExchange is one request's state on the picker.
type eppExchange struct {
	n      *Node
	m      *eppMetrics
	stream extprocv3.ExternalProcessor_ProcessServer

	reqStreamed, respStreamed bool

	hdr     http.Header
	method  string
	path    string
	query   string
	subset  []string // nil: no hint
	hinted  bool
	body    []byte
	decided bool

	// The pick and its accounting (held from the decision to the end of
	// the response).
	pool      *pool
	req       *inferenceRequest
	dec       decision
	confirmed int        // the self-check's prediction (confirmedPrediction)
	picks     []*replica // primary first, then fallbacks
	served    *replica   // the one holding the in-flight count
	sentAt    int64      // when it was sent to served (unix nanos; replica.sent)
	keys      []index.BlockKey
	queued    int64
	start     time.Time
	limited   bool
	finished  bool
	firstByte bool

	// What the response showed, for passive health, the self-check and
	// the cost model, as the proxy's relay reads it.
	status    int
	streaming bool
	res       relayResult
}

func (x *eppExchange) handle(msg *extprocv3.ProcessingRequest) (done bool, err error) {
	switch v := msg.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		x.readHeaders(msg, v.RequestHeaders)
		if v.RequestHeaders.GetEndOfStream() {
			return x.decide(false, false)
		}
		if !x.reqStreamed {
			// Buffered (or no body sent): the headers go on unchanged
			// now, the pick rides on the body response.
			return false, x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
				RequestHeaders: &extprocv3.HeadersResponse{}}})
		}
	case *extprocv3.ProcessingRequest_RequestBody:
		b := v.RequestBody
		if int64(len(x.body)+len(b.GetBody())) > x.n.cfg.MaxBodyBytes {
			return x.reject(&apiError{status: http.StatusRequestEntityTooLarge, code: CodeBodyTooLarge,
				message: fmt.Sprintf("request body exceeds the %d-byte limit", x.n.cfg.MaxBodyBytes)})
		}
		x.body = append(x.body, b.GetBody()...)
		if b.GetEndOfStream() {
			return x.decide(true, true)
		}
	case *extprocv3.ProcessingRequest_RequestTrailers:
		if !x.decided {
			if done, err := x.decide(true, false); done || err != nil {
				return done, err
			}
		}
		return false, x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
			RequestTrailers: &extprocv3.TrailersResponse{}}})
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		x.responseHeaders(msg, v.ResponseHeaders)
		if err := x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
			ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
				HeaderMutation: x.responseHeaderMutation()}}}}); err != nil {
			return false, err
		}
		if v.ResponseHeaders.GetEndOfStream() && x.served != nil {
			x.complete()
			x.finish()
		}
	case *extprocv3.ProcessingRequest_ResponseBody:
		b := v.ResponseBody
		x.releaseQueued()
		x.observeBody(b.GetBody())
		var r *extprocv3.BodyResponse
		if x.respStreamed {
			r = &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
				Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{
					Body: b.GetBody(), EndOfStream: b.GetEndOfStream()}}}}}
		} else {
			r = &extprocv3.BodyResponse{}
		}
		if err := x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: r}}); err != nil {
			return false, err
		}
		if b.GetEndOfStream() && x.served != nil && !x.finished {
			x.complete()
			x.finish()
		}
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		if x.served != nil && !x.finished {
			x.complete()
			x.finish()
		}
		return false, x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
			ResponseTrailers: &extprocv3.TrailersResponse{}}})
	}
	return false, nil
}

func (x *eppExchange) send(r *extprocv3.ProcessingResponse) error { return x.stream.Send(r) }

// readHeaders takes the request's headers and the subset hint.
func (x *eppExchange) readHeaders(msg *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders) {
	x.hdr = http.Header{}
	for _, hv := range h.GetHeaders().GetHeaders() {
		v := headerText(hv)
		switch k := strings.ToLower(hv.GetKey()); k {
		case ":method":
			x.method = v
		case ":path":
			p, q, _ := strings.Cut(v, "?")
			x.path, x.query = p, q
		default:
			if !strings.HasPrefix(k, ":") {
				x.hdr.Add(k, v)
			}
		}
	}
	if x.method == "" {
		x.method = http.MethodPost
	}
	if ns, ok := msg.GetMetadataContext().GetFilterMetadata()[EPPSubsetNamespace]; ok {
		if v, ok := ns.GetFields()[EPPSubsetKey]; ok {
			x.hinted = true
			x.subset = endpointList(v)
		}
	}
}

// headerText is an ext_proc header's value: Envoy sends raw_value, older
// data planes value.
func headerText(hv *corev3.HeaderValue) string {
	if v := hv.GetRawValue(); len(v) > 0 {
		return string(v)
	}
	return hv.GetValue()
}

// endpointList reads a list of "ip:port" from a metadata value: a list of
// strings, or one string of comma-separated endpoints.
func endpointList(v *structpb.Value) []string {
	var out []string
	add := func(s string) {
		for e := range strings.SplitSeq(s, ",") {
			if e = strings.TrimSpace(e); e != "" {
				out = append(out, e)
			}
		}
	}
	if l := v.GetListValue(); l != nil {
		for _, e := range l.GetValues() {
			add(e.GetStringValue())
		}
	} else {
		add(v.GetStringValue())
	}
	return out
}

// decide routes the request and sends the pick: on the headers response
// when the exchange is streamed (followed by the body, unchanged), or on
// the body response when it is buffered. withBody says a body was sent;
// bodyDone that the body ended with the last chunk (no trailers follow).
func (x *eppExchange) decide(withBody, bodyDone bool) (bool, error) {
	x.decided = true
	n := x.n
	if n.cfg.MaxInFlight > 0 {
		if n.inflight.cur.Add(1) > n.inflight.max {
			n.inflight.cur.Add(-1)
			x.m.requests.WithLabelValues(eppShed).Inc()
			return true, x.immediate(&apiError{status: http.StatusTooManyRequests, code: CodeOverloaded,
				message: fmt.Sprintf("gateway at its in-flight limit of %d requests", n.inflight.max), retryAfter: 1})
		}
		x.limited = true
	}
	if aerr := x.pick(); aerr != nil {
		if aerr.status == http.StatusServiceUnavailable {
			x.m.requests.WithLabelValues(eppNoEndpoint).Inc()
		} else {
			x.m.requests.WithLabelValues(eppRejected).Inc()
		}
		return true, x.immediate(aerr)
	}
	x.m.requests.WithLabelValues(eppPicked).Inc()

	dests := make([]string, len(x.picks))
	for i, r := range x.picks {
		dests[i] = r.targetPod
	}
	dest := strings.Join(dests, ",")
	mutation := &extprocv3.HeaderMutation{
		SetHeaders: []*corev3.HeaderValueOption{{
			Header:       &corev3.HeaderValue{Key: EPPDestinationHeader, RawValue: []byte(dest)},
			AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
		}},
		// The gateway's own request headers stop here, as in proxy mode.
		RemoveHeaders: []string{strings.ToLower(HeaderStrategy), strings.ToLower(HeaderPinReplica), strings.ToLower(HeaderAdminToken)},
	}
	meta := &structpb.Struct{Fields: map[string]*structpb.Value{
		EPPPickNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			EPPDestinationHeader: structpb.NewStringValue(dest)}}),
	}}
	if !withBody || x.reqStreamed {
		if err := x.send(&extprocv3.ProcessingResponse{DynamicMetadata: meta,
			Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
				Response: &extprocv3.CommonResponse{HeaderMutation: mutation}}}}); err != nil {
			return false, err
		}
		if !withBody {
			return false, nil
		}
		return false, x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
				Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{
					Body: x.body, EndOfStream: bodyDone}}}}}}})
	}
	return false, x.send(&extprocv3.ProcessingResponse{DynamicMetadata: meta,
		Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: mutation}}}})
}

// pick reads the request as the proxy would, routes it among the hinted
// subset of its model's pool, and takes the in-flight and queued-prefill
// accounting on the primary.
func (x *eppExchange) pick() *apiError {
	n := x.n
	ep := findEndpoint(x.path)
	if ep == nil {
		return &apiError{status: http.StatusNotFound, code: CodeNotFound, message: fmt.Sprintf("no route for %s", truncatePath(x.path))}
	}
	if !ep.allows(x.method) {
		return &apiError{status: http.StatusMethodNotAllowed, code: CodeMethodNotAllowed, message: "use " + strings.Join(ep.methods, " or ")}
	}
	var req *inferenceRequest
	var aerr *apiError
	switch ep.shape {
	case shapeMultipart:
		req, aerr = multipartModel(x.hdr.Get("Content-Type"), x.body, x.path)
	case shapeResponseByID:
		req = &inferenceRequest{kind: kindCompletions, partial: true, method: x.method, path: x.path, responseID: responseIDOf(x.path)}
	default:
		req, aerr = parseEndpoint(ep, x.path, x.body)
	}
	if aerr != nil {
		return aerr
	}
	r := &http.Request{Method: x.method, URL: &url.URL{Path: x.path, RawQuery: x.query}, Header: x.hdr}
	ctx := x.stream.Context()
	p, lora, strat, pinned, aerr := n.endpointRoute(ctx, r, ep, req)
	if aerr != nil {
		return aerr
	}
	sub := p
	if x.hinted {
		sub = subsetPool(p, x.subset)
		if len(sub.replicas) == 0 {
			return &apiError{status: http.StatusServiceUnavailable, code: CodeNoHealthyReplica,
				message: fmt.Sprintf("no replica of model %q among the %d endpoints of the subset hint", p.model, len(x.subset)), retryAfter: 1}
		}
	}

	s := getScratch()
	defer putScratch(s)
	rr, keys := n.prepare(ctx, sub, lora, req, s)
	rr.Now = time.Now().UnixNano()
	s.rng = n.newRand()
	t0 := time.Now()
	dec, earliest, err := n.routeOnce(sub, strat, keys, &rr, s, nil, nil)
	if err != nil {
		return &apiError{status: http.StatusServiceUnavailable, code: CodeNoHealthyReplica,
			message: fmt.Sprintf("no healthy replica for model %q", p.model), retryAfter: retryAfterSeconds(rr.Now, earliest)}
	}
	n.observeDecision(p, dec, time.Since(t0))
	x.picks = append(x.picks, dec.rep)
	// Fallbacks: the strategy's next choices with the earlier picks
	// excluded, so a retry lands where the strategy would have sent it.
	if pinned == "" {
		for len(x.picks) <= n.cfg.EPP.Fallbacks {
			rest := withoutReplicas(sub, x.picks)
			if len(rest.replicas) == 0 {
				break
			}
			s.rng = n.newRand()
			fb, _, err := n.routeOnce(rest, strat, keys, &rr, s, nil, nil)
			if err != nil {
				break
			}
			x.picks = append(x.picks, fb.rep)
		}
	}
	x.pool, x.req, x.dec, x.keys = p, req, dec, slices.Clone(keys)
	x.confirmed = n.confirmedPrediction(dec, keys)
	x.start = time.Now()
	x.queued = int64(dec.Uncached)
	x.hold(dec.rep)
	return nil
}

// hold moves the request's in-flight and queued-prefill accounting to rep.
func (x *eppExchange) hold(rep *replica) {
	if x.served == rep {
		return
	}
	if x.served != nil {
		x.served.inflight.Add(-1)
		x.served.ended(x.sentAt, x.dec.Uncached, false) // it never had the request
		x.served.mInflight.Dec()
		x.served.queuedPrefill.Add(-x.queued)
	}
	x.served, x.sentAt = rep, nowNanos()
	rep.inflight.Add(1)
	rep.sent(x.sentAt, x.dec.Uncached)
	rep.mInflight.Inc()
	rep.queuedPrefill.Add(x.queued)
}

// releaseQueued ends the queued-prefill estimate at the first response
// byte, as the proxy does.
func (x *eppExchange) releaseQueued() {
	if x.firstByte {
		return
	}
	x.firstByte = true
	if x.served != nil && x.queued != 0 {
		x.served.queuedPrefill.Add(-x.queued)
	}
	x.queued = 0
}

// responseHeaders confirms which endpoint served the request and records
// the prompt in its ledger on success.
func (x *eppExchange) responseHeaders(msg *extprocv3.ProcessingRequest, h *extprocv3.HttpHeaders) {
	if x.served == nil {
		return
	}
	code := 0
	for _, hv := range h.GetHeaders().GetHeaders() {
		v := headerText(hv)
		switch strings.ToLower(hv.GetKey()) {
		case ":status":
			code, _ = strconv.Atoi(v)
		case "content-type":
			x.streaming = strings.HasPrefix(v, "text/event-stream")
		}
	}
	x.status = code
	by := "unreported"
	if ns, ok := msg.GetMetadataContext().GetFilterMetadata()[EPPPickNamespace]; ok {
		if v, ok := ns.GetFields()[EPPServedKey]; ok {
			by = "other"
			served := v.GetStringValue()
			for i, r := range x.picks {
				if r.targetPod == served {
					by = "primary"
					if i > 0 {
						by = "fallback"
					}
					x.hold(r)
					break
				}
			}
			if by == "other" {
				x.n.log.Warn("endpoint picker: the data plane served a request elsewhere than picked",
					"served", served, "picked", x.picks[0].name)
			}
		}
	}
	x.m.served.WithLabelValues(by).Inc()
	if code >= 200 && code < 300 {
		// The ledger of the replica that served, which a fallback may be.
		ledger := route.LedgerFor(x.pool.mode, x.served.cfg.PublishesKVEvents())
		x.n.recordDecision(x.served, ledger, x.keys, x.start.UnixNano())
	}
}

// responseHeaderMutation names the replica that served the request, as
// the proxy's response does.
func (x *eppExchange) responseHeaderMutation() *extprocv3.HeaderMutation {
	if x.served == nil {
		return nil
	}
	return &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
		Header:       &corev3.HeaderValue{Key: strings.ToLower(HeaderReplica), RawValue: []byte(x.served.name)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
	}}}
}

// observeBody tallies a response chunk as the proxy's relay does.
func (x *eppExchange) observeBody(b []byte) {
	if len(b) == 0 || x.served == nil {
		return
	}
	now := time.Now().UnixNano()
	if x.res.firstAt == 0 {
		x.res.firstAt = now
	}
	x.res.lastAt = now
	x.res.bytes += int64(len(b))
	if x.streaming {
		x.res.sse.feed(b, now, x.served)
	} else {
		x.res.body.feed(b)
	}
}

// complete takes what a response that reached its end showed: the
// replica's passive health, the self-check against the engine's cached
// tokens, and the cost model's observation (streams only, as in the
// proxy).
func (x *eppExchange) complete() {
	n, rep := x.n, x.served
	if x.status >= 500 {
		n.upstreamFailure(rep, reasonStatus5xx)
		return
	}
	rep.onSuccess()
	if x.status < 200 || x.status >= 300 {
		return
	}
	u := x.res.sse.usage
	if !x.streaming {
		u = parseUsage(x.res.body.bytes())
	}
	n.checkPrediction(x.dec, x.confirmed, u)
	if x.streaming && x.res.firstAt != 0 && x.req.firstByteIsToken() {
		ttft := time.Duration(x.res.firstAt - x.start.UnixNano())
		rep.mTTFT.Observe(ttft.Seconds())
		n.observeCost(rep, x.dec, ttft, x.res)
	}
}

// finish releases the request's accounting once; it runs at the end of
// the response (complete says it reached its end) or when the stream
// ends, whichever is first.
func (x *eppExchange) finish() {
	if x.finished {
		return
	}
	x.finished = true
	if x.served != nil {
		x.releaseQueued()
		x.served.inflight.Add(-1)
		x.served.ended(x.sentAt, x.dec.Uncached, x.res.prefilled(x.status))
		x.served.mInflight.Dec()
	}
	if x.limited {
		x.n.inflight.cur.Add(-1)
	}
}

// immediate answers the client directly (no endpoint is picked) with the
// gateway's own error body.
func (x *eppExchange) immediate(e *apiError) error {
	x.n.m.clientErrors.WithLabelValues(e.code).Inc()
	hdrs := []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: "content-type", RawValue: []byte("application/json")}}}
	if e.retryAfter > 0 {
		hdrs = append(hdrs, &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: "retry-after", RawValue: []byte(strconv.Itoa(e.retryAfter))}})
	}
	return x.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{
			Status:  &typev3.HttpStatus{Code: typev3.StatusCode(e.status)},
			Headers: &extprocv3.HeaderMutation{SetHeaders: hdrs},
			Body:    errorJSON(e.status, e.code, e.message),
			Details: e.code,
		}}})
}

func (x *eppExchange) reject(e *apiError) (bool, error) {
	x.m.requests.WithLabelValues(eppRejected).Inc()
	return true, x.immediate(e)
}

// subsetPool is p restricted to the replicas whose endpoint is in hint.
func subsetPool(p *pool, hint []string) *pool {
	sub := *p
	sub.replicas = nil
	for _, r := range p.replicas {
		if slices.Contains(hint, r.targetPod) {
			sub.replicas = append(sub.replicas, r)
		}
	}
	return &sub
}

// withoutReplicas is p without the replicas in drop.
func withoutReplicas(p *pool, drop []*replica) *pool {
	sub := *p
	sub.replicas = nil
	for _, r := range p.replicas {
		if !slices.Contains(drop, r) {
			sub.replicas = append(sub.replicas, r)
		}
	}
	return &sub
}

// multipartModel reads the "model" field of a buffered multipart form.
func multipartModel(contentType string, body []byte, path string) (*inferenceRequest, *apiError) {
	mt, params, err := mime.ParseMediaType(contentType)
	if err != nil || mt != "multipart/form-data" || params["boundary"] == "" {
		return nil, errBadRequest(CodeInvalidMultipart, "the body must be multipart/form-data with a boundary")
	}
	mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
	req := &inferenceRequest{kind: kindCompletions, partial: true, path: path}
	for {
		part, err := mr.NextPart()
		if err == io.EOF {
			return req, nil // no model field: the only pool's, as vLLM would
		}
		if err != nil {
			return nil, errBadRequest(CodeInvalidMultipart, "unreadable multipart body")
		}
		if part.FormName() == "model" {
			v, err := io.ReadAll(io.LimitReader(part, 1024))
			if err != nil || len(v) == 0 {
				return nil, errBadRequest(CodeInvalidField, `field "model" must be a non-empty string`)
			}
			req.model = string(v)
			return req, nil
		}
	}
}
