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
