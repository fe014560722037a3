package sim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// maxBodyBytes bounds a request body (a 32K-token prompt is well under it).
const maxBodyBytes = 16 << 20

// Handler returns the replica's HTTP API. It is what Start serves; tests may
// mount it elsewhere.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", s.handleCompletions)
	mux.HandleFunc("POST /v1/chat/completions", s.handleChat)
	mux.HandleFunc("POST /tokenize", s.handleTokenize)
	mux.HandleFunc("GET /v1/models", s.handleModels)
	s.routeEndpoints(mux)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.metrics.reg, promhttp.HandlerOpts{}))
	if s.cfg.EnableResetEndpoint {
		mux.HandleFunc("POST /reset_prefix_cache", s.handleReset)
	}
	return recoverer(s, mux)
}

// recoverer turns a handler panic into a 500 so the simulator never dies on
// a request.
func recoverer(s *Server, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if v := recover(); v != nil {
				if v == http.ErrAbortHandler {
					panic(v)
				}
				s.log.Error("vllmsim: handler panic", "path", r.URL.Path, "panic", fmt.Sprint(v))
				writeError(w, http.StatusInternalServerError, "internal error")
			}
		}()
		h.ServeHTTP(w, r)
	})
}

// apiError is vLLM's ErrorResponse: {"error": {message, type, param, code}}
// with code the HTTP status.
type apiError struct {
	Error apiErrorInfo `json:"error"`
}

type apiErrorInfo struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

func writeError(w http.ResponseWriter, status int, msg string) {
	typ := "BadRequestError"
	switch status {
	case http.StatusNotFound:
		typ = "NotFoundError"
	case http.StatusInternalServerError:
		typ = "InternalServerError"
	case http.StatusServiceUnavailable:
		typ = "ServiceUnavailableError"
	}
	writeJSON(w, status, apiError{Error: apiErrorInfo{Message: msg, Type: typ, Code: status}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// errorStatus maps engine errors to HTTP.
func errorStatus(err error) int {
	switch {
	case errors.Is(err, ErrClosed):
		return http.StatusServiceUnavailable
	case errors.Is(err, ErrBadRequest), errors.Is(err, ErrPromptTooLong), errors.Is(err, ErrRequestTooLarge):
		return http.StatusBadRequest
	}
	return http.StatusInternalServerError
}

func decodeBody(w http.ResponseWriter, r *http.Request, v any) bool {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	if err != nil {
		writeError(w, http.StatusBadRequest, "could not read request body")
		return false
	}
	if err := json.Unmarshal(body, v); err != nil {
		writeError(w, http.StatusBadRequest, "invalid JSON body: "+err.Error())
		return false
	}
	return true
}

// checkModel reports (and writes) 404 for a model this replica does not
// serve. An omitted model means the served one, as vLLM allows.
func (s *Server) checkModel(w http.ResponseWriter, model string) bool {
	if model != "" && model != s.cfg.ServedModelName {
		writeError(w, http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", model))
		return false
	}
	return true
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type genParams struct {
	Model               string          `json:"model"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	Temperature         *float64        `json:"temperature"`
	IgnoreEOS           bool            `json:"ignore_eos"`
	Stream              bool            `json:"stream"`
	StreamOptions       *streamOptions  `json:"stream_options"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            json.RawMessage `json:"messages"`
	N                   *int            `json:"n"`

	// vLLM's tokenization options, honoured with an hf:<dir> tokenizer
	// (defaults as vLLM's: add_special_tokens true for a prompt and false
	// for messages, add_generation_prompt true).
	Tools                json.RawMessage `json:"tools"`
	AddGenerationPrompt  *bool           `json:"add_generation_prompt"`
	ContinueFinalMessage bool            `json:"continue_final_message"`
	AddSpecialTokens     *bool           `json:"add_special_tokens"`
	ChatTemplateKwargs   json.RawMessage `json:"chat_template_kwargs"`
}

// validate checks the sampling fields the simulator honours or refuses.
func (p *genParams) validate() error {
	if p.StreamOptions != nil && !p.Stream {
		return fmt.Errorf("%w: stream_options can only be set when stream is true", ErrBadRequest)
	}
	if p.N != nil && *p.N != 1 {
		return fmt.Errorf("%w: n must be 1 (the simulator generates one choice), got %d", ErrBadRequest, *p.N)
	}
	if p.Temperature != nil && *p.Temperature < 0 {
		return fmt.Errorf("%w: temperature must be non-negative, got %v", ErrBadRequest, *p.Temperature)
	}
	return nil
}

// parsePrompt reads a completions prompt: a string, a token list, or a
// one-element list of either (batched prompts are not supported).
func (s *Server) parsePrompt(raw json.RawMessage) ([]uint32, error) {
	return s.parsePromptSpecial(raw, true)
}

// parsePromptSpecial is parsePrompt with add_special_tokens given (text
// prompts only; token prompts are taken as they are).
func (s *Server) parsePromptSpecial(raw json.RawMessage, addSpecial bool) ([]uint32, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, fmt.Errorf("%w: prompt is required", ErrBadRequest)
	}
	var str string
	if err := json.Unmarshal(raw, &str); err == nil {
		return s.encodeText(str, addSpecial), nil
	}
	var toks []uint32
	if err := json.Unmarshal(raw, &toks); err == nil {
		return toks, nil
	}
	var strs []string
	if err := json.Unmarshal(raw, &strs); err == nil {
		if len(strs) != 1 {
			return nil, fmt.Errorf("%w: exactly one prompt per request is supported, got %d", ErrBadRequest, len(strs))
		}
		return s.encodeText(strs[0], addSpecial), nil
	}
	var tokss [][]uint32
	if err := json.Unmarshal(raw, &tokss); err == nil {
		if len(tokss) != 1 {
			return nil, fmt.Errorf("%w: exactly one prompt per request is supported, got %d", ErrBadRequest, len(tokss))
		}
		return tokss[0], nil
	}
	return nil, fmt.Errorf("%w: prompt must be a string or a list of token ids", ErrBadRequest)
}

// encodeText tokenizes a text prompt; addSpecial adds an hf tokenizer's
// post-processor tokens (the others have none).
func (s *Server) encodeText(text string, addSpecial bool) []uint32 {
	if s.hf != nil {
		return s.hf.EncodeSpecial(nil, text, addSpecial)
	}
	return s.tok.Encode(nil, text)
}

// parseMessages tokenizes a chat with vLLM's default options.
func (s *Server) parseMessages(raw json.RawMessage) ([]uint32, error) {
	return s.parseChat(&genParams{Messages: raw})
}

// parseChat tokenizes p's messages: with an hf tokenizer, rendered with
// the model's chat template and p's options, as vLLM does; otherwise with
// the ChatML-like tokenizer.RenderChat.
func (s *Server) parseChat(p *genParams) ([]uint32, error) {
	raw := flattenMedia(p.Messages)
	if len(bytes.TrimSpace(raw)) == 0 || bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
		return nil, fmt.Errorf("%w: messages is required", ErrBadRequest)
	}
	if s.hf != nil {
		req := tokenizer.ChatRequest{Messages: raw, Tools: p.Tools, AddGenerationPrompt: true,
			ContinueFinalMessage: p.ContinueFinalMessage, Kwargs: p.ChatTemplateKwargs}
		if p.AddGenerationPrompt != nil {
			req.AddGenerationPrompt = *p.AddGenerationPrompt
		}
		if req.AddGenerationPrompt && req.ContinueFinalMessage {
			return nil, fmt.Errorf("%w: continue_final_message and add_generation_prompt cannot both be true", ErrBadRequest)
		}
		text, err := s.hf.RenderChat(req)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadRequest, err)
		}
		return s.encodeText(text, p.AddSpecialTokens != nil && *p.AddSpecialTokens), nil
	}
	msgs, err := tokenizer.ParseMessages(raw)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadRequest, err)
	}
	if len(msgs) == 0 {
		return nil, fmt.Errorf("%w: messages is empty", ErrBadRequest)
	}
	return s.tok.Encode(nil, tokenizer.RenderChat(msgs)), nil
}

// maxTokens resolves max_tokens as vLLM does: omitted means the rest of the
// context window.
func (s *Server) maxTokens(p *genParams, promptLen int) (int, error) {
	mt := p.MaxTokens
	if mt == nil {
		mt = p.MaxCompletionTokens
	}
	if mt == nil {
		n := s.cfg.MaxModelLen - promptLen
		if n < 1 {
			return 0, fmt.Errorf("%w: this model's maximum context length is %d tokens, however the prompt has %d tokens",
				ErrPromptTooLong, s.cfg.MaxModelLen, promptLen)
		}
		return n, nil
	}
	if *mt < 1 {
		return 0, fmt.Errorf("%w: max_tokens must be at least 1, got %d", ErrBadRequest, *mt)
	}
	return *mt, nil
}

type usage struct {
	PromptTokens        int                 `json:"prompt_tokens"`
	TotalTokens         int                 `json:"total_tokens"`
	CompletionTokens    int                 `json:"completion_tokens"`
	PromptTokensDetails promptTokensDetails `json:"prompt_tokens_details"`
}

type promptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

type completionChoice struct {
	Index        int     `json:"index"`
	Text         string  `json:"text"`
	Logprobs     any     `json:"logprobs"`
	FinishReason *string `json:"finish_reason"`
	StopReason   any     `json:"stop_reason"`
}

type chatDelta struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content"`
}

type chatChunkChoice struct {
	Index        int       `json:"index"`
	Delta        chatDelta `json:"delta"`
	Logprobs     any       `json:"logprobs"`
	FinishReason *string   `json:"finish_reason"`
	StopReason   any       `json:"stop_reason,omitempty"`
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type chatChoice struct {
	Index        int         `json:"index"`
	Message      chatMessage `json:"message"`
	Logprobs     any         `json:"logprobs"`
	FinishReason *string     `json:"finish_reason"`
	StopReason   any         `json:"stop_reason"`
}

type response struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices any    `json:"choices"`
	Usage   *usage `json:"usage,omitempty"`
}

func (s *Server) handleCompletions(w http.ResponseWriter, r *http.Request) {
	var p genParams
	if !decodeBody(w, r, &p) || !s.checkModel(w, p.Model) {
		return
	}
	if batch := s.promptBatch(p.Prompt, p.AddSpecialTokens == nil || *p.AddSpecialTokens); len(batch) > 1 {
		s.generateBatch(w, r, &p, batch)
		return
	}
	prompt, err := s.parsePromptSpecial(p.Prompt, p.AddSpecialTokens == nil || *p.AddSpecialTokens)
	if err != nil {
		writeError(w, errorStatus(err), err.Error())
		return
	}
	s.generate(w, r, &p, prompt, false)
}

func (s *Server) handleChat(w http.ResponseWriter, r *http.Request) {
	var p genParams
	if !decodeBody(w, r, &p) || !s.checkModel(w, p.Model) {
		return
	}
	prompt, err := s.parseChat(&p)
	if err != nil {
		writeError(w, errorStatus(err), err.Error())
		return
	}
	s.generate(w, r, &p, prompt, true)
}

// generate runs one request through the engine and writes the response,
// streamed or not. A client that goes away aborts the request.
func (s *Server) generate(w http.ResponseWriter, r *http.Request, p *genParams, prompt []uint32, chat bool) {
	err := p.validate()
	var mt int
	if err == nil {
		mt, err = s.maxTokens(p, len(prompt))
	}
	if err == nil {
		err = s.eng.Check(len(prompt), mt) // Check reads only immutable config
	}
	if err != nil {
		writeError(w, errorStatus(err), err.Error())
		return
	}
	prefix, object, chunkObject := "cmpl", "text_completion", "text_completion"
	if chat {
		prefix, object, chunkObject = "chatcmpl", "chat.completion", "chat.completion.chunk"
	}
	id, ch, err := s.submit(prefix, prompt, mt)
	if err != nil {
		writeError(w, errorStatus(err), err.Error())
		return
	}
	defer s.abort(id) // no-op once finished
	created := time.Now().Unix()
	model := s.cfg.ServedModelName
	ctx := r.Context()

	if !p.Stream {
		var text strings.Builder
		for {
			select {
			case <-ctx.Done():
				return
			case ev, ok := <-ch:
				if !ok {
					writeError(w, http.StatusServiceUnavailable, "server shutting down")
					return
				}
				if ev.fin == nil {
					text.WriteString(OutputTokenText(ev.out.Index))
					continue
				}
				reason := string(ev.fin.Reason)
				var choices any = []completionChoice{{Text: text.String(), FinishReason: &reason}}
				if chat {
					choices = []chatChoice{{Message: chatMessage{Role: "assistant", Content: text.String()}, FinishReason: &reason}}
				}
				u := finUsage(ev.fin)
				writeJSON(w, http.StatusOK, response{ID: string(id), Object: object, Created: created, Model: model, Choices: choices, Usage: &u})
				return
			}
		}
	}

	fl, _ := w.(http.Flusher)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	if fl != nil {
		fl.Flush()
	}
	var buf bytes.Buffer
	emit := func(v any) bool {
		buf.Reset()
		buf.WriteString("data: ")
		b, _ := json.Marshal(v)
		buf.Write(b)
		buf.WriteString("\n\n")
		if _, err := w.Write(buf.Bytes()); err != nil {
			return false
		}
		if fl != nil {
			fl.Flush()
		}
		return true
	}
	includeUsage := p.StreamOptions != nil && p.StreamOptions.IncludeUsage
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-ch:
			if !ok {
				return // shutting down: end the stream without [DONE]
			}
			if ev.fin != nil {
				if includeUsage {
					u := finUsage(ev.fin)
					var empty any = []completionChoice{}
					if chat {
						empty = []chatChunkChoice{}
					}
					if !emit(response{ID: string(id), Object: chunkObject, Created: created, Model: model, Choices: empty, Usage: &u}) {
						return
					}
				}
				_, _ = io.WriteString(w, "data: [DONE]\n\n")
				if fl != nil {
					fl.Flush()
				}
				return
			}
			if !s.held(ctx, mt, ev.out.Index) {
				return
			}
			var fr *string
			if ev.out.Index == mt-1 {
				reason := string(FinishLength)
				fr = &reason
			}
			text := OutputTokenText(ev.out.Index)
			var choices any = []completionChoice{{Text: text, FinishReason: fr}}
			if chat {
				if ev.out.Index == 0 {
					role := []chatChunkChoice{{Delta: chatDelta{Role: "assistant"}}}
					if !emit(response{ID: string(id), Object: chunkObject, Created: created, Model: model, Choices: role}) {
						return
					}
				}
				choices = []chatChunkChoice{{Delta: chatDelta{Content: text}, FinishReason: fr}}
			}
			if !emit(response{ID: string(id), Object: chunkObject, Created: created, Model: model, Choices: choices}) {
				return
			}
		}
	}
}

func finUsage(f *Finished) usage {
	return usage{
		PromptTokens: f.PromptTokens, CompletionTokens: f.OutputTokens,
		TotalTokens: f.PromptTokens + f.OutputTokens, PromptTokensDetails: promptTokensDetails{CachedTokens: f.CachedTokens},
	}
}

type tokenizeResponse struct {
	Count       int      `json:"count"`
	MaxModelLen int      `json:"max_model_len"`
	Tokens      []uint32 `json:"tokens"`
	TokenStrs   any      `json:"token_strs"`
}

func (s *Server) handleTokenize(w http.ResponseWriter, r *http.Request) {
	var p genParams
	if !decodeBody(w, r, &p) || !s.checkModel(w, p.Model) {
		return
	}
	var toks []uint32
	var err error
	switch {
	case len(p.Messages) > 0 && !bytes.Equal(bytes.TrimSpace(p.Messages), []byte("null")):
		toks, err = s.parseChat(&p)
	default:
		toks, err = s.parsePromptSpecial(p.Prompt, p.AddSpecialTokens == nil || *p.AddSpecialTokens)
	}
	if err != nil {
		writeError(w, errorStatus(err), err.Error())
		return
	}
	if toks == nil {
		toks = []uint32{}
	}
	writeJSON(w, http.StatusOK, tokenizeResponse{Count: len(toks), MaxModelLen: s.cfg.MaxModelLen, Tokens: toks})
}

type modelCard struct {
	ID          string  `json:"id"`
	Object      string  `json:"object"`
	Created     int64   `json:"created"`
	OwnedBy     string  `json:"owned_by"`
	Root        string  `json:"root"`
	Parent      *string `json:"parent"`
	MaxModelLen int     `json:"max_model_len"`
}

func (s *Server) handleModels(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{
		"object": "list",
		"data": []modelCard{{
			ID: s.cfg.ServedModelName, Object: "model", Created: s.epoch.Unix(), OwnedBy: "vllm",
			Root: s.cfg.ServedModelName, MaxModelLen: s.cfg.MaxModelLen,
		}},
	})
}

// handleReset is vLLM's dev endpoint. vLLM answers 200 either way; the body
// says whether the cache was cleared (it is refused while requests hold
// blocks).
func (s *Server) handleReset(w http.ResponseWriter, _ *http.Request) {
	ok := s.ResetPrefixCache()
	writeJSON(w, http.StatusOK, map[string]bool{"success": ok})
}
