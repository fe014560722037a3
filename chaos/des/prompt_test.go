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
