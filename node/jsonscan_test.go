package node

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var scanSeeds = []string{
	`{"model":"m","prompt":"hi"}`,
	` {"model" : "m", "prompt" : "a\nb\u00e9\ud83d\ude00\"\\\/\b\f\r\t", "stream": true} `,
	`{"model":"m","prompt":[1,2,3],"max_tokens":5,"cache_salt":"s","user":"u"}`,
	`{"model":"m","prompt":[[1,2],[3]],"max_completion_tokens":7}`,
	`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}`,
	`{"mod\u0065l":"m","model":"last"}`,
	`{"prompt":"\ud800x","model":"\udc00\ud800\udc00"}`,
	"{\"prompt\":\"bad utf8 \xff\xfe here\"}",
	`{"a":{"b":[1,-2.5e+3,true,false,null,{}]},"prompt":"x"}`,
	`{"a":01}`, `{"a":1.}`, `{"a":.5}`, `{"a":-}`, `{"a":1e}`, `{"a":"\x"}`, `{"a":"\u12"}`,
	`{"a":tru}`, `{"a":nul}`, `{"a" 1}`, `{"a":1,}`, `{,}`, `{"a":[1,]}`, `[1,2]`, `"str"`, `12`,
	`{"a":1}}`, `{"a":"` + "\x01" + `"}`, ``, `{`, `}`, `{"a":[`, `{"a":{"b":1`, `nul`, ` `, `null`, `{"prompt":null,"model":null}`,
}

func TestScanBodyAgreesWithEncodingJSON(t *testing.T) {
	for _, s := range scanSeeds {
		checkScanBody(t, []byte(s))
	}
}

func FuzzScanBody(f *testing.F) {
	for _, s := range scanSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) { checkScanBody(t, b) })
}

// checkScanBody is the differential check: scanBody accepts exactly what
// json.Valid accepts, returns the same raw field values as decoding into a
// map, and unquotes strings exactly as encoding/json does.
func checkScanBody(t *testing.T, b []byte) {
	f, isObject, err := scanBody(b)
	valid := json.Valid(b)
	require.Equal(t, valid, err == nil, "validity of %q: %v", b, err)
	if !valid {
		return
	}
	var m map[string]json.RawMessage
	objErr := json.Unmarshal(b, &m)
	require.Equal(t, objErr == nil && m != nil, isObject, "object-ness of %q", b)
	if !isObject {
		return
	}
	for name, got := range map[string]jsonField{
		"model": f.model, "prompt": f.prompt, "messages": f.messages, "stream": f.stream,
		"max_tokens": f.maxTokens, "max_completion_tokens": f.maxCompletionTokens,
		"cache_salt": f.cacheSalt, "user": f.user,
	} {
		want, ok := m[name]
		if !ok {
			require.Nil(t, got, "field %s of %q", name, b)
			continue
		}
		require.Equal(t, string(want), string(got), "field %s of %q", name, b)
		if len(got) > 0 && got[0] == '"' {
			var s string
			require.NoError(t, json.Unmarshal(got, &s))
			require.Equal(t, s, unquote(got), "unquote of %q", got)
		}
		if len(got) > 0 && got[0] == '[' {
			var elems []json.RawMessage
			require.NoError(t, json.Unmarshal(got, &elems))
			gotElems := arrayElems(got)
			require.Len(t, gotElems, len(elems))
			for i := range elems {
				require.Equal(t, string(elems[i]), string(gotElems[i]))
			}
			var want []uint32
			toks, ok := tokenIDs(nil, got)
			if json.Unmarshal(got, &want) == nil {
				require.True(t, ok, "tokenIDs of %q", got)
				require.Equal(t, len(want), len(toks))
				for i := range want {
					require.Equal(t, want[i], toks[i])
				}
			} else {
				require.False(t, ok, "tokenIDs of %q", got)
			}
		}
	}
}

func TestScanBodyDepthLimit(t *testing.T) {
	deep := bytes.Repeat([]byte("["), maxJSONDepth+10)
	_, _, err := scanBody(append([]byte(`{"a":`), deep...))
	assert.Error(t, err)
}

func BenchmarkParseInference(b *testing.B) {
	body, err := json.Marshal(map[string]any{"model": "m", "prompt": seedPrompt(1, 1), "stream": true, "max_tokens": 128})
	require.NoError(b, err)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if _, e := parseInference(kindCompletions, body); e != nil {
			b.Fatal(e)
		}
	}
}
