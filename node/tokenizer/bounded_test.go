package tokenizer

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
)

// checkLimited checks EncodeLimited's contract for one text and limit.
func checkLimited(t *testing.T, name string, tok Tokenizer, text string, lim Limit) {
	t.Helper()
	full := tok.Encode(nil, text)
	got, trunc := EncodeLimited(tok, nil, text, lim)
	if len(got) > len(full) || !slices.Equal(got, full[:len(got)]) {
		t.Fatalf("%s: EncodeLimited(%+v) is not a prefix of Encode on %q:\n got %v\nfull %v", name, lim, text, got, full)
	}
	if lim.MaxTokens > 0 && len(got) > lim.MaxTokens {
		t.Fatalf("%s: %d tokens over the limit %+v (trunc %v) on %q", name, len(got), lim, trunc, text)
	}
	if !trunc && len(got) != len(full) {
		t.Fatalf("%s: %d of %d tokens and not truncated", name, len(got), len(full))
	}
	if lim.MaxPieceBytes == 0 && lim.MaxTokens > 0 && len(full) > lim.MaxTokens && len(got) != lim.MaxTokens {
		t.Fatalf("%s: %d tokens, want exactly the limit %d", name, len(got), lim.MaxTokens)
	}
}

func TestEncodeLimited(t *testing.T) {
	toks := map[string]Tokenizer{"bytes": Bytes{}, "tiktoken": mustTiktoken(t)}
	for _, m := range testedHFModels() {
		if h := tryLoadHF(t, m); h != nil {
			toks[m] = h
			toks[m+"+cache"] = newCachedHF(t, h, 32)
		}
	}
	toks["tiktoken+cache"] = newCachedT(t, mustTiktoken(t), nil)
	r := rand.New(rand.NewPCG(8, 9))
	texts := hfCorpusTexts(21, 300)
	texts = append(texts, strings.Repeat("a", 5000), "x\n"+strings.Repeat(" ", 3000)+"y")
	for name, tok := range toks {
		for _, text := range texts {
			lim := Limit{MaxTokens: r.IntN(200)}
			if r.IntN(3) == 0 {
				lim.MaxPieceBytes = 1 + r.IntN(64)
			}
			checkLimited(t, name, tok, text, lim)
			checkLimited(t, name, tok, text, lim) // warm cache
		}
	}
}

// tryLoadHF is loadHFT without skipping: nil if the data is missing.
func tryLoadHF(t *testing.T, model string) *HF {
	var h *HF
	t.Run("load-"+model, func(t *testing.T) { h = loadHFT(t, model) })
	return h
}

// TestEncodeLimitedBoundsWork encodes a 31 MB prompt of one character
// (issue 14's case, 27.5 s with tiktoken before) with the gateway's
// default limits; it must finish well within a second per tokenizer.
func TestEncodeLimitedBoundsWork(t *testing.T) {
	if testing.Short() {
		t.Skip("31 MB prompts")
	}
	lim := Limit{MaxTokens: 262144, MaxPieceBytes: 64 << 10}
	toks := map[string]Tokenizer{"tiktoken": mustTiktoken(t)}
	for _, m := range testedHFModels() {
		if h := tryLoadHF(t, m); h != nil {
			toks[m] = h
		}
	}
	for _, ch := range []string{"a", " ", "!", "\n", "7", "é"} {
		text := strings.Repeat(ch, 31<<20/len(ch))
		for name, tok := range toks {
			start := time.Now()
			toks, _ := EncodeLimited(tok, nil, text, lim)
			d := time.Since(start)
			t.Logf("%s %q x31MB: %d tokens in %v", name, ch, len(toks), d.Round(time.Millisecond))
			if d > 5*time.Second { // generous for a loaded 2-core machine; typical is < 100 ms
				t.Errorf("%s: %v for a 31 MB one-character prompt", name, d)
			}
		}
	}
}
