package tokenizer

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestJSONToValueMatchesEncodingJSON checks the chat renderer's JSON parser
// against encoding/json: the same strings (escapes, surrogates, invalid
// UTF-8) and the same verdict on malformed input.
func TestJSONToValueMatchesEncodingJSON(t *testing.T) {
	texts := hfCorpusTexts(31, 300)
	texts = append(texts, "\xff\xfe", "a\\b", "tab\tnl\ncr\r\"q\"/", "\u2028\u0000")
	for _, s := range texts {
		raw, err := json.Marshal(map[string]any{"k": s})
		if err != nil {
			t.Fatal(err)
		}
		checkJSONString(t, raw)
		// The same text with every rune \u-escaped.
		var b strings.Builder
		b.WriteString(`{"k":"`)
		for _, c := range strings.ToValidUTF8(s, "\ufffd") {
			if c > 0xffff {
				hi, lo := (c-0x10000)>>10+0xd800, (c-0x10000)&0x3ff+0xdc00
				b.WriteString(`\u` + hex(hi) + `\u` + hex(lo))
			} else {
				b.WriteString(`\u` + hex(c))
			}
		}
		b.WriteString(`"}`)
		checkJSONString(t, []byte(b.String()))
	}
	// A lone surrogate escape decodes to U+FFFD, as in encoding/json.
	checkJSONString(t, []byte(`{"k":"a\ud83db\udc00c"}`))
	for _, bad := range []string{`{"k":"\x"}`, `{"k":"a`, `{"k" "a"}`, `{"k":tru}`, `[1,]`, `{"k":"\u12"}`, `{"k":1}x`, "{\"k\":\"a\x01\"}", `{"k":--1}`} {
		if _, err := jsonToValue(json.RawMessage(bad)); err == nil {
			t.Errorf("jsonToValue(%q) accepted malformed JSON", bad)
		}
	}
}

func hex(r rune) string {
	const digits = "0123456789abcdef"
	return string([]byte{digits[r>>12&15], digits[r>>8&15], digits[r>>4&15], digits[r&15]})
}

func checkJSONString(t *testing.T, raw []byte) {
	t.Helper()
	var want map[string]string
	if err := json.Unmarshal(raw, &want); err != nil {
		t.Fatalf("encoding/json rejects %q: %v", raw, err)
	}
	v, err := jsonToValue(raw)
	if err != nil {
		t.Fatalf("jsonToValue(%q): %v", raw, err)
	}
	got, _ := v.AsDict().Get("k")
	if got.AsString() != want["k"] {
		t.Fatalf("jsonToValue(%q) = %q, encoding/json %q", raw, got.AsString(), want["k"])
	}
}
