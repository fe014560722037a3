package node

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func getWith(t *testing.T, n *Node, path string, hdr map[string]string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, "http://"+n.HTTPAddr()+path, nil)
	require.NoError(t, err)
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	return resp.StatusCode, readAll(t, resp)
}

// The debug views reveal which prompts are cached: they need the admin
// token unless made public.
func TestDebugViewsNeedTheAdminToken(t *testing.T) {
	t.Setenv("KVMESH_ADMIN_TOKEN", "")
	e := newFakeEngine(t, "a")
	secured := func(c *Config) { c.DebugPublic = false; c.AdminToken = "s3cret" }
	n := startNode(t, secured, ReplicaConfig{Name: "a", URL: e.url()})
	route := "/debug/route?model=m&prompt=hello"
	for _, path := range []string{route, "/debug/replicas"} {
		st, body := getWith(t, n, path, nil)
		assert.Equal(t, http.StatusUnauthorized, st, path)
		assert.Contains(t, body, `"code":"unauthorized"`)
		st, _ = getWith(t, n, path, map[string]string{"Authorization": "Bearer wrong"})
		assert.Equal(t, http.StatusUnauthorized, st, path)
		st, body = getWith(t, n, path, map[string]string{"Authorization": "Bearer s3cret"})
		assert.Equal(t, http.StatusOK, st, body)
		st, _ = getWith(t, n, path, map[string]string{HeaderAdminToken: "s3cret"})
		assert.Equal(t, http.StatusOK, st, path)
	}
	var rep ReplicasReport
	_, body := getWith(t, n, "/debug/replicas", map[string]string{"Authorization": "Bearer s3cret"})
	require.NoError(t, json.Unmarshal([]byte(body), &rep))
	require.Len(t, rep.Replicas, 1)
	assert.Equal(t, "a", rep.Replicas[0].Name)
	assert.NotEmpty(t, rep.ConfigDigest)

	// No token configured anywhere: refused, and the answer says what to set.
	n2 := startNode(t, func(c *Config) { c.DebugPublic = false }, ReplicaConfig{Name: "a", URL: e.url()})
	st, body := getWith(t, n2, route, map[string]string{"Authorization": "Bearer "})
	assert.Equal(t, http.StatusUnauthorized, st)
	assert.Contains(t, body, "KVMESH_ADMIN_TOKEN")
	// The token from the environment counts.
	t.Setenv("KVMESH_ADMIN_TOKEN", "from-env")
	n3 := startNode(t, func(c *Config) { c.DebugPublic = false }, ReplicaConfig{Name: "a", URL: e.url()})
	st, _ = getWith(t, n3, route, map[string]string{"Authorization": "Bearer from-env"})
	assert.Equal(t, http.StatusOK, st)
	// Made public explicitly.
	n4 := startNode(t, func(c *Config) { c.DebugPublic = true }, ReplicaConfig{Name: "a", URL: e.url()})
	st, _ = getWith(t, n4, route, nil)
	assert.Equal(t, http.StatusOK, st)
	assert.False(t, DefaultConfig().DebugPublic, "private by default")
}

// Go's profiles need the admin token even on a gateway whose debug views
// are public (LocalConfig's), and serve real profiles to its holder.
func TestProfilesNeedTheAdminToken(t *testing.T) {
	t.Setenv("KVMESH_ADMIN_TOKEN", "")
	e := newFakeEngine(t, "a")
	n := startNode(t, func(c *Config) { c.DebugPublic = true; c.AdminToken = "s3cret" }, ReplicaConfig{Name: "a", URL: e.url()})
	paths := []string{"/debug/pprof/", "/debug/pprof/goroutine?debug=1", "/debug/pprof/heap",
		"/debug/pprof/cmdline", "/debug/pprof/symbol", "/debug/pprof/profile?seconds=1", "/debug/pprof/trace?seconds=1"}
	for _, path := range paths {
		st, body := getWith(t, n, path, nil)
		assert.Equal(t, http.StatusUnauthorized, st, path)
		assert.Contains(t, body, "profiles require the admin token", path)
		st, _ = getWith(t, n, path, map[string]string{"Authorization": "Bearer wrong"})
		assert.Equal(t, http.StatusUnauthorized, st, path)
	}
	auth := map[string]string{"Authorization": "Bearer s3cret"}
	st, body := getWith(t, n, "/debug/pprof/", auth)
	require.Equal(t, http.StatusOK, st, body)
	assert.Contains(t, body, "goroutine")
	st, body = getWith(t, n, "/debug/pprof/goroutine?debug=1", auth)
	require.Equal(t, http.StatusOK, st, body)
	assert.Contains(t, body, "tokenGate", "this very request's stack is in the dump")
	// A CPU profile is a gzipped protobuf (gzip's magic bytes first).
	st, body = getWith(t, n, "/debug/pprof/profile?seconds=1", auth)
	require.Equal(t, http.StatusOK, st, body)
	require.Greater(t, len(body), 2)
	assert.Equal(t, "\x1f\x8b", body[:2])

	// A gateway without a token cannot open them at all, and says what to set.
	n2 := startNode(t, func(c *Config) { c.DebugPublic = true }, ReplicaConfig{Name: "a", URL: e.url()})
	st, body = getWith(t, n2, "/debug/pprof/", map[string]string{"Authorization": "Bearer "})
	assert.Equal(t, http.StatusUnauthorized, st)
	assert.Contains(t, body, "KVMESH_ADMIN_TOKEN")
	assert.NotContains(t, body, "--debug-public", "making debug views public does not open profiles")
}

// A pinned request goes to the named replica; the pin needs the admin
// token, and neither the pin nor the token reaches the engine.
func TestPinReplica(t *testing.T) {
	a, b := newFakeEngine(t, "a"), newFakeEngine(t, "b")
	n := startNode(t, func(c *Config) { c.AdminToken = "s3cret" },
		ReplicaConfig{Name: "a", URL: a.url()}, ReplicaConfig{Name: "b", URL: b.url()})
	body := `{"model":"m","prompt":"hello","max_tokens":2}`
	resp := post(t, n, "/v1/completions", body, map[string]string{HeaderPinReplica: "b"})
	out := readAll(t, resp)
	assert.Equal(t, http.StatusUnauthorized, resp.StatusCode, out)
	resp = post(t, n, "/v1/completions", body, map[string]string{HeaderPinReplica: "zz", HeaderAdminToken: "s3cret"})
	out = readAll(t, resp)
	assert.Equal(t, http.StatusBadRequest, resp.StatusCode)
	assert.Contains(t, out, CodeUnknownPin)
	for range 8 {
		resp = post(t, n, "/v1/completions", body, map[string]string{HeaderPinReplica: "b", HeaderAdminToken: "s3cret"})
		readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		assert.Equal(t, "b", resp.Header.Get(HeaderReplica))
	}
	assert.Zero(t, a.requests.Load())
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, h := range b.headers {
		assert.Empty(t, h.Get(HeaderPinReplica))
		assert.Empty(t, h.Get(HeaderAdminToken), "the admin token never goes upstream")
	}
}

// Past MaxInFlight requests the gateway answers 429 with Retry-After,
// without reading the body, and serves again once requests finish.
func TestInFlightLimit(t *testing.T) {
	release := make(chan struct{})
	started := make(chan struct{}, 8)
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/completions" {
			w.WriteHeader(http.StatusOK)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		started <- struct{}{}
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"text":"ok"}]}`)
	}))
	t.Cleanup(engine.Close)
	n := startNode(t, func(c *Config) { c.MaxInFlight = 2; c.FirstByteTimeout = time.Minute },
		ReplicaConfig{Name: "a", URL: engine.URL})
	body := `{"model":"m","prompt":"hello","max_tokens":2}`
	done := make(chan int, 2)
	for range 2 {
		go func() {
			resp, err := http.Post("http://"+n.HTTPAddr()+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				done <- 0
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			done <- resp.StatusCode
		}()
	}
	for range 2 {
		select {
		case <-started:
		case <-time.After(10 * time.Second):
			t.Fatal("the two requests did not reach the engine")
		}
	}
	require.Equal(t, 2.0, gaugeValue(t, n, "kvmesh_http_inflight_requests"))
	resp := post(t, n, "/v1/completions", body, nil)
	out := readAll(t, resp)
	assert.Equal(t, http.StatusTooManyRequests, resp.StatusCode, out)
	assert.Equal(t, "1", resp.Header.Get("Retry-After"))
	assert.Contains(t, out, CodeOverloaded)
	// Probes are not limited.
	st, _ := getWith(t, n, "/health", nil)
	assert.Equal(t, http.StatusOK, st)

	close(release)
	for range 2 {
		select {
		case st := <-done:
			assert.Equal(t, http.StatusOK, st)
		case <-time.After(10 * time.Second):
			t.Fatal("held requests did not finish")
		}
	}
	require.Eventually(t, func() bool { return gaugeValue(t, n, "kvmesh_http_inflight_requests") == 0 }, 5*time.Second, 5*time.Millisecond)
	resp = post(t, n, "/v1/completions", body, nil)
	readAll(t, resp)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, 4096, DefaultConfig().MaxInFlight)
}

// startDisagreeing starts a gateway in front of replicas a and b of model
// m, where only b publishes KV events and so is probed, and b's
// /tokenize disagrees (fake engines answer ids +1000); it returns once
// b's verdict is in.
func startDisagreeing(t *testing.T) (n *Node, a *fakeEngine) {
	t.Helper()
	a, b := newFakeEngine(t, "a"), newFakeEngine(t, "b")
	n = startNode(t, func(c *Config) {
		c.IndexMode = "kv-events"
		c.Tokenizer = TokenizerCharacter
		c.BlockSize = 4
	}, ReplicaConfig{Name: "a", URL: a.url()}, ReplicaConfig{Name: "b", URL: b.url(), KVBind: "tcp://127.0.0.1:0"})
	require.Eventually(t, func() bool { return len(n.Agreement()) == 1 }, 10*time.Second, 5*time.Millisecond)
	return n, a
}

// A replica that leaves the routing table takes its verdict with it: the
// model goes back to the gateway's tokenizer when no remaining replica
// disagrees, and its series go.
func TestAgreementForgetsRemovedReplica(t *testing.T) {
	n, a := startDisagreeing(t)
	assert.Equal(t, "b", n.Agreement()[0].Replica, "only the replica that publishes KV events is probed")
	assert.Equal(t, AgreementDisagree, n.Agreement()[0].Verdict)
	assert.True(t, n.agree.engine.has("m"))

	spec := specFromConfig(&n.cfg)
	spec.models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{{Name: "a", URL: a.url()}}}}
	require.NoError(t, n.applySpec(spec))
	assert.Empty(t, n.Agreement())
	assert.False(t, n.agree.engine.has("m"), "the model's own tokenizer again")
	assert.Zero(t, gaugeValue(t, n, "kvmesh_tokenizer_engine_tokenizes"))
}

// A verdict that the removed replica's probe reaches while the removal
// runs is dropped, in the state and in the gauges: the probe loop's
// context has ended by then. ci683 (five .ci/run at once, -race) saw
// kvmesh_tokenizer_engine_tokenizes at 1 after the removal, set by a
// late probe after forgetChecks had reset it.
func TestAgreementVerdictAfterRemovalIsDropped(t *testing.T) {
	n, a := startDisagreeing(t)
	p, rb := n.tbl.Load().replicaByName("b")
	require.NotNil(t, rb)

	spec := specFromConfig(&n.cfg)
	spec.models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{{Name: "a", URL: a.url()}}}}
	require.NoError(t, n.applySpec(spec))
	require.Empty(t, n.Agreement())

	// b's probe loop's context, which the removal cancelled.
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	n.recordAgreement(ended, p, rb, AgreementReport{Model: "m", Replica: "b", Verdict: AgreementDisagree, Tokenizer: n.tokName})
	assert.Empty(t, n.Agreement(), "no verdict for a removed replica")
	assert.False(t, n.agree.engine.has("m"))
	assert.Zero(t, gaugeValue(t, n, "kvmesh_tokenizer_engine_tokenizes"))
}
