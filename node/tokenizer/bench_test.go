package tokenizer

import (
	"math/rand/v2"
	"strings"
	"testing"
)

// Benchmarks for issue 4's "prompt → tokens" target, on the seed-shaped
// prompt (28.8 KB, ~4,970 cl100k tokens):
//
//	go test -run '^$' -bench . -benchtime 200ms ./node/tokenizer

func benchPrompts(n int) []string {
	salt := seedSalt(rand.New(rand.NewPCG(77, 78)))
	ps := make([]string, n)
	for i := range ps {
		ps[i] = seedPrompt(salt, 1, i)
	}
	return ps
}

// BenchmarkTiktokenFull is a plain tiktoken-go encode of the whole prompt
// (the reference; not what Tiktoken.Encode does any more).
func BenchmarkTiktokenFull(b *testing.B) {
	tk := mustTiktoken(b)
	p := benchPrompts(1)[0]
	b.SetBytes(int64(len(p)))
	b.ReportAllocs()
	var dst []uint32
	for b.Loop() {
		dst = tk.encodeReference(dst[:0], p)
	}
}

// BenchmarkTiktokenNative is Tiktoken.Encode on the whole prompt: the
// native ASCII encoder, no cache (the cold cost without Cached).
func BenchmarkTiktokenNative(b *testing.B) {
	tk := mustTiktoken(b)
	p := benchPrompts(1)[0]
	b.SetBytes(int64(len(p)))
	b.ReportAllocs()
	var dst []uint32
	for b.Loop() {
		dst = tk.Encode(dst[:0], p)
	}
}

// BenchmarkTiktokenNativeMixed is Tiktoken.Encode on the prompt with a
// non-ASCII word in every line, so every line goes through tiktoken-go's
// regexp2 path for a few bytes.
func BenchmarkTiktokenNativeMixed(b *testing.B) {
	tk := mustTiktoken(b)
	p := strings.ReplaceAll(benchPrompts(1)[0], "healthy", "héalthy")
	b.SetBytes(int64(len(p)))
	b.ReportAllocs()
	var dst []uint32
	for b.Loop() {
		dst = tk.Encode(dst[:0], p)
	}
}

// BenchmarkCachedWarm is the common case: the same salt and document seen
// before, a new question number.
func BenchmarkCachedWarm(b *testing.B) {
	tk := mustTiktoken(b)
	c := newCachedT(b, tk, nil)
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

// BenchmarkCachedCold encodes prompts never seen (a new salt each time)
// through the cache, including the cost of filling it.
func BenchmarkCachedCold(b *testing.B) {
	tk := mustTiktoken(b)
	c := newCachedT(b, tk, nil)
	r := rand.New(rand.NewPCG(1, 2))
	b.ReportAllocs()
	var dst []uint32
	for b.Loop() {
		b.StopTimer()
		p := seedPrompt(seedSalt(r), 1, 1)
		b.StartTimer()
		dst = c.Encode(dst[:0], p)
	}
}

// BenchmarkBytes is the byte tokenizer on the same prompt.
func BenchmarkBytes(b *testing.B) {
	p := benchPrompts(1)[0]
	b.SetBytes(int64(len(p)))
	b.ReportAllocs()
	dst := make([]uint32, 0, len(p))
	for b.Loop() {
		dst = Bytes{}.Encode(dst[:0], p)
	}
}
