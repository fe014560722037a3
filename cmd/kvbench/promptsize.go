package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// tokenizerEngine is --tokenizer's value for the engine's own /tokenize.
const tokenizerEngine = "engine"

// localCounter counts with a tokenizer of package node/tokenizer, special
// tokens included as vLLM adds them to a completion prompt.
type localCounter struct {
	name string
	tok  tokenizer.Tokenizer
}

func (l localCounter) Name() string { return l.name }

func (l localCounter) CountTokens(_ context.Context, prompt string) (int, error) {
	if h, ok := l.tok.(*tokenizer.HF); ok {
		return len(h.EncodeSpecial(nil, prompt, true)), nil
	}
	return len(l.tok.Encode(nil, prompt)), nil
}

// engineCounter counts with an engine's POST /tokenize (vLLM's:
// {"model","prompt","add_special_tokens"} -> {"count","max_model_len",
// "tokens"}).
type engineCounter struct {
	url   string // the engine's base URL
	model string
	hc    *http.Client
}

func (e engineCounter) Name() string {
	return tokenizerEngine + " " + strings.TrimRight(e.url, "/") + "/tokenize"
}

func (e engineCounter) CountTokens(ctx context.Context, prompt string) (int, error) {
	body, err := json.Marshal(map[string]any{"model": e.model, "prompt": prompt, "add_special_tokens": true})
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(e.url, "/")+"/tokenize", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := e.hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return 0, err
	}
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("POST %s: HTTP %d: %s", e.Name(), resp.StatusCode, strings.TrimSpace(string(b[:min(len(b), 200)])))
	}
	var out struct {
		Count  *int  `json:"count"`
		Tokens []int `json:"tokens"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return 0, fmt.Errorf("POST %s: %w", e.Name(), err)
	}
	if out.Count == nil {
		return len(out.Tokens), nil
	}
	return *out.Count, nil
}

// newCounter returns the counter --tokenizer names: "engine" (the first
// engine's /tokenize; engineURL "" when there is none) or a
// node/tokenizer name (hf:<dir>, tiktoken, bytes).
func newCounter(name, engineURL, model string) (study.TokenCounter, error) {
	if name == tokenizerEngine {
		if engineURL == "" {
			return nil, fmt.Errorf("%w: --tokenizer engine needs a deployment (--target or --engines); in process give hf:<dir> or tiktoken", study.ErrInvalidConfig)
		}
		return engineCounter{url: engineURL, model: model, hc: &http.Client{Transport: &http.Transport{Proxy: nil}}}, nil
	}
	tok, err := tokenizer.New(name)
	if err != nil {
		return nil, fmt.Errorf("%w: --tokenizer: %w", study.ErrInvalidConfig, err)
	}
	return localCounter{name: name, tok: tok}, nil
}

// sizePrompts applies --tokenizer and --prompt-tokens to c: the seed's
// body is resized so that its prompts are --prompt-tokens long in the
// counter's tokens. Without --tokenizer c is unchanged.
func sizePrompts(ctx context.Context, c study.Config, opt options, engineURL, model string, stderr io.Writer) (study.Config, error) {
	if opt.tokenizer == "" {
		return c, nil
	}
	cnt, err := newCounter(opt.tokenizer, engineURL, model)
	if err != nil {
		return c, err
	}
	ps, err := study.SizePrompts(ctx, cnt, opt.promptTokens)
	if e, ok := cnt.(engineCounter); ok {
		e.hc.CloseIdleConnections()
	}
	if err != nil {
		return c, err
	}
	c.BodyRepeats = ps.Repeats
	c.PromptSizing = &ps
	fmt.Fprintf(stderr, "kvbench: %s\n", study.SizingLine(ps))
	return c, nil
}
