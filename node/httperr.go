package node

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// Stable error codes of the HTTP API ("code" in the OpenAI-style error
// body). Clients may match on them; they never change meaning.
const (
	CodeInvalidJSON      = "invalid_json"
	CodeBodyTooLarge     = "body_too_large"
	CodeBodyTimeout      = "body_timeout"
	CodeMissingModel     = "missing_model"
	CodeModelNotFound    = "model_not_found"
	CodeMissingPrompt    = "missing_prompt"
	CodeEmptyPrompt      = "empty_prompt"
	CodeInvalidPrompt    = "invalid_prompt"
	CodeBatchUnsupported = "batch_prompt_unsupported" // no longer returned: batches are routed

	CodeMissingMessages    = "missing_messages"
	CodeEmptyMessages      = "empty_messages"
	CodeInvalidMessages    = "invalid_messages"
	CodeUnsupportedContent = "unsupported_content" // no longer returned: media parts are routed
	CodeInvalidField       = "invalid_field_type"
	CodeUnknownStrategy    = "unknown_strategy"
	CodeNoHealthyReplica   = "no_healthy_replica"
	CodeUpstreamError      = "upstream_unavailable"
	CodeUpstreamTimeout    = "upstream_timeout"
	CodeStreamBroken       = "upstream_stream_broken"
	CodeInternal           = "internal_error"
	CodeMethodNotAllowed   = "method_not_allowed"
	CodeNotFound           = "not_found"
	CodeShuttingDown       = "shutting_down"
	CodeGatewayShutdown    = "gateway_shutdown"
	CodeNotReady           = "not_ready"
	// CodeResponseOwnerGone: the replica that stored a Responses API
	// response (previous_response_id, /v1/responses/{id}) left the pool;
	// the response is lost with its in-process store.
	CodeResponseOwnerGone = "response_owner_gone"
	// CodeResponseOwnerUnavailable: that replica is ejected, or failing
	// its health check with health_fail_open off; retry later.
	CodeResponseOwnerUnavailable = "response_owner_unavailable"
	// CodeResponseOwnerUndiscovered: the gateway does not know which
	// replica stored the response, and some replica did not answer its
	// lookup in time (or too many lookups were running); retry.
	CodeResponseOwnerUndiscovered = "response_owner_undiscovered"
	// CodeResponseNotFound: no replica of any pool has the response.
	CodeResponseNotFound = "response_not_found"
	// CodeInvalidMultipart: a multipart body without a readable "model".
	CodeInvalidMultipart = "invalid_multipart"
)

// apiError is an error answered to the client.
type apiError struct {
	status  int
	code    string
	message string
	// retryAfter, when positive, is sent as Retry-After (seconds).
	retryAfter int
}

func (e *apiError) Error() string { return e.code + ": " + e.message }

func errBadRequest(code, msg string) *apiError {
	return &apiError{status: http.StatusBadRequest, code: code, message: msg}
}

// errorType maps a status to OpenAI's error "type".
func errorType(status int) string {
	switch {
	case status == http.StatusNotFound:
		return "not_found_error"
	case status == http.StatusTooManyRequests:
		return "rate_limit_error"
	case status < 500:
		return "invalid_request_error"
	case status == http.StatusServiceUnavailable:
		return "service_unavailable"
	default:
		return "server_error"
	}
}

type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Code    string `json:"code"`
}

// errorJSON renders the OpenAI-style error object.
func errorJSON(status int, code, msg string) []byte {
	b, _ := json.Marshal(errorBody{Error: errorDetail{Message: msg, Type: errorType(status), Code: code}})
	return b
}

// writeError answers e as JSON. It must be called before any byte of the
// response was written.
func writeError(w http.ResponseWriter, e *apiError) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	if e.retryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(e.retryAfter))
	}
	body := errorJSON(e.status, e.code, e.message)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(e.status)
	_, _ = w.Write(body)
}
