package tokenizer

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// randomASCII returns n random ASCII bytes, biased towards the classes and
// sequences the pre-tokenizer treats specially.
func randomASCII(r *rand.Rand, n int) string {
	const common = "aZ e'sSt'rRe'VEm'lLdD0123456789  \t\n\r\v\f.,!?\"'()-_\\/@#"
	b := make([]byte, n)
	for i := range b {
		if r.IntN(4) == 0 {
			b[i] = byte(r.IntN(128))
		} else {
			b[i] = common[r.IntN(len(common))]
		}
	}
	return string(b)
}

// TestFastEncodeEqualsReference compares the native encoder with
// tiktoken-go on random ASCII, random mixed Unicode, and seed-shaped texts.
func TestFastEncodeEqualsReference(t *testing.T) {
	tk := mustTiktoken(t)
	r := rand.New(rand.NewPCG(31, 32))
	n := 3000
	if testing.Short() {
		n = 500
	}
	check := func(text string) {
		t.Helper()
		want := tk.encodeReference(nil, text)
		got := tk.Encode(nil, text)
		if !slices.Equal(want, got) {
			i := 0
			for i < min(len(want), len(got)) && want[i] == got[i] {
				i++
			}
			t.Fatalf("native encode differs from tiktoken-go at token %d for %q", i, text)
		}
	}
	for i := range n {
		switch i % 4 {
		case 0:
			check(randomASCII(r, r.IntN(200)))
		case 1:
			check(randomText(r, r.IntN(80)))
		case 2:
			words := []string{"a", "the", "ab", "zz", "'", "'s", "'ll", "x's", " ", "  ", "\n", "\r\n", " \n", "\t", ".", "...", "1", "1234567", "\v", "\x00"}
			var b strings.Builder
			for range r.IntN(60) {
				b.WriteString(words[r.IntN(len(words))])
			}
			check(b.String())
		case 3:
			if i%40 == 3 {
				check(seedShaped(r))
			}
		}
	}
	// Long pieces take the heap path of the BPE.
	check(strings.Repeat("abcdefghij", 30))
	check(strings.Repeat("!@#$%^&*()", 30) + "\n\n")
	check(strings.Repeat(" ", 300) + "x")
	check(strings.Repeat("\n", 100))
	check(seedPrompt(seedSalt(r), 12, 345678))
	// Every pair of ASCII bytes, in and out of context.
	var b strings.Builder
	for c := range 128 {
		for d := range 128 {
			b.WriteByte(byte(c))
			b.WriteByte(byte(d))
			b.WriteByte(' ')
		}
		check(b.String())
		b.Reset()
	}
	// Every ASCII byte next to runes of each class.
	for _, u := range []string{"é", "ª", "²", "٣", "\u00a0", "\u2028", "\u0085", "\u200b", "🙂", "\u0301", "\xff"} {
		for c := range 128 {
			b.WriteByte(byte(c))
			b.WriteString(u)
			b.WriteByte(byte(c))
			b.WriteString(" " + u + u)
			b.WriteByte(byte(c))
			b.WriteByte(byte(c))
		}
		check(b.String())
		b.Reset()
	}
}

func FuzzFastEncode(f *testing.F) {
	tk := mustTiktoken(f)
	for _, s := range []string{"", "hello world", "it's 1234 o'clock\r\n\n  x", "é\nZ b", "\x00\x7f\v\f", " !\n", "a  \n b"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, text string) {
		if len(text) > 4000 {
			return
		}
		want := tk.encodeReference(nil, text)
		got := tk.Encode(nil, text)
		if !slices.Equal(want, got) {
			t.Fatalf("native encode differs from tiktoken-go for %q", text)
		}
	})
}

func TestNextPieceASCII(t *testing.T) {
	pieces := func(s string) []string {
		var out []string
		for i := 0; i < len(s); {
			j := nextPiece(s, i)
			out = append(out, s[i:j])
			i = j
		}
		return out
	}
	for _, c := range []struct {
		in   string
		want []string
	}{
		{"Hello world", []string{"Hello", " world"}},
		{"it's", []string{"it", "'s"}},
		{"'sa", []string{"'s", "a"}},
		{"I'LL", []string{"I", "'LL"}},
		{"(hello)", []string{"(hello", ")"}},
		{" 123456", []string{" ", "123", "456"}},
		{"a  b", []string{"a", " ", " b"}},
		{"a  ", []string{"a", "  "}},
		{"a \n\n b", []string{"a", " \n\n", " b"}},
		{"x.\n\nY", []string{"x", ".\n\n", "Y"}},
		{" ...", []string{" ..."}},
		{"\t\tx", []string{"\t", "\tx"}},
		{"a \n \t", []string{"a", " \n", " \t"}},
		{"1 \n2", []string{"1", " \n", "2"}},
	} {
		require.Equal(t, c.want, pieces(c.in), "%q", c.in)
	}
}

// TestBytePairEncodeLong checks the heap BPE against the rescanning one
// and against tiktoken-go on long pieces, and that a huge piece is fast.
func TestBytePairEncodeLong(t *testing.T) {
	tk := mustTiktoken(t)
	r := rand.New(rand.NewPCG(41, 42))
	var pieces []string
	for _, alpha := range []string{"a", "ab", "abc", "etaoinshrdlu", "!@#$%^&*", "aaab", "é日"} {
		for range 4 {
			n := 1 + r.IntN(700)
			b := make([]byte, 0, n)
			for len(b) < n {
				b = append(b, alpha[r.IntN(len(alpha))])
			}
			pieces = append(pieces, string(b))
		}
	}
	pieces = append(pieces, strings.Repeat("a", 1000), strings.Repeat("ab", 300)+"c", strings.Repeat("the", 200))
	for _, p := range pieces {
		short := tk.bytePairEncodeShort(nil, p)
		long := tk.bytePairEncodeLong(nil, p)
		require.Equal(t, short, long, "piece of %d bytes", len(p))
		require.Equal(t, short, tk.runsCore().bpeRuns(nil, p), "run-length BPE, piece of %d bytes", len(p))
		if len(p) < 400 && strings.Trim(p, "abcdefghijklmnopqrstuvwxyz") == "" {
			// A run of letters is one pre-tokenizer piece.
			require.Equal(t, tk.encodeReference(nil, p), tk.Encode(nil, p))
		}
	}
	// A 200 KB run of letters: quadratic BPE would take minutes.
	huge := strings.Repeat("xq", 100_000)
	out := tk.Encode(nil, huge)
	dec, err := tk.Decode(nil, out)
	require.NoError(t, err)
	require.Equal(t, huge, string(dec))
}
