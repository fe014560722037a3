package node

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/internal/freeport"
	"github.com/kvmesh/kvmesh/internal/leaktest"
	"github.com/kvmesh/kvmesh/route"
)

func TestMain(m *testing.M) {
	leaktest.Main(m,
		// httptest servers' and the transport's idle connections close
		// asynchronously after Cleanup.
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		// zmq4 v0.17.0's PUB socket never stops its writer goroutine on
		// Close (the simulator's publisher, not ours; kvevents ignores it too).
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
	)
}

// startNode starts a Node for model "m" over the given replicas with
// LocalConfig, mutated by tune, and shuts it down at cleanup.
func startNode(t testing.TB, tune func(*Config), reps ...ReplicaConfig) *Node {
	t.Helper()
	cfg := testConfig()
	cfg.Models = []ModelConfig{{Name: "m", Replicas: reps}}
	if tune != nil {
		tune(&cfg)
	}
	n, err := New(cfg, nil)
	require.NoError(t, err)
	require.NoError(t, n.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, n.Shutdown(ctx))
	})
	return n
}

func rc(name, url string) ReplicaConfig { return ReplicaConfig{Name: name, URL: url} }

// closedURL returns an http URL on a port nothing listens on.
func closedURL(t testing.TB) string {
	return "http://" + freeport.Refusing(t) // see there: ci360
}

func post(t testing.TB, n *Node, path, body string, hdr map[string]string) *http.Response {
	t.Helper()
	return postTo(t, "http://"+n.HTTPAddr(), path, body, hdr)
}

func readAll(t testing.TB, resp *http.Response) string {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}

type errResp struct {
	Error struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    string `json:"code"`
	} `json:"error"`
}

func decodeErr(t testing.TB, body string) errResp {
	t.Helper()
	var e errResp
	require.NoError(t, json.Unmarshal([]byte(body), &e), body)
	return e
}

const streamReq = `{"model":"m","prompt":"hello world, a prompt long enough to fill a block or two of characters for the index to match against later on. padding padding padding padding","stream":true,"max_tokens":5}`

func TestStreamingBytesIdenticalAndHeaders(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.chunks.Store(20)
	n := startNode(t, nil, rc("a", e.url()))

	resp := post(t, n, "/v1/completions", streamReq, map[string]string{"Authorization": "Bearer xyz", HeaderStrategy: "least-request"})
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, "a", resp.Header.Get(HeaderReplica))
	assert.Equal(t, strings.TrimPrefix(e.url(), "http://"), resp.Header.Get(HeaderTargetPod))
	assert.Equal(t, "a", resp.Header.Get("X-Engine"), "upstream headers pass through")
	assert.Equal(t, "text/event-stream; charset=utf-8", resp.Header.Get("Content-Type"))
	got := readAll(t, resp)
	assert.Equal(t, streamBody("a", 20), got, "bytes must be identical to the upstream's")

	e.mu.Lock()
	hdr := e.headers[0]
	body := e.bodies[0]
	e.mu.Unlock()
	assert.Equal(t, "Bearer xyz", hdr.Get("Authorization"), "client headers reach the engine")
	assert.Empty(t, hdr.Get(HeaderStrategy), "the gateway's own header is not forwarded")
	assert.Equal(t, streamReq, string(body), "the body is forwarded unchanged")

	// The decision was recorded: the same prompt now matches replica a.
	assert.Equal(t, 1.0, value(n.m.decisions.WithLabelValues("m", "least-request", "least_request")))
	assert.Positive(t, n.Index().Stats().Entries[index.History])
}

func TestStreamIsRelayedChunkByChunk(t *testing.T) {
	// The client must see the first event while the engine is still
	// holding the rest back: no buffering of the stream.
	e := newFakeEngine(t, "a")
	e.chunks.Store(3)
	e.chunkDelay.Store(int64(time.Hour)) // the second event never comes on its own
	n := startNode(t, nil, rc("a", e.url()))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+n.HTTPAddr()+"/v1/completions", strings.NewReader(streamReq))
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	assert.True(t, strings.HasPrefix(line, `data: {"id":"cmpl-a"`), line)
	cancel()
	require.Eventually(t, func() bool { return e.cancelled.Load() == 1 }, 5*time.Second, 5*time.Millisecond,
		"client disconnect must cancel the upstream request")
	require.Eventually(t, func() bool { return value(n.m.inflight.WithLabelValues("a")) == 0 },
		5*time.Second, 5*time.Millisecond)
}

func TestNonStreaming(t *testing.T) {
	e := newFakeEngine(t, "a")
	n := startNode(t, nil, rc("a", e.url()))
	resp := post(t, n, "/v1/completions", `{"model":"m","prompt":[1,2,3,4,5]}`, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, "a", resp.Header.Get(HeaderReplica))
	assert.Equal(t, `{"id":"cmpl-a","object":"text_completion","choices":[{"index":0,"text":"done"}],"usage":{"prompt_tokens":10,"completion_tokens":5}}`, readAll(t, resp))

	resp = post(t, n, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	readAll(t, resp)
}

func TestRetryOnConnectFailure(t *testing.T) {
	e := newFakeEngine(t, "live")
	n := startNode(t, func(c *Config) { c.HealthInterval = 0 }, rc("dead", closedURL(t)), rc("live", e.url()))
	prompt := strings.Repeat("x", 1000)
	// Teach the index that "dead" holds the prompt, so prefix-cache picks it.
	h := n.Index().Hasher()
	keys := h.AppendKeysString(nil, h.Root("m", "", ""), prompt)
	dead, _ := n.ReplicaID("dead")
	require.NoError(t, n.Index().Record(keys, dead, index.History, time.Now().UnixNano()))

	body := fmt.Sprintf(`{"model":"m","prompt":%q,"stream":true}`, prompt)
	resp := post(t, n, "/v1/completions", body, map[string]string{HeaderStrategy: "prefix-cache"})
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, "live", resp.Header.Get(HeaderReplica))
	assert.Equal(t, streamBody("live", 5), readAll(t, resp))
	assert.Equal(t, 1.0, value(n.m.retries))
	assert.Equal(t, 1.0, value(n.m.upstreamErrors.WithLabelValues("dead", reasonConnect)))
	assert.Equal(t, 1.0, value(n.m.decisions.WithLabelValues("m", "prefix-cache", "prefix_match")))
}

func TestConnectFailureWithoutRetryIs502(t *testing.T) {
	n := startNode(t, func(c *Config) { c.HealthInterval = 0 }, rc("dead", closedURL(t)))
	resp := post(t, n, "/v1/completions", streamReq, nil)
	require.Equal(t, http.StatusBadGateway, resp.StatusCode)
	assert.Equal(t, CodeUpstreamError, decodeErr(t, readAll(t, resp)).Error.Code)
}

func TestMidStreamFailureEndsWithErrorEvent(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.chunks.Store(5)
	e.breakAfter.Store(2)
	n := startNode(t, nil, rc("a", e.url()))
	resp := post(t, n, "/v1/completions", streamReq, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	got := readAll(t, resp)
	events := strings.SplitAfter(streamBody("a", 5), "\n\n")
	prefix := events[0] + events[1] + events[2][:len(events[2])/2]
	require.True(t, strings.HasPrefix(got, prefix), got)
	rest := strings.TrimPrefix(got, prefix)
	require.True(t, strings.HasPrefix(rest, "\n\ndata: {\"error\":"), rest)
	require.True(t, strings.HasSuffix(rest, "}\n\n"), rest)
	var ev errResp
	require.NoError(t, json.Unmarshal([]byte(strings.TrimSuffix(strings.TrimPrefix(rest, "\n\ndata: "), "\n\n")), &ev))
	assert.Equal(t, CodeStreamBroken, ev.Error.Code)
	assert.Equal(t, 1.0, value(n.m.upstreamErrors.WithLabelValues("a", reasonMidStream)))
}

func TestIdleTimeoutEndsStream(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.chunks.Store(3)
	e.chunkDelay.Store(int64(time.Hour))
	n := startNode(t, func(c *Config) { c.IdleTimeout = 100 * time.Millisecond }, rc("a", e.url()))
	resp := post(t, n, "/v1/completions", streamReq, nil)
	got := readAll(t, resp)
	require.Contains(t, got, `"code":"upstream_stream_broken"`)
	assert.Contains(t, got, "idle_timeout")
	require.Eventually(t, func() bool { return e.cancelled.Load() == 1 }, 5*time.Second, 5*time.Millisecond)
}

func TestFirstByteTimeoutIs504(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.firstDelay.Store(int64(time.Hour))
	n := startNode(t, func(c *Config) { c.FirstByteTimeout = 100 * time.Millisecond }, rc("a", e.url()))
	resp := post(t, n, "/v1/completions", `{"model":"m","prompt":"hi"}`, nil)
	require.Equal(t, http.StatusGatewayTimeout, resp.StatusCode)
	assert.Equal(t, CodeUpstreamTimeout, decodeErr(t, readAll(t, resp)).Error.Code)
}

func TestPassiveEjectionAnd503(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.status.Store(500)
	n := startNode(t, func(c *Config) {
		c.HealthInterval = 0
		c.EjectAfter = 3
		c.EjectBackoff = time.Hour
		c.EjectMaxBackoff = 2 * time.Hour
	}, rc("a", e.url()))
	for i := 0; i < 3; i++ {
		resp := post(t, n, "/v1/completions", streamReq, nil)
		require.Equal(t, http.StatusInternalServerError, resp.StatusCode, "engine errors pass through")
		readAll(t, resp)
	}
	resp := post(t, n, "/v1/completions", streamReq, nil)
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	assert.Equal(t, "3600", resp.Header.Get("Retry-After"))
	assert.Equal(t, CodeNoHealthyReplica, decodeErr(t, readAll(t, resp)).Error.Code)
	assert.EqualValues(t, 3, e.requests.Load(), "an ejected replica gets no traffic")
	assert.Equal(t, 1.0, value(n.m.ejections.WithLabelValues("a")))
}

func TestEjectionBackoffGrows(t *testing.T) {
	r, err := newReplica(0, rc("a", "http://127.0.0.1:1"), "m")
	require.NoError(t, err)
	now := int64(1e18)
	for round, want := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 5 * time.Second} {
		for i := 0; i < 2; i++ {
			ej, _ := r.onFailure(now, 3, time.Second, 5*time.Second)
			require.False(t, ej, "round %d", round)
		}
		ej, d := r.onFailure(now, 3, time.Second, 5*time.Second)
		require.True(t, ej)
		require.Equal(t, want, d, "round %d", round)
		require.False(t, r.available(now))
		require.True(t, r.available(now+int64(d)))
	}
	r.onSuccess()
	for i := 0; i < 2; i++ {
		r.onFailure(now, 3, time.Second, 5*time.Second)
	}
	_, d := r.onFailure(now, 3, time.Second, 5*time.Second)
	require.Equal(t, time.Second, d, "a success resets the backoff")
}

func TestActiveHealthRemovesAndRestores(t *testing.T) {
	a := newFakeEngine(t, "a")
	b := newFakeEngine(t, "b")
	n := startNode(t, nil, rc("a", a.url()), rc("b", b.url()))
	a.healthStatus.Store(503)
	ra := n.tbl.Load().byName["a"]
	require.Eventually(t, func() bool { return !ra.available(nowNanos()) }, 5*time.Second, 5*time.Millisecond)
	before := a.requests.Load()
	for i := 0; i < 10; i++ {
		resp := post(t, n, "/v1/completions", streamReq, map[string]string{HeaderStrategy: "random"})
		require.Equal(t, "b", resp.Header.Get(HeaderReplica))
		readAll(t, resp)
	}
	assert.Equal(t, before, a.requests.Load())
	a.healthStatus.Store(0)
	require.Eventually(t, func() bool { return ra.available(nowNanos()) }, 5*time.Second, 5*time.Millisecond)
}

// TestHealthFailOpen: when every replica of a model fails its /health
// polls, requests still route among them (Config.HealthFailOpen, on by
// default): counted, logged once, and shown in /ready and /debug/route.
// A replica that passes its polls again takes the traffic back, and one
// ejected for failing requests stays out even then.
func TestHealthFailOpen(t *testing.T) {
	a := newFakeEngine(t, "a")
	b := newFakeEngine(t, "b")
	var logs syncBuffer
	cfg := testConfig()
	cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", a.url()), rc("b", b.url())}}}
	cfg.EjectBackoff, cfg.EjectMaxBackoff = time.Hour, time.Hour // an ejection lasts the test
	require.True(t, cfg.HealthFailOpen, "fail-open is the default")
	n, err := New(cfg, slog.New(slog.NewJSONHandler(&logs, nil)))
	require.NoError(t, err)
	require.NoError(t, n.Start(context.Background()))
	defer func() { require.NoError(t, n.Shutdown(context.Background())) }()
	ra, rb := n.tbl.Load().byName["a"], n.tbl.Load().byName["b"]
	down := func(r *replica) func() bool { return func() bool { return r.activeDown.Load() } }
	routeTo := func() string {
		t.Helper()
		resp := post(t, n, "/v1/completions", streamReq, map[string]string{HeaderStrategy: "random"})
		body := readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode, body)
		return resp.Header.Get(HeaderReplica)
	}

	a.healthStatus.Store(503)
	b.healthStatus.Store(503)
	require.Eventually(t, down(ra), 10*time.Second, 5*time.Millisecond)
	require.Eventually(t, down(rb), 10*time.Second, 5*time.Millisecond)
	got := map[string]int{}
	for range 20 {
		got[routeTo()]++
	}
	assert.Positive(t, got["a"], "random routing spreads over both replicas failing health: %v", got)
	assert.Positive(t, got["b"], "random routing spreads over both replicas failing health: %v", got)
	assert.Equal(t, 20.0, value(n.m.failOpen.WithLabelValues("m")))
	assert.Equal(t, []string{"m"}, readyReport(t, n).FailOpen)
	assert.Equal(t, 1, strings.Count(logs.String(), "routing among those failing them"), "entering fail-open is logged once")
	resp := post(t, n, "/debug/route", streamReq, nil)
	var rep struct {
		Pick        string
		FailOpen    bool `json:"fail_open"`
		Unavailable []UnavailableReplica
	}
	require.NoError(t, json.Unmarshal([]byte(readAll(t, resp)), &rep))
	assert.True(t, rep.FailOpen)
	assert.NotEmpty(t, rep.Pick)
	assert.Len(t, rep.Unavailable, 2)

	// b passes its polls again: it takes every request, and fail-open ends.
	b.healthStatus.Store(0)
	require.Eventually(t, func() bool { return rb.available(nowNanos()) }, 10*time.Second, 5*time.Millisecond)
	for range 10 {
		require.Equal(t, "b", routeTo())
	}
	assert.Equal(t, 20.0, value(n.m.failOpen.WithLabelValues("m")), "no fail-open decision while b passes")
	assert.Empty(t, readyReport(t, n).FailOpen)
	assert.Contains(t, logs.String(), "fail-open routing ended")

	// Both fail their polls again, and a fails its requests until it is
	// ejected: from then on only b, still failing its polls, gets traffic.
	b.healthStatus.Store(503)
	a.status.Store(500)
	require.Eventually(t, down(rb), 10*time.Second, 5*time.Millisecond)
	for i := 0; ra.ejectedUntil.Load() <= nowNanos(); i++ {
		require.Less(t, i, 200, "a was never ejected")
		resp := post(t, n, "/v1/completions", streamReq, map[string]string{HeaderStrategy: "random"})
		readAll(t, resp)
	}
	before := a.requests.Load()
	for range 10 {
		require.Equal(t, "b", routeTo())
	}
	assert.Equal(t, before, a.requests.Load(), "an ejected replica gets no traffic, fail-open or not")
	assert.Equal(t, []string{"m"}, readyReport(t, n).FailOpen)
}

// TestFailedReplicaPolledAtUnhealthyInterval: a replica whose /health
// poll failed is polled at UnhealthyInterval, not HealthInterval (an hour
// here, so the old schedule would keep it down for the whole test): it
// leaves rotation, Retry-After names the quick re-poll, and it returns
// when its engine does. Without HealthFailOpen its model is unroutable
// meanwhile.
func TestFailedReplicaPolledAtUnhealthyInterval(t *testing.T) {
	a := newFakeEngine(t, "a")
	a.healthStatus.Store(503)
	n := startNode(t, func(c *Config) {
		c.HealthInterval = time.Hour
		c.UnhealthyInterval = 20 * time.Millisecond
		c.HealthFailOpen = false
	}, rc("a", a.url()))
	ra := n.tbl.Load().byName["a"]
	require.Eventually(t, func() bool { return !ra.available(nowNanos()) }, 10*time.Second, 5*time.Millisecond,
		"the second failed poll comes UnhealthyInterval after the first")

	resp := post(t, n, "/v1/completions", streamReq, nil)
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	assert.Equal(t, "1", resp.Header.Get("Retry-After"), "the next poll is 20ms away, not an hour")
	assert.Equal(t, CodeNoHealthyReplica, decodeErr(t, readAll(t, resp)).Error.Code)
	assert.Equal(t, []string{"m"}, readyReport(t, n).NoAvailableReplica)
	assert.Empty(t, readyReport(t, n).FailOpen)

	a.healthStatus.Store(0)
	require.Eventually(t, func() bool { return ra.available(nowNanos()) }, 10*time.Second, 5*time.Millisecond)
	resp = post(t, n, "/v1/completions", streamReq, nil)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	readAll(t, resp)
}

func TestHealthPollSchedule(t *testing.T) {
	r, err := newReplica(0, rc("a", "http://127.0.0.1:1"), "m")
	require.NoError(t, err)
	n := &Node{cfg: Config{HealthInterval: 2 * time.Second, UnhealthyInterval: 250 * time.Millisecond}}
	assert.Equal(t, 2*time.Second, n.healthPollAfter(r))
	r.setActive(false, 2)
	assert.Equal(t, 250*time.Millisecond, n.healthPollAfter(r), "one failed poll is checked again soon")
	r.setActive(false, 2)
	assert.Equal(t, 250*time.Millisecond, n.healthPollAfter(r), "and so is a replica out of rotation")
	assert.Equal(t, int64(1e9+250e6), r.availableAt(1e9, n.downPollInterval()))
	r.setActive(true, 2)
	assert.Equal(t, 2*time.Second, n.healthPollAfter(r))
	n.cfg.UnhealthyInterval = 0
	r.setActive(false, 2)
	assert.Equal(t, 2*time.Second, n.healthPollAfter(r), "zero keeps one interval")
}

func TestBadInput(t *testing.T) {
	e := newFakeEngine(t, "a")
	n := startNode(t, func(c *Config) { c.MaxBodyBytes = 1 << 16 }, rc("a", e.url()))
	big := `{"model":"m","prompt":"` + strings.Repeat("x", 1<<17) + `"}`
	cases := []struct {
		name, path, body string
		hdr              map[string]string
		status           int
		code             string
	}{
		{"not json", "/v1/completions", `{"model":`, nil, 400, CodeInvalidJSON},
		{"not an object", "/v1/completions", `[1,2]`, nil, 400, CodeInvalidJSON},
		{"empty body", "/v1/completions", ``, nil, 400, CodeInvalidJSON},
		{"missing model", "/v1/completions", `{"prompt":"hi"}`, nil, 400, CodeMissingModel},
		{"unknown model", "/v1/completions", `{"model":"nope","prompt":"hi"}`, nil, 404, CodeModelNotFound},
		{"missing prompt", "/v1/completions", `{"model":"m"}`, nil, 400, CodeMissingPrompt},
		{"null prompt", "/v1/completions", `{"model":"m","prompt":null}`, nil, 400, CodeMissingPrompt},
		{"empty prompt", "/v1/completions", `{"model":"m","prompt":""}`, nil, 400, CodeEmptyPrompt},
		{"empty token list", "/v1/completions", `{"model":"m","prompt":[]}`, nil, 400, CodeEmptyPrompt},
		{"prompt object", "/v1/completions", `{"model":"m","prompt":{"a":1}}`, nil, 400, CodeInvalidPrompt},
		{"prompt number", "/v1/completions", `{"model":"m","prompt":7}`, nil, 400, CodeInvalidPrompt},
		{"negative token", "/v1/completions", `{"model":"m","prompt":[1,-2]}`, nil, 400, CodeInvalidPrompt},
		{"mixed list", "/v1/completions", `{"model":"m","prompt":[1,"a"]}`, nil, 400, CodeInvalidPrompt},
		{"stream not bool", "/v1/completions", `{"model":"m","prompt":"hi","stream":"yes"}`, nil, 400, CodeInvalidField},
		{"model not string", "/v1/completions", `{"model":5,"prompt":"hi"}`, nil, 400, CodeInvalidField},
		{"missing messages", "/v1/chat/completions", `{"model":"m"}`, nil, 400, CodeMissingMessages},
		{"empty messages", "/v1/chat/completions", `{"model":"m","messages":[]}`, nil, 400, CodeEmptyMessages},
		{"messages not array", "/v1/chat/completions", `{"model":"m","messages":"hi"}`, nil, 400, CodeInvalidMessages},
		{"message without role", "/v1/chat/completions", `{"model":"m","messages":[{"content":"hi"}]}`, nil, 400, CodeInvalidMessages},
		{"oversized body", "/v1/completions", big, nil, 413, CodeBodyTooLarge},
		{"unknown strategy", "/v1/completions", `{"model":"m","prompt":"hi"}`, map[string]string{HeaderStrategy: "fastest"}, 400, CodeUnknownStrategy},
		{"unknown path", "/v1/nope", `{}`, nil, 404, CodeNotFound},
		{"batch mixing strings and token lists", "/v1/completions", `{"model":"m","prompt":["a",[1]]}`, nil, 400, CodeInvalidPrompt},
		{"embeddings model not string", "/v1/embeddings", `{"model":5,"input":"hi"}`, nil, 400, CodeInvalidField},
		{"embeddings not json", "/v1/embeddings", `{"model":`, nil, 400, CodeInvalidJSON},
		{"responses without input", "/v1/responses", `{"model":"m"}`, nil, 400, CodeMissingPrompt},
		{"responses input number", "/v1/responses", `{"model":"m","input":5}`, nil, 400, CodeInvalidPrompt},
		{"responses unknown model", "/v1/responses", `{"model":"x","input":"hi"}`, nil, 404, CodeModelNotFound},
		{"transcription not multipart", "/v1/audio/transcriptions", `{"model":"m"}`, nil, 400, CodeInvalidMultipart},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp := post(t, n, tc.path, tc.body, tc.hdr)
			body := readAll(t, resp)
			require.Equal(t, tc.status, resp.StatusCode, body)
			assert.Equal(t, "application/json", resp.Header.Get("Content-Type"))
			er := decodeErr(t, body)
			assert.Equal(t, tc.code, er.Error.Code)
			assert.NotEmpty(t, er.Error.Message)
			assert.NotEmpty(t, er.Error.Type)
		})
	}
	// Oversized body without Content-Length (chunked): still 413.
	pr, pw := io.Pipe()
	go func() {
		_, _ = pw.Write([]byte(big))
		_ = pw.Close()
	}()
	req, _ := http.NewRequest(http.MethodPost, "http://"+n.HTTPAddr()+"/v1/completions", pr)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	require.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode)
	readAll(t, resp)

	resp, err = http.Get("http://" + n.HTTPAddr() + "/v1/completions")
	require.NoError(t, err)
	require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
	readAll(t, resp)
	assert.Zero(t, e.requests.Load(), "no bad request reaches an engine")
}

func TestSingleElementBatchIsRouted(t *testing.T) {
	e := newFakeEngine(t, "a")
	n := startNode(t, nil, rc("a", e.url()))
	for _, body := range []string{`{"model":"m","prompt":["hello"]}`, `{"model":"m","prompt":[[1,2,3]]}`} {
		resp := post(t, n, "/v1/completions", body, nil)
		require.Equal(t, http.StatusOK, resp.StatusCode, body)
		readAll(t, resp)
	}
}

func TestModelsMerged(t *testing.T) {
	a := newFakeEngine(t, "a")
	cfg := func(c *Config) {
		c.Models = append(c.Models, ModelConfig{Name: "other", Adapters: []string{"other-lora"}, Replicas: []ReplicaConfig{rc("z", closedURL(t))}})
	}
	n := startNode(t, cfg, rc("a", a.url()))
	resp, err := http.Get("http://" + n.HTTPAddr() + "/v1/models")
	require.NoError(t, err)
	var list struct {
		Object string           `json:"object"`
		Data   []map[string]any `json:"data"`
	}
	require.NoError(t, json.Unmarshal([]byte(readAll(t, resp)), &list))
	require.Equal(t, "list", list.Object)
	var ids []string
	for _, d := range list.Data {
		ids = append(ids, d["id"].(string))
	}
	assert.Equal(t, []string{"m", "other", "other-lora"}, ids)
	assert.Equal(t, "vllm", list.Data[0]["owned_by"], "the engine's own entry when it lists the model")
	assert.Equal(t, "other", list.Data[2]["parent"])
}

func TestLoadViewScrapesEngineMetrics(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.running.Store(3)
	e.waiting.Store(7)
	n := startNode(t, nil, rc("a", e.url()))
	r := n.tbl.Load().byName["a"]
	require.Eventually(t, func() bool {
		run, wait, kv := r.load()
		return run == 3 && wait == 7 && kv == 0.25
	}, 5*time.Second, 5*time.Millisecond)
}

// debugReport mirrors RouteReport for decoding (Selection marshals one way).
type debugReport struct {
	RouteReport
	Explanation *struct {
		Selection string `json:"selection"`
		Replicas  []struct {
			Name     string `json:"name"`
			Matched  int    `json:"matched_blocks"`
			InFlight int    `json:"in_flight"`
		} `json:"replicas"`
	} `json:"explanation"`
}

type fixedPeers map[string]int

func (f fixedPeers) InFlight(name string) int { return f[name] }

func TestDebugRouteExplains(t *testing.T) {
	a := newFakeEngine(t, "a")
	b := newFakeEngine(t, "b")
	n := startNode(t, nil, rc("a", a.url()), rc("b", b.url()))
	n.SetPeerLoad(fixedPeers{"a": 4})
	prompt := strings.Repeat("abcdefgh", 64) // 512 chars = 4 blocks of 128
	h := n.Index().Hasher()
	keys := h.AppendKeysString(nil, h.Root("m", "", ""), prompt)
	bid, _ := n.ReplicaID("b")
	require.NoError(t, n.Index().Record(keys[:2], bid, index.History, time.Now().UnixNano()))

	resp, err := http.Get("http://" + n.HTTPAddr() + "/debug/route?model=m&strategy=prefix-cache&prompt=" + prompt)
	require.NoError(t, err)
	body := readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, body)
	var rep debugReport
	require.NoError(t, json.Unmarshal([]byte(body), &rep))
	assert.Equal(t, "b", rep.Pick)
	assert.Equal(t, "prefix_match", rep.Selection)
	assert.Equal(t, 4, rep.TotalBlocks)
	assert.Equal(t, 512, rep.PromptTokens)
	require.NotNil(t, rep.Explanation)
	require.Len(t, rep.Explanation.Replicas, 2)
	assert.Equal(t, 0, rep.Explanation.Replicas[0].Matched)
	assert.Equal(t, 4, rep.Explanation.Replicas[0].InFlight, "peers' load is part of the view")
	assert.Equal(t, 2, rep.Explanation.Replicas[1].Matched)
	assert.Zero(t, a.requests.Load()+b.requests.Load(), "explaining proxies nothing")
	assert.NotContains(t, body, "abcdefgh", "the report never echoes the prompt")

	// POST with a chat body.
	resp = post(t, n, "/debug/route", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, map[string]string{HeaderStrategy: "cost"})
	body = readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, body)
	require.NoError(t, json.Unmarshal([]byte(body), &rep))
	assert.Equal(t, "cost", rep.Strategy)
	assert.NotEmpty(t, rep.Pick)
}

func TestRemoteTokenizerCachesAndFallsBack(t *testing.T) {
	e := newFakeEngine(t, "a")
	n := startNode(t, func(c *Config) {
		c.Tokenizer = TokenizerRemote
		c.BlockSize = 4
	}, rc("a", e.url()))
	body := `{"model":"m","prompt":"hello tokenizer"}`
	for i := 0; i < 2; i++ {
		resp := post(t, n, "/v1/completions", body, nil)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		readAll(t, resp)
	}
	assert.Equal(t, 1.0, value(n.m.tokenizeCache.WithLabelValues("miss")))
	assert.Equal(t, 1.0, value(n.m.tokenizeCache.WithLabelValues("hit")))
	// The keys come from the engine's tokens (byte+1000), not the local BPE.
	h := n.Index().Hasher()
	var toks []uint32
	for _, c := range []byte("hello tokenizer") {
		toks = append(toks, uint32(c)+1000)
	}
	keys := h.AppendKeys(nil, h.Root("m", "", ""), toks)
	out := make([]int32, 1)
	aid, _ := n.ReplicaID("a")
	assert.Equal(t, len(keys), n.Index().Match(keys, []index.ReplicaID{aid}, index.ModeHistory, time.Now().UnixNano(), out))
}

func TestMetricsEndpointIsPerNode(t *testing.T) {
	e := newFakeEngine(t, "a")
	n1 := startNode(t, nil, rc("a", e.url()))
	n2 := startNode(t, nil, rc("a", e.url()))
	readAll(t, post(t, n1, "/v1/completions", streamReq, nil))
	get := func(n *Node) string {
		resp, err := http.Get("http://" + n.HTTPAddr() + "/metrics")
		require.NoError(t, err)
		return readAll(t, resp)
	}
	m1, m2 := get(n1), get(n2)
	assert.Contains(t, m1, `kvmesh_route_decisions_total{model="m",selection="least_request_fallback",strategy="prefix-cache"} 1`+"\n")
	assert.NotContains(t, m2, `kvmesh_route_decisions_total{`)
	for _, name := range []string{"kvmesh_index_entries", "kvmesh_proxy_inflight", "kvmesh_route_decision_seconds", "kvmesh_route_match_fraction", "kvmesh_proxy_ttft_seconds"} {
		assert.Contains(t, m1, name)
	}
	// Issue 19's series: where requests went, what they took end to end
	// and what the gateway added, the queued prefill, the build.
	assert.Contains(t, m1, `kvmesh_route_replica_decisions_total{model="m",replica="a"} 1`+"\n")
	assert.Contains(t, m1, `kvmesh_http_request_duration_seconds_count{model="m"} 1`+"\n")
	assert.Contains(t, m1, "kvmesh_http_added_latency_seconds_count 1\n")
	assert.Contains(t, m1, `kvmesh_route_queued_prefill_tokens{model="m",replica="a"} 0`+"\n", "released at the first byte")
	assert.Regexp(t, `kvmesh_build_info\{goversion="go[^"]+",revision="[^"]+",version="[^"]+"\} 1\n`, m1)
	assert.Contains(t, m2, "kvmesh_http_added_latency_seconds_count 0\n")
	// The Go runtime's series: the defaults, and the scheduling latency
	// (how long ready goroutines waited for a thread: a gateway short of
	// CPU shows here first).
	for _, name := range []string{"go_goroutines ", "go_gc_duration_seconds_count ", "go_sched_latencies_seconds_bucket{le=", "process_cpu_seconds_total "} {
		assert.Contains(t, m1, name)
	}
}

// TestTTFTEstimateRatio: a stream that cost routed records its TTFT over
// cost's estimate; one routed by a strategy that estimates nothing records
// nothing.
func TestTTFTEstimateRatio(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.firstDelay.Store(int64(300 * time.Millisecond))
	e.chunkDelay.Store(int64(2 * time.Millisecond)) // a TPOT: the model takes a decode sample
	n := startNode(t, func(c *Config) { c.Strategy = route.NameCost }, rc("a", e.url()))
	tbl := n.tbl.Load()
	model := tbl.pools[0].set.Model()
	id := tbl.byName["a"].id
	ratio := n.m.ttftEstimate.WithLabelValues("a")
	// observeCost records the ratio, then feeds the model: once the model
	// holds the stream's decode sample, the ratio is recorded or never is.
	observed := func(streams uint32) {
		t.Helper()
		require.Eventually(t, func() bool { return model.Rates(id).DecodeSamples == streams }, 10*time.Second, 5*time.Millisecond)
	}

	readAll(t, post(t, n, "/v1/completions", streamReq, nil))
	observed(1)
	count, sum := histogram(ratio)
	require.EqualValues(t, 1, count)
	// The engine held the first token 300 ms; for a short prompt on an
	// idle replica cost expects far less.
	assert.Greater(t, sum, 1.0)

	readAll(t, post(t, n, "/v1/completions", streamReq, map[string]string{HeaderStrategy: route.NamePrefixCache}))
	observed(2)
	count, _ = histogram(ratio)
	assert.EqualValues(t, 1, count, "prefix-cache estimates nothing")
}

// TestEstimatedPastTargetCounter: a cost decision whose pick is estimated
// past the TTFT target counts, by model and replica; one within it, and
// one by a strategy that estimates nothing, do not.
func TestEstimatedPastTargetCounter(t *testing.T) {
	e := newFakeEngine(t, "a")
	n := startNode(t, func(c *Config) {
		c.Strategy = route.NameCost
		c.Route.Cost.TTFTTargetSeconds = 1e-9 // below any estimate
	}, rc("a", e.url()))
	const name = "kvmesh_route_estimated_past_target_total"
	series := map[string]string{"model": "m", "replica": "a"}
	readAll(t, post(t, n, "/v1/completions", streamReq, nil))
	assert.Equal(t, 1.0, counterValue(t, n, name, series))
	readAll(t, post(t, n, "/v1/completions", streamReq, map[string]string{HeaderStrategy: route.NamePrefixCache}))
	assert.Equal(t, 1.0, counterValue(t, n, name, series), "prefix-cache estimates nothing")

	n2 := startNode(t, func(c *Config) {
		c.Strategy = route.NameCost
		c.Route.Cost.TTFTTargetSeconds = 1e6
	}, rc("a", e.url()))
	readAll(t, post(t, n2, "/v1/completions", streamReq, nil))
	assert.Equal(t, 1.0, counterValue(t, n2, "kvmesh_route_replica_decisions_total", series))
	assert.Zero(t, counterValue(t, n2, name, series), "estimated within the target")
}

// TestQueuedPrefillGaugeWhileWaiting: the gauge shows a request's uncached
// prompt tokens while the engine has not answered, and 0 after.
func TestQueuedPrefillGaugeWhileWaiting(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.firstDelay.Store(int64(time.Second))
	n := startNode(t, nil, rc("a", e.url()))
	get := func() string {
		resp, err := http.Get("http://" + n.HTTPAddr() + "/metrics")
		require.NoError(t, err)
		return readAll(t, resp)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := http.Post("http://"+n.HTTPAddr()+"/v1/completions", "application/json", strings.NewReader(streamReq))
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	queued := regexp.MustCompile(`kvmesh_route_queued_prefill_tokens\{model="m",replica="a"\} ([1-9][0-9]*)\n`)
	require.Eventually(t, func() bool { return queued.MatchString(get()) }, 10*time.Second, 5*time.Millisecond)
	<-done
	assert.Contains(t, get(), `kvmesh_route_queued_prefill_tokens{model="m",replica="a"} 0`+"\n")
}

func TestShutdownDrainsAndIsIdempotent(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.chunks.Store(4)
	e.chunkDelay.Store(int64(50 * time.Millisecond))
	cfg := testConfig()
	cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", e.url())}}}
	n, err := New(cfg, nil)
	require.NoError(t, err)
	require.NoError(t, n.Start(context.Background()))
	require.ErrorIs(t, n.Start(context.Background()), ErrAlreadyStarted)

	done := make(chan string, 1)
	go func() {
		resp, err := http.Post("http://"+n.HTTPAddr()+"/v1/completions", "application/json", strings.NewReader(streamReq))
		if err != nil {
			done <- err.Error()
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- string(b)
	}()
	<-e.started
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, n.Shutdown(ctx))
	assert.Equal(t, streamBody("a", 4), <-done, "an in-flight stream drains completely")
	require.NoError(t, n.Shutdown(ctx))
	require.ErrorIs(t, n.Start(context.Background()), ErrShutdown)
	_, err = net.Dial("tcp", n.HTTPAddr())
	assert.Error(t, err, "the listener is closed")
}

func TestShutdownDeadlineCutsStreams(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.chunks.Store(3)
	e.chunkDelay.Store(int64(time.Hour))
	cfg := testConfig()
	cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", e.url())}}}
	n, err := New(cfg, nil)
	require.NoError(t, err)
	require.NoError(t, n.Start(context.Background()))
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := http.Post("http://"+n.HTTPAddr()+"/v1/completions", "application/json", strings.NewReader(streamReq))
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	<-e.started
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	assert.ErrorIs(t, n.Shutdown(ctx), context.DeadlineExceeded)
	<-done
	require.Eventually(t, func() bool { return e.cancelled.Load() == 1 }, 5*time.Second, 5*time.Millisecond)
}

func TestShutdownBeforeStart(t *testing.T) {
	cfg := testConfig()
	cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", "http://127.0.0.1:1")}}}
	n, err := New(cfg, nil)
	require.NoError(t, err)
	require.NoError(t, n.Shutdown(context.Background()))
	require.ErrorIs(t, n.Start(context.Background()), ErrShutdown)
	assert.Empty(t, n.HTTPAddr())
}

func TestParseEngineLoad(t *testing.T) {
	text := `# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a b}c\"d"} 2
vllm:num_requests_running{engine="1",model_name="m"} 3 1700000000000
vllm:num_requests_waiting{model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0"} 0.5
vllm:kv_cache_usage_perc{engine="1"} 0.75
vllm:gpu_cache_usage_perc 0.1
vllm:prefix_cache_hits_total{model_name="m"} 99
vllm:num_requests_waiting{model_name="x"} NaN
garbage line
`
	l, err := parseEngineLoad(strings.NewReader(text))
	require.NoError(t, err)
	assert.EqualValues(t, 5, l.running)
	assert.EqualValues(t, 4, l.waiting)
	assert.Equal(t, 0.75, l.kvUsage)

	l, err = parseEngineLoad(strings.NewReader("vllm:gpu_cache_usage_perc 0.3\n"))
	require.NoError(t, err)
	assert.Equal(t, 0.3, l.kvUsage)
	assert.EqualValues(t, -1, l.running)

	_, err = parseEngineLoad(strings.NewReader("up 1\n"))
	assert.ErrorIs(t, err, ErrUpstream)
}

func TestRecoverTurnsPanicInto500(t *testing.T) {
	cfg := testConfig()
	cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", "http://127.0.0.1:1")}}}
	n, err := New(cfg, nil)
	require.NoError(t, err)
	h := n.recoverer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { panic("boom") }))
	rec := &recorder{header: http.Header{}}
	h.ServeHTTP(rec, &http.Request{URL: mustURL("/x")})
	assert.Equal(t, 500, rec.code)
	assert.Equal(t, CodeInternal, decodeErr(t, rec.body.String()).Error.Code)
}

type recorder struct {
	header http.Header
	code   int
	body   bytes.Buffer
}

func (r *recorder) Header() http.Header         { return r.header }
func (r *recorder) WriteHeader(c int)           { r.code = c }
func (r *recorder) Write(b []byte) (int, error) { return r.body.Write(b) }

func TestRemoteTokenizerFallsBackToLocal(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.tokStatus.Store(500)
	n := startNode(t, func(c *Config) { c.Tokenizer = TokenizerRemote }, rc("a", e.url()))
	text := strings.Repeat("fallback text ", 20)
	resp := post(t, n, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":%q}`, text), nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	readAll(t, resp)
	assert.Equal(t, 1.0, value(n.m.tokenizeCache.WithLabelValues("fallback")))
	assert.Equal(t, 1.0, value(n.m.upstreamErrors.WithLabelValues("a", reasonRemoteTokenize)))
	// The keys are the local tiktoken's.
	s := getScratch()
	defer putScratch(s)
	toks := n.tok.Encode(nil, text)
	h := n.Index().Hasher()
	keys := h.AppendKeys(nil, h.Root("m", "", ""), toks)
	require.NotEmpty(t, keys)
	aid, _ := n.ReplicaID("a")
	out := make([]int32, 1)
	assert.Equal(t, len(keys), n.Index().Match(keys, []index.ReplicaID{aid}, index.ModeHistory, time.Now().UnixNano(), out))
}

func TestUnhealthyAfterConsecutivePolls(t *testing.T) {
	r, err := newReplica(0, rc("a", "http://127.0.0.1:1"), "m")
	require.NoError(t, err)
	assert.False(t, r.setActive(false, 2))
	assert.True(t, r.available(1), "one failed poll is not an outage")
	assert.True(t, r.setActive(false, 2))
	assert.False(t, r.available(1))
	assert.False(t, r.setActive(false, 2))
	assert.True(t, r.setActive(true, 2))
	assert.True(t, r.available(1))
	assert.False(t, r.setActive(false, 2), "the count restarts after a success")
}

type recordSink struct {
	mu  sync.Mutex
	got []string
}

func (s *recordSink) Recorded(model, replica string, l index.Ledger, keys []index.BlockKey, now int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.got = append(s.got, fmt.Sprintf("%s/%s/%s/%d", model, replica, l, len(keys)))
}

func TestRecordListenerHearsDecisions(t *testing.T) {
	e := newFakeEngine(t, "a")
	n := startNode(t, nil, rc("a", e.url()))
	sink := &recordSink{}
	n.SetRecordListener(sink)
	readAll(t, post(t, n, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":%q}`, strings.Repeat("z", 300)), nil))
	e.status.Store(500)
	readAll(t, post(t, n, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":%q}`, strings.Repeat("y", 300)), nil))
	sink.mu.Lock()
	defer sink.mu.Unlock()
	assert.Equal(t, []string{"m/a/history/2"}, sink.got, "only successful decisions are recorded")
}

func TestStalledBodyUploadTimesOut(t *testing.T) {
	e := newFakeEngine(t, "a")
	n := startNode(t, func(c *Config) { c.BodyReadTimeout = 100 * time.Millisecond }, rc("a", e.url()))
	conn, err := net.Dial("tcp", n.HTTPAddr())
	require.NoError(t, err)
	defer conn.Close()
	_, err = io.WriteString(conn, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":")
	require.NoError(t, err)
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(5*time.Second)))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	require.NoError(t, err, "the gateway answers instead of hanging")
	assert.Equal(t, http.StatusRequestTimeout, resp.StatusCode)
	assert.Equal(t, CodeBodyTimeout, decodeErr(t, readAll(t, resp)).Error.Code)
}

func TestQueuedPrefillReleasedAtFirstByte(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.chunks.Store(3)
	e.chunkDelay.Store(int64(time.Hour)) // first event, then silence
	n := startNode(t, nil, rc("a", e.url()))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	body := fmt.Sprintf(`{"model":"m","prompt":%q,"stream":true}`, strings.Repeat("q", 1000))
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+n.HTTPAddr()+"/v1/completions", strings.NewReader(body))
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	_, err = bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	r := n.tbl.Load().byName["a"]
	assert.EqualValues(t, 1, r.inflight.Load(), "the stream is still open")
	require.Eventually(t, func() bool { return r.queuedPrefill.Load() == 0 }, 5*time.Second, time.Millisecond,
		"the prefill is no longer queued once the first token arrived")
	cancel()
	require.Eventually(t, func() bool { return r.inflight.Load() == 0 }, 5*time.Second, time.Millisecond)
}

func TestPerModelIndexMode(t *testing.T) {
	a, b := newFakeEngine(t, "a"), newFakeEngine(t, "b")
	n := startNode(t, func(c *Config) {
		c.Models = append(c.Models, ModelConfig{Name: "other", IndexMode: "kv-events", Replicas: []ReplicaConfig{rc("b", b.url())}})
	}, rc("a", a.url()))
	for model, want := range map[string]string{"m": "history", "other": "kv-events"} {
		resp, err := http.Get("http://" + n.HTTPAddr() + "/debug/route?model=" + model + "&prompt=hello")
		require.NoError(t, err)
		var rep debugReport
		require.NoError(t, json.Unmarshal([]byte(readAll(t, resp)), &rep))
		assert.Equal(t, want, rep.IndexMode, model)
	}
	// A decision in kv-events mode is recorded as speculative.
	readAll(t, post(t, n, "/v1/completions", fmt.Sprintf(`{"model":"other","prompt":%q,"stream":true}`, strings.Repeat("s", 300)), nil))
	assert.Equal(t, 2, n.Index().Stats().Entries[index.Speculative])
}

// syncBuffer is a goroutine-safe log sink.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestLogsNeverContainPrompts(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.breakAfter.Store(2)
	var logs syncBuffer
	cfg := testConfig()
	cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", e.url()), rc("dead", closedURL(t))}}}
	n, err := New(cfg, slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	require.NoError(t, err)
	require.NoError(t, n.Start(context.Background()))
	defer func() { require.NoError(t, n.Shutdown(context.Background())) }()
	const secret = "SECRET-PROMPT-MARKER"
	prompt := strings.Repeat(secret+" ", 40)
	for _, body := range []string{
		fmt.Sprintf(`{"model":"m","prompt":%q,"stream":true}`, prompt),
		fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}],"stream":true}`, prompt),
		fmt.Sprintf(`{"model":"m","prompt":%q`, prompt),
		fmt.Sprintf(`{"model":"m","prompt":[%q,%q]}`, prompt, prompt),
		fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":[{"type":%q}]}]}`, secret),
	} {
		for i := 0; i < 3; i++ {
			resp := post(t, n, "/v1/completions", body, map[string]string{HeaderStrategy: "random"})
			readAll(t, resp)
			resp = post(t, n, "/v1/chat/completions", body, map[string]string{HeaderStrategy: "random"})
			readAll(t, resp)
		}
	}
	require.Contains(t, logs.String(), `"msg":"routed"`, "debug logs were written")
	assert.NotContains(t, logs.String(), secret)
}

func TestReadAllSized(t *testing.T) {
	b, err := readAllSized(strings.NewReader("hello"), 5)
	require.NoError(t, err)
	assert.Equal(t, "hello", string(b))
	_, err = readAllSized(strings.NewReader("hel"), 5)
	assert.ErrorIs(t, err, io.ErrUnexpectedEOF)
	_, err = readAllSized(strings.NewReader(""), 5)
	assert.ErrorIs(t, err, io.ErrUnexpectedEOF)
	b, err = readAllSized(strings.NewReader("hello world"), 5)
	require.NoError(t, err)
	assert.Equal(t, "hello world", string(b))
	b, err = readAllSized(strings.NewReader("abc"), -1)
	require.NoError(t, err)
	assert.Equal(t, "abc", string(b))
}

// The cost model learns from content events only: the usage event and
// [DONE] are not output tokens (the count comes from usage.completion_tokens),
// and the time until they arrive is not decode time.
func TestCostObservationCountsContentEventsOnly(t *testing.T) {
	const chunks = 5 // content events, as many as max_tokens below
	e := newFakeEngine(t, "a")
	e.chunks.Store(chunks)
	e.chunkDelay.Store(int64(2 * time.Millisecond))
	// The usage event and [DONE] each come tail after the content. A TPOT
	// that spanned them would be at least 2·tail over the chunks−1 gaps; the
	// content events' own 2 ms gaps stretched to 61 ms each once under
	// -race with three CI runs at once, so tail keeps the two apart. The
	// model clips a sample to 4× its current step (Model.Observe): a prior
	// of 0.2 s lets the tail's 0.3 s through, where the default 0.03 s
	// would clip it to 0.12 s, below the bound asserted.
	const tail = 600 * time.Millisecond
	e.tailDelay.Store(int64(tail))
	n := startNode(t, func(c *Config) { c.Route.Cost.PriorDecodeStepSeconds = 0.2 }, rc("a", e.url()))
	tbl := n.tbl.Load()
	r := tbl.byName["a"]
	m := tbl.pools[0].set.Model()
	prior := m.Rates(r.id)
	alpha := m.Config().Alpha

	resp := post(t, n, "/v1/completions", `{"model":"m","prompt":"hello","max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}`, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	readAll(t, resp)
	var got route.Rates
	require.Eventually(t, func() bool { got = m.Rates(r.id); return got.DecodeSamples == 1 }, 5*time.Second, time.Millisecond)

	// One EWMA step from the prior: sample = prior + (after − prior)/α.
	outSample := prior.OutputTokens + (got.OutputTokens-prior.OutputTokens)/alpha
	assert.InDelta(t, 5, outSample, 1e-6, "completion_tokens of the usage event, not the event count")
	stepSample := prior.DecodeStepSeconds + (got.DecodeStepSeconds-prior.DecodeStepSeconds)/alpha
	withTail := (2 * tail / (chunks - 1)).Seconds()
	assert.Less(t, stepSample, withTail/2, "TPOT spans the content events (2 ms apart), not the 2×%s tail", tail)
}

// The cost model learns prefill speed from the prefill the engine ran:
// prompt − cached tokens of its usage, not the routing-time estimate. A
// history index takes this 4,000-character prompt for 1,000 uncached
// tokens; the engine found all but 40 of them cached, too few to time
// prefill by (MinSampleTokens), so the model learns nothing from it.
func TestCostLearnsPrefillFromEngineUsage(t *testing.T) {
	for _, tc := range []struct {
		name        string
		cached      int64
		wantSamples uint32
	}{
		{"engine reports 960 cached", 960, 0},
		{"engine reports none cached", 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newFakeEngine(t, "a")
			e.chunks.Store(3)
			e.firstDelay.Store(int64(300 * time.Millisecond))
			e.chunkDelay.Store(int64(5 * time.Millisecond)) // content events in separate reads: a TPOT to observe
			e.usagePrompt.Store(1000)
			e.usageCached.Store(tc.cached)
			n := startNode(t, func(c *Config) { c.Strategy = route.NameCost }, rc("a", e.url()))
			tbl := n.tbl.Load()
			r := tbl.byName["a"]
			m := tbl.pools[0].set.Model()
			body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`, strings.Repeat("w", 4000))
			resp := post(t, n, "/v1/completions", body, nil)
			require.Equal(t, http.StatusOK, resp.StatusCode)
			readAll(t, resp)
			require.Eventually(t, func() bool { return m.Rates(r.id).DecodeSamples == 1 }, 5*time.Second, time.Millisecond,
				"the stream was observed")
			assert.Equal(t, tc.wantSamples, m.Rates(r.id).PrefillSamples)
		})
	}
}

// TestCostLearnsCharactersPerToken: a gateway keying prompts by
// characters converts them to engine tokens by the ratio the engine's
// usage shows, not by the rule of thumb of four: the 5,000-character
// prompt the engine counted as 1,000 tokens moves the ratio halfway from
// 4 to 5 (the prior weighs as one sample), and the next decision's view
// (/debug/route, cost) converts with the new ratio.
func TestCostLearnsCharactersPerToken(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.usagePrompt.Store(1000)
	e.chunks.Store(3)
	e.chunkDelay.Store(int64(5 * time.Millisecond)) // a TPOT: each observed stream counts a decode sample
	n := startNode(t, func(c *Config) { c.Strategy = route.NameCost }, rc("a", e.url()))
	m := n.tbl.Load().pools[0].set.Model()
	require.Equal(t, route.CharsPerToken, m.UnitsPerToken())
	prompt := strings.Repeat("w", 5000)
	body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`, prompt)
	resp := post(t, n, "/v1/completions", body, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	readAll(t, resp)
	require.Eventually(t, func() bool { return m.UnitsPerToken() != route.CharsPerToken }, 5*time.Second, time.Millisecond,
		"the stream's usage was observed")
	assert.InDelta(t, 4.5, m.UnitsPerToken(), 1e-9)

	// A batch of prompts is keyed by its longest: its characters are
	// not the prompt_tokens' (all of them), so it teaches no ratio.
	rep := n.tbl.Load().byName["a"]
	decodes := m.Rates(rep.id).DecodeSamples
	body = fmt.Sprintf(`{"model":"m","prompt":[%q,%q],"max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`, prompt, prompt)
	resp = post(t, n, "/v1/completions", body, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	readAll(t, resp)
	require.Eventually(t, func() bool { return m.Rates(rep.id).DecodeSamples > decodes }, 5*time.Second, time.Millisecond,
		"the batch's stream was observed")
	assert.InDelta(t, 4.5, m.UnitsPerToken(), 1e-9)

	resp = post(t, n, "/debug/route", fmt.Sprintf(`{"model":"m","prompt":%q}`, prompt), nil)
	out := readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, out)
	var report struct {
		Explanation struct {
			UnitsPerToken float64 `json:"units_per_token"`
		} `json:"explanation"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &report))
	assert.InDelta(t, 4.5, report.Explanation.UnitsPerToken, 1e-9)
}

// testConfig is LocalConfig with the strategy and index mode these tests
// were written against (prefix-cache, history), set explicitly now that
// the defaults are cost and auto; tests of a default use LocalConfig.
func testConfig() Config {
	c := LocalConfig()
	c.Strategy = route.NamePrefixCache
	c.IndexMode = index.ModeHistory.String()
	return c
}
