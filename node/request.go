package node

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"

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

// inferenceRequest is what the gateway reads from a request body; the body
// itself is forwarded unchanged. Exactly one of text, tokens and messages
// holds the prompt.
type inferenceRequest struct {
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
}

// wireRequest holds the fields the gateway reads; the rest of the body is
// ignored here and forwarded as is.
type wireRequest struct {
	Model               *string         `json:"model"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            json.RawMessage `json:"messages"`
	Stream              *bool           `json:"stream"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	CacheSalt           *string         `json:"cache_salt"`
	User                *string         `json:"user"`
}

// readBody reads at most limit bytes of the request body.
func readBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, *apiError) {
	if r.ContentLength > limit {
		return nil, &apiError{status: http.StatusRequestEntityTooLarge, code: CodeBodyTooLarge,
			message: fmt.Sprintf("request body of %d bytes exceeds the %d-byte limit", r.ContentLength, limit)}
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, &apiError{status: http.StatusRequestEntityTooLarge, code: CodeBodyTooLarge,
				message: fmt.Sprintf("request body exceeds the %d-byte limit", limit)}
		}
		return nil, errBadRequest(CodeInvalidJSON, "cannot read request body")
	}
	return body, nil
}

// parseInference reads the routing-relevant fields of body. Errors are
// client errors with stable codes; their messages never quote prompt text.
func parseInference(kind apiKind, body []byte) (*inferenceRequest, *apiError) {
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) == 0 || trimmed[0] != '{' {
		return nil, errBadRequest(CodeInvalidJSON, "request body must be a JSON object")
	}
	var w wireRequest
	if err := json.Unmarshal(trimmed, &w); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return nil, errBadRequest(CodeInvalidField, fmt.Sprintf("field %q has the wrong type (got JSON %s, want %s)", te.Field, te.Value, te.Type))
		}
		return nil, errBadRequest(CodeInvalidJSON, "request body is not valid JSON")
	}
	req := &inferenceRequest{kind: kind}
	if w.Model == nil || *w.Model == "" {
		return nil, errBadRequest(CodeMissingModel, `"model" is required`)
	}
	req.model = *w.Model
	if w.Stream != nil {
		req.stream = *w.Stream
	}
	if w.MaxTokens != nil {
		req.maxTokens = *w.MaxTokens
	} else if w.MaxCompletionTokens != nil {
		req.maxTokens = *w.MaxCompletionTokens
	}
	if w.CacheSalt != nil {
		req.cacheSalt = *w.CacheSalt
	}
	if w.User != nil {
		req.user = *w.User
	}
	switch kind {
	case kindCompletions:
		if e := parsePrompt(req, w.Prompt); e != nil {
			return nil, e
		}
	case kindChat:
		if e := parseMessages(req, w.Messages); e != nil {
			return nil, e
		}
	}
	return req, nil
}

func isNull(raw json.RawMessage) bool {
	return len(raw) == 0 || bytes.Equal(raw, []byte("null"))
}

// parsePrompt reads a completions "prompt": a string, a token list, or a
// batch of exactly one string or token list. A batch of several prompts
// cannot be routed as one prompt and is refused.
func parsePrompt(req *inferenceRequest, raw json.RawMessage) *apiError {
	raw = bytes.TrimSpace(raw)
	if isNull(raw) {
		return errBadRequest(CodeMissingPrompt, `"prompt" is required`)
	}
	bad := errBadRequest(CodeInvalidPrompt, `"prompt" must be a string, an array of token ids, or an array of one string or one token array`)
	switch raw[0] {
	case '"':
		if err := json.Unmarshal(raw, &req.text); err != nil {
			return bad
		}
		if req.text == "" {
			return errBadRequest(CodeEmptyPrompt, `"prompt" is empty`)
		}
		return nil
	case '[':
	default:
		return bad
	}
	inner := bytes.TrimLeft(raw[1:], " \t\r\n")
	if len(inner) == 0 {
		return bad
	}
	switch c := inner[0]; {
	case c == ']':
		return errBadRequest(CodeEmptyPrompt, `"prompt" is empty`)
	case c >= '0' && c <= '9':
		if err := json.Unmarshal(raw, &req.tokens); err != nil {
			return bad
		}
		return nil
	case c == '"':
		var batch []string
		if err := json.Unmarshal(raw, &batch); err != nil {
			return bad
		}
		if len(batch) > 1 {
			return errBadRequest(CodeBatchUnsupported, fmt.Sprintf("a batch of %d prompts cannot be routed as one request; send one prompt per request", len(batch)))
		}
		req.text = batch[0]
		if req.text == "" {
			return errBadRequest(CodeEmptyPrompt, `"prompt" is empty`)
		}
		return nil
	case c == '[':
		var batch [][]uint32
		if err := json.Unmarshal(raw, &batch); err != nil {
			return bad
		}
		if len(batch) > 1 {
			return errBadRequest(CodeBatchUnsupported, fmt.Sprintf("a batch of %d prompts cannot be routed as one request; send one prompt per request", len(batch)))
		}
		req.tokens = batch[0]
		if len(req.tokens) == 0 {
			return errBadRequest(CodeEmptyPrompt, `"prompt" is empty`)
		}
		return nil
	default:
		return bad
	}
}

// parseMessages reads a chat "messages" array.
func parseMessages(req *inferenceRequest, raw json.RawMessage) *apiError {
	raw = bytes.TrimSpace(raw)
	if isNull(raw) {
		return errBadRequest(CodeMissingMessages, `"messages" is required`)
	}
	msgs, err := tokenizer.ParseMessages(raw)
	if err != nil {
		if errors.Is(err, tokenizer.ErrUnsupportedContent) {
			return errBadRequest(CodeUnsupportedContent, err.Error())
		}
		return errBadRequest(CodeInvalidMessages, err.Error())
	}
	if len(msgs) == 0 {
		return errBadRequest(CodeEmptyMessages, `"messages" is empty`)
	}
	req.messages = msgs
	req.rawMessages = raw
	return nil
}
