package node

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/route"
)

// seedPrompt is the study's prompt shape (DESIGN §7): 256 hex salt,
// "Document N", the sentence ×300, a question.
func seedPrompt(doc, question int) string {
	var b strings.Builder
	for i := 0; i < 32; i++ {
		fmt.Fprintf(&b, "%08x", uint32(doc*2654435761)+uint32(i))
	}
	fmt.Fprintf(&b, "\nDocument %d\n", doc)
	for i := 0; i < 300; i++ {
		b.WriteString("The service tracks request latency, token throughput, cache utilization, and healthy replicas.\n")
	}
	fmt.Fprintf(&b, "Question %06d: Explain the operational tradeoffs in detail.", question)
	return b.String()
}

// benchNode builds (without starting) a Node with replicas replicas of
// model "m", block size 16, and an index where replica i holds the first
// (i·blocks/replicas) blocks of keys, so Match walks a realistic depth.
func benchNode(tb testing.TB, replicas int, keys []index.BlockKey) *Node {
	tb.Helper()
	cfg := testConfig()
	cfg.Tokenizer = TokenizerCharacter
	cfg.BlockSize = 16
	var reps []ReplicaConfig
	for i := 0; i < replicas; i++ {
		reps = append(reps, ReplicaConfig{Name: fmt.Sprintf("r%02d", i), URL: fmt.Sprintf("http://127.0.0.1:%d", 10000+i)})
	}
	cfg.Models = []ModelConfig{{Name: "m", Replicas: reps}}
	n, err := New(cfg, nil)
	require.NoError(tb, err)
	now := time.Now().UnixNano()
	for i, r := range n.tbl.Load().replicas {
		depth := len(keys) * i / replicas
		if depth > 0 {
			require.NoError(tb, n.index.Record(keys[:depth], r.id, index.History, now))
		}
		r.inflight.Store(int64(i % 5))
		r.running.Store(int64(i % 4))
		r.waiting.Store(int64(i % 3))
		r.queuedPrefill.Store(int64(100 * i))
	}
	return n
}

// BenchmarkRouteDecision measures block keys → pick for a 5K-token prompt
// over 16 replicas: candidate filtering, one index Match, the load view and
// the strategy (tokenization excluded). Target: ≤ 15 µs and ≤ 2 allocs.
func BenchmarkRouteDecision(b *testing.B) {
	const tokens = 5000
	toks := make([]uint32, tokens)
	for i := range toks {
		toks[i] = uint32(i*7919) % 100000
	}
	probe := benchNode(b, 1, nil)
	h := probe.index.Hasher()
	keys := h.AppendKeys(nil, h.Root("m", "", ""), toks)
	n := benchNode(b, 16, keys)
	p := n.tbl.Load().pools[0]
	for _, name := range route.Names() {
		b.Run(name, func(b *testing.B) {
			strat, err := p.set.Get(name)
			require.NoError(b, err)
			s := getScratch()
			defer putScratch(s)
			rr := route.Request{TotalBlocks: len(keys), BlockTokens: 16, PromptTokens: tokens, MaxTokens: 128, SessionKey: uint64(keys[3])}
			// Warm the scratch buffers and the ring.
			rr.Now = time.Now().UnixNano()
			_, _, err = n.routeOnce(p, strat, keys, &rr, s, nil, nil)
			require.NoError(b, err)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				rr.Now += 1000
				s.rng = route.NewRand(uint64(i))
				d, _, err := n.routeOnce(p, strat, keys, &rr, s, nil, nil)
				if err != nil || d.rep == nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestRouteDecisionAllocs pins the hot path's allocation ceiling (STYLE 9).
func TestRouteDecisionAllocs(t *testing.T) {
	toks := make([]uint32, 5000)
	for i := range toks {
		toks[i] = uint32(i)
	}
	probe := benchNode(t, 1, nil)
	h := probe.index.Hasher()
	keys := h.AppendKeys(nil, h.Root("m", "", ""), toks)
	n := benchNode(t, 16, keys)
	p := n.tbl.Load().pools[0]
	for _, name := range route.Names() {
		strat, err := p.set.Get(name)
		require.NoError(t, err)
		s := getScratch()
		rr := route.Request{TotalBlocks: len(keys), BlockTokens: 16, PromptTokens: 5000, SessionKey: 42, Now: time.Now().UnixNano()}
		_, _, err = n.routeOnce(p, strat, keys, &rr, s, nil, nil)
		require.NoError(t, err)
		allocs := testing.AllocsPerRun(200, func() {
			rr.Now += 1000
			if _, _, err := n.routeOnce(p, strat, keys, &rr, s, nil, nil); err != nil {
				t.Fatal(err)
			}
		})
		putScratch(s)
		require.LessOrEqual(t, allocs, 2.0, "strategy %s", name)
	}
}

// BenchmarkPromptKeys measures prompt → block keys for the seed's 28.6 KB
// prompt: character mode (hash the bytes) and tiktoken with the prefix
// cache warm (same document, new question) and cold (new document).
func BenchmarkPromptKeys(b *testing.B) {
	for _, tc := range []struct {
		name, tok string
		warm      bool
	}{
		{"character", TokenizerCharacter, true},
		{"tiktoken-warm", TokenizerTiktoken, true},
		{"tiktoken-cold", TokenizerTiktoken, false},
	} {
		b.Run(tc.name, func(b *testing.B) {
			cfg := testConfig()
			cfg.Tokenizer = tc.tok
			cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", "http://127.0.0.1:1")}}}
			n, err := New(cfg, nil)
			require.NoError(b, err)
			p := n.tbl.Load().pools[0]
			s := getScratch()
			defer putScratch(s)
			prompts := make([]*inferenceRequest, 64)
			for i := range prompts {
				doc := 1
				if !tc.warm {
					doc = 1000 + i
				}
				prompts[i] = &inferenceRequest{kind: kindCompletions, model: "m", text: seedPrompt(doc, i)}
			}
			n.prepare(b.Context(), p, "", prompts[0], s) // warm the cache with document 1
			b.SetBytes(int64(len(prompts[0].text)))
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				req := prompts[i%len(prompts)]
				if !tc.warm && i >= len(prompts) {
					// Cold: a document never seen. Re-salting costs a string
					// build outside the timer.
					b.StopTimer()
					req = &inferenceRequest{kind: kindCompletions, model: "m", text: seedPrompt(100000+i, i)}
					b.StartTimer()
				}
				rr, _ := n.prepare(b.Context(), p, "", req, s)
				if rr.TotalBlocks == 0 {
					b.Fatal("no blocks")
				}
			}
		})
	}
}

// TestPromptKeysMatchFullTokenization checks that the prefix-cached
// tokenizer yields exactly the block keys of a full tiktoken encode.
func TestPromptKeysMatchFullTokenization(t *testing.T) {
	if testing.Short() {
		t.Skip("loads the tiktoken vocabulary")
	}
	cfg := testConfig()
	cfg.Tokenizer = TokenizerTiktoken
	cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", "http://127.0.0.1:1")}}}
	n, err := New(cfg, nil)
	require.NoError(t, err)
	require.NotNil(t, n.tokCache)
	cfg.TokenizerCacheBytes = 0
	plain, err := New(cfg, nil)
	require.NoError(t, err)
	require.Nil(t, plain.tokCache)
	for i, text := range []string{seedPrompt(1, 1), seedPrompt(1, 2), seedPrompt(2, 3), seedPrompt(1, 4)} {
		s1, s2 := getScratch(), getScratch()
		req := &inferenceRequest{kind: kindCompletions, model: "m", text: text}
		r1, k1 := n.prepare(t.Context(), n.tbl.Load().pools[0], "", req, s1)
		r2, k2 := plain.prepare(t.Context(), plain.tbl.Load().pools[0], "", req, s2)
		require.Equal(t, r2, r1, "prompt %d", i)
		require.Equal(t, k2, k1, "prompt %d", i)
		putScratch(s1)
		putScratch(s2)
	}
	require.Positive(t, n.tokCache.Stats().Hits)
}
