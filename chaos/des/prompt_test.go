package des

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// TestPromptsMatchFullEncode checks the shared-prefix path against what a
// gateway computes from scratch: a fresh (uncached) tokenizer over the
// whole prompt and the hasher's keys from the root, for seed prompts,
// multi-turn prompts and perturbed prompts, in character and token key
// modes, with tiktoken and the byte tokenizer.
func TestPromptsMatchFullEncode(t *testing.T) {
	tik, err := tokenizer.New(tokenizer.NameTiktoken)
	require.NoError(t, err)
	cached, err := tokenizer.NewCached(tik, tokenizer.DefaultCachedConfig())
	require.NoError(t, err)
	type tc struct {
		name      string
		tok, full tokenizer.Tokenizer
		block     int
		charKeys  bool
	}
	cases := []tc{
		{"tiktoken/token-keys", cached, tik, 16, false},
		{"tiktoken/char-keys", cached, tik, 128, true},
		{"bytes/char-keys", tokenizer.Bytes{}, tokenizer.Bytes{}, 128, true},
		{"bytes/token-keys", tokenizer.Bytes{}, tokenizer.Bytes{}, 16, false},
	}
	docs := study.Documents(7, "phase-x", 1, 3, 0)
	rng := rand.New(rand.NewPCG(3, 4))
	// Realistic prompts first: seed prompts and multi-turn sessions whose
	// first two prompts in a group are two turns of one session (the
	// group's prefix must shrink to the document when other sessions
	// come).
	var texts []string
	for q := range 40 {
		d := docs[q%len(docs)]
		switch q % 4 {
		case 0, 1:
			texts = append(texts, d.Prompt(q))
		case 2, 3:
			first := study.TurnPrompt(d, q, 1, "", "")
			texts = append(texts, first, study.TurnPrompt(d, q, 2, first, " The service tracks."))
		}
	}
	realistic := len(texts)
	// Then prompts that share a group's first line but not its prefix:
	// same length and a safe split where the prefix ends but different
	// text before it, and prompts diverging early, mid-line or right at
	// the prefix's end.
	for q := range 12 {
		d := docs[q%len(docs)]
		p := d.Prompt(q)
		texts = append(texts, strings.Replace(p, "latency", "latenci", 1), strings.Replace(d.Prefix(), "cache", "cachE", 1)+"\nQ")
		cut := rng.IntN(len(p))
		texts = append(texts, p[:cut]+" zz\n  tail "+fmt.Sprint(q), p[:cut], d.Prefix()+"\n", d.Prefix()+"\n\n x")
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h, err := index.NewHasher(11, c.block)
			require.NoError(t, err)
			root := h.Root("m", "", "")
			p := newPrompts(c.tok, h, root, c.charKeys)
			var keys []index.BlockKey
			for i, text := range texts {
				if i == realistic {
					// Most realistic prompts must have taken the shared
					// path, or this test proves nothing about it.
					require.Greater(t, p.reused, uint64(realistic*3/4), "reused %d of %d", p.reused, realistic)
				}
				var toks []uint32
				toks, keys = p.prepare(text, keys)
				want := c.full.Encode(nil, text)
				require.Equal(t, want, toks, "tokens of %q...", text[:min(len(text), 40)])
				var wantKeys []index.BlockKey
				if c.charKeys {
					wantKeys = h.AppendKeysString(nil, root, text)
				} else {
					wantKeys = h.AppendKeys(nil, root, want)
				}
				require.Equal(t, wantKeys, keys)
			}
		})
	}
}

// TestSafeSplit checks rule N's byte tests at the edges.
func TestSafeSplit(t *testing.T) {
	require.True(t, safeSplit("a\nQ", 2))
	require.False(t, safeSplit("a\n\nQ", 2))
	require.False(t, safeSplit("a\n Q", 2))
	require.False(t, safeSplit("a\nQ", 3))
	require.False(t, safeSplit("a\nQ", 0))
	require.False(t, safeSplit("ab"+strings.Repeat("x", 3), 2))
}

// TestPromptsSplitMatchesJoined feeds the same prompts to prepare (joined)
// and prepareSplit (prefix and tail apart: the documents' shared prefix
// strings as the study driver passes them, and random splits) and checks
// both against a full encode; the split path must take the shared-prefix
// path as often as the joined one.
func TestPromptsSplitMatchesJoined(t *testing.T) {
	tik, err := tokenizer.New(tokenizer.NameTiktoken)
	require.NoError(t, err)
	for _, charKeys := range []bool{false, true} {
		t.Run(fmt.Sprint("charKeys=", charKeys), func(t *testing.T) {
			block := 16
			if charKeys {
				block = 128
			}
			h, err := index.NewHasher(11, block)
			require.NoError(t, err)
			root := h.Root("m", "", "")
			mk := func() *prompts {
				c, err := tokenizer.NewCached(tik, tokenizer.DefaultCachedConfig())
				require.NoError(t, err)
				return newPrompts(c, h, root, charKeys)
			}
			joined, split := mk(), mk()
			docs := study.Documents(9, "phase-y", 0, 4, 0)
			prefixes := make([]string, len(docs))
			for i, d := range docs {
				prefixes[i] = d.Prefix()
			}
			rng := rand.New(rand.NewPCG(7, 8))
			type pr struct{ prefix, tail string }
			var in []pr
			for q := range 60 {
				g := q % len(docs)
				switch q % 6 {
				case 0, 1, 2:
					in = append(in, pr{prefixes[g], "\n" + study.QuestionLine(q)})
				case 3:
					full := study.TurnPrompt(docs[g], q, 1, "", "")
					in = append(in, pr{prefixes[g], full[len(prefixes[g]):]})
				case 4:
					p := docs[g].Prompt(q)
					cut := rng.IntN(len(p) + 1)
					in = append(in, pr{p[:cut], p[cut:]})
				case 5:
					// Same first line, different text: the group's
					// prefix must shrink on either path.
					alt := strings.Replace(prefixes[g], "latency", "latenci", 1+rng.IntN(3))
					in = append(in, pr{alt, "\n" + study.QuestionLine(q)}, pr{"", alt + "\nQ"}, pr{prefixes[g][:100], ""})
				}
			}
			var k1, k2 []index.BlockKey
			for i, x := range in {
				full := x.prefix + x.tail
				var t1, t2 []uint32
				t1, k1 = joined.prepare(full, k1)
				t1 = append([]uint32(nil), t1...)
				t2, k2 = split.prepareSplit(x.prefix, x.tail, k2)
				want := tik.Encode(nil, full)
				require.Equal(t, want, t1, "joined tokens, prompt %d", i)
				require.Equal(t, want, t2, "split tokens, prompt %d", i)
				wantKeys := h.AppendKeys(nil, root, want)
				if charKeys {
					wantKeys = h.AppendKeysString(nil, root, full)
				}
				norm := func(k []index.BlockKey) []index.BlockKey { return append([]index.BlockKey{}, k...) }
				require.Equal(t, norm(wantKeys), norm(k1), "joined keys, prompt %d", i)
				require.Equal(t, norm(wantKeys), norm(k2), "split keys, prompt %d", i)
			}
			require.Equal(t, joined.reused, split.reused, "both paths reuse prefixes alike")
			require.Greater(t, split.reused, uint64(len(in)/3))
			// The driver-like prompts (a document's prefix string and a
			// question) must mostly skip the join.
			t.Logf("%d prompts, %d reused, %d joined", len(in), split.reused, split.joined)
			require.Less(t, split.joined, uint64(len(in)/2))
		})
	}
}
