package node

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestSSETallyCountsContentEvents(t *testing.T) {
	stream := "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}],\"usage\":null}\n\n" +
		"data: {\"choices\": [ {\"index\":0,\"text\":\"b\"} ]}\r\n\r\n" +
		": keep-alive comment\n\n" +
		"data: {\"choices\":[{\"index\":0,\"text\":\"c\"}]}\n\n" +
		"data: {\"id\":\"x\",\"choices\": [ ],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\": 7}}\n\n" +
		"data: [DONE]\n\n"
	// Every split of the stream into two reads gives the same tally.
	for cut := 0; cut <= len(stream); cut++ {
		var s sseTally
		s.feed([]byte(stream[:cut]), 1, nil)
		s.feed([]byte(stream[cut:]), 2, nil)
		assert.Equal(t, 3, s.content, "cut %d", cut)
		assert.True(t, s.hasUsage, "cut %d", cut)
		assert.Equal(t, 7, s.usageTokens, "cut %d", cut)
	}

	// Without a usage event the count is the content events'; an error
	// event is not content.
	var s sseTally
	s.feed([]byte("data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"error\":{\"message\":\"x\"}}\n\n"), 5, nil)
	assert.Equal(t, 1, s.content)
	assert.False(t, s.hasUsage)
	assert.Equal(t, int64(5), s.firstAt)
}

func BenchmarkSSETally(b *testing.B) {
	chunk := []byte("data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" tok\",\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n")
	b.ReportAllocs()
	b.SetBytes(int64(len(chunk)))
	var s sseTally
	for i := 0; i < b.N; i++ {
		s.feed(chunk, int64(i), nil)
	}
}
