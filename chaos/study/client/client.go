// Package client is the study's streaming completion client: it POSTs one
// /v1/completions request with stream and include_usage, reads the SSE
// stream, and reports what the seed study measures: time to the first
// content chunk, time to the last content chunk, time to the end of the
// stream, the content chunk count, whether "[DONE]" arrived, the usage, and
// the replica named in the gateway's x-kvmesh-replica response header. It
// never retries. Durations are wall time; callers running a time-compressed
// simulator scale them to model time with Scale.
//
// A Client is safe for concurrent use.
package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/chaos/study"
)

// ReplicaHeader is the response header a kvmesh gateway names the serving
// replica in.
const ReplicaHeader = "x-kvmesh-replica"

// StrategyHeader is the request header that selects a routing strategy.
const StrategyHeader = "routing-strategy"

// SessionHeader carries a multi-turn session's id to the gateway.
const SessionHeader = "x-session-id"

// ErrStream is wrapped in Outcome.Err descriptions for protocol failures.
var ErrStream = errors.New("client: bad stream")

// Client sends streaming completion requests.
type Client struct {
	// HTTP is the HTTP client used; it must not have a total timeout
	// shorter than a stream (use contexts instead).
	HTTP *http.Client
	// Model is the model name sent in every request.
	Model string
}

// Request is one request to send.
type Request struct {
	// URL is the full /v1/completions URL.
	URL string
	// Strategy, if not empty, is sent as the routing-strategy header.
	Strategy string
	// Session, if not empty, is sent as x-session-id and as the OpenAI
	// "user" field.
	Session string
	// Prompt and MaxTokens are the request body's fields.
	Prompt    string
	MaxTokens int
	// Replica names the replica when the request goes straight to an
	// engine (no gateway header to read it from).
	Replica string
	// CacheSalt, if not empty, is sent as vLLM's cache_salt: requests
	// with different salts never share prefix-cache blocks (a target run
	// isolates phases with it on engines that refuse /reset_prefix_cache).
	CacheSalt string
}

type body struct {
	Model         string        `json:"model"`
	Prompt        string        `json:"prompt"`
	MaxTokens     int           `json:"max_tokens"`
	Temperature   float64       `json:"temperature"`
	IgnoreEOS     bool          `json:"ignore_eos"`
	Stream        bool          `json:"stream"`
	StreamOptions streamOptions `json:"stream_options"`
	User          string        `json:"user,omitempty"`
	CacheSalt     string        `json:"cache_salt,omitempty"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type chunk struct {
	Choices []struct {
		Text  string `json:"text"`
		Delta *struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
}

// Do sends req and reads its stream to the end (or until ctx ends). It
// returns the outcome with wall-time offsets from the moment the POST
// started, and that moment. It never returns an error: failures are in
// Outcome.Err and Outcome.Status.
func (c *Client) Do(ctx context.Context, req Request) (study.Outcome, time.Time) {
	o := study.Outcome{CachedTokens: -1, Replica: req.Replica}
	b, err := json.Marshal(body{
		Model: c.Model, Prompt: req.Prompt, MaxTokens: req.MaxTokens, Temperature: 0,
		IgnoreEOS: true, Stream: true, StreamOptions: streamOptions{IncludeUsage: true}, User: req.Session,
		CacheSalt: req.CacheSalt,
	})
	start := time.Now()
	if err != nil {
		o.Err = err.Error()
		return o, start
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, req.URL, bytes.NewReader(b))
	if err != nil {
		o.Err = err.Error()
		return o, start
	}
	hreq.Header.Set("Content-Type", "application/json")
	hreq.Header.Set("Accept", "text/event-stream")
	if req.Strategy != "" {
		hreq.Header.Set(StrategyHeader, req.Strategy)
	}
	if req.Session != "" {
		hreq.Header.Set(SessionHeader, req.Session)
	}
	hc := c.HTTP
	if hc == nil {
		hc = http.DefaultClient
	}
	start = time.Now()
	resp, err := hc.Do(hreq)
	if err != nil {
		o.End = time.Since(start)
		o.Err = err.Error()
		return o, start
	}
	defer func() { _ = resp.Body.Close() }()
	o.Status = resp.StatusCode
	if r := resp.Header.Get(ReplicaHeader); r != "" {
		o.Replica = r
	}
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		o.End = time.Since(start)
		o.Err = fmt.Sprintf("http %d: %s", resp.StatusCode, strings.TrimSpace(string(msg)))
		return o, start
	}
	var text strings.Builder
	err = readSSE(resp.Body, func(data []byte) error {
		now := time.Since(start)
		if o.GotDone {
			return fmt.Errorf("%w: data after [DONE]", ErrStream)
		}
		if bytes.Equal(data, []byte("[DONE]")) {
			o.GotDone = true
			return nil
		}
		var ch chunk
		if err := json.Unmarshal(data, &ch); err != nil {
			return fmt.Errorf("%w: chunk: %v", ErrStream, err)
		}
		if ch.Error != nil {
			return fmt.Errorf("%w: server error in stream: %s", ErrStream, ch.Error.Message)
		}
		content := ""
		for _, c := range ch.Choices {
			content += c.Text
			if c.Delta != nil {
				content += c.Delta.Content
			}
		}
		if content != "" {
			if o.ContentChunks == 0 {
				o.FirstContent = now
			}
			o.LastContent = now
			o.ContentChunks++
			text.WriteString(content)
		}
		if ch.Usage != nil {
			o.HasUsage = true
			o.PromptTokens = ch.Usage.PromptTokens
			o.CompletionTokens = ch.Usage.CompletionTokens
			if d := ch.Usage.PromptTokensDetails; d != nil {
				o.CachedTokens = d.CachedTokens
			}
		}
		return nil
	})
	o.End = time.Since(start)
	o.Text = text.String()
	if err != nil {
		o.Err = err.Error()
	}
	return o, start
}

// readSSE calls fn with the data of every event in r. Multi-line data
// fields are joined with newlines, as the SSE specification says.
func readSSE(r io.Reader, fn func([]byte) error) error {
	br := bufio.NewReaderSize(r, 32<<10)
	var data []byte
	have := false
	for {
		line, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			// A very long line: collect it whole.
			rest, err2 := br.ReadBytes('\n')
			line = append(append([]byte(nil), line...), rest...)
			err = err2
		}
		trimmed := bytes.TrimRight(line, "\r\n")
		switch {
		case len(trimmed) == 0 && len(line) > 0:
			if have {
				if ferr := fn(data); ferr != nil {
					return ferr
				}
			}
			data, have = data[:0], false
		case bytes.HasPrefix(trimmed, []byte("data:")):
			v := bytes.TrimPrefix(trimmed[5:], []byte(" "))
			if have {
				data = append(data, '\n')
			}
			data = append(data, v...)
			have = true
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				if have {
					return fn(data)
				}
				return nil
			}
			return err
		}
	}
}

// Scale converts a wall-time outcome to model time for a simulator running
// speed times faster than modelled, and sets Start to startModel.
func Scale(o study.Outcome, speed float64, startModel time.Duration) study.Outcome {
	s := func(d time.Duration) time.Duration { return time.Duration(float64(d) * speed) }
	o.Start = startModel
	o.FirstContent = s(o.FirstContent)
	o.LastContent = s(o.LastContent)
	o.End = s(o.End)
	return o
}
