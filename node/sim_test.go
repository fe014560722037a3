package node

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

// startSim starts a simulated vLLM replica serving model "m" with KV events
// on loopback.
func startSim(t testing.TB, events bool) *sim.Server {
	t.Helper()
	return startSimWith(t, func(c *sim.Config) { c.KVEvents.EnableKVCacheEvents = events })
}

// startSimWith starts a simulated replica of model "m" on loopback with
// the test's settings applied to sim.LocalConfig.
func startSimWith(t testing.TB, tune func(*sim.Config)) *sim.Server {
	t.Helper()
	cfg := sim.LocalConfig()
	cfg.ServedModelName = "m"
	cfg.Logger = slog.New(slog.DiscardHandler)
	tune(&cfg)
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

// simKeying keys prompts as the simulator's engines do (bytes, blocks of
// 16) and routes on their KV events.
func simKeying(c *Config) {
	c.IndexMode = "kv-events"
	c.Tokenizer = TokenizerCharacter // the simulator's byte tokenizer
	c.BlockSize = 16
}

func simReplica(name string, s *sim.Server) ReplicaConfig {
	return ReplicaConfig{Name: name, URL: s.URL(), KVEndpoint: s.KVEventsAddr(), ReplayEndpoint: s.KVReplayAddr()}
}

// debugRoute asks the node how it would route prompt.
func debugRoute(t testing.TB, n *Node, strategy, prompt string) debugReport {
	t.Helper()
	body, _ := json.Marshal(map[string]string{"model": "m", "prompt": prompt})
	resp := post(t, n, "/debug/route", string(body), map[string]string{HeaderStrategy: strategy})
	raw := readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, raw)
	var rep debugReport
	require.NoError(t, json.Unmarshal([]byte(raw), &rep))
	return rep
}

// waitSubscribed waits until the node's subscriber for replica name hears
// srv's events: PUB/SUB drops what is published before the subscription is
// up, and an idle engine publishes nothing that would reveal the gap, so a
// test first sends throwaway prompts straight to the engine until one shows
// up confirmed in the node's index.
func waitSubscribed(t testing.TB, n *Node, srv *sim.Server, name string) {
	t.Helper()
	i := 0
	require.Eventually(t, func() bool {
		i++
		warm := fmt.Sprintf("warm-up %s %d %s", name, i, strings.Repeat("w", 64))
		body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":1}`, warm)
		resp, err := http.Post(srv.URL()+"/v1/completions", "application/json", strings.NewReader(body))
		require.NoError(t, err)
		readAll(t, resp)
		deadline := time.Now().Add(200 * time.Millisecond)
		for time.Now().Before(deadline) {
			if matchedOf(debugRoute(t, n, "prefix-cache", warm), name) > 0 {
				return true
			}
			time.Sleep(5 * time.Millisecond) // polling the index for the condition
		}
		return false
	}, 20*time.Second, time.Millisecond)
}

func matchedOf(rep debugReport, name string) int {
	if rep.Explanation == nil {
		return -1
	}
	for _, r := range rep.Explanation.Replicas {
		if r.Name == name {
			return r.Matched
		}
	}
	return -1
}

func TestSimKVEventsConfirmRouteAndReset(t *testing.T) {
	a, b := startSim(t, true), startSim(t, true)
	n := startNode(t, func(c *Config) {
		simKeying(c)
		c.SpeculativeTTL = 300 * time.Millisecond
	}, simReplica("a", a), simReplica("b", b))
	waitSubscribed(t, n, a, "a")
	waitSubscribed(t, n, b, "b")

	prompt := "Document 7\n" + strings.Repeat("The service tracks request latency and healthy replicas. ", 12)
	body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}`, prompt)
	resp := post(t, n, "/v1/completions", body, map[string]string{HeaderStrategy: "prefix-cache"})
	require.Equal(t, http.StatusOK, resp.StatusCode)
	first := resp.Header.Get(HeaderReplica)
	out := readAll(t, resp)
	require.True(t, strings.HasSuffix(out, "data: [DONE]\n\n"), out)
	blocks := len(prompt) / 16

	// The engine's BlockStored events confirm the prompt's blocks.
	require.Eventually(t, func() bool {
		return matchedOf(debugRoute(t, n, "prefix-cache", prompt), first) == blocks
	}, 10*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return n.Index().Stats().Entries[index.Confirmed] >= blocks },
		10*time.Second, 10*time.Millisecond)

	// The same prefix sticks to the replica holding it.
	for i := 0; i < 3; i++ {
		resp := post(t, n, "/v1/completions", body, map[string]string{HeaderStrategy: "prefix-cache"})
		require.Equal(t, first, resp.Header.Get(HeaderReplica))
		readAll(t, resp)
	}

	// An engine cache reset (AllBlocksCleared) removes that replica's
	// confirmed entries; the speculative ones the repeats left expire.
	srv := map[string]*sim.Server{"a": a, "b": b}[first]
	before := n.Index().Stats().Entries[index.Confirmed]
	require.True(t, srv.ResetPrefixCache())
	require.Eventually(t, func() bool { return n.Index().Stats().Entries[index.Confirmed] <= before-blocks },
		10*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool {
		return matchedOf(debugRoute(t, n, "prefix-cache", prompt), first) == 0
	}, 10*time.Second, 10*time.Millisecond)
}

func TestSimStreamsThroughGateway(t *testing.T) {
	a := startSim(t, false)
	n := startNode(t, nil, rc("a", a.URL()))
	body := `{"model":"m","prompt":"hello simulator","max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}`
	resp := post(t, n, "/v1/completions", body, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	out := readAll(t, resp)
	assert.Equal(t, 8+1+1, strings.Count(out, "data: "), "8 tokens, usage, [DONE]")
	assert.Contains(t, out, `"completion_tokens":8`)

	resp = post(t, n, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3}`, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Contains(t, readAll(t, resp), `"completion_tokens":3`)

	// Engine load figures come from its /metrics.
	r := n.tbl.Load().byName["a"]
	require.Eventually(t, func() bool { run, _, kv := r.load(); return run == 0 && kv >= 0 }, 5*time.Second, 10*time.Millisecond)
}

func TestKVBindReceivesEventsFromAConnectingPublisher(t *testing.T) {
	e := newFakeEngine(t, "a")
	n := startNode(t, func(c *Config) {
		c.IndexMode = "hybrid"
		c.Tokenizer = TokenizerCharacter
		c.BlockSize = 4
		// The fake engine's /tokenize deliberately disagrees (ids +1000);
		// this test is about the events' plumbing.
		c.TokenizerAgreement = AgreementOff
	}, ReplicaConfig{Name: "a", URL: e.url(), KVBind: "tcp://127.0.0.1:0"})
	addr := n.KVBindAddr("a")
	require.NotEqual(t, "tcp://127.0.0.1:0", addr, "the bound port is resolved")

	pc := kvevents.DefaultPublisherConfig()
	pc.Endpoint = addr // no wildcard: the engine connects, as vLLM does
	pc.RedialInterval = 50 * time.Millisecond
	pub, err := kvevents.NewPublisher(pc, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	defer pub.Close()

	text := "abcdefgh" // two blocks of 4
	toks := make([]uint32, len(text))
	for i := range text {
		toks[i] = uint32(text[i])
	}
	stored := kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.KindBlockStored, Stored: &kvevents.BlockStored{
		BlockHashes: []kvevents.EngineHash{11, 12}, TokenIDs: toks, BlockSize: 4,
	}}}}
	// PUB/SUB drops what is sent before the subscription is up: resend.
	require.Eventually(t, func() bool {
		_, err := pub.Publish(stored)
		require.NoError(t, err)
		return matchedOf(debugRoute(t, n, "prefix-cache", text), "a") == 2
	}, 10*time.Second, 20*time.Millisecond)

	_, err = pub.Publish(kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.KindBlockRemoved, Removed: &kvevents.BlockRemoved{
		BlockHashes: []kvevents.EngineHash{12},
	}}}})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return matchedOf(debugRoute(t, n, "prefix-cache", text), "a") == 1 },
		10*time.Second, 10*time.Millisecond, "BlockRemoved drops that block of that replica")
}

// debugRouteBody asks the node how it would route a request body.
func debugRouteBody(t testing.TB, n *Node, body map[string]any) debugReport {
	t.Helper()
	raw, _ := json.Marshal(body)
	resp := post(t, n, "/debug/route", string(raw), map[string]string{HeaderStrategy: "prefix-cache"})
	out := readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, out)
	var rep debugReport
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	return rep
}

// The engine's events go through kvevents.StoredForIndex: a cache_salt in
// extra_keys roots the blocks under the salted root (so the salted request
// matches and the unsalted one does not), and a non-GPU medium is ignored.
func TestKVEventsSaltAndMedium(t *testing.T) {
	e := newFakeEngine(t, "a")
	n := startNode(t, func(c *Config) {
		c.IndexMode = "kv-events"
		c.Tokenizer = TokenizerCharacter
		c.BlockSize = 4
		c.TokenizerAgreement = AgreementOff // see TestKVBindReceivesEventsFromAConnectingPublisher
	}, ReplicaConfig{Name: "a", URL: e.url(), KVBind: "tcp://127.0.0.1:0"})
	pc := kvevents.DefaultPublisherConfig()
	pc.Endpoint = n.KVBindAddr("a")
	pc.RedialInterval = 50 * time.Millisecond
	pub, err := kvevents.NewPublisher(pc, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	defer pub.Close()

	tokens := func(s string) []uint32 {
		out := make([]uint32, len(s))
		for i := range s {
			out[i] = uint32(s[i])
		}
		return out
	}
	salted, plain, cpu := "abcdefgh", "ijklmnop", "qrstuvwx"
	matched := func(prompt, salt string) int {
		body := map[string]any{"model": "m", "prompt": prompt}
		if salt != "" {
			body["cache_salt"] = salt
		}
		return matchedOf(debugRouteBody(t, n, body), "a")
	}
	// The CPU-tier copy of cpu comes first in the batch; the marker (plain,
	// GPU) shows the whole batch arrived.
	batch := kvevents.Batch{Events: []kvevents.Event{
		{Kind: kvevents.KindBlockStored, Stored: &kvevents.BlockStored{
			BlockHashes: []kvevents.EngineHash{31, 32}, TokenIDs: tokens(cpu), BlockSize: 4, Medium: "CPU"}},
		{Kind: kvevents.KindBlockStored, Stored: &kvevents.BlockStored{
			BlockHashes: []kvevents.EngineHash{11, 12}, TokenIDs: tokens(salted), BlockSize: 4, CacheSalt: "s1"}},
		{Kind: kvevents.KindBlockStored, Stored: &kvevents.BlockStored{
			BlockHashes: []kvevents.EngineHash{21, 22}, TokenIDs: tokens(plain), BlockSize: 4}},
	}}
	require.Eventually(t, func() bool {
		_, err := pub.Publish(batch)
		require.NoError(t, err)
		return matched(plain, "") == 2
	}, 10*time.Second, 20*time.Millisecond)
	assert.Equal(t, 2, matched(salted, "s1"), "salted events match the salted request")
	assert.Equal(t, 0, matched(salted, ""), "and not the unsalted one")
	assert.Equal(t, 0, matched(salted, "s2"), "nor another salt")
	assert.Equal(t, 0, matched(cpu, ""), "a CPU-tier store is not a GPU cache hit")

	// A CPU-tier removal leaves the GPU copy; a GPU one removes it.
	_, err = pub.Publish(kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.KindBlockRemoved,
		Removed: &kvevents.BlockRemoved{BlockHashes: []kvevents.EngineHash{12}, Medium: "CPU"}}}})
	require.NoError(t, err)
	_, err = pub.Publish(kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.KindBlockRemoved,
		Removed: &kvevents.BlockRemoved{BlockHashes: []kvevents.EngineHash{21}}}}})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return matched(plain, "") == 0 }, 10*time.Second, 10*time.Millisecond)
	assert.Equal(t, 2, matched(salted, "s1"), "the CPU-tier removal did not drop the GPU block")
}

// Blocks from the first one with opaque extra keys (multimodal) on are not
// indexed: their keys from token ids would claim them for any prompt with
// the same placeholder tokens. The encoder does not carry OpaqueFrom, so
// the decoded batch goes to HandleBatch directly (no subscriber runs).
func TestKVEventsOpaqueBlocksNotIndexed(t *testing.T) {
	e := newFakeEngine(t, "a")
	n := startNode(t, func(c *Config) {
		c.IndexMode = "kv-events"
		c.Tokenizer = TokenizerCharacter
		c.BlockSize = 4
	}, rc("a", e.url()))
	text := "abcdefghijkl"
	toks := make([]uint32, len(text))
	for i := range text {
		toks[i] = uint32(text[i])
	}
	r := n.tbl.Load().byName["a"]
	kvHandler{n: n, r: r}.HandleBatch("a", 1, &kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.KindBlockStored,
		Stored: &kvevents.BlockStored{BlockHashes: []kvevents.EngineHash{1, 2, 3}, TokenIDs: toks, BlockSize: 4,
			HasExtraKeys: true, HasOpaque: true, OpaqueFrom: 1}}}})
	assert.Equal(t, 1, matchedOf(debugRoute(t, n, "prefix-cache", text), "a"))
	assert.Equal(t, 1, n.Index().Stats().Entries[index.Confirmed])
}

// A legacy-format publisher (llm-d-inference-sim's array encoding, seqs
// from 1) sends a chain's first block with parent_block_hash 0: the gateway
// confirms the chain, routes by it, and counts the tolerance, not an
// unknown_parent.
func TestKVEventsLegacyParentZeroConfirmed(t *testing.T) {
	e := newFakeEngine(t, "a")
	n := startNode(t, func(c *Config) {
		c.IndexMode = "kv-events"
		c.Tokenizer = TokenizerCharacter
		c.BlockSize = 4
		c.TokenizerAgreement = AgreementOff // see TestKVBindReceivesEventsFromAConnectingPublisher
	}, ReplicaConfig{Name: "a", URL: e.url(), KVBind: "tcp://127.0.0.1:0"})
	pc := kvevents.DefaultPublisherConfig()
	pc.Endpoint = n.KVBindAddr("a")
	pc.RedialInterval = 50 * time.Millisecond
	pc.Encoding = kvevents.EncodingArray
	pc.FirstSeq = 1
	pub, err := kvevents.NewPublisher(pc, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	defer pub.Close()

	text := "abcdefghijkl"
	toks := make([]uint32, len(text))
	for i := range text {
		toks[i] = uint32(text[i])
	}
	batch := kvevents.Batch{Events: []kvevents.Event{
		{Kind: kvevents.KindBlockStored, Stored: &kvevents.BlockStored{
			BlockHashes: []kvevents.EngineHash{11, 12}, ParentBlockHash: 0, HasParent: true,
			TokenIDs: toks[:8], BlockSize: 4}},
		{Kind: kvevents.KindBlockStored, Stored: &kvevents.BlockStored{
			BlockHashes: []kvevents.EngineHash{13}, ParentBlockHash: 12, HasParent: true,
			TokenIDs: toks[8:], BlockSize: 4}},
	}}
	require.Eventually(t, func() bool {
		_, err := pub.Publish(batch)
		require.NoError(t, err)
		return matchedOf(debugRoute(t, n, "prefix-cache", text), "a") == 3
	}, 10*time.Second, 20*time.Millisecond)
	// The handler counts the tolerance after the index applied the batch,
	// so a route can see the chain a moment before the counter moves (CI
	// once read 0 here under load).
	require.Eventually(t, func() bool {
		return counterValue(t, n, "kvmesh_kvevents_tolerated_total",
			map[string]string{"replica": "a", "kind": index.TolParentZero.String()}) >= 1
	}, 10*time.Second, 5*time.Millisecond)
	assert.Zero(t, counterValue(t, n, "kvmesh_index_kv_apply_errors_total",
		map[string]string{"replica": "a", "reason": "unknown_parent"}))
}

// TestReplacedEngineForgetsItsBlocks: a config change that gives a
// replica's name another KV-event source (another engine) drops the old
// engine's confirmed blocks at once; kept, they would draw the old
// engine's prompts to an engine that never cached them, and no eviction
// event would ever remove them. The new source's blocks then apply.
func TestReplacedEngineForgetsItsBlocks(t *testing.T) {
	a, c := startSim(t, true), startSim(t, true)
	n := startNode(t, simKeying, simReplica("a", a))
	waitSubscribed(t, n, a, "a")

	prompt := "Replaced engine\n" + strings.Repeat("The old engine cached this prompt and then went away. ", 8)
	body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":2}`, prompt)
	readAll(t, post(t, n, "/v1/completions", body, nil))
	blocks := len(prompt) / 16
	require.Eventually(t, func() bool { return matchedOf(debugRoute(t, n, "prefix-cache", prompt), "a") == blocks },
		10*time.Second, 10*time.Millisecond)

	// Same name and address, another event source: the confirmed
	// entries go with the reload, before anything is published.
	spec := specFromConfig(&n.cfg)
	spec.version = 2
	moved := simReplica("a", a)
	moved.KVEndpoint, moved.ReplayEndpoint = c.KVEventsAddr(), c.KVReplayAddr()
	spec.models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{moved}}}
	require.NoError(t, n.applySpec(spec))
	assert.Zero(t, matchedOf(debugRoute(t, n, "prefix-cache", prompt), "a"), "the old engine's blocks outlived the reload")
	assert.Zero(t, n.Index().Stats().Entries[index.Confirmed])
	assert.Equal(t, 1.0, counterValue(t, n, "kvmesh_kvevents_resets_total",
		map[string]string{"replica": "a", "reason": "source_changed"}))

	// The new source's events land on the replica.
	waitSubscribed(t, n, c, "a")
}
