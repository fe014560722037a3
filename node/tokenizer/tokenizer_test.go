package tokenizer

import (
	"errors"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

func mustTiktoken(t testing.TB) *Tiktoken {
	t.Helper()
	tk, err := New(NameTiktoken)
	require.NoError(t, err)
	return tk.(*Tiktoken)
}

func TestNewNames(t *testing.T) {
	for _, name := range []string{NameBytes, NameCharacter} {
		tk, err := New(name)
		require.NoError(t, err, name)
		require.Equal(t, Bytes{}, tk)
	}
	a, err := New(NameTiktoken)
	require.NoError(t, err)
	b, err := New(NameCL100K)
	require.NoError(t, err)
	require.Same(t, a.(*Tiktoken), b.(*Tiktoken), "the vocabulary is loaded once and shared")
	require.Equal(t, NameTiktoken, a.Name())

	for _, name := range []string{"", "gpt2", "Bytes", "remote"} {
		_, err := New(name)
		require.ErrorIs(t, err, ErrUnknownTokenizer, name)
	}
}

func TestBytes(t *testing.T) {
	var bt Bytes
	got := bt.Encode([]uint32{7}, "aé\n")
	require.Equal(t, []uint32{7, 'a', 0xc3, 0xa9, '\n'}, got)
	out, err := bt.Decode([]byte("x"), got[1:])
	require.NoError(t, err)
	require.Equal(t, "xaé\n", string(out))
	_, err = bt.Decode(nil, []uint32{256})
	require.ErrorIs(t, err, ErrUnknownToken)
}

func TestTiktokenKnownIDs(t *testing.T) {
	tk := mustTiktoken(t)
	// Published cl100k_base encodings.
	require.Equal(t, []uint32{15339, 1917}, tk.Encode(nil, "hello world"))
	require.Equal(t, []uint32{9906, 4435, 0}, tk.Encode(nil, "Hello World!"))
	require.Empty(t, tk.Encode(nil, ""))
	// Encode appends.
	require.Equal(t, []uint32{1, 15339, 1917}, tk.Encode([]uint32{1}, "hello world"))
	// Special-token text is ordinary text, never the special ID.
	require.NotContains(t, tk.Encode(nil, "a<|endoftext|>b"), uint32(100257))
}

func TestTiktokenSeedPromptSize(t *testing.T) {
	tk := mustTiktoken(t)
	p := seedPrompt(seedSalt(rand.New(rand.NewPCG(1, 2))), 7, 123)
	require.InDelta(t, 28_830, len(p), 10) // 28.2 KiB
	n := len(tk.Encode(nil, p))
	// The sentence is 16 cl100k tokens (".\n" is one), so the 300 copies
	// are 4,800; the hex salt adds roughly 100-200 depending on its digits.
	require.Equal(t, 16, len(tk.Encode(nil, seedSentence)))
	require.GreaterOrEqual(t, n, 4_800+60, "got %d tokens", n)
	require.LessOrEqual(t, n, 4_800+260, "got %d tokens", n)
}

func TestTiktokenDecodeRoundTrip(t *testing.T) {
	tk := mustTiktoken(t)
	for _, s := range []string{
		"", "hello world", "héllo wörld 日本語 🙂", "  \n\n\tx", "<|endoftext|>", "it's 12345 o'clock",
		seedPrompt(seedSalt(rand.New(rand.NewPCG(3, 4))), 1, 2),
	} {
		out, err := tk.Decode(nil, tk.Encode(nil, s))
		require.NoError(t, err)
		require.Equal(t, s, string(out))
	}
	out, err := tk.Decode(nil, []uint32{100257})
	require.NoError(t, err)
	require.Equal(t, "<|endoftext|>", string(out))

	out, err = tk.Decode([]byte("a"), []uint32{15339, uint32(tk.VocabSize())})
	require.ErrorIs(t, err, ErrUnknownToken)
	require.Equal(t, "ahello", string(out), "bytes before the bad token are kept")
	_, err = tk.Decode(nil, []uint32{100261}) // a hole between special IDs
	require.True(t, errors.Is(err, ErrUnknownToken))
}

func TestTiktokenConcurrent(t *testing.T) {
	tk := mustTiktoken(t)
	texts := []string{"alpha beta", "gamma\ndelta 42", "The service tracks request latency."}
	want := make([][]uint32, len(texts))
	for i, s := range texts {
		want[i] = tk.Encode(nil, s)
	}
	var wg sync.WaitGroup
	errs := make(chan string, 8)
	for g := range 8 {
		wg.Go(func() {
			for i := range 50 {
				k := (g + i) % len(texts)
				got := tk.Encode(nil, texts[k])
				if len(got) != len(want[k]) {
					errs <- texts[k]
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for s := range errs {
		t.Errorf("concurrent encode of %q differs", s)
	}
}
