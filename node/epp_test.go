package node

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvmesh/kvmesh/chaos/extproc"
	"github.com/kvmesh/kvmesh/index"
)

// These tests drive the endpoint picker over real gRPC streams with
// chaos/extproc, a data plane built from Envoy's published ext_proc protos
// that stands in for Envoy (which cannot run here), in front of simulated
// vLLM engines on loopback.

// startEPPNode starts a gateway with the picker on over reps.
func startEPPNode(t testing.TB, tune func(*Config), reps ...ReplicaConfig) *Node {
	t.Helper()
	return startNode(t, func(c *Config) {
		c.EPP.Addr = "127.0.0.1:0"
		c.Tokenizer = TokenizerCharacter
		c.BlockSize = 16
		if tune != nil {
			tune(c)
		}
	}, reps...)
}

// dataPlane starts the stand-in data plane over pickers as an HTTP server.
func dataPlane(t testing.TB, cfg extproc.Config) (*extproc.DataPlane, string) {
	t.Helper()
	if !cfg.TLS && cfg.Pickers == nil {
		t.Fatal("no pickers")
	}
	d, err := extproc.New(cfg)
	require.NoError(t, err)
	srv := httptest.NewServer(d)
	t.Cleanup(func() {
		srv.Close()
		_ = d.Close()
	})
	return d, srv.URL
}

func postTo(t testing.TB, base, path, body string, hdr map[string]string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, base+path, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	return resp
}

func hostOf(t testing.TB, raw string) string {
	u, err := url.Parse(raw)
	require.NoError(t, err)
	return u.Host
}

func TestEPPStreamsThroughThePickAndLearnsThePrefix(t *testing.T) {
	a, b := startSim(t, false), startSim(t, false)
	n := startEPPNode(t, func(c *Config) { c.Strategy = "prefix-cache" }, rc("a", a.URL()), rc("b", b.URL()))
	d, base := dataPlane(t, extproc.Config{Pickers: []string{n.EPPAddr()}, TLS: true, ChunkBytes: 7})

	prompt := "the shared system prompt of this test, long enough for several blocks " + strings.Repeat("x", 200)
	body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":4,"stream":true}`, prompt)
	resp := postTo(t, base, "/v1/completions", body, nil)
	got := readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, got)
	first := resp.Header.Get(HeaderReplica)
	require.Contains(t, []string{"a", "b"}, first)
	assert.True(t, strings.HasSuffix(strings.TrimSpace(got), "data: [DONE]"), got)
	assert.Equal(t, int64(1), d.Served(0), "the primary served")

	// The same engine answers the same request directly with the same
	// bytes: the body went through the picker (in 7-byte chunks) unchanged.
	eng := a
	if first == "b" {
		eng = b
	}
	direct := postTo(t, eng.URL(), "/v1/completions", body, nil)
	// The engine numbers its responses and stamps them with the second
	// they were made in; the two requests may straddle a second boundary
	// (more likely on a busy machine: CI once failed on it).
	ids := regexp.MustCompile(`cmpl-[0-9a-f]+`)
	created := regexp.MustCompile(`"created":[0-9]+`)
	normal := func(s string) string {
		return created.ReplaceAllString(ids.ReplaceAllString(s, "cmpl-x"), `"created":0`)
	}
	assert.Equal(t, normal(readAll(t, direct)), normal(got))

	// The decision was recorded for the served replica: the next request
	// with the prefix goes there too.
	id, _ := n.ReplicaID(first)
	h := n.Index().Hasher()
	keys := h.AppendKeysString(nil, h.Root("m", "", ""), prompt)
	out := make([]int32, 1)
	n.Index().Match(keys, []index.ReplicaID{id}, index.ModeHistory, time.Now().UnixNano(), out)
	assert.Equal(t, len(keys), int(out[0]))
	for range 3 {
		resp := postTo(t, base, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":2}`, prompt+" more"), nil)
		readAll(t, resp)
		assert.Equal(t, first, resp.Header.Get(HeaderReplica))
	}
	// Every stream's accounting was released.
	require.Eventually(t, func() bool {
		for _, r := range n.tbl.Load().replicas {
			if r.inflight.Load() != 0 || r.queuedPrefill.Load() != 0 || r.sends.Len() != 0 {
				return false
			}
		}
		return true
	}, 5*time.Second, time.Millisecond)
}

func TestEPPBufferedModeAndChat(t *testing.T) {
	a := startSim(t, false)
	n := startEPPNode(t, func(c *Config) { c.EPP.Plaintext = true }, rc("a", a.URL()))
	_, base := dataPlane(t, extproc.Config{Pickers: []string{n.EPPAddr()}, Buffered: true})
	resp := postTo(t, base, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3}`, nil)
	got := readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, got)
	assert.Contains(t, got, `"chat.completion"`)
	assert.Equal(t, "a", resp.Header.Get(HeaderReplica))
}

func TestEPPSubsetHint(t *testing.T) {
	a, b := startSim(t, false), startSim(t, false)
	n := startEPPNode(t, nil, rc("a", a.URL()), rc("b", b.URL()))
	var hint []string
	_, base := dataPlane(t, extproc.Config{Pickers: []string{n.EPPAddr()}, TLS: true,
		Subset: func(*http.Request) []string { return hint }})

	hint = []string{hostOf(t, b.URL())}
	for i := range 6 {
		resp := postTo(t, base, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"p%d","max_tokens":1}`, i), nil)
		readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		assert.Equal(t, "b", resp.Header.Get(HeaderReplica), "only the hinted endpoint may be picked")
	}
	// A hint naming no endpoint of the pool (or none at all) is a 503.
	for _, h := range [][]string{{"10.9.9.9:80"}, {}} {
		hint = h
		resp := postTo(t, base, "/v1/completions", `{"model":"m","prompt":"x","max_tokens":1}`, nil)
		got := readAll(t, resp)
		assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, got)
		assert.Equal(t, CodeNoHealthyReplica, decodeErr(t, got).Error.Code)
	}
}

func TestEPPImmediateResponses(t *testing.T) {
	a := startSim(t, false)
	n := startEPPNode(t, func(c *Config) { c.MaxBodyBytes = 4096 }, rc("a", a.URL()))
	_, base := dataPlane(t, extproc.Config{Pickers: []string{n.EPPAddr()}, TLS: true, ChunkBytes: 1000})
	for _, tc := range []struct {
		path, body string
		status     int
		code       string
	}{
		{"/v1/completions", `{"model":"nope","prompt":"x"}`, http.StatusNotFound, CodeModelNotFound},
		{"/v1/completions", `not json`, http.StatusBadRequest, CodeInvalidJSON},
		{"/v1/nothing", `{}`, http.StatusNotFound, CodeNotFound},
		{"/v1/completions", `{"model":"m","prompt":"` + strings.Repeat("y", 50000) + `"}`, http.StatusRequestEntityTooLarge, CodeBodyTooLarge},
	} {
		resp := postTo(t, base, tc.path, tc.body, nil)
		got := readAll(t, resp)
		assert.Equal(t, tc.status, resp.StatusCode, got)
		assert.Equal(t, tc.code, decodeErr(t, got).Error.Code, got)
	}
}

func TestEPPShedsAtTheInFlightLimit(t *testing.T) {
	// The engine holds its first token long enough for the limit to fill.
	release := make(chan struct{})
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if r.URL.Path != "/v1/completions" { // health probes and scrapes
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		<-release
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer eng.Close()
	defer close(release)
	n := startEPPNode(t, func(c *Config) { c.MaxInFlight = 1 }, rc("a", eng.URL))
	_, base := dataPlane(t, extproc.Config{Pickers: []string{n.EPPAddr()}, TLS: true})
	first := postTo(t, base, "/v1/completions", `{"model":"m","prompt":"held","stream":true}`, nil)
	require.Equal(t, http.StatusOK, first.StatusCode)
	// No body byte yet: the prompt the pick left to compute is queued,
	// and the send log carries it for cost's slot wait.
	a := n.tbl.Load().byName["a"]
	require.Positive(t, a.queuedPrefill.Load())
	_, since, ok := a.sends.Recent(1)
	require.True(t, ok)
	require.Equal(t, int(a.queuedPrefill.Load()), since)
	resp := postTo(t, base, "/v1/completions", `{"model":"m","prompt":"second"}`, nil)
	got := readAll(t, resp)
	assert.Equal(t, http.StatusTooManyRequests, resp.StatusCode, got)
	assert.Equal(t, CodeOverloaded, decodeErr(t, got).Error.Code)
	assert.Equal(t, "1", resp.Header.Get("Retry-After"))
	release <- struct{}{}
	readAll(t, first)
}

// TestEPPTakesBackPromptsNeverComputed: as the proxy does
// (TestProxyTakesBackPromptsNeverComputed), the endpoint picker's send
// log keeps the prompt of a request that ended for the requests sent
// before it only when its successful response began: an error answer's
// is taken back.
func TestEPPTakesBackPromptsNeverComputed(t *testing.T) {
	release, releaseServed := make(chan struct{}), make(chan struct{})
	firstSent := make(chan struct{}, 1)
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.URL.Path != "/v1/completions" { // health probes and scrapes
			return
		}
		switch {
		case strings.Contains(string(body), "refused"):
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"error":{"message":"no","type":"BadRequestError","code":400}}`)
			return
		case strings.Contains(string(body), "served"):
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n")
			w.(http.Flusher).Flush()
			firstSent <- struct{}{}
			<-releaseServed
		default:
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			select {
			case <-release:
			case <-r.Context().Done():
			}
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	defer eng.Close()
	n := startEPPNode(t, nil, rc("a", eng.URL))
	_, base := dataPlane(t, extproc.Config{Pickers: []string{n.EPPAddr()}, TLS: true})
	a := n.tbl.Load().byName["a"]
	const tail = ", a prompt long enough to fill a block or two of characters for the index"
	waiting := postTo(t, base, "/v1/completions", `{"model":"m","prompt":"waiting`+tail+`","stream":true}`, nil)
	require.Equal(t, http.StatusOK, waiting.StatusCode)
	defer readAll(t, waiting)
	defer close(release)
	own := int(a.queuedPrefill.Load())
	require.Positive(t, own)
	since := func() int {
		t.Helper()
		require.Eventually(t, func() bool { return a.sends.Len() == 1 }, 10*time.Second, time.Millisecond,
			"the waiting request alone in flight")
		_, since, ok := a.sends.Recent(1)
		require.True(t, ok)
		return since
	}
	require.Equal(t, own, since())

	resp := postTo(t, base, "/v1/completions", `{"model":"m","prompt":"refused`+tail+`","stream":true}`, nil)
	readAll(t, resp)
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
	require.Equal(t, own, since(), "an error answer's prompt is taken back")

	served := make(chan struct{})
	go func() {
		defer close(served)
		resp := postTo(t, base, "/v1/completions", `{"model":"m","prompt":"served`+tail+`","stream":true}`, nil)
		readAll(t, resp)
	}()
	<-firstSent
	require.Eventually(t, func() bool { return a.sends.Len() == 2 && a.queuedPrefill.Load() == int64(own) }, 10*time.Second, time.Millisecond,
		"the first byte came: its queued prefill is released")
	_, other, _ := a.sends.Recent(1)
	require.Positive(t, other, "its own prompt")
	close(releaseServed)
	<-served
	require.Equal(t, own+other, since(), "a served stream's prompt counts for the request sent before it")
}

func TestEPPFallbackServedIsConfirmed(t *testing.T) {
	a := startSim(t, false)
	dead := closedURL(t)
	n := startEPPNode(t, func(c *Config) {
		c.Strategy = "consistent-hash"
		c.HealthInterval = 0 // the dead replica stays eligible: the data plane meets it
	}, rc("a", a.URL()), rc("dead", dead))
	d, base := dataPlane(t, extproc.Config{Pickers: []string{n.EPPAddr()}, TLS: true})
	servedBy := map[string]int{}
	for i := range 12 {
		resp := postTo(t, base, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"fallback %d","max_tokens":1}`, i), nil)
		got := readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode, got)
		servedBy[resp.Header.Get(HeaderReplica)]++
	}
	assert.Equal(t, 12, servedBy["a"], "the response names the replica that served, not the dead primary")
	assert.Positive(t, d.Served(1), "some primaries were the dead replica: a fallback served")
	assert.Equal(t, float64(d.Served(1)), counterValue(t, n, "kvmesh_epp_served_total", map[string]string{"by": "fallback"}))
	require.Eventually(t, func() bool {
		for _, r := range n.tbl.Load().replicas {
			if r.inflight.Load() != 0 || r.sends.Len() != 0 {
				return false
			}
		}
		return true
	}, 5*time.Second, time.Millisecond, "in-flight counts and sends moved to the served replica and released")
}

func TestEPPHealthServices(t *testing.T) {
	a := startSim(t, false)
	n := startEPPNode(t, nil, rc("a", a.URL()))
	conn, err := grpc.NewClient(n.EPPAddr(), grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{InsecureSkipVerify: true})))
	require.NoError(t, err)
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	for _, svc := range []string{EPPHealthLiveness, EPPHealthReadiness, "envoy.service.ext_proc.v3.ExternalProcessor"} {
		require.Eventually(t, func() bool {
			r, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
			return err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING
		}, 5*time.Second, 10*time.Millisecond, svc)
	}
}

func TestEPPConfigValidation(t *testing.T) {
	for _, tune := range []func(*Config){
		func(c *Config) { c.EPP.Fallbacks = -1 },
		func(c *Config) { c.EPP.CertFile = "x.pem" },
		func(c *Config) { c.EPP.Plaintext, c.EPP.CertFile, c.EPP.KeyFile = true, "c", "k" },
	} {
		c := LocalConfig()
		c.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", "http://127.0.0.1:1")}}}
		tune(&c)
		assert.Error(t, c.Validate())
	}
}

// TestEPPPickerFailoverAcrossAClusterSharesTheIndex runs two clustered
// gateways as pickers: decisions one picker makes are routed on by the
// other, and when the first stops, the data plane's requests go on
// through the second.
func TestEPPPickerFailoverAcrossAClusterSharesTheIndex(t *testing.T) {
	a, b := startSim(t, false), startSim(t, false)
	reps := []ReplicaConfig{rc("a", a.URL()), rc("b", b.URL())}
	c1 := gwConfig("g1", t.TempDir(), nil, 2, reps...)
	c1.EPP.Addr, c1.Strategy = "127.0.0.1:0", "prefix-cache"
	g1, stop1 := startGateway(t, c1)
	c2 := gwConfig("g2", t.TempDir(), []string{g1.Cluster().GossipAddr()}, 2, reps...)
	c2.EPP.Addr, c2.Strategy = "127.0.0.1:0", "prefix-cache"
	g2, _ := startGateway(t, c2)
	waitReady(t, g1, g2)
	settleCluster(t, []*Node{g1, g2})

	d, base := dataPlane(t, extproc.Config{Pickers: []string{g1.EPPAddr(), g2.EPPAddr()}, TLS: true})
	prompt := "a prefix the first picker places " + strings.Repeat("z", 160)
	resp := postTo(t, base, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":1}`, prompt), nil)
	got := readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, got)
	placed := resp.Header.Get(HeaderReplica)

	// g2 learns g1's decision through the cluster.
	id, ok := g2.ReplicaID(placed)
	require.True(t, ok)
	h := g2.Index().Hasher()
	keys := h.AppendKeysString(nil, h.Root("m", "", ""), prompt)
	out := make([]int32, 1)
	require.Eventually(t, func() bool {
		g2.Index().Match(keys, []index.ReplicaID{id}, index.ModeHistory, time.Now().UnixNano(), out)
		return int(out[0]) == len(keys)
	}, 10*time.Second, time.Millisecond)

	stop1()
	for range 3 {
		resp := postTo(t, base, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":1}`, prompt+" again"), nil)
		got := readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode, got)
		assert.Equal(t, placed, resp.Header.Get(HeaderReplica), "the second picker routes on the first one's decision")
	}
	assert.Equal(t, int64(3), d.Failovers())
}
