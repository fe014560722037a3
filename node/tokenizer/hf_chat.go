package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/ardanlabs/jinja"
)

// ErrChatTemplate is returned when a model's chat template is missing,
// does not compile, or fails to render a conversation.
var ErrChatTemplate = errors.New("tokenizer: chat template")

// Chat templates are rendered with github.com/ardanlabs/jinja, an engine
// made for LLM chat templates: it has no dependencies, keeps dicts in
// insertion order (so tools and tool-call arguments render in the order the
// client sent them, as Python dicts do), and its tojson writes Python's
// json.dumps separators (", " and ": ") that transformers' tojson uses.
// github.com/nikolalohinski/gonja/v2 also renders the Qwen3 and Llama 3
// templates but its tojson is compact ({"a":1}), which changes every tool
// prompt's tokens, and it pulls in logrus and json-iterator.

// ChatRequest is a chat prompt as an OpenAI client sends it, with vLLM's
// defaults: AddGenerationPrompt true unless ContinueFinalMessage.
type ChatRequest struct {
	// Messages is the "messages" JSON array.
	Messages json.RawMessage
	// Tools is the "tools" JSON array, or nil.
	Tools json.RawMessage
	// AddGenerationPrompt appends the assistant's turn header.
	AddGenerationPrompt bool
	// ContinueFinalMessage renders the last (assistant) message open, so
	// the model continues it (a prefill): the rendering is cut right after
	// its content, as transformers does.
	ContinueFinalMessage bool
	// Kwargs is "chat_template_kwargs" (a JSON object, e.g.
	// {"enable_thinking": false}), or nil.
	Kwargs json.RawMessage
}

// chatTemplate is a model's compiled chat template.
type chatTemplate struct {
	once sync.Once
	tmpl *jinja.Template
	err  error
}

func (h *HF) compiledChat() (*jinja.Template, error) {
	c := &h.chat
	c.once.Do(func() {
		if h.chatTemplate == "" {
			c.err = fmt.Errorf("%w: %s has no chat_template", ErrChatTemplate, h.name)
			return
		}
		c.tmpl, c.err = jinja.Compile(h.chatTemplate)
		if c.err != nil {
			c.err = fmt.Errorf("%w: %s: %w", ErrChatTemplate, h.name, c.err)
		}
	})
	return c.tmpl, c.err
}

// RenderChat renders a conversation with the model's chat template as
// vLLM does before tokenizing: each message's content is a string, text
// parts joined with "\n" (vLLM's "string" content format; other part types
// wrap ErrUnsupportedContent), null content is "", tool-call arguments
// given as JSON strings are parsed into objects, and the template sees
// messages, tools (if any), add_generation_prompt, bos_token, eos_token and
// the chat_template_kwargs. Errors wrap ErrInvalidMessages or
// ErrChatTemplate and never include prompt text.
func (h *HF) RenderChat(req ChatRequest) (string, error) {
	tmpl, err := h.compiledChat()
	if err != nil {
		return "", err
	}
	msgs, err := jsonToValue(req.Messages)
	if err != nil || !msgs.IsList() {
		return "", fmt.Errorf("%w: messages must be a JSON array", ErrInvalidMessages)
	}
	for i, m := range msgs.AsList().Items {
		if err := vllmMessage(m); err != nil {
			return "", fmt.Errorf("messages[%d]: %w", i, err)
		}
	}
	vars := map[string]jinja.Value{}
	if len(req.Kwargs) > 0 && string(req.Kwargs) != "null" {
		kw, err := jsonToValue(req.Kwargs)
		if err != nil || !kw.IsDict() {
			return "", fmt.Errorf("%w: chat_template_kwargs must be a JSON object", ErrInvalidMessages)
		}
		d := kw.AsDict()
		for _, k := range d.Keys {
			vars[k] = d.Data[k]
		}
	}
	vars["messages"] = msgs
	vars["add_generation_prompt"] = jinja.NewBool(req.AddGenerationPrompt)
	vars["bos_token"] = jinja.NewString(h.bosToken)
	vars["eos_token"] = jinja.NewString(h.eosToken)
	if len(req.Tools) > 0 && string(req.Tools) != "null" {
		tools, err := jsonToValue(req.Tools)
		if err != nil || !tools.IsList() {
			return "", fmt.Errorf("%w: tools must be a JSON array", ErrInvalidMessages)
		}
		vars["tools"] = tools
	}
	out, err := tmpl.RenderValues(vars)
	if err != nil {
		return "", fmt.Errorf("%w: %s: %w", ErrChatTemplate, h.name, err)
	}
	if req.ContinueFinalMessage {
		items := msgs.AsList().Items
		if len(items) == 0 {
			return "", fmt.Errorf("%w: continue_final_message without messages", ErrInvalidMessages)
		}
		c, _ := items[len(items)-1].AsDict().Get("content")
		final := strings.TrimSpace(c.AsString())
		at := strings.LastIndex(out, final)
		if at < 0 {
			return "", fmt.Errorf("%w: %s: the final message is not in the rendered prompt", ErrChatTemplate, h.name)
		}
		out = out[:at+len(final)]
	}
	return out, nil
}

// EncodeChat renders req (RenderChat) and appends its tokens without
// adding special tokens, as vLLM tokenizes a rendered chat prompt.
func (h *HF) EncodeChat(dst []uint32, req ChatRequest) ([]uint32, error) {
	text, err := h.RenderChat(req)
	if err != nil {
		return dst, err
	}
	return h.Encode(dst, text), nil
}

// vllmMessage checks one message and rewrites it in place as vLLM hands
// it to the template.
func vllmMessage(m jinja.Value) error {
	if !m.IsDict() {
		return fmt.Errorf("%w: a message must be an object", ErrInvalidMessages)
	}
	d := m.AsDict()
	if r, ok := d.Get("role"); !ok || !r.IsString() || r.AsString() == "" {
		return fmt.Errorf("%w: a message needs a string role", ErrInvalidMessages)
	}
	c, _ := d.Get("content")
	switch {
	case c.IsUndefined() || c.IsNone():
		d.Set("content", jinja.NewString(""))
	case c.IsString():
	case c.IsList():
		var b strings.Builder
		for j, p := range c.AsList().Items {
			if !p.IsDict() {
				return fmt.Errorf("%w: content[%d] must be an object", ErrInvalidMessages, j)
			}
			typ, _ := p.AsDict().Get("type")
			if !typ.IsString() || typ.AsString() != "text" {
				return fmt.Errorf("%w: content[%d]: only \"text\" parts are supported", ErrUnsupportedContent, j)
			}
			text, _ := p.AsDict().Get("text")
			if !text.IsString() {
				return fmt.Errorf("%w: content[%d] of type \"text\" has no string text", ErrInvalidMessages, j)
			}
			if j > 0 {
				b.WriteByte('\n')
			}
			b.WriteString(text.AsString())
		}
		d.Set("content", jinja.NewString(b.String()))
	default:
		return fmt.Errorf("%w: content must be a string, an array of parts or null", ErrInvalidMessages)
	}
	if tc, ok := d.Get("tool_calls"); ok && tc.IsList() {
		for _, call := range tc.AsList().Items {
			if !call.IsDict() {
				continue
			}
			f, ok := call.AsDict().Get("function")
			if !ok || !f.IsDict() {
				continue
			}
			if a, ok := f.AsDict().Get("arguments"); ok && a.IsString() {
				if v, err := jsonToValue(json.RawMessage(a.AsString())); err == nil {
					f.AsDict().Set("arguments", v)
				}
			}
		}
	}
	return nil
}

// jsonToValue decodes JSON into a template value, keeping object keys in
// their order and integers as integers. It is a small recursive-descent
// parser: encoding/json's Decoder.Token, which also keeps order, costs
// ~5 us per KB of message text, most of a chat's keying time.
func jsonToValue(raw json.RawMessage) (jinja.Value, error) {
	p := jsonParser{b: raw}
	p.ws()
	v, err := p.value(0)
	if err != nil {
		return jinja.Undefined(), err
	}
	if p.ws(); p.i != len(p.b) {
		return jinja.Undefined(), fmt.Errorf("%w: trailing data", ErrInvalidMessages)
	}
	return v, nil
}

var errJSON = fmt.Errorf("%w: malformed JSON", ErrInvalidMessages)

type jsonParser struct {
	b []byte
	i int
}

func (p *jsonParser) ws() {
	for p.i < len(p.b) && (p.b[p.i] == ' ' || p.b[p.i] == '\t' || p.b[p.i] == '\n' || p.b[p.i] == '\r') {
		p.i++
	}
}

func (p *jsonParser) value(depth int) (jinja.Value, error) {
	if depth > 10000 || p.i >= len(p.b) {
		return jinja.Undefined(), errJSON
	}
	switch c := p.b[p.i]; {
	case c == '{':
		p.i++
		d := jinja.NewDict()
		p.ws()
		if p.i < len(p.b) && p.b[p.i] == '}' {
			p.i++
			return d, nil
		}
		for {
			p.ws()
			k, err := p.str()
			if err != nil {
				return d, err
			}
			if p.ws(); p.i >= len(p.b) || p.b[p.i] != ':' {
				return d, errJSON
			}
			p.i++
			p.ws()
			v, err := p.value(depth + 1)
			if err != nil {
				return d, err
			}
			d.AsDict().Set(k, v)
			if p.ws(); p.i >= len(p.b) {
				return d, errJSON
			}
			if p.b[p.i] == '}' {
				p.i++
				return d, nil
			}
			if p.b[p.i] != ',' {
				return d, errJSON
			}
			p.i++
		}
	case c == '[':
		p.i++
		var items []jinja.Value
		p.ws()
		if p.i < len(p.b) && p.b[p.i] == ']' {
			p.i++
			return jinja.NewList(items), nil
		}
		for {
			p.ws()
			v, err := p.value(depth + 1)
			if err != nil {
				return v, err
			}
			items = append(items, v)
			if p.ws(); p.i >= len(p.b) {
				return v, errJSON
			}
			if p.b[p.i] == ']' {
				p.i++
				return jinja.NewList(items), nil
			}
			if p.b[p.i] != ',' {
				return v, errJSON
			}
			p.i++
		}
	case c == '"':
		s, err := p.str()
		return jinja.NewString(s), err
	case c == 't' && bytes.HasPrefix(p.b[p.i:], []byte("true")):
		p.i += 4
		return jinja.NewBool(true), nil
	case c == 'f' && bytes.HasPrefix(p.b[p.i:], []byte("false")):
		p.i += 5
		return jinja.NewBool(false), nil
	case c == 'n' && bytes.HasPrefix(p.b[p.i:], []byte("null")):
		p.i += 4
		return jinja.None(), nil
	case c == '-' || (c >= '0' && c <= '9'):
		j := p.i
		for j < len(p.b) && strings.IndexByte("+-0123456789.eE", p.b[j]) >= 0 {
			j++
		}
		num := json.Number(p.b[p.i:j])
		if !json.Valid(p.b[p.i:j]) {
			return jinja.Undefined(), errJSON
		}
		p.i = j
		return jinja.FromGoValue(num), nil
	}
	return jinja.Undefined(), errJSON
}

// str reads a JSON string at p.i; without escapes it is one copy.
func (p *jsonParser) str() (string, error) {
	if p.i >= len(p.b) || p.b[p.i] != '"' {
		return "", errJSON
	}
	j := p.i + 1
	escaped := false
	for ; j < len(p.b); j++ {
		c := p.b[j]
		if c == '\\' {
			escaped = true
			j++
			continue
		}
		if c == '"' {
			break
		}
		if c < 0x20 {
			return "", errJSON
		}
	}
	if j >= len(p.b) {
		return "", errJSON
	}
	raw := p.b[p.i : j+1]
	p.i = j + 1
	if !escaped && utf8.Valid(raw) {
		return string(raw[1 : len(raw)-1]), nil
	}
	return unescapeJSON(raw[1 : len(raw)-1])
}

// unescapeJSON decodes the inside of a JSON string; invalid UTF-8 becomes
// U+FFFD, as encoding/json does.
func unescapeJSON(in []byte) (string, error) {
	out := make([]byte, 0, len(in))
	for i := 0; i < len(in); {
		c := in[i]
		if c != '\\' {
			if c < utf8.RuneSelf {
				out = append(out, c)
				i++
				continue
			}
			r, n := utf8.DecodeRune(in[i:])
			out = utf8.AppendRune(out, r) // RuneError for invalid bytes
			i += n
			continue
		}
		if i+1 >= len(in) {
			return "", errJSON
		}
		switch e := in[i+1]; e {
		case '"', '\\', '/':
			out = append(out, e)
		case 'b':
			out = append(out, '\b')
		case 'f':
			out = append(out, '\f')
		case 'n':
			out = append(out, '\n')
		case 'r':
			out = append(out, '\r')
		case 't':
			out = append(out, '\t')
		case 'u':
			r, ok := hex4(in, i+2)
			if !ok {
				return "", errJSON
			}
			i += 6
			if utf16.IsSurrogate(r) {
				if r2, ok := hex4(in, i+2); ok && i+1 < len(in) && in[i] == '\\' && in[i+1] == 'u' {
					if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
						out = utf8.AppendRune(out, dec)
						i += 6
						continue
					}
				}
				r = utf8.RuneError
			}
			out = utf8.AppendRune(out, r)
			continue
		default:
			return "", errJSON
		}
		i += 2
	}
	return string(out), nil
}

// hex4 reads four hex digits at in[i:].
func hex4(in []byte, i int) (rune, bool) {
	if i+4 > len(in) {
		return 0, false
	}
	var r rune
	for _, c := range in[i : i+4] {
		switch {
		case c >= '0' && c <= '9':
			c -= '0'
		case c >= 'a' && c <= 'f':
			c = c - 'a' + 10
		case c >= 'A' && c <= 'F':
			c = c - 'A' + 10
		default:
			return 0, false
		}
		r = r<<4 | rune(c)
	}
	return r, true
}
