package tokenizer

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRenderChat(t *testing.T) {
	msgs := []Message{{Role: "system", Content: "Be brief."}, {Role: "user", Content: "Hi\nthere"}}
	want := "<|im_start|>system\nBe brief.<|im_end|>\n" +
		"<|im_start|>user\nHi\nthere<|im_end|>\n" +
		"<|im_start|>assistant\n"
	require.Equal(t, want, RenderChat(msgs))
	require.Equal(t, "<|im_start|>assistant\n", RenderChat(nil))

	// A conversation extended by one turn renders to an extension of the
	// shorter conversation's rendering up to its generation prompt.
	longer := append(append([]Message(nil), msgs...), Message{Role: "assistant", Content: "Hello."})
	short := RenderChat(msgs)
	require.True(t, strings.HasPrefix(RenderChat(longer), short[:len(short)-len("<|im_start|>assistant\n")]))
}

func TestParseMessages(t *testing.T) {
	good := []struct {
		in   string
		want []Message
	}{
		{`[]`, []Message{}},
		{`[{"role":"user","content":"hi"}]`, []Message{{"user", "hi"}}},
		{` [ {"role":"assistant","content":null,"tool_calls":[]} ] `, []Message{{"assistant", ""}}},
		{`[{"role":"assistant"}]`, []Message{{"assistant", ""}}},
		{`[{"role":"user","name":"bob","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]`,
			[]Message{{"user", "a\nb"}}},
		{`[{"role":"user","content":[]}]`, []Message{{"user", ""}}},
		{`[{"role":"system","content":"s"},{"role":"user","content":"u\u00e9"}]`,
			[]Message{{"system", "s"}, {"user", "ué"}}},
	}
	for _, c := range good {
		got, err := ParseMessages(json.RawMessage(c.in))
		require.NoError(t, err, c.in)
		require.Equal(t, c.want, got, c.in)
	}

	bad := []struct {
		in   string
		want error
	}{
		{``, ErrInvalidMessages},
		{`null`, ErrInvalidMessages},
		{`"hi"`, ErrInvalidMessages},
		{`{"role":"user"}`, ErrInvalidMessages},
		{`[`, ErrInvalidMessages},
		{`["hi"]`, ErrInvalidMessages},
		{`[{"content":"x"}]`, ErrInvalidMessages},
		{`[{"role":"","content":"x"}]`, ErrInvalidMessages},
		{`[{"role":7,"content":"x"}]`, ErrInvalidMessages},
		{`[{"role":"user","content":7}]`, ErrInvalidMessages},
		{`[{"role":"user","content":{"type":"text"}}]`, ErrInvalidMessages},
		{`[{"role":"user","content":["x"]}]`, ErrInvalidMessages},
		{`[{"role":"user","content":[{"text":"x"}]}]`, ErrInvalidMessages},
		{`[{"role":"user","content":[{"type":"text"}]}]`, ErrInvalidMessages},
		{`[{"role":"user","content":[{"type":"text","text":5}]}]`, ErrInvalidMessages},
		{`[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:x"}}]}]`, ErrUnsupportedContent},
		{`[{"role":"user","content":[{"type":"text","text":"a"},{"type":"input_audio"}]}]`, ErrUnsupportedContent},
	}
	for _, c := range bad {
		_, err := ParseMessages(json.RawMessage(c.in))
		require.ErrorIs(t, err, c.want, c.in)
	}

	// Errors never echo prompt text.
	_, err := ParseMessages(json.RawMessage(`[{"role":"user","content":"SECRET"},{"role":"user","content":[{"type":"image_url"}]}]`))
	require.ErrorIs(t, err, ErrUnsupportedContent)
	require.NotContains(t, err.Error(), "SECRET")
	require.Contains(t, err.Error(), "messages[1]")
}
