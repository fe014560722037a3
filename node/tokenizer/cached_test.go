package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// atoms are the building blocks of random texts: every character class the
// cl100k pre-tokenizer distinguishes, and the sequences around which its
// alternatives compete (contractions, whitespace runs before newlines,
// punctuation before newlines, digit runs, Unicode letters and spaces,
// invalid UTF-8, special-token text).
var atoms = []string{
	"a", "Z", "q", "The", " the", "service", " latency", "I", "x",
	"'s", "'S", "'t", "'re", "'VE", "'m", "'ll", "'d", "'", "''", "'l", "'r",
	"0", "7", "12", "345", "6789", "1,000", "3.14",
	" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", " \n", "\n ", "\t\n", " \n\n ",
	".", ",", "!", "?", "...", ":", "-", "--", "(", ")", "[", "]", "{", "}", "\"", "`", "#", "<", ">", "|", "_", "/", "\\", "@", "^", "~",
	".\n", ",\n", "!\n\n", "?\r\n", " .", " ?\n",
	"é", "É", "ß", "日本語", "中", "Ωμέγα", "Привет", "ﬁ", "ǅ", "ⅷ", "²", "٣", "๓",
	"\u00a0", "\u2003", "\u3000", "\u0085", "\u2028", "\u200b", "\ufeff",
	"🙂", "👩‍💻", "\u0301", "e\u0301",
	"\xff", "\xc3", "\xe6\x97", "\x80",
	"<|endoftext|>", "<|im_start|>", "<|im_end|>",
	"ª", "µ", "¹", "\u00ad", "\u1680", "\u180e", "'é", "'ſ", "Ǆ", "ｓ", "ſ", "İ", "K", "\u00a0\n", "\u3000x",
	"\v", "\f", "\x00", "\x1c", "\x1f", "\x7f", " \v\n", "\f ",
}

// randomText joins n random atoms.
func randomText(r *rand.Rand, n int) string {
	var b strings.Builder
	for range n {
		b.WriteString(atoms[r.IntN(len(atoms))])
	}
	return b.String()
}

// seedShaped returns a seed-like prompt with random perturbations at line
// boundaries (where rule N splits) and between words (rule W).
func seedShaped(r *rand.Rand) string {
	var b strings.Builder
	if r.IntN(2) == 0 {
		b.WriteString(seedSalt(r))
	}
	fmt.Fprintf(&b, "\nDocument %d\n", r.IntN(1000))
	lines := 5 + r.IntN(40)
	seps := []string{"\n", "\n\n", " \n", "\n ", "\r\n", ".\n", "\n\t", "\n" + atoms[r.IntN(len(atoms))]}
	for range lines {
		words := strings.Fields(seedSentence)
		for i, w := range words {
			if i > 0 {
				if r.IntN(8) == 0 {
					b.WriteString(atoms[r.IntN(len(atoms))])
				} else {
					b.WriteByte(' ')
				}
			}
			b.WriteString(w)
		}
		b.WriteString(seps[r.IntN(len(seps))])
	}
	fmt.Fprintf(&b, "Question %06d: %s", r.IntN(1_000_000), randomText(r, r.IntN(12)))
	return b.String()
}

// refEncoder returns tiktoken-go's own encode (no native fast path).
func refEncoder(t testing.TB) func(dst []uint32, text string) []uint32 {
	return mustTiktoken(t).encodeReference
}

// checkSplits encodes text whole and at every split the rule accepts, and
// returns the positions where the halves do not concatenate to the whole.
func checkSplits(enc func([]uint32, string) []uint32, text string, rule func(string, int) bool) []int {
	whole := enc(nil, text)
	var bad []int
	for p := 1; p < len(text); p++ {
		if !rule(text, p) {
			continue
		}
		got := enc(enc(nil, text[:p]), text[p:])
		if !slices.Equal(got, whole) {
			bad = append(bad, p)
		}
	}
	return bad
}

// TestSafeSplitRules is the differential proof of split.go's rules on
// random and seed-shaped texts: splitting at any accepted point and
// encoding both sides equals the full tiktoken encode.
func TestSafeSplitRules(t *testing.T) {
	tk := refEncoder(t)
	r := rand.New(rand.NewPCG(11, 12))
	n := 400
	if testing.Short() {
		n = 60
	}
	for i := range n {
		var text string
		if i%4 == 3 {
			text = seedShaped(r)
			text = text[:min(len(text), 600+r.IntN(600))] // keep the per-split work bounded
		} else {
			text = randomText(r, 5+r.IntN(120))
		}
		if bad := checkSplits(tk, text, isSafeSplit); len(bad) > 0 {
			p := bad[0]
			t.Fatalf("unsafe split at %d in %q | %q", p, text[max(0, p-20):p], text[p:min(len(text), p+20)])
		}
	}
}

// TestSafeSplitCheckerHasTeeth shows the harness above catches unsafe
// rules: splitting inside a whitespace run, a word or a contraction
// changes the tokens on the same kind of texts.
func TestSafeSplitCheckerHasTeeth(t *testing.T) {
	tk := refEncoder(t)
	// Whole, " \n" is one piece (and one token); split, it is two.
	bad := checkSplits(tk, "a \nb", func(s string, p int) bool { return p == 2 })
	require.NotEmpty(t, bad, "a split inside a whitespace run must be detected")
	bad = checkSplits(tk, "hello world", func(string, int) bool { return true })
	require.NotEmpty(t, bad, "a split inside a word must be detected")
	bad = checkSplits(tk, "it's", func(s string, p int) bool { return p == 3 })
	require.NotEmpty(t, bad, "a split inside a contraction must be detected")
}

func FuzzSafeSplit(f *testing.F) {
	tk := refEncoder(f)
	for _, s := range []string{
		"a\nb", "x y", "it's\nok", "a \nb", "1\n2", "\n\n!x", "é\nZ", "\xff\nA b", "a\u00a0b c",
		seedPrompt(strings.Repeat("ab", 128), 1, 2)[:400],
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, text string) {
		if len(text) > 300 {
			return
		}
		if bad := checkSplits(tk, text, isSafeSplit); len(bad) > 0 {
			t.Fatalf("unsafe split at %d in %q", bad[0], text)
		}
	})
}

func TestSplitHelpers(t *testing.T) {
	require.True(t, splitNewline("a\nb", 2))
	require.False(t, splitNewline("a\n b", 2))
	require.False(t, splitNewline("a\n\nb", 2))
	require.False(t, splitNewline("a\n", 2), "the end of text is never a split")
	require.True(t, splitWord("ab c", 2))
	require.False(t, splitWord("a1 c", 2))
	require.False(t, splitWord("é c", 2))
	require.Equal(t, 2, nextSafeSplit("a\nb\nc", 0))
	require.Equal(t, 4, nextSafeSplit("a\nb\nc", 3))
	require.Equal(t, -1, nextSafeSplit("a\nb\nc", 5))
	require.Equal(t, 4, prevNewlineSplit("a\nb\nc", 0, 5))
	require.Equal(t, 2, prevNewlineSplit("a\nb\nc", 0, 4))
	require.Equal(t, -1, prevNewlineSplit("a\nb\nc", 2, 4))
	require.Equal(t, 2, prevNewlineSplit("a\nb\n c", 0, 6), "skips a newline before a space")
}

func newCachedT(t testing.TB, inner Tokenizer, mut func(*CachedConfig)) *Cached {
	t.Helper()
	cfg := DefaultCachedConfig()
	if mut != nil {
		mut(&cfg)
	}
	c, err := NewCached(inner, cfg)
	require.NoError(t, err)
	return c
}

// TestCachedEqualsFull runs families of related prompts (shared prefixes,
// different endings, edits in the middle, extensions) through Cached with
// several configurations and compares every result with a full encode.
func TestCachedEqualsFull(t *testing.T) {
	tk := mustTiktoken(t)
	ref := refEncoder(t)
	configs := map[string]func(*CachedConfig){
		"default":  nil,
		"small":    func(c *CachedConfig) { c.SegmentBytes = 16; c.MaxTailProbes = 4 },
		"evicting": func(c *CachedConfig) { c.SegmentBytes = 32; c.MaxBytes = 4096 },
		"noTails":  func(c *CachedConfig) { c.SegmentBytes = 64; c.MaxTailProbes = 0 },
	}
	families := 30
	if testing.Short() {
		families = 8
	}
	for name, mut := range configs {
		t.Run(name, func(t *testing.T) {
			c := newCachedT(t, tk, mut)
			r := rand.New(rand.NewPCG(21, uint64(len(name))))
			for range families {
				var base string
				if r.IntN(2) == 0 {
					base = seedShaped(r)
				} else {
					base = randomText(r, 50+r.IntN(400))
				}
				for v := range 6 {
					text := base
					switch v {
					case 1: // new ending
						text = base[:r.IntN(len(base)+1)] + randomText(r, r.IntN(30))
					case 2: // extension (a chat's next turn)
						text = base + "\n" + randomText(r, r.IntN(60))
					case 3: // edit in the middle
						i := r.IntN(len(base) + 1)
						text = base[:i] + randomText(r, 1+r.IntN(3)) + base[i:]
					case 4: // a prefix of the base
						text = base[:r.IntN(len(base)+1)]
					}
					want := ref(nil, text)
					got := c.Encode([]uint32{42}, text)
					require.Equal(t, uint32(42), got[0])
					if !slices.Equal(want, got[1:]) {
						t.Fatalf("cached encode differs from full for %q", text)
					}
				}
			}
			st := c.Stats()
			require.Positive(t, st.Hits)
			require.LessOrEqual(t, st.Bytes, c.cfg.MaxBytes)
			if name == "evicting" {
				require.Positive(t, st.Evictions)
			}
		})
	}
}

func TestCachedSeedHotPath(t *testing.T) {
	tk := mustTiktoken(t)
	ref := refEncoder(t)
	c := newCachedT(t, tk, nil)
	salt := seedSalt(rand.New(rand.NewPCG(5, 6)))
	first := seedPrompt(salt, 3, 1)
	require.Equal(t, ref(nil, first), c.Encode(nil, first))
	st := c.Stats()
	require.Equal(t, uint64(1), st.Misses)
	require.Equal(t, uint64(len(first)), st.EncodedBytes)

	for q := 2; q < 6; q++ {
		p := seedPrompt(salt, 3, q)
		require.Equal(t, ref(nil, p), c.Encode(nil, p))
	}
	st = c.Stats()
	require.Equal(t, uint64(4), st.Hits)
	// Only the question line is encoded again.
	q := len("Question 000002: Explain the operational tradeoffs in detail.")
	require.Equal(t, uint64(len(first)+4*q), st.EncodedBytes)

	// Another document with the same salt shares only the salt.
	p := seedPrompt(salt, 4, 1)
	require.Equal(t, ref(nil, p), c.Encode(nil, p))
}

func TestCachedBytes(t *testing.T) {
	c := newCachedT(t, Bytes{}, func(c *CachedConfig) { c.SegmentBytes = 16 })
	r := rand.New(rand.NewPCG(1, 1))
	base := seedShaped(r)
	for range 5 {
		text := base[:r.IntN(len(base)+1)]
		require.Equal(t, Bytes{}.Encode(nil, text), c.Encode(nil, text))
	}
	require.Equal(t, "bytes", c.Name())
	out, err := c.Decode(nil, []uint32{'h', 'i'})
	require.NoError(t, err)
	require.Equal(t, "hi", string(out))
}

func TestCachedUncacheable(t *testing.T) {
	tk := mustTiktoken(t)
	c := newCachedT(t, tk, nil)
	text := "short text without a newline"
	require.Equal(t, tk.encodeReference(nil, text), c.Encode(nil, text))
	require.Equal(t, tk.encodeReference(nil, ""), c.Encode(nil, ""))
	st := c.Stats()
	require.Equal(t, uint64(2), st.Uncacheable)
	require.Zero(t, st.Entries)
}

type otherTokenizer struct{ Bytes }

func TestNewCachedErrors(t *testing.T) {
	_, err := NewCached(otherTokenizer{}, DefaultCachedConfig())
	require.ErrorIs(t, err, ErrNotCacheable)
	for _, mut := range []func(*CachedConfig){
		func(c *CachedConfig) { c.MaxBytes = 0 },
		func(c *CachedConfig) { c.SegmentBytes = 8 },
		func(c *CachedConfig) { c.MaxTailProbes = -1 },
	} {
		cfg := DefaultCachedConfig()
		mut(&cfg)
		require.ErrorIs(t, cfg.Validate(), ErrInvalidConfig)
		_, err := NewCached(Bytes{}, cfg)
		require.ErrorIs(t, err, ErrInvalidConfig)
	}
	require.NoError(t, DefaultCachedConfig().Validate())
}

// TestCachedConcurrent hammers one Cached from several goroutines with
// overlapping prompts and a cache small enough to evict; run with -race.
func TestCachedConcurrent(t *testing.T) {
	tk := mustTiktoken(t)
	c := newCachedT(t, tk, func(c *CachedConfig) { c.SegmentBytes = 64; c.MaxBytes = 32 << 10 })
	r := rand.New(rand.NewPCG(9, 9))
	var texts []string
	for range 4 {
		base := seedShaped(r)
		base = base[:min(len(base), 3000)]
		for q := range 4 {
			texts = append(texts, fmt.Sprintf("%s\nQuestion %d?", base, q))
		}
	}
	want := make([][]uint32, len(texts))
	for i, s := range texts {
		want[i] = tk.encodeReference(nil, s)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var failures []int
	for g := range 4 {
		wg.Go(func() {
			for i := range 40 {
				k := (g*7 + i*5) % len(texts)
				if !slices.Equal(c.Encode(nil, texts[k]), want[k]) {
					mu.Lock()
					failures = append(failures, k)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	require.Empty(t, failures)
	require.Positive(t, c.Stats().Hits)
}

// TestHotPathsDoNotAllocate pins the 0 allocs/op of the benchmarks: the
// native encoder on ASCII text, and a warm Cached hit.
func TestHotPathsDoNotAllocate(t *testing.T) {
	tk := mustTiktoken(t)
	c := newCachedT(t, tk, nil)
	salt := seedSalt(rand.New(rand.NewPCG(8, 8)))
	ps := []string{seedPrompt(salt, 1, 1), seedPrompt(salt, 1, 2), seedPrompt(salt, 1, 3)}
	c.Encode(nil, ps[0])
	dst := make([]uint32, 0, 8192)
	i := 0
	allocs := testing.AllocsPerRun(20, func() {
		i++
		dst = c.Encode(dst[:0], ps[1+i%2])
	})
	require.Zero(t, allocs, "warm Cached.Encode")
	allocs = testing.AllocsPerRun(5, func() { dst = tk.Encode(dst[:0], ps[0]) })
	require.Zero(t, allocs, "Tiktoken.Encode on ASCII")
}

// FuzzCached encodes a text and two variants sharing its prefix through a
// small-stride Cached and compares each with tiktoken-go.
func FuzzCached(f *testing.F) {
	tk := mustTiktoken(f)
	f.Add("The service\ntracks latency.\nQuestion ", "1: why?", "2: how?")
	f.Add("a\nb\nc d e\n", "\n x", "'s")
	f.Fuzz(func(t *testing.T, base, s1, s2 string) {
		if len(base)+len(s1)+len(s2) > 3000 {
			return
		}
		c, err := NewCached(tk, CachedConfig{MaxBytes: 1 << 20, SegmentBytes: 16, MaxTailProbes: 8})
		require.NoError(t, err)
		for _, text := range []string{base, base + s1, base + s2, base[:len(base)/2] + s1} {
			if want, got := tk.encodeReference(nil, text), c.Encode(nil, text); !slices.Equal(want, got) {
				t.Fatalf("cached encode differs from tiktoken-go for %q", text)
			}
		}
	})
}
