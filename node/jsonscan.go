package node

import (
	"bytes"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// A one-pass reader for request bodies. The gateway needs half a dozen
// top-level fields of bodies that are mostly one long prompt string;
// encoding/json validates the whole body, then decodes it, then decodes the
// prompt again (three passes over ~30 KB). This scanner validates the body
// and extracts the fields in one pass, and unquotes the prompt with a
// tight loop. It accepts exactly what json.Valid accepts (FuzzScanBody
// checks that against encoding/json), keys match case-sensitively as vLLM's
// pydantic models do, and a repeated key keeps its last value.

var (
	errJSONSyntax = errors.New("node: invalid JSON")
	errJSONDepth  = errors.New("node: JSON nested too deeply")
)

// maxJSONDepth matches encoding/json's nesting limit.
const maxJSONDepth = 10000

// jsonField is a top-level value: its raw bytes (nil when absent).
type jsonField []byte

// bodyFields are the top-level fields the gateway reads.
type bodyFields struct {
	model, prompt, messages, stream, maxTokens, maxCompletionTokens, cacheSalt, user jsonField
	// Chat-template and tokenization options (vLLM's), read for the hf:
	// tokenizer.
	tools, addGenerationPrompt, continueFinalMessage, addSpecialTokens, chatTemplateKwargs jsonField
}

// scanBody validates body as one JSON value with optional surrounding
// whitespace and, when it is an object, returns the raw values of the
// fields the gateway reads. ok is false when body is valid JSON but not an
// object.
func scanBody(body []byte) (f bodyFields, isObject bool, err error) {
	s := jscan{b: body}
	s.ws()
	if s.i < len(s.b) && s.b[s.i] == '{' {
		isObject = true
		if err = s.object(&f); err != nil {
			return f, true, err
		}
	} else if err = s.value(0); err != nil {
		return f, false, err
	}
	s.ws()
	if s.i != len(s.b) {
		return f, isObject, errJSONSyntax
	}
	return f, isObject, nil
}

type jscan struct {
	b []byte
	i int
}

func (s *jscan) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// object reads the top-level object, recording the fields of interest.
func (s *jscan) object(f *bodyFields) error {
	s.i++ // '{'
	s.ws()
	if s.i < len(s.b) && s.b[s.i] == '}' {
		s.i++
		return nil
	}
	for {
		s.ws()
		if s.i >= len(s.b) || s.b[s.i] != '"' {
			return errJSONSyntax
		}
		ks := s.i
		esc, err := s.str()
		if err != nil {
			return err
		}
		key := s.b[ks+1 : s.i-1]
		if esc {
			// Keys with escapes are rare; decode them properly.
			var k string
			if json.Unmarshal(s.b[ks:s.i], &k) != nil {
				return errJSONSyntax
			}
			key = []byte(k)
		}
		s.ws()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return errJSONSyntax
		}
		s.i++
		s.ws()
		vs := s.i
		if err := s.value(1); err != nil {
			return err
		}
		v := jsonField(s.b[vs:s.i])
		switch string(key) {
		case "model":
			f.model = v
		case "prompt":
			f.prompt = v
		case "messages":
			f.messages = v
		case "stream":
			f.stream = v
		case "max_tokens":
			f.maxTokens = v
		case "max_completion_tokens":
			f.maxCompletionTokens = v
		case "cache_salt":
			f.cacheSalt = v
		case "user":
			f.user = v
		case "tools":
			f.tools = v
		case "add_generation_prompt":
			f.addGenerationPrompt = v
		case "continue_final_message":
			f.continueFinalMessage = v
		case "add_special_tokens":
			f.addSpecialTokens = v
		case "chat_template_kwargs":
			f.chatTemplateKwargs = v
		}
		s.ws()
		if s.i >= len(s.b) {
			return errJSONSyntax
		}
		switch s.b[s.i] {
		case ',':
			s.i++
		case '}':
			s.i++
			return nil
		default:
			return errJSONSyntax
		}
	}
}

// value validates one value starting at s.i (after whitespace).
func (s *jscan) value(depth int) error {
	if depth > maxJSONDepth {
		return errJSONDepth
	}
	if s.i >= len(s.b) {
		return errJSONSyntax
	}
	switch c := s.b[s.i]; {
	case c == '"':
		_, err := s.str()
		return err
	case c == '{':
		s.i++
		s.ws()
		if s.i < len(s.b) && s.b[s.i] == '}' {
			s.i++
			return nil
		}
		for {
			s.ws()
			if s.i >= len(s.b) || s.b[s.i] != '"' {
				return errJSONSyntax
			}
			if _, err := s.str(); err != nil {
				return err
			}
			s.ws()
			if s.i >= len(s.b) || s.b[s.i] != ':' {
				return errJSONSyntax
			}
			s.i++
			s.ws()
			if err := s.value(depth + 1); err != nil {
				return err
			}
			s.ws()
			if s.i >= len(s.b) {
				return errJSONSyntax
			}
			if s.b[s.i] == '}' {
				s.i++
				return nil
			}
			if s.b[s.i] != ',' {
				return errJSONSyntax
			}
			s.i++
		}
	case c == '[':
		s.i++
		s.ws()
		if s.i < len(s.b) && s.b[s.i] == ']' {
			s.i++
			return nil
		}
		for {
			s.ws()
			if err := s.value(depth + 1); err != nil {
				return err
			}
			s.ws()
			if s.i >= len(s.b) {
				return errJSONSyntax
			}
			if s.b[s.i] == ']' {
				s.i++
				return nil
			}
			if s.b[s.i] != ',' {
				return errJSONSyntax
			}
			s.i++
		}
	case c == '-' || (c >= '0' && c <= '9'):
		return s.number()
	case c == 't':
		return s.lit("true")
	case c == 'f':
		return s.lit("false")
	case c == 'n':
		return s.lit("null")
	}
	return errJSONSyntax
}

func (s *jscan) lit(w string) error {
	if len(s.b)-s.i < len(w) || string(s.b[s.i:s.i+len(w)]) != w {
		return errJSONSyntax
	}
	s.i += len(w)
	return nil
}

// number validates -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
func (s *jscan) number() error {
	b := s.b
	i := s.i
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	default:
		return errJSONSyntax
	}
	if i < len(b) && b[i] == '.' {
		i++
		if i >= len(b) || b[i] < '0' || b[i] > '9' {
			return errJSONSyntax
		}
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= len(b) || b[i] < '0' || b[i] > '9' {
			return errJSONSyntax
		}
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
		}
	}
	s.i = i
	return nil
}

// str validates a string starting at the opening quote and leaves s.i after
// the closing quote; esc reports whether it contains escapes.
func (s *jscan) str() (esc bool, err error) {
	b := s.b
	i := s.i + 1
	for i < len(b) {
		c := b[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			i++
			continue
		}
		switch {
		case c == '"':
			s.i = i + 1
			return esc, nil
		case c == '\\':
			esc = true
			if i+1 >= len(b) {
				return esc, errJSONSyntax
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+6 > len(b) || !isHex4(b[i+2:i+6]) {
					return esc, errJSONSyntax
				}
				i += 6
			default:
				return esc, errJSONSyntax
			}
		case c < 0x20:
			return esc, errJSONSyntax
		default:
			i++
		}
	}
	return esc, errJSONSyntax
}

func isHex4(h []byte) bool {
	for _, c := range h {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F') {
			return false
		}
	}
	return true
}

func hexVal(h []byte) rune {
	var r rune
	for _, c := range h {
		r <<= 4
		switch {
		case c >= '0' && c <= '9':
			r |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			r |= rune(c-'a') + 10
		default:
			r |= rune(c-'A') + 10
		}
	}
	return r
}

// unquote decodes a validated JSON string literal (with its quotes) exactly
// as encoding/json does, including U+FFFD for invalid UTF-8 and unpaired
// surrogates.
func unquote(lit []byte) string {
	body := lit[1 : len(lit)-1]
	if bytes.IndexByte(body, '\\') < 0 && utf8.Valid(body) {
		return string(body)
	}
	// A strings.Builder hands its buffer over as the string: one copy of a
	// long prompt, not two.
	var out strings.Builder
	out.Grow(len(body))
	for i := 0; i < len(body); {
		// Copy the run up to the next escape in one go.
		run := body[i:]
		if k := bytes.IndexByte(run, '\\'); k >= 0 {
			run = run[:k]
		}
		if len(run) > 0 {
			writeValidUTF8(&out, run)
			i += len(run)
			continue
		}
		switch body[i+1] {
		case '"', '\\', '/':
			out.WriteByte(body[i+1])
		case 'b':
			out.WriteByte('\b')
		case 'f':
			out.WriteByte('\f')
		case 'n':
			out.WriteByte('\n')
		case 'r':
			out.WriteByte('\r')
		case 't':
			out.WriteByte('\t')
		case 'u':
			r := hexVal(body[i+2 : i+6])
			i += 6
			if utf16.IsSurrogate(r) {
				if i+6 <= len(body) && body[i] == '\\' && body[i+1] == 'u' {
					if dec := utf16.DecodeRune(r, hexVal(body[i+2:i+6])); dec != utf8.RuneError {
						out.WriteRune(dec)
						i += 6
						continue
					}
				}
				r = utf8.RuneError
			}
			out.WriteRune(r)
			continue
		}
		i += 2
	}
	return out.String()
}

// writeValidUTF8 writes run, replacing each invalid UTF-8 byte with
// U+FFFD as encoding/json does.
func writeValidUTF8(out *strings.Builder, run []byte) {
	if utf8.Valid(run) {
		out.Write(run)
		return
	}
	for len(run) > 0 {
		r, size := utf8.DecodeRune(run)
		if r == utf8.RuneError && size == 1 {
			out.WriteRune(utf8.RuneError)
		} else {
			out.Write(run[:size])
		}
		run = run[size:]
	}
}

// fieldString decodes a validated field that must be a string or null.
func (f jsonField) string() (string, bool, error) {
	switch {
	case len(f) == 0 || string(f) == "null":
		return "", false, nil
	case f[0] == '"':
		return unquote(f), true, nil
	}
	return "", false, errJSONType
}

var errJSONType = errors.New("node: wrong JSON type")

// fieldBool decodes true, false or null.
func (f jsonField) bool() (bool, error) {
	switch string(f) {
	case "", "null", "false":
		return false, nil
	case "true":
		return true, nil
	}
	return false, errJSONType
}

// fieldInt decodes an integer or null (encoding/json's rules for *int: no
// fraction, no exponent).
func (f jsonField) int() (int, bool, error) {
	if len(f) == 0 || string(f) == "null" {
		return 0, false, nil
	}
	v, err := strconv.ParseInt(string(f), 10, 64)
	if err != nil {
		return 0, false, errJSONType
	}
	return int(v), true, nil
}

// tokenIDs decodes a validated array of non-negative integers that fit in
// uint32, appending to dst; ok is false for any other element.
func tokenIDs(dst []uint32, arr []byte) ([]uint32, bool) {
	i := 1 // after '['
	for {
		for i < len(arr) && (arr[i] == ' ' || arr[i] == '\t' || arr[i] == '\n' || arr[i] == '\r' || arr[i] == ',') {
			i++
		}
		if i >= len(arr) || arr[i] == ']' {
			return dst, true
		}
		var v uint64
		start := i
		for i < len(arr) && arr[i] >= '0' && arr[i] <= '9' {
			v = v*10 + uint64(arr[i]-'0')
			if v > 1<<32-1 {
				return dst, false
			}
			i++
		}
		if i == start {
			return dst, false
		}
		if i < len(arr) && (arr[i] == '.' || arr[i] == 'e' || arr[i] == 'E') {
			return dst, false
		}
		dst = append(dst, uint32(v))
	}
}

// arrayElems splits a validated array into its elements' raw bytes.
func arrayElems(arr []byte) [][]byte {
	var out [][]byte
	s := jscan{b: arr, i: 1}
	for {
		s.ws()
		if s.i >= len(arr) || arr[s.i] == ']' {
			return out
		}
		start := s.i
		if s.value(1) != nil {
			return out // unreachable for validated input
		}
		out = append(out, arr[start:s.i])
		s.ws()
		if s.i < len(arr) && arr[s.i] == ',' {
			s.i++
		}
	}
}
