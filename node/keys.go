package node

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"

	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node/tokenizer"
	"github.com/kvmesh/kvmesh/route"
)

// prepare turns a request's prompt into block keys (in s.keys) and the
// route.Request a strategy sees. Now and the rng are set per attempt by the
// caller.
func (n *Node) prepare(ctx context.Context, p *pool, lora string, req *inferenceRequest, s *scratch) (route.Request, []index.BlockKey) {
	root := n.hasher.Root(p.model, lora, req.cacheSalt)
	s.keys = s.keys[:0]
	s.keyCut = req.partial
	promptTokens := 0
	units := 1.0 // the keys' units per engine token
	switch {
	case req.tokens == nil && req.text == "" && len(req.messages) == 0:
		// No prompt to key (an endpoint routed by load, or a chat whose
		// first part is media): the strategies see zero blocks.
	case req.tokens != nil:
		// The client tokenized: use its tokens as they are.
		s.keys = n.hasher.AppendKeys(s.keys, root, req.tokens)
		promptTokens = len(req.tokens)
	case n.engineTokenizes(ctx, p):
		// The gateway's tokenizer disagreed with the engine (agreement.go).
		s.tokens = n.engineTokens(ctx, p, req, s.tokens[:0])
		s.keys = n.hasher.AppendKeys(s.keys, root, s.tokens)
		promptTokens = len(s.tokens)
	case n.tokName == TokenizerCharacter:
		text := req.text
		if req.kind == kindChat {
			text = tokenizer.RenderChat(req.messages)
		}
		promptTokens = len(text)
		units = p.set.Model().UnitsPerToken()
		if len(text) > n.cfg.MaxKeyTokens {
			text = text[:n.cfg.MaxKeyTokens] // one token per byte; the count above stays exact
		}
		s.keys = n.hasher.AppendKeysString(s.keys, root, text)
	default:
		toks, cut := n.tokenize(ctx, p, req, s.tokens[:0])
		s.tokens = toks
		s.keyCut = s.keyCut || cut
		s.keys = n.hasher.AppendKeys(s.keys, root, toks)
		promptTokens = len(toks)
	}
	rr := route.NewRequest(s.keys, root, n.hasher.BlockTokens(), promptTokens, req.maxTokens, req.user)
	rr.UnitsPerToken = units
	return rr, s.keys
}

// tokenize encodes the prompt with the remote tokenizer when configured
// (falling back to the local one on any failure), else the local one. cut
// reports that the local encode stopped at MaxKeyTokens or at a piece over
// MaxKeyPieceBytes: the tokens are then a prefix of the prompt's, and their
// count is not the prompt's length.
func (n *Node) tokenize(ctx context.Context, p *pool, req *inferenceRequest, dst []uint32) (toks []uint32, cut bool) {
	if n.remote != nil {
		toks, rep, err := n.remote.tokens(ctx, n, p, req)
		if err == nil {
			return append(dst, toks...), false
		}
		if ctx.Err() == nil {
			n.m.tokenizeCache.WithLabelValues("fallback").Inc()
			if rep != nil {
				n.m.upstreamErrors.WithLabelValues(rep.name, reasonRemoteTokenize).Inc()
			}
			n.log.Debug("remote tokenize failed, using the local tokenizer", "model", p.model, "err", err)
		}
	}
	lim := tokenizer.Limit{MaxTokens: n.cfg.MaxKeyTokens, MaxPieceBytes: MaxKeyPieceBytes}
	tok, hf := n.tok, n.hf
	if mt := p.tok; mt != nil {
		tok, hf = mt.tok, mt.hf
	}
	if hf != nil {
		return n.tokenizeHF(p, req, dst, lim, tok, hf)
	}
	text := req.text
	if req.kind == kindChat {
		text = tokenizer.RenderChat(req.messages)
	}
	return tokenizer.EncodeLimited(tok, dst, text, lim)
}

// keyTokenizer is a model's own tokenizer (ModelConfig.Tokenizer): tok,
// possibly prefix-cached, and the HF tokenizer it wraps (nil for others).
// name is the Tokenizer value it was loaded from.
type keyTokenizer struct {
	name string
	tok  tokenizer.Tokenizer
	hf   *tokenizer.HF
}

// nameOrGlobal is kt's name, or "global" for nil (the Node's own).
func (kt *keyTokenizer) nameOrGlobal() string {
	if kt == nil {
		return "global"
	}
	return kt.name
}

// newKeyTokenizer loads the tokenizer called name (a local one: not auto
// or remote), with a prefix cache of cacheBytes when it supports one.
func newKeyTokenizer(name string, cacheBytes int64) (keyTokenizer, *tokenizer.Cached, error) {
	tok, err := tokenizer.New(name)
	if err != nil {
		return keyTokenizer{}, nil, err
	}
	kt := keyTokenizer{name: name, tok: tok}
	kt.hf, _ = tok.(*tokenizer.HF)
	var c *tokenizer.Cached
	if (name == TokenizerTiktoken || kt.hf != nil) && cacheBytes > 0 {
		cc := tokenizer.DefaultCachedConfig()
		cc.MaxBytes = cacheBytes
		if c, err = tokenizer.NewCached(tok, cc); err != nil {
			return keyTokenizer{}, nil, err
		}
		kt.tok = c
	}
	return kt, c, nil
}

// tokenizeHF encodes the prompt with the model's own tokenizer as vLLM
// does: a completion prompt with the post-processor's special tokens when
// add_special_tokens (default true), a chat rendered with the model's
// template and encoded without adding special tokens (unless the request
// asks). A conversation the template cannot render gets no keys (the
// engine would refuse it too).
func (n *Node) tokenizeHF(p *pool, req *inferenceRequest, dst []uint32, lim tokenizer.Limit, tok tokenizer.Tokenizer, hf *tokenizer.HF) ([]uint32, bool) {
	text := req.text
	if req.kind == kindChat {
		var err error
		text, err = hf.RenderChat(tokenizer.ChatRequest{
			Messages:             req.rawMessages,
			Tools:                req.tmpl.tools,
			AddGenerationPrompt:  req.tmpl.addGenerationPrompt,
			ContinueFinalMessage: req.tmpl.continueFinalMessage,
			Kwargs:               req.tmpl.kwargs,
		})
		if err != nil {
			// The error may quote message values: log its kind only.
			kind := "chat_template"
			if errors.Is(err, tokenizer.ErrInvalidMessages) || errors.Is(err, tokenizer.ErrUnsupportedContent) {
				kind = "invalid_messages"
			}
			n.log.Debug("chat template failed; the request gets no block keys", "model", p.model, "kind", kind)
			return dst, true
		}
	}
	base := len(dst)
	if req.tmpl.addSpecialTokens {
		dst = append(dst, hf.SpecialPrefix()...)
	}
	sub := lim
	if sub.MaxTokens -= len(dst) - base; sub.MaxTokens <= 0 {
		return dst[:base+lim.MaxTokens], true
	}
	dst, cut := tokenizer.EncodeLimited(tok, dst, text, sub)
	if req.tmpl.addSpecialTokens && !cut {
		dst = append(dst, hf.SpecialSuffix()...)
		if len(dst)-base > lim.MaxTokens {
			return dst[:base+lim.MaxTokens], true
		}
	}
	return dst, cut
}

// remoteTokenizer asks an engine's /tokenize and caches the answers by a
// hash of the model and prompt. Cached token slices are shared read-only.
type remoteTokenizer struct {
	client *http.Client
	size   int

	mu    sync.Mutex
	cache map[uint64][]uint32
	ring  []uint64 // insertion order, for FIFO eviction
	next  int
}

func newRemoteTokenizer(client *http.Client, size int) *remoteTokenizer {
	return &remoteTokenizer{client: client, size: size, cache: make(map[uint64][]uint32, size)}
}

type tokenizeRequest struct {
	Model    string          `json:"model"`
	Prompt   string          `json:"prompt,omitempty"`
	Messages json.RawMessage `json:"messages,omitempty"`
}

type tokenizeResponse struct {
	Count  int      `json:"count"`
	Tokens []uint32 `json:"tokens"`
}

func (t *remoteTokenizer) key(model string, req *inferenceRequest) uint64 {
	h := xxh3.New()
	_, _ = h.WriteString(model)
	if req.kind == kindChat {
		_, _ = h.WriteString("\x00chat\x00")
		_, _ = h.Write(req.rawMessages)
	} else {
		_, _ = h.WriteString("\x00text\x00")
		_, _ = h.WriteString(req.text)
	}
	return h.Sum64()
}

func (t *remoteTokenizer) get(k uint64) ([]uint32, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	v, ok := t.cache[k]
	return v, ok
}

func (t *remoteTokenizer) put(k uint64, toks []uint32) {
	if t.size == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.cache[k]; ok {
		return
	}
	if len(t.ring) < t.size {
		t.ring = append(t.ring, k)
	} else {
		delete(t.cache, t.ring[t.next])
		t.ring[t.next] = k
		t.next = (t.next + 1) % t.size
	}
	t.cache[k] = toks
}

// tokens returns the engine's tokenization of req's prompt, from the cache
// or from the first available replica of p (returned, nil on a cache hit),
// within RemoteTokenizeTimeout.
func (t *remoteTokenizer) tokens(ctx context.Context, n *Node, p *pool, req *inferenceRequest) ([]uint32, *replica, error) {
	k := t.key(p.model, req)
	if toks, ok := t.get(k); ok {
		n.m.tokenizeCache.WithLabelValues("hit").Inc()
		return toks, nil, nil
	}
	n.m.tokenizeCache.WithLabelValues("miss").Inc()
	var rep *replica
	now := nowNanos()
	for _, r := range p.replicas {
		if r.available(now) {
			rep = r
			break
		}
	}
	if rep == nil {
		return nil, nil, fmt.Errorf("%w: %w", ErrRemoteTokenize, ErrNoHealthyReplica)
	}
	body := tokenizeRequest{Model: req.model}
	if req.kind == kindChat {
		body.Messages = req.rawMessages
	} else {
		body.Prompt = req.text
	}
	data, err := json.Marshal(body)
	if err != nil {
		return nil, rep, fmt.Errorf("%w: %w", ErrRemoteTokenize, err)
	}
	ctx, cancel := context.WithTimeout(ctx, n.cfg.RemoteTokenizeTimeout)
	defer cancel()
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, rep.endpoint("/tokenize"), bytes.NewReader(data))
	if err != nil {
		return nil, rep, fmt.Errorf("%w: %w", ErrRemoteTokenize, err)
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := t.client.Do(hr)
	if err != nil {
		return nil, rep, fmt.Errorf("%w: %s: %w", ErrRemoteTokenize, rep.name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return nil, rep, fmt.Errorf("%w: %s: status %d", ErrRemoteTokenize, rep.name, resp.StatusCode)
	}
	var tr tokenizeResponse
	if err := json.NewDecoder(io.LimitReader(resp.Body, n.cfg.MaxBodyBytes)).Decode(&tr); err != nil {
		return nil, rep, fmt.Errorf("%w: %s: %w", ErrRemoteTokenize, rep.name, err)
	}
	if len(tr.Tokens) == 0 {
		return nil, rep, fmt.Errorf("%w: %s: no tokens", ErrRemoteTokenize, rep.name)
	}
	t.put(k, tr.Tokens)
	return tr.Tokens, rep, nil
}
