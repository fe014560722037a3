package tokenizer

import (
	"encoding/json"
	"strings"
	"testing"
)

// Benchmarks of the Qwen3 tokenizer (issue 15's targets: the seed prompt
// keyed in <= 300 µs uncached and <= 30 µs through the prefix cache, 0
// allocs warm; a 1 MiB run of one character <= 50 ms):
//
//	go test -run '^$' -bench HF -benchtime 2s ./node/tokenizer

// BenchmarkHFSeedUncached encodes the seed prompt with no prefix cache
// (the tokenizer's own piece cache is warm after the first iteration).
func BenchmarkHFSeedUncached(b *testing.B) {
	h := loadHFT(b, "qwen3")
	p := benchPrompts(1)[0]
	b.SetBytes(int64(len(p)))
	b.ReportAllocs()
	dst := make([]uint32, 0, 8192)
	for b.Loop() {
		dst = h.Encode(dst[:0], p)
	}
	b.ReportMetric(float64(len(dst)), "tokens")
}

// BenchmarkHFSeedColdPieces is BenchmarkHFSeedUncached with the piece
// cache emptied before every encode: every piece goes through BPE.
func BenchmarkHFSeedColdPieces(b *testing.B) {
	h := loadHFT(b, "qwen3")
	p := benchPrompts(1)[0]
	b.SetBytes(int64(len(p)))
	b.ReportAllocs()
	dst := make([]uint32, 0, 8192)
	for b.Loop() {
		b.StopTimer()
		for i := range h.pieces.slots {
			h.pieces.slots[i].Store(nil)
		}
		b.StartTimer()
		dst = h.Encode(dst[:0], p)
	}
}

// BenchmarkHFSeedCached is the prefix-cached tokenizer on seed prompts
// that share the salt and document, with a new question each time.
func BenchmarkHFSeedCached(b *testing.B) {
	h := loadHFT(b, "qwen3")
	c := newCachedHF(b, h, 0)
	ps := benchPrompts(1024)
	c.Encode(nil, ps[0])
	b.SetBytes(int64(len(ps[0])))
	b.ReportAllocs()
	dst := make([]uint32, 0, 8192)
	i := 0
	for b.Loop() {
		i++
		dst = c.Encode(dst[:0], ps[i%len(ps)])
	}
	st := c.Stats()
	b.ReportMetric(float64(st.HitBytes)/float64(st.HitBytes+st.EncodedBytes), "hit-frac")
}

// BenchmarkHFOneChar1MiB encodes 1 MiB of one repeated character.
func BenchmarkHFOneChar1MiB(b *testing.B) {
	for _, ch := range []string{"a", " ", "\n", "é", "!", "7"} {
		b.Run(strings.Trim(strings.ReplaceAll(strings.ReplaceAll(ch, " ", "space"), "\n", "newline"), ""), func(b *testing.B) {
			h := loadHFT(b, "qwen3")
			p := strings.Repeat(ch, (1<<20)/len(ch))
			b.SetBytes(int64(len(p)))
			b.ReportAllocs()
			var dst []uint32
			for b.Loop() {
				dst = h.Encode(dst[:0], p)
			}
			b.ReportMetric(float64(len(dst)), "tokens")
		})
	}
}

// BenchmarkHFChatSeed renders a chat holding the seed prompt (system
// document + question) with Qwen3's template and keys it through the
// prefix cache, as the gateway does for a chat request.
func BenchmarkHFChatSeed(b *testing.B) {
	h := loadHFT(b, "qwen3")
	c := newCachedHF(b, h, 0)
	p := benchPrompts(1)[0]
	doc, q, _ := strings.Cut(p, "Question ")
	msgs, err := json.Marshal([]map[string]string{{"role": "system", "content": doc}, {"role": "user", "content": "Question " + q}})
	if err != nil {
		b.Fatal(err)
	}
	req := ChatRequest{Messages: msgs, AddGenerationPrompt: true}
	b.SetBytes(int64(len(msgs)))
	b.ReportAllocs()
	dst := make([]uint32, 0, 8192)
	for b.Loop() {
		text, err := h.RenderChat(req)
		if err != nil {
			b.Fatal(err)
		}
		dst = c.Encode(dst[:0], text)
	}
}
