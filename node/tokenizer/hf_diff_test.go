package tokenizer

import (
	"bytes"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

// Differential test of HF against an independent reference: the JS
// @huggingface/tokenizers and @huggingface/jinja (testdata/hfref/ref.mjs)
// on the same tokenizer data, over a generated corpus (hf_corpus_test.go).
// It needs node and the npm packages (`npm ci` in testdata/hfref; .ci/run
// installs them) and skips, saying so, without them.

// Corpus sizes per model: the full ones in `go test ./...`, smaller ones
// under -short (CI's -race -short pass, where the race detector makes
// every encode ~10x slower).
func diffSizes() (texts, chats int) {
	if testing.Short() {
		return 300, 40
	}
	return 2500, 300
}

// refOutput is ref.mjs's answer.
type refOutput struct {
	Texts        [][]uint32 `json:"texts"`
	TextsSpecial [][]uint32 `json:"texts_special"`
	Chats        []struct {
		Prompt string   `json:"prompt"`
		IDs    []uint32 `json:"ids"`
	} `json:"chats"`
}

type refCorpus struct {
	Texts []string     `json:"texts"`
	Chats []corpusChat `json:"chats"`
}

// runReference runs ref.mjs for model on corpus.
func runReference(t *testing.T, model string, corpus refCorpus) refOutput {
	t.Helper()
	hfModelDir(t, model) // skips without the packages
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("node not found: the differential test needs node and `npm ci` in node/tokenizer/testdata/hfref")
	}
	in, err := json.Marshal(corpus)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(node, "ref.mjs", model)
	cmd.Dir = filepath.Join("testdata", "hfref")
	cmd.Stdin = bytes.NewReader(in)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	start := time.Now()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("node ref.mjs %s: %v\n%s", model, err, stderr.String())
	}
	var ref refOutput
	if err := json.Unmarshal(out, &ref); err != nil {
		t.Fatalf("ref.mjs output: %v", err)
	}
	t.Logf("%s: reference for %d texts, %d chats in %v", model, len(corpus.Texts), len(corpus.Chats), time.Since(start).Round(time.Millisecond))
	return ref
}

func TestHFDiffTexts(t *testing.T) {
	for _, model := range testedHFModels() {
		t.Run(model, func(t *testing.T) {
			h := loadHFT(t, model)
			n, _ := diffSizes()
			texts := hfCorpusTexts(2026, n)
			ref := runReference(t, model, refCorpus{Texts: texts})
			bad, tokens := 0, 0
			for i, text := range texts {
				got := h.Encode(nil, text)
				gotS := h.EncodeSpecial(nil, text, true)
				tokens += len(got)
				if !slices.Equal(got, ref.Texts[i]) || !slices.Equal(gotS, ref.TextsSpecial[i]) {
					bad++
					if bad <= 5 {
						t.Errorf("text %d %q:\n got %v\nwant %v\n special got %v\n special want %v", i, text, got, ref.Texts[i], gotS, ref.TextsSpecial[i])
					}
				}
			}
			if bad > 0 {
				t.Fatalf("%s: %d of %d texts differ", model, bad, len(texts))
			}
			t.Logf("%s: %d texts, %d tokens, every id identical (with and without special tokens)", model, len(texts), tokens)
		})
	}
}

func TestHFDiffChats(t *testing.T) {
	for _, model := range testedHFModels() {
		t.Run(model, func(t *testing.T) {
			h := loadHFT(t, model)
			_, n := diffSizes()
			chats := hfCorpusChats(2027, n, model == "qwen3") // Llama 3's and DeepSeek V3's templates take no tools
			ref := runReference(t, model, refCorpus{Chats: chats})
			bad, tokens, tools, prefills := 0, 0, 0, 0
			for i, c := range chats {
				msgs, err := json.Marshal(c.Messages)
				if err != nil {
					t.Fatal(err)
				}
				req := ChatRequest{Messages: msgs, AddGenerationPrompt: c.AddGenerationPrompt, ContinueFinalMessage: c.ContinueFinal}
				if c.Tools != nil {
					tools++
					if req.Tools, err = json.Marshal(c.Tools); err != nil {
						t.Fatal(err)
					}
				}
				if c.ContinueFinal {
					prefills++
				}
				prompt, err := h.RenderChat(req)
				if err != nil {
					t.Fatalf("chat %d: %v", i, err)
				}
				got := h.Encode(nil, prompt)
				tokens += len(got)
				if prompt != ref.Chats[i].Prompt || !slices.Equal(got, ref.Chats[i].IDs) {
					bad++
					if bad <= 3 {
						t.Errorf("chat %d:\n got %q\nwant %q\n got %v\nwant %v", i, prompt, ref.Chats[i].Prompt, got, ref.Chats[i].IDs)
					}
				}
			}
			if bad > 0 {
				t.Fatalf("%s: %d of %d chats differ", model, bad, len(chats))
			}
			t.Logf("%s: %d chats (%d with tools, %d assistant prefills), %d tokens: every prompt and id identical",
				model, len(chats), tools, prefills, tokens)
		})
	}
}
