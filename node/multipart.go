package node

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net"
	"net/http"
	"strings"
	"time"
)

// maxModelFieldBytes bounds the "model" form value.
const maxModelFieldBytes = 1 << 10

// readMultipart reads a multipart/form-data request (audio transcription
// and translation) only as far as its "model" field: the bytes read so far
// are kept and sent first, the rest of the body streams through to the
// engine unread. A form whose file part comes before "model" (the openai
// clients send the file first) is buffered up to the model field, within
// MaxBodyBytes; nothing after it is.
func (n *Node) readMultipart(w http.ResponseWriter, r *http.Request) (*inferenceRequest, *apiError) {
	if r.ContentLength > n.cfg.MaxBodyBytes {
		return nil, &apiError{status: http.StatusRequestEntityTooLarge, code: CodeBodyTooLarge,
			message: fmt.Sprintf("request body of %d bytes exceeds the %d-byte limit", r.ContentLength, n.cfg.MaxBodyBytes)}
	}
	mt, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mt != "multipart/form-data" || params["boundary"] == "" {
		return nil, errBadRequest(CodeInvalidMultipart, "the body must be multipart/form-data with a boundary")
	}
	// The search for the model field is bounded in time like readBody;
	// the deadline is lifted before the rest streams to the engine.
	rc := http.NewResponseController(w)
	if n.cfg.BodyReadTimeout > 0 && rc.SetReadDeadline(time.Now().Add(n.cfg.BodyReadTimeout)) == nil {
		defer func() { _ = rc.SetReadDeadline(time.Time{}) }()
	}
	body := http.MaxBytesReader(w, r.Body, n.cfg.MaxBodyBytes)
	var seen bytes.Buffer
	mr := multipart.NewReader(io.TeeReader(body, &seen), params["boundary"])
	req := &inferenceRequest{kind: kindCompletions, partial: true, path: r.URL.Path}
	fail := func(err error) *apiError {
		_ = r.Body.Close()
		w.Header().Set("Connection", "close")
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return &apiError{status: http.StatusRequestEntityTooLarge, code: CodeBodyTooLarge,
				message: fmt.Sprintf("request body exceeds the %d-byte limit before its \"model\" field", n.cfg.MaxBodyBytes)}
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return &apiError{status: http.StatusRequestTimeout, code: CodeBodyTimeout,
				message: "the request body did not reach its \"model\" field in time"}
		}
		return errBadRequest(CodeInvalidMultipart, "cannot read the multipart body: "+err.Error())
	}
	for {
		part, err := mr.NextPart()
		if err == io.EOF {
			break // no model field: the only pool's, if there is one
		}
		if err != nil {
			return nil, fail(err)
		}
		if part.FormName() != "model" {
			continue // NextPart skips (and so keeps) the rest of this part
		}
		v, err := io.ReadAll(io.LimitReader(part, maxModelFieldBytes+1))
		if err != nil {
			return nil, fail(err)
		}
		if len(v) > maxModelFieldBytes {
			return nil, errBadRequest(CodeInvalidMultipart, `the "model" field is too long`)
		}
		req.model = strings.TrimSpace(string(v))
		if req.model == "" {
			return nil, errBadRequest(CodeMissingModel, `"model" must not be empty`)
		}
		break
	}
	// seen holds everything read from the body so far (the multipart
	// reader's read-ahead included): it goes first, the unread rest after.
	req.upstream = io.MultiReader(bytes.NewReader(seen.Bytes()), body)
	req.upstreamLen = r.ContentLength
	return req, nil
}
