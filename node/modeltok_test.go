package node

import (
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// modelTokMsgs is a chat whose token count differs between tiktoken
// (RenderChat) and the Qwen3 template, so the count tells which keyed it.
const modelTokMsgs = `[{"role":"system","content":"You are terse."},{"role":"user","content":"Bonjour, 世界! Explain prefix caching in two lines, please."}]`

// routeReport asks n's /debug/route for model's chat and decodes it.
func routeReport(t testing.TB, n *Node, model string) debugReport {
	t.Helper()
	resp := post(t, n, "/debug/route", fmt.Sprintf(`{"model":%q,"messages":%s}`, model, modelTokMsgs),
		map[string]string{HeaderStrategy: "prefix-cache"})
	body := readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, body)
	var rep debugReport
	require.NoError(t, json.Unmarshal([]byte(body), &rep))
	return rep
}

// modelTokCounts are the chat's token counts under the global tiktoken
// and under the Qwen3 tokenizer in dir, and the Qwen3 ids.
func modelTokCounts(t testing.TB, dir string) (tik int, qwen []uint32) {
	t.Helper()
	tk, err := tokenizer.New(TokenizerTiktoken)
	require.NoError(t, err)
	var msgs []tokenizer.Message
	require.NoError(t, json.Unmarshal([]byte(modelTokMsgs), &msgs))
	qw, err := tokenizer.New(TokenizerHFPrefix + dir)
	require.NoError(t, err)
	qwen, err = qw.(*tokenizer.HF).EncodeChat(nil, tokenizer.ChatRequest{Messages: json.RawMessage(modelTokMsgs), AddGenerationPrompt: true})
	require.NoError(t, err)
	tik = len(tk.Encode(nil, tokenizer.RenderChat(msgs)))
	require.NotEqual(t, tik, len(qwen), "the test needs counts that tell the tokenizers apart")
	return tik, qwen
}

// TestClusterModelTokenizerPatch sets a model's own tokenizer through a
// raft config patch (two gateways: real memberlist, NATS and raft on
// loopback): afterwards both gateways key the model's prompts with the
// Qwen3 tokenizer (token count, and keys that match entries recorded from
// Qwen3 ids), without a restart; a name the document refuses is a 400; a
// directory a gateway cannot load is refused at apply, counted, and the
// previous table stays; removing the field returns to the global one.
func TestClusterModelTokenizerPatch(t *testing.T) {
	if testing.Short() {
		t.Skip("two-gateway cluster: skipped with -short")
	}
	dir := qwen3Dir(t)
	tik, qwen := modelTokCounts(t, dir)
	e := newFakeEngine(t, "e")
	mk := func(id string, join []string) Config {
		c := gwConfig(id, t.TempDir(), join, 2, rc("e", e.url()))
		c.Tokenizer = TokenizerTiktoken
		return c
	}
	g0, _ := startGateway(t, mk("gw-a", nil))
	g1, _ := startGateway(t, mk("gw-b", []string{g0.Cluster().GossipAddr()}))
	gws := []*Node{g0, g1}
	waitReady(t, gws...)
	for _, g := range gws {
		assert.Equal(t, tik, routeReport(t, g, "m").PromptTokens, "before the patch: the global tiktoken (%s)", g.NodeID())
	}

	patch := func(body string) uint64 {
		t.Helper()
		code, out := admin(t, g1, http.MethodPatch, "/admin/v1/config", body)
		require.Equal(t, http.StatusOK, code, out)
		var v struct{ Version uint64 }
		require.NoError(t, json.Unmarshal([]byte(out), &v))
		return v.Version
	}
	waitVersion := func(v uint64) {
		t.Helper()
		for _, g := range gws {
			require.Eventually(t, func() bool { return g.ConfigVersion() >= v }, 20*time.Second, time.Millisecond, g.NodeID())
		}
	}

	// Set: both gateways key m with Qwen3.
	v := patch(fmt.Sprintf(`{"models":{"m":{"tokenizer":%q}}}`, TokenizerHFPrefix+dir))
	waitVersion(v)
	h := g0.Index().Hasher()
	keys := h.AppendKeys(nil, h.Root("m", "", ""), qwen)
	require.NotEmpty(t, keys)
	for _, g := range gws {
		id, ok := g.ReplicaID("e")
		require.True(t, ok)
		require.NoError(t, g.Index().Record(keys, id, index.History, time.Now().UnixNano()))
		rep := routeReport(t, g, "m")
		assert.Equal(t, len(qwen), rep.PromptTokens, g.NodeID())
		assert.Equal(t, len(keys), rep.TotalBlocks, g.NodeID())
		assert.Equal(t, len(keys), matchedOf(rep, "e"), "keys from the Qwen3 ids match (%s)", g.NodeID())
	}

	// A name the document does not know never reaches the FSM.
	code, out := admin(t, g0, http.MethodPatch, "/admin/v1/config", `{"models":{"m":{"tokenizer":"sentencepiece"}}}`)
	assert.Equal(t, http.StatusBadRequest, code, out)
	assert.Contains(t, out, `models[\"m\"].tokenizer`)

	// A well-formed directory that is not there: committed by raft (the FSM
	// reads no files), refused by every gateway, which keeps the Qwen3 table.
	errs := []uint64{g0.cl.applyErrors.Load(), g1.cl.applyErrors.Load()}
	bad := patch(`{"models":{"m":{"tokenizer":"hf:/nonexistent/kvmesh-test-tokenizer"}}}`)
	for i, g := range gws {
		require.Eventually(t, func() bool { return g.cl.applyErrors.Load() > errs[i] }, 20*time.Second, time.Millisecond, g.NodeID())
		assert.Less(t, g.ConfigVersion(), bad, "the refused version is not in force (%s)", g.NodeID())
		assert.Equal(t, len(qwen), routeReport(t, g, "m").PromptTokens, "the previous table stays (%s)", g.NodeID())
	}

	// Remove: back to the global tokenizer, and the cache lets Qwen3 go.
	v = patch(`{"models":{"m":{"tokenizer":null}}}`)
	waitVersion(v)
	for _, g := range gws {
		assert.Equal(t, tik, routeReport(t, g, "m").PromptTokens, "after removal: the global tiktoken (%s)", g.NodeID())
		g.reloadMu.Lock()
		cached := len(g.modelToks)
		g.reloadMu.Unlock()
		assert.Zero(t, cached, "no model tokenizer left cached (%s)", g.NodeID())
	}
}

// TestApplySpecModelTokenizer checks the standalone apply path without
// tokenizer data: a per-model name other than tiktoken or hf:<dir>, a
// directory that does not load, and any per-model tokenizer under the
// character tokenizer are refused with ErrInvalidConfig and the previous
// table stays; tiktoken under a remote global is the global's own local
// tokenizer (no pool tokenizer).
func TestApplySpecModelTokenizer(t *testing.T) {
	a := newFakeEngine(t, "a")
	n := startNode(t, nil, rc("a", a.url()))
	require.Equal(t, TokenizerCharacter, n.tokName, "LocalConfig in history mode keys by character")
	before := n.tbl.Load()
	for _, name := range []string{"sentencepiece", TokenizerAuto, TokenizerHFPrefix, TokenizerTiktoken} {
		spec := specFromConfig(&n.cfg)
		spec.models = []ModelConfig{{Name: "m", Tokenizer: name, Replicas: []ReplicaConfig{rc("a", a.url())}}}
		err := n.applySpec(spec)
		require.ErrorIs(t, err, ErrInvalidConfig, name)
		assert.Contains(t, err.Error(), "tokenizer", name)
		assert.Same(t, before, n.tbl.Load(), "refused: the previous table stays (%s)", name)
	}

	r := startNode(t, func(c *Config) { c.Tokenizer = TokenizerRemote }, rc("a", a.url()))
	spec := specFromConfig(&r.cfg)
	spec.models = []ModelConfig{{Name: "m", Tokenizer: TokenizerHFPrefix + t.TempDir(), Replicas: []ReplicaConfig{rc("a", a.url())}}}
	prev := r.tbl.Load()
	require.ErrorIs(t, r.applySpec(spec), ErrInvalidConfig, "a directory without tokenizer.json")
	assert.Same(t, prev, r.tbl.Load())
	spec.models[0].Tokenizer = TokenizerTiktoken
	require.NoError(t, r.applySpec(spec))
	assert.Nil(t, r.tbl.Load().pools[0].tok, "tiktoken is the remote global's local tokenizer")
}

// BenchmarkModelTokenizerKeys measures prompt → block keys for a model
// whose own tokenizer (Qwen3) came from a routing-config apply, warm
// (same document, new question): the pool's tokenizer is read from the
// pool the request holds, so the warm path stays allocation-free.
func BenchmarkModelTokenizerKeys(b *testing.B) {
	dir := qwen3Dir(b)
	cfg := testConfig()
	cfg.Tokenizer = TokenizerTiktoken
	cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", "http://127.0.0.1:1")}}}
	n, err := New(cfg, nil)
	require.NoError(b, err)
	spec := specFromConfig(&cfg)
	spec.version = 2
	spec.models = []ModelConfig{{Name: "m", Tokenizer: TokenizerHFPrefix + dir, Replicas: cfg.Models[0].Replicas}}
	require.NoError(b, n.applySpec(spec))
	p := n.tbl.Load().pools[0]
	require.NotNil(b, p.tok)
	s := getScratch()
	defer putScratch(s)
	prompts := make([]*inferenceRequest, 64)
	for i := range prompts {
		prompts[i] = &inferenceRequest{kind: kindCompletions, model: "m", text: seedPrompt(1, i), tmpl: templateOptions{addSpecialTokens: true}}
	}
	n.prepare(b.Context(), p, "", prompts[0], s)
	b.SetBytes(int64(len(prompts[0].text)))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if rr, _ := n.prepare(b.Context(), p, "", prompts[i%len(prompts)], s); rr.TotalBlocks == 0 {
			b.Fatal("no blocks")
		}
	}
}

// TestModelTokenizerReprobesAgreement checks that a model's tokenizer
// changed by a config apply is probed again against its engines: with the
// global tiktoken, a Qwen3 engine disagrees and the model is switched to
// the engine's /tokenize; setting the model's tokenizer to Qwen3 makes the
// carried-over replica agree and switches back to local keying; removing
// it brings the disagreement back.
func TestModelTokenizerReprobesAgreement(t *testing.T) {
	dir := qwen3Dir(t)
	e := startSimTok(t, TokenizerHFPrefix+dir)
	n := startNode(t, func(c *Config) {
		c.IndexMode, c.Tokenizer, c.BlockSize = "kv-events", TokenizerTiktoken, 16
	}, simReplica("e", e))
	verdict := func(want string, switched bool) {
		t.Helper()
		require.Eventually(t, func() bool {
			ag := n.Agreement()
			return len(ag) == 1 && ag[0].Verdict == want && n.agree.engine.has("m") == switched
		}, 20*time.Second, 5*time.Millisecond, "want %s, switched %v; have %+v", want, switched, n.Agreement())
	}
	verdict(AgreementDisagree, true)
	before := n.tbl.Load().byName["e"]

	spec := specFromConfig(&n.cfg)
	spec.version = 2
	spec.models = []ModelConfig{{Name: "m", Tokenizer: TokenizerHFPrefix + dir, Replicas: []ReplicaConfig{simReplica("e", e)}}}
	require.NoError(t, n.applySpec(spec))
	assert.Same(t, before, n.tbl.Load().byName["e"], "the replica is carried over, not re-added")
	verdict(AgreementAgree, false)

	spec.version = 3
	spec.models[0].Tokenizer = ""
	require.NoError(t, n.applySpec(spec))
	verdict(AgreementDisagree, true)
}
