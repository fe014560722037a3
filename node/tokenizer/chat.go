package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// ErrInvalidMessages is returned by ParseMessages for a messages value it
// cannot read: not an array, a message that is not an object, a missing or
// non-string role, or content of a JSON type other than string, array or
// null.
var ErrInvalidMessages = errors.New("tokenizer: invalid messages")

// ErrUnsupportedContent is returned by ParseMessages for a content part
// whose type is not "text" (images, audio, files...): kvmesh routes text
// prompts only.
var ErrUnsupportedContent = errors.New("tokenizer: unsupported message content")

// Message is one chat message with its content flattened to text.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// Chat template markers used by RenderChat.
const (
	chatStart = "<|im_start|>"
	chatEnd   = "<|im_end|>"
)

// RenderChat renders messages into the one prompt string that the
// simulator tokenizes and the gateway hashes. The template is ChatML-like
// and deterministic:
//
//	<|im_start|>{role}\n{content}<|im_end|>\n     (once per message, in order)
//	<|im_start|>assistant\n                      (the generation prompt)
//
// Roles and contents are copied verbatim (no trimming, no escaping), so two
// conversations that share their first messages render to strings that
// share a prefix, which is what prefix-cache routing needs. The markers
// are plain text for cl100k_base (it has no such special tokens). A real
// engine renders with its model's own template; use the engine's
// /tokenize when token-exact agreement with that engine matters.
func RenderChat(messages []Message) string {
	n := len(chatStart) + len("assistant\n")
	for _, m := range messages {
		n += len(chatStart) + len(m.Role) + 1 + len(m.Content) + len(chatEnd) + 1
	}
	var b strings.Builder
	b.Grow(n)
	for _, m := range messages {
		b.WriteString(chatStart)
		b.WriteString(m.Role)
		b.WriteByte('\n')
		b.WriteString(m.Content)
		b.WriteString(chatEnd)
		b.WriteByte('\n')
	}
	b.WriteString(chatStart)
	b.WriteString("assistant\n")
	return b.String()
}

// wireMessage is one OpenAI chat message as it arrives; fields kvmesh does
// not use (name, tool_calls, ...) are ignored.
type wireMessage struct {
	Role    *string         `json:"role"`
	Content json.RawMessage `json:"content"`
}

// wirePart is one element of an array content.
type wirePart struct {
	Type *string `json:"type"`
	Text *string `json:"text"`
}

// ParseMessages reads an OpenAI chat "messages" value: a JSON array of
// objects with a string "role" and a "content" that is a string, null or
// absent (read as ""), or an array of parts. Text parts
// ({"type":"text","text":...}) are joined with "\n", as vLLM does for
// string-format chat templates. Any other part type returns an error
// wrapping ErrUnsupportedContent; any other shape an error wrapping
// ErrInvalidMessages. Error messages name the offending message index but
// never include prompt text.
func ParseMessages(raw json.RawMessage) ([]Message, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || raw[0] != '[' {
		return nil, fmt.Errorf("%w: messages must be a JSON array", ErrInvalidMessages)
	}
	var wire []json.RawMessage
	if err := json.Unmarshal(raw, &wire); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidMessages, err)
	}
	out := make([]Message, 0, len(wire))
	for i, w := range wire {
		w = bytes.TrimSpace(w)
		if len(w) == 0 || w[0] != '{' {
			return nil, fmt.Errorf("%w: messages[%d] must be an object", ErrInvalidMessages, i)
		}
		var m wireMessage
		if err := json.Unmarshal(w, &m); err != nil {
			return nil, fmt.Errorf("%w: messages[%d]: %w", ErrInvalidMessages, i, err)
		}
		if m.Role == nil || *m.Role == "" {
			return nil, fmt.Errorf("%w: messages[%d] has no role", ErrInvalidMessages, i)
		}
		content, err := parseContent(m.Content)
		if err != nil {
			return nil, fmt.Errorf("messages[%d]: %w", i, err)
		}
		out = append(out, Message{Role: *m.Role, Content: content})
	}
	return out, nil
}

// parseContent flattens one message's content to text.
func parseContent(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return "", nil
	}
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", fmt.Errorf("%w: content: %w", ErrInvalidMessages, err)
		}
		return s, nil
	case '[':
		var parts []json.RawMessage
		if err := json.Unmarshal(raw, &parts); err != nil {
			return "", fmt.Errorf("%w: content: %w", ErrInvalidMessages, err)
		}
		var b strings.Builder
		for j, pr := range parts {
			pr = bytes.TrimSpace(pr)
			if len(pr) == 0 || pr[0] != '{' {
				return "", fmt.Errorf("%w: content[%d] must be an object", ErrInvalidMessages, j)
			}
			var p wirePart
			if err := json.Unmarshal(pr, &p); err != nil {
				return "", fmt.Errorf("%w: content[%d]: %w", ErrInvalidMessages, j, err)
			}
			if p.Type == nil {
				return "", fmt.Errorf("%w: content[%d] has no type", ErrInvalidMessages, j)
			}
			if *p.Type != "text" {
				return "", fmt.Errorf("%w: content[%d] has type %q, only \"text\" is supported",
					ErrUnsupportedContent, j, truncate(*p.Type, 32))
			}
			if p.Text == nil {
				return "", fmt.Errorf("%w: content[%d] of type \"text\" has no string text", ErrInvalidMessages, j)
			}
			if j > 0 {
				b.WriteByte('\n')
			}
			b.WriteString(*p.Text)
		}
		return b.String(), nil
	default:
		return "", fmt.Errorf("%w: content must be a string, an array of parts or null", ErrInvalidMessages)
	}
}

// truncate shortens s to at most n bytes for an error message.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
