// Package extproc is a minimal data plane for testing endpoint pickers: an
// HTTP reverse proxy that asks a Gateway API Inference Extension endpoint
// picker (EPP) where each request goes over Envoy's ext_proc protocol, then
// sends the request there, as an Envoy-based gateway configured for an
// InferencePool does.
//
// It stands in for Envoy because Envoy itself cannot run here (no Debian
// package, no download). It speaks the protocol from Envoy's published Go
// protos over a real gRPC stream and follows the parts of Envoy's
// behaviour a picker depends on: full-duplex streamed request and response
// bodies (the request body cut into chunks), the protocol_config on the
// first message, the subset hint in filter metadata, the pick taken from
// the x-gateway-destination-endpoint header (primary then fallbacks, tried
// in order on a connect failure), the header mutations applied, the served
// endpoint reported in the response's metadata context, and immediate
// responses written to the client as they are. It does not model Envoy's
// timeouts, retries on response codes, or flow control.
package extproc

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"
)

// The protocol's names (GIE docs/proposals/004-endpoint-picker-protocol).
const (
	destinationHeader = "x-gateway-destination-endpoint"
	subsetNamespace   = "envoy.lb.subset_hint"
	subsetKey         = "x-gateway-destination-endpoint-subset"
	lbNamespace       = "envoy.lb"
	servedKey         = "x-gateway-destination-endpoint-served"
)

// ErrNoPicker is returned when no picker answered.
var ErrNoPicker = errors.New("extproc: no endpoint picker answered")

// Config configures a DataPlane.
type Config struct {
	// Pickers are the pickers' gRPC addresses, tried in order per request
	// (a failed one is skipped: picker failover).
	Pickers []string
	// TLS dials the pickers with TLS and verifies nothing, as Envoy
	// Gateway's generated configuration does for a GIE picker.
	TLS bool
	// ChunkBytes cuts the request body sent to the picker. Default 4 KiB.
	ChunkBytes int
	// Subset, if set, returns the subset hint for a request (nil: none).
	Subset func(*http.Request) []string
	// Buffered sends the request body in one message in BUFFERED mode
	// instead of full-duplex streamed chunks.
	Buffered bool
}

// DataPlane is an http.Handler; Close releases its picker connections.
type DataPlane struct {
	cfg    Config
	conns  []*grpc.ClientConn
	client *http.Client
	// Served counts requests by the position of the endpoint that served
	// them in the pick (0 primary, 1 first fallback, ...).
	served [4]atomic.Int64
	// PickerFailovers counts requests that a picker other than the first
	// answered.
	failovers atomic.Int64
}

// New dials the pickers (lazily, as gRPC does).
func New(cfg Config) (*DataPlane, error) {
	if len(cfg.Pickers) == 0 {
		return nil, fmt.Errorf("extproc: no picker address")
	}
	if cfg.ChunkBytes <= 0 {
		cfg.ChunkBytes = 4 << 10
	}
	creds := insecure.NewCredentials()
	if cfg.TLS {
		creds = credentials.NewTLS(&tls.Config{InsecureSkipVerify: true}) //nolint:gosec // as Envoy Gateway's default
	}
	d := &DataPlane{cfg: cfg, client: &http.Client{Transport: &http.Transport{
		MaxIdleConnsPerHost: 256, DisableCompression: true,
		DialContext: (&net.Dialer{Timeout: 2 * time.Second}).DialContext,
	}}}
	for _, a := range cfg.Pickers {
		c, err := grpc.NewClient(a, grpc.WithTransportCredentials(creds))
		if err != nil {
			_ = d.Close()
			return nil, err
		}
		d.conns = append(d.conns, c)
	}
	return d, nil
}

// Close closes the picker connections.
func (d *DataPlane) Close() error {
	var errs []error
	for _, c := range d.conns {
		errs = append(errs, c.Close())
	}
	d.client.CloseIdleConnections()
	return errors.Join(errs...)
}

// Served returns how many requests the endpoint at position i of the pick
// served.
func (d *DataPlane) Served(i int) int64 { return d.served[i].Load() }

// Failovers returns how many requests a picker other than the first
// answered.
func (d *DataPlane) Failovers() int64 { return d.failovers.Load() }

// ServeHTTP asks a picker, sends the request to the pick and relays the
// response through the picker's response path.
func (d *DataPlane) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, "read body", http.StatusBadRequest)
		return
	}
	var lastErr error
	for i, c := range d.conns {
		x, err := d.open(r.Context(), c, r, body)
		if err != nil {
			lastErr = err
			continue // this picker is down: the next one
		}
		if i > 0 {
			d.failovers.Add(1)
		}
		x.run(w)
		return
	}
	http.Error(w, fmt.Sprintf("%v: %v", ErrNoPicker, lastErr), http.StatusServiceUnavailable)
}

// exchange is one request's ext_proc stream.
type exchange struct {
	d      *DataPlane
	r      *http.Request
	stream extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
	// What the picker answered on the request path.
	immediate *extprocv3.ImmediateResponse
	dests     []string
	hdr       http.Header
	body      []byte
}

// open runs the request path on one picker: headers and body out, the
// pick and the body back.
func (d *DataPlane) open(ctx context.Context, c *grpc.ClientConn, r *http.Request, body []byte) (*exchange, error) {
	ctx, cancel := context.WithCancel(ctx)
	stream, err := extprocv3.NewExternalProcessorClient(c).Process(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	x := &exchange{d: d, r: r, stream: stream, cancel: cancel, hdr: r.Header.Clone()}
	if err := x.requestPath(body); err != nil {
		cancel()
		return nil, err
	}
	return x, nil
}

func (x *exchange) requestPath(body []byte) error {
	mode := filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	if x.d.cfg.Buffered {
		mode = filterv3.ProcessingMode_BUFFERED
	}
	first := &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: headerMap(x.r.Method, x.r.URL.RequestURI(), x.r.Host, x.r.Header), EndOfStream: len(body) == 0}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: mode},
	}
	if x.d.cfg.Subset != nil {
		if sub := x.d.cfg.Subset(x.r); sub != nil {
			vals := make([]any, len(sub))
			for i, s := range sub {
				vals[i] = s
			}
			st, err := structpb.NewStruct(map[string]any{subsetKey: vals})
			if err != nil {
				return err
			}
			first.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{subsetNamespace: st}}
		}
	}
	if err := x.stream.Send(first); err != nil {
		return err
	}
	if len(body) > 0 && x.d.cfg.Buffered {
		// Buffered: Envoy waits for the headers response first.
		resp, err := x.stream.Recv()
		if err != nil {
			return err
		}
		if x.takeImmediate(resp) {
			return nil
		}
		x.applyRequestMutation(resp.GetRequestHeaders().GetResponse().GetHeaderMutation(), resp)
		if err := x.stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}}); err != nil {
			return err
		}
		resp, err = x.stream.Recv()
		if err != nil {
			return err
		}
		if x.takeImmediate(resp) {
			return nil
		}
		x.applyRequestMutation(resp.GetRequestBody().GetResponse().GetHeaderMutation(), resp)
		x.body = body
		return nil
	}
	for off := 0; off < len(body); off += x.d.cfg.ChunkBytes {
		end := min(off+x.d.cfg.ChunkBytes, len(body))
		err := x.stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: body[off:end], EndOfStream: end == len(body)}}})
		if errors.Is(err, io.EOF) {
			// The picker ended the stream early (an immediate response to
			// a body too large): its answer waits in Recv.
			break
		}
		if err != nil {
			return err
		}
	}
	resp, err := x.stream.Recv()
	if err != nil {
		return err
	}
	if x.takeImmediate(resp) {
		return nil
	}
	h := resp.GetRequestHeaders()
	if h == nil {
		return fmt.Errorf("extproc: picker answered %T before the request headers", resp.GetResponse())
	}
	x.applyRequestMutation(h.GetResponse().GetHeaderMutation(), resp)
	for len(body) > 0 {
		resp, err := x.stream.Recv()
		if err != nil {
			return err
		}
		sb := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sb == nil {
			return fmt.Errorf("extproc: picker answered %T, want a streamed request body", resp.GetResponse())
		}
		x.body = append(x.body, sb.GetBody()...)
		if sb.GetEndOfStream() {
			break
		}
	}
	return nil
}

func (x *exchange) takeImmediate(resp *extprocv3.ProcessingResponse) bool {
	x.immediate = resp.GetImmediateResponse()
	return x.immediate != nil
}

// applyRequestMutation applies the picker's header mutation and reads the
// pick from the header (and checks the dynamic metadata agrees).
func (x *exchange) applyRequestMutation(m *extprocv3.HeaderMutation, resp *extprocv3.ProcessingResponse) {
	for _, k := range m.GetRemoveHeaders() {
		x.hdr.Del(k)
	}
	for _, o := range m.GetSetHeaders() {
		v := string(o.GetHeader().GetRawValue())
		if v == "" {
			v = o.GetHeader().GetValue()
		}
		x.hdr.Set(o.GetHeader().GetKey(), v)
	}
	dest := x.hdr.Get(destinationHeader)
	if md := resp.GetDynamicMetadata().GetFields()[lbNamespace].GetStructValue().GetFields()[destinationHeader]; md != nil && md.GetStringValue() != dest {
		dest = "" // the protocol forbids two different values
	}
	x.dests = nil
	for e := range strings.SplitSeq(dest, ",") {
		if e = strings.TrimSpace(e); e != "" {
			x.dests = append(x.dests, e)
		}
	}
	x.hdr.Del(destinationHeader)
}

// run sends the request to the pick and relays the response.
func (x *exchange) run(w http.ResponseWriter) {
	defer x.cancel()
	if im := x.immediate; im != nil {
		for _, o := range im.GetHeaders().GetSetHeaders() {
			w.Header().Set(o.GetHeader().GetKey(), string(o.GetHeader().GetRawValue()))
		}
		w.WriteHeader(int(im.GetStatus().GetCode()))
		_, _ = w.Write(im.GetBody())
		return
	}
	if len(x.dests) == 0 {
		http.Error(w, "picker named no endpoint", http.StatusBadGateway)
		return
	}
	var resp *http.Response
	served := -1
	for i, dest := range x.dests {
		req, err := http.NewRequestWithContext(x.r.Context(), x.r.Method, "http://"+dest+x.r.URL.RequestURI(), strings.NewReader(string(x.body)))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		req.Header = x.hdr.Clone()
		req.ContentLength = int64(len(x.body))
		resp, err = x.d.client.Do(req)
		if err == nil {
			served = i
			break
		}
		var op *net.OpError
		if !errors.As(err, &op) || op.Op != "dial" {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
	}
	if served < 0 {
		http.Error(w, "no picked endpoint accepted the connection", http.StatusServiceUnavailable)
		return
	}
	defer resp.Body.Close()
	if served < len(x.d.served) {
		x.d.served[served].Add(1)
	}
	st, _ := structpb.NewStruct(map[string]any{servedKey: x.dests[served]})
	rh := resp.Header.Clone()
	if err := x.stream.Send(&extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: statusHeaderMap(resp.StatusCode, rh)}},
		MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{lbNamespace: st}},
	}); err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	hr, err := x.stream.Recv()
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	for _, o := range hr.GetResponseHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		rh.Set(o.GetHeader().GetKey(), string(o.GetHeader().GetRawValue()))
	}
	for k, vs := range rh {
		w.Header()[k] = vs
	}
	w.WriteHeader(resp.StatusCode)
	flusher, _ := w.(http.Flusher)
	if flusher != nil {
		flusher.Flush() // the head goes on at once, as Envoy sends it
	}
	buf := make([]byte, 32<<10)
	for {
		nr, rerr := resp.Body.Read(buf)
		eos := rerr != nil
		if nr > 0 || eos {
			if err := x.stream.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
				ResponseBody: &extprocv3.HttpBody{Body: append([]byte(nil), buf[:nr]...), EndOfStream: eos}}}); err != nil {
				return
			}
			br, err := x.stream.Recv()
			if err != nil {
				return
			}
			out := buf[:nr]
			if sb := br.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse(); sb != nil {
				out = sb.GetBody()
			}
			if len(out) > 0 {
				if _, err := w.Write(out); err != nil {
					return
				}
				if flusher != nil {
					flusher.Flush()
				}
			}
		}
		if eos {
			_ = x.stream.CloseSend()
			return
		}
	}
}

func headerMap(method, path, authority string, h http.Header) *corev3.HeaderMap {
	m := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte(method)},
		{Key: ":path", RawValue: []byte(path)},
		{Key: ":authority", RawValue: []byte(authority)},
	}}
	for k, vs := range h {
		for _, v := range vs {
			m.Headers = append(m.Headers, &corev3.HeaderValue{Key: strings.ToLower(k), RawValue: []byte(v)})
		}
	}
	return m
}

func statusHeaderMap(code int, h http.Header) *corev3.HeaderMap {
	m := headerMap("", "", "", h)
	m.Headers = append([]*corev3.HeaderValue{{Key: ":status", RawValue: fmt.Appendf(nil, "%d", code)}}, m.Headers[3:]...)
	return m
}
