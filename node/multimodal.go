package node

import (
	"bytes"
	"encoding/json"
)

// Multimodal chat. vLLM puts a media item into its prompt as placeholder
// tokens whose number depends on the model's processor (an image's size
// after resizing, an audio clip's length), and mixes a hash of the
// processed item into the extra_keys of every block the placeholders
// cover (vllm/v1/core/kv_cache_utils.py, generate_block_hash_extra_keys
// with the request's mm_features: identifier = the multimodal hash of the
// processed data). Neither the placeholder count nor that hash can be
// derived from the request without running the model's processor, so the
// gateway keys a chat only up to its first media part: every block before
// it is keyed exactly, no block from it on is keyed at all. Requests with
// a shared system prompt and history before the media still stick to the
// replica that caches them.

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
