package node

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// apiKind is the OpenAI endpoint a request came in on.
type apiKind uint8

const (
	kindCompletions apiKind = iota + 1
	kindChat
)

func (k apiKind) path() string {
	if k == kindChat {
		return "/v1/chat/completions"
	}
	return "/v1/completions"
}

// upstreamPath is the engine path the request goes to: its endpoint's
// (endpoints.go), else its kind's.
func (r *inferenceRequest) upstreamPath() string {
	if r.path != "" {
		return r.path
	}
	return r.kind.path()
}

// upstreamMethod is the request's HTTP method towards the engine.
func (r *inferenceRequest) upstreamMethod() string {
	if r.method != "" {
		return r.method
	}
	return http.MethodPost
}

// inferenceRequest is what the gateway reads from a request body; the body
// itself is forwarded unchanged. Exactly one of text, tokens and messages
// holds the prompt.
type inferenceRequest struct {
	// arrived is when the gateway's handler got the request (before its
	// body was read): the start of kvmesh_http_request_duration_seconds
	// and kvmesh_http_added_latency_seconds. Zero: not observed.
	arrived time.Time
	// kind is how the prompt is keyed: as a completions prompt or as chat
	// messages (a Responses API input is keyed as chat).
	kind      apiKind
	model     string
	stream    bool
	maxTokens int
	cacheSalt string
	user      string

	text        string
	tokens      []uint32
	messages    []tokenizer.Message
	rawMessages json.RawMessage // for the engine's /tokenize
	tmpl        templateOptions // for the hf: tokenizer

	// partial is set when only a prefix of the prompt is keyed (a chat cut
	// at its first media part, a Responses input with non-text items): the
	// keyed token count is then not the prompt's length.
	partial bool
	// batch is the number of prompts of a completions prompt list (0 for
	// a single prompt); the request is keyed by its longest prompt.
	batch int

	// path and method, when set, are the engine path and HTTP method
	// (endpoints other than completions and chat); upstream, when set, is
	// the body to send instead of the buffered one (a multipart form
	// streamed through), upstreamLen its length (-1 unknown).
	path        string
	method      string
	upstream    io.Reader
	upstreamLen int64
	// previousResponseID is a Responses API request's
	// previous_response_id; responseID the {id} of /v1/responses/{id}.
	previousResponseID string
	responseID         string
}

// templateOptions are vLLM's tokenization options of a request, with its
// defaults: add_special_tokens true for completions and false for chat;
// add_generation_prompt true; continue_final_message false.
type templateOptions struct {
	tools                json.RawMessage
	kwargs               json.RawMessage
	addSpecialTokens     bool
	addGenerationPrompt  bool
	continueFinalMessage bool
}

// parseTemplateOptions reads the options into req.tmpl.
func parseTemplateOptions(req *inferenceRequest, f *bodyFields) *apiError {
	wrongType := func(field string) *apiError {
		return errBadRequest(CodeInvalidField, fmt.Sprintf("field %q must be a boolean", field))
	}
	o := templateOptions{addSpecialTokens: req.kind == kindCompletions, addGenerationPrompt: true}
	var err error
	if len(f.addSpecialTokens) > 0 && string(f.addSpecialTokens) != "null" {
		if o.addSpecialTokens, err = f.addSpecialTokens.bool(); err != nil {
			return wrongType("add_special_tokens")
		}
	}
	if len(f.addGenerationPrompt) > 0 && string(f.addGenerationPrompt) != "null" {
		if o.addGenerationPrompt, err = f.addGenerationPrompt.bool(); err != nil {
			return wrongType("add_generation_prompt")
		}
	}
	if o.continueFinalMessage, err = f.continueFinalMessage.bool(); err != nil {
		return wrongType("continue_final_message")
	}
	if !isNull(json.RawMessage(f.tools)) {
		o.tools = json.RawMessage(f.tools)
	}
	if !isNull(json.RawMessage(f.chatTemplateKwargs)) {
		o.kwargs = json.RawMessage(f.chatTemplateKwargs)
	}
	req.tmpl = o
	return nil
}

// readBody reads at most limit bytes of the request body within timeout
// (a read deadline on the client connection, lifted afterwards so that the
// server's disconnect detection keeps working during long streams).
func readBody(w http.ResponseWriter, r *http.Request, limit int64, timeout time.Duration) ([]byte, *apiError) {
	if r.ContentLength > limit {
		return nil, &apiError{status: http.StatusRequestEntityTooLarge, code: CodeBodyTooLarge,
			message: fmt.Sprintf("request body of %d bytes exceeds the %d-byte limit", r.ContentLength, limit)}
	}
	rc := http.NewResponseController(w)
	if timeout > 0 && rc.SetReadDeadline(time.Now().Add(timeout)) == nil {
		defer func() { _ = rc.SetReadDeadline(time.Time{}) }()
	}
	body, err := readAllSized(http.MaxBytesReader(w, r.Body, limit), r.ContentLength)
	if err != nil {
		// Whatever is left of the body is not read: close the connection
		// after the error rather than wait to drain it.
		_ = r.Body.Close()
		w.Header().Set("Connection", "close")
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, &apiError{status: http.StatusRequestEntityTooLarge, code: CodeBodyTooLarge,
				message: fmt.Sprintf("request body exceeds the %d-byte limit", limit)}
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return nil, &apiError{status: http.StatusRequestTimeout, code: CodeBodyTimeout,
				message: "the request body did not arrive in time"}
		}
		return nil, errBadRequest(CodeInvalidJSON, "cannot read request body")
	}
	return body, nil
}

// readAllSized reads rd to the end into one buffer of the announced size
// (io.ReadAll would grow it by doubling: a dozen copies for a 30 KB
// prompt); without a Content-Length it falls back to io.ReadAll.
func readAllSized(rd io.Reader, size int64) ([]byte, error) {
	if size <= 0 {
		return io.ReadAll(rd)
	}
	buf := make([]byte, size+1) // +1 to see a body longer than announced
	n, err := io.ReadFull(rd, buf)
	switch {
	case (err == io.ErrUnexpectedEOF || err == io.EOF) && int64(n) == size:
		return buf[:n], nil
	case err == io.EOF:
		return nil, io.ErrUnexpectedEOF // shorter than announced
	case err != nil:
		return nil, err
	}
	// More bytes than Content-Length: net/http does not deliver them, so
	// this is unreachable for HTTP/1.1, but read on rather than truncate.
	rest, err := io.ReadAll(rd)
	return append(buf, rest...), err
}

// parseInference reads the routing-relevant fields of body in one pass
// (see jsonscan.go). Errors are client errors with stable codes; their
// messages never quote prompt text.
func parseInference(kind apiKind, body []byte) (*inferenceRequest, *apiError) {
	f, isObject, err := scanBody(body)
	if err != nil || !isObject {
		return nil, errBadRequest(CodeInvalidJSON, "request body must be a JSON object")
	}
	wrongType := func(field, want string) *apiError {
		return errBadRequest(CodeInvalidField, fmt.Sprintf("field %q must be %s", field, want))
	}
	req := &inferenceRequest{kind: kind}
	model, ok, err := f.model.string()
	if err != nil {
		return nil, wrongType("model", "a string")
	}
	if !ok || model == "" {
		return nil, errBadRequest(CodeMissingModel, `"model" is required`)
	}
	req.model = model
	if req.stream, err = f.stream.bool(); err != nil {
		return nil, wrongType("stream", "a boolean")
	}
	mt, ok, err := f.maxTokens.int()
	if err != nil {
		return nil, wrongType("max_tokens", "an integer")
	}
	if !ok {
		if mt, _, err = f.maxCompletionTokens.int(); err != nil {
			return nil, wrongType("max_completion_tokens", "an integer")
		}
	}
	req.maxTokens = mt
	if req.cacheSalt, _, err = f.cacheSalt.string(); err != nil {
		return nil, wrongType("cache_salt", "a string")
	}
	if req.user, _, err = f.user.string(); err != nil {
		return nil, wrongType("user", "a string")
	}
	if e := parseTemplateOptions(req, &f); e != nil {
		return nil, e
	}
	switch kind {
	case kindCompletions:
		if e := parsePrompt(req, json.RawMessage(f.prompt)); e != nil {
			return nil, e
		}
	case kindChat:
		if e := parseMessages(req, json.RawMessage(f.messages)); e != nil {
			return nil, e
		}
	}
	return req, nil
}

func isNull(raw json.RawMessage) bool {
	return len(raw) == 0 || bytes.Equal(raw, []byte("null"))
}

// parsePrompt reads a completions "prompt" (already validated JSON): a
// string, a token list, or a batch of strings or token lists. vLLM serves a
// batch as one request on one engine, so a batch is routed as a whole: it
// is keyed by its longest prompt (most bytes of text, most token ids), the
// one whose cached prefix saves the most prefill; prompts sharing that
// prefix ride along, and the others are prefilled wherever the batch goes.
func parsePrompt(req *inferenceRequest, raw json.RawMessage) *apiError {
	if isNull(raw) {
		return errBadRequest(CodeMissingPrompt, `"prompt" is required`)
	}
	// The errors are built only when returned: a prompt that parses costs
	// no allocation for them.
	bad := func() *apiError {
		return errBadRequest(CodeInvalidPrompt, `"prompt" must be a string, an array of token ids, or an array of strings or of token arrays`)
	}
	empty := func() *apiError { return errBadRequest(CodeEmptyPrompt, `"prompt" is empty`) }
	switch raw[0] {
	case '"':
		req.text = unquote(raw)
		if req.text == "" {
			return empty()
		}
		return nil
	case '[':
	default:
		return bad()
	}
	inner := bytes.TrimLeft(raw[1:], " \t\r\n")
	switch c := inner[0]; {
	case c == ']':
		return empty()
	case c >= '0' && c <= '9':
		toks, ok := tokenIDs(make([]uint32, 0, len(raw)/4), raw)
		if !ok {
			return bad()
		}
		req.tokens = toks
		return nil
	case c == '"' || c == '[':
		elems := arrayElems(raw)
		longest := elems[0]
		for _, e := range elems {
			if e[0] != c {
				return bad()
			}
			if len(e) > len(longest) {
				longest = e
			}
		}
		if len(elems) > 1 {
			// The engine's usage counts every prompt: the keyed one is
			// only part of it.
			req.batch, req.partial = len(elems), true
		}
		if c == '"' {
			req.text = unquote(longest)
			if req.text == "" {
				return empty()
			}
			return nil
		}
		toks, ok := tokenIDs(nil, longest)
		if !ok {
			return bad()
		}
		if len(toks) == 0 {
			return empty()
		}
		req.tokens = toks
		return nil
	default:
		return bad()
	}
}

// parseMessages reads a chat "messages" array.
func parseMessages(req *inferenceRequest, raw json.RawMessage) *apiError {
	raw = bytes.TrimSpace(raw)
	if isNull(raw) {
		return errBadRequest(CodeMissingMessages, `"messages" is required`)
	}
	if maybeMedia(raw) {
		// Media parts (image, audio, video, ...): key the chat up to the
		// first one (multimodal.go), without decoding the media bytes
		// more than once.
		if cut, media, ok := mediaScan(raw); ok && media {
			req.partial = true
			if len(cut) == 0 {
				req.messages = []tokenizer.Message{}
				req.rawMessages = json.RawMessage("[]")
				return nil
			}
			raw = cut
		}
	}
	msgs, err := tokenizer.ParseMessages(raw)
	if errors.Is(err, tokenizer.ErrUnsupportedContent) {
		// Media parts (image, audio, video, ...): key the chat up to the
		// first one (see mediaCut); the engine validates the rest.
		cut, ok := mediaCut(raw)
		if !ok {
			return errBadRequest(CodeInvalidMessages, err.Error())
		}
		if len(cut) == 0 {
			// Media first: nothing to key, route by load.
			req.partial = true
			req.messages = []tokenizer.Message{}
			req.rawMessages = json.RawMessage("[]")
			return nil
		}
		raw = cut
		req.partial = true
		msgs, err = tokenizer.ParseMessages(raw)
	}
	if err != nil {
		return errBadRequest(CodeInvalidMessages, err.Error())
	}
	if len(msgs) == 0 && !req.partial {
		return errBadRequest(CodeEmptyMessages, `"messages" is empty`)
	}
	req.messages = msgs
	req.rawMessages = raw
	return nil
}
