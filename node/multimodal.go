package node

import (
	"bytes"
	"encoding/json"
)

// Multimodal chat. vLLM puts a media item into its prompt as placeholder
// tokens whose number depends on the model's processor (an image's size
// after resizing, an audio clip's length), and every block the
// placeholders overlap gets an extra key (the item's identifier, a hash of
// the model id and the item's data, and its offset in the block: vLLM's
// _gen_mm_extra_hash_keys in vllm/v1/core/kv_cache_utils.py). The gateway
// could hash the item, but it cannot know how many placeholder tokens the
// processor makes of it, so neither the media blocks nor any block after
// them can be keyed from the request. The gateway therefore keys a chat up
// to its first media part: every block before it exactly, none from it on.
// Requests sharing a system prompt and history before the media still go
// to the replica that caches them.

// mediaCut returns the messages of raw up to the first content part that
// is not text: the messages before it whole (their raw JSON), and that
// message's text parts before the media part (if any). ok is false when raw
// is not an array of message objects.
func mediaCut(raw json.RawMessage) (json.RawMessage, bool) {
	var msgs []json.RawMessage
	if json.Unmarshal(raw, &msgs) != nil {
		return nil, false
	}
	var out []json.RawMessage
	for _, m := range msgs {
		var head struct {
			Role    json.RawMessage `json:"role"`
			Content json.RawMessage `json:"content"`
		}
		if json.Unmarshal(m, &head) != nil {
			return nil, false
		}
		c := bytes.TrimSpace(head.Content)
		if len(c) == 0 || c[0] != '[' {
			out = append(out, m)
			continue
		}
		var parts []json.RawMessage
		if json.Unmarshal(c, &parts) != nil {
			return nil, false
		}
		for j, p := range parts {
			var pt struct {
				Type string `json:"type"`
			}
			if json.Unmarshal(p, &pt) != nil {
				return nil, false
			}
			if pt.Type == "text" {
				continue
			}
			if j > 0 {
				cut, err := json.Marshal(map[string]json.RawMessage{"role": head.Role, "content": joinArray(parts[:j])})
				if err != nil {
					return nil, false
				}
				out = append(out, cut)
			}
			return joinArray(out), true
		}
		out = append(out, m)
	}
	return joinArray(out), true
}

// joinArray renders elems as a JSON array (nil for none).
func joinArray(elems []json.RawMessage) json.RawMessage {
	if len(elems) == 0 {
		return nil
	}
	out := []byte{'['}
	for i, e := range elems {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, e...)
	}
	return append(out, ']')
}

// maybeMedia is a cheap test (one substring search) for a non-text content
// part: some `"type"` key whose string value is not "text". An unescaped
// `"type"` cannot occur inside a JSON string, so text content never
// triggers it; tool calls ("type":"function") do, and mediaScan then finds
// no media.
func maybeMedia(raw []byte) bool {
	for b := raw; ; {
		i := bytes.Index(b, []byte(`"type"`))
		if i < 0 {
			return false
		}
		b = b[i+6:]
		j := skipWS(b, 0)
		if j >= len(b) || b[j] != ':' {
			continue
		}
		j = skipWS(b, j+1)
		if !bytes.HasPrefix(b[j:], []byte(`"text"`)) {
			return true
		}
	}
}

func skipWS(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// mediaScan is mediaCut in one pass of the fast scanner over raw (a valid
// JSON array of messages, as scanBody checked): it returns the cut and
// whether there was a media part at all. ok is false for shapes it does
// not read (a key with escapes, a message that is not an object): the
// caller then takes the general path.
func mediaScan(raw []byte) (cut json.RawMessage, media, ok bool) {
	s := jscan{b: raw}
	s.ws()
	if s.i >= len(s.b) || s.b[s.i] != '[' {
		return nil, false, false
	}
	s.i++
	var out []json.RawMessage
	for {
		s.ws()
		if s.i < len(s.b) && s.b[s.i] == ']' {
			return joinArray(out), false, true
		}
		start := s.i
		role, partsEnd, cutAt, found, good := scanMessage(&s)
		if !good {
			return nil, false, false
		}
		if found {
			if partsEnd > 0 { // text parts before the media part
				m := append([]byte(`{"role":`), role...)
				m = append(m, `,"content":`...)
				m = append(m, raw[cutAt:partsEnd]...)
				m = append(m, ']', '}')
				out = append(out, m)
			}
			return joinArray(out), true, true
		}
		out = append(out, raw[start:s.i])
		s.ws()
		if s.i >= len(s.b) {
			return nil, false, false
		}
		if s.b[s.i] == ',' {
			s.i++
		}
	}
}

// scanMessage reads one message object. When its content holds a non-text
// part, found is set and raw[contentStart:partsEnd] is the content array up
// to (without) that part (partsEnd 0: no part before it).
func scanMessage(s *jscan) (role []byte, partsEnd, contentStart int, found, ok bool) {
	if s.i >= len(s.b) || s.b[s.i] != '{' {
		return nil, 0, 0, false, false
	}
	s.i++
	for {
		s.ws()
		if s.i < len(s.b) && s.b[s.i] == '}' {
			s.i++
			return role, 0, 0, false, true
		}
		ks := s.i
		esc, err := s.str()
		if err != nil || esc {
			return nil, 0, 0, false, false
		}
		key := string(s.b[ks+1 : s.i-1])
		s.ws()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return nil, 0, 0, false, false
		}
		s.i++
		s.ws()
		vs := s.i
		switch {
		case key == "content" && s.i < len(s.b) && s.b[s.i] == '[':
			end, hit, good := scanParts(s)
			if !good {
				return nil, 0, 0, false, false
			}
			if hit {
				if role == nil {
					// The role follows the content: skip the rest of it.
					s.i = vs
					if s.value(1) != nil {
						return nil, 0, 0, false, false
					}
					role = findRole(s)
				}
				return role, end, vs, true, role != nil
			}
		default:
			if s.value(1) != nil {
				return nil, 0, 0, false, false
			}
			if key == "role" {
				role = s.b[vs:s.i]
			}
		}
		s.ws()
		if s.i < len(s.b) && s.b[s.i] == ',' {
			s.i++
		}
	}
}

// findRole reads on through the rest of a message object (the role may
// follow the content) and returns its role value.
func findRole(s *jscan) []byte {
	for {
		s.ws()
		if s.i >= len(s.b) || s.b[s.i] == '}' {
			return nil
		}
		if s.b[s.i] == ',' {
			s.i++
			continue
		}
		ks := s.i
		if _, err := s.str(); err != nil {
			return nil
		}
		key := string(s.b[ks+1 : s.i-1])
		s.ws()
		if s.i >= len(s.b) || s.b[s.i] != ':' {
			return nil
		}
		s.i++
		s.ws()
		vs := s.i
		if s.value(1) != nil {
			return nil
		}
		if key == "role" {
			return s.b[vs:s.i]
		}
	}
}

// scanParts reads a content array; at the first part whose "type" is not
// "text" it stops (hit) and returns the end of the previous part (0 when
// it is the first).
func scanParts(s *jscan) (prevEnd int, hit, ok bool) {
	s.i++ // '['
	for {
		s.ws()
		if s.i >= len(s.b) {
			return 0, false, false
		}
		switch s.b[s.i] {
		case ']':
			s.i++
			return prevEnd, false, true
		case ',':
			s.i++
			continue
		}
		ps := s.i
		if s.value(2) != nil {
			return 0, false, false
		}
		var pt struct {
			Type string `json:"type"`
		}
		part := s.b[ps:s.i]
		if typ, found := partType(part); found {
			pt.Type = typ
		} else if json.Unmarshal(part, &pt) != nil {
			return 0, false, false
		}
		if pt.Type != "text" {
			return prevEnd, true, true
		}
		prevEnd = s.i
	}
}

// partType reads a part object's "type" when it is the first key (as
// clients write it); found is false otherwise.
func partType(part []byte) (string, bool) {
	i := skipWS(part, 1)
	if !bytes.HasPrefix(part[i:], []byte(`"type"`)) {
		return "", false
	}
	i = skipWS(part, i+6)
	if i >= len(part) || part[i] != ':' {
		return "", false
	}
	i = skipWS(part, i+1)
	if i >= len(part) || part[i] != '"' {
		return "", false
	}
	end := bytes.IndexByte(part[i+1:], '"')
	if end < 0 || bytes.IndexByte(part[i+1:i+1+end], '\\') >= 0 {
		return "", false
	}
	return string(part[i+1 : i+1+end]), true
}
