package tokenizer

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// Invariants of HF that need no reference: the prefix cache and the three
// BPE variants give the same tokens, and decoding gives the text back.

func newCachedHF(tb testing.TB, h *HF, segment int) *Cached {
	tb.Helper()
	cfg := DefaultCachedConfig()
	if segment > 0 {
		cfg.SegmentBytes = segment
	}
	c, err := NewCached(h, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return c
}

// checkHFInvariants checks one text against h and a Cached h.
func checkHFInvariants(t testing.TB, h *HF, c *Cached, text string) {
	want := h.Encode(nil, text)
	if got := c.Encode(nil, text); !slices.Equal(got, want) {
		t.Fatalf("%s: Cached differs on %q:\n got %v\nwant %v", h.Name(), text, got, want)
	}
	if got := c.Encode(nil, text); !slices.Equal(got, want) { // now from the cache
		t.Fatalf("%s: warm Cached differs on %q", h.Name(), text)
	}
	if !utf8.ValidString(text) {
		return
	}
	dec, err := h.Decode(nil, want)
	if err != nil {
		t.Fatalf("%s: Decode: %v", h.Name(), err)
	}
	exp := text
	if h.nfc {
		exp = norm.NFC.String(text)
	}
	if string(dec) != exp {
		t.Fatalf("%s: decode(encode(%q)) = %q", h.Name(), text, dec)
	}
}

func TestHFCachedEqualsUncached(t *testing.T) {
	for _, model := range testedHFModels() {
		t.Run(model, func(t *testing.T) {
			h := loadHFT(t, model)
			c := newCachedHF(t, h, 64)
			texts := hfCorpusTexts(7, 600)
			// Prompts sharing long prefixes, so the cache is hit.
			r := rand.New(rand.NewPCG(3, 4))
			for i := range 200 {
				texts = append(texts, texts[i]+"\n"+texts[r.IntN(len(texts))]+" "+texts[i+1])
			}
			salt := seedSalt(r)
			for q := range 20 {
				texts = append(texts, seedPrompt(salt, 1, q))
			}
			for _, text := range texts {
				checkHFInvariants(t, h, c, text)
			}
			st := c.Stats()
			if st.Hits == 0 {
				t.Fatalf("no cache hits: %+v", st)
			}
			t.Logf("%s: %d texts; cache %+v", model, len(texts), st)
		})
	}
}

// TestHFBPEVariants checks bpeShort, bpeHeap and bpeRuns against each
// other on random pieces, including long runs.
func TestHFBPEVariants(t *testing.T) {
	for _, model := range testedHFModels() {
		t.Run(model, func(t *testing.T) {
			h := loadHFT(t, model)
			r := rand.New(rand.NewPCG(5, 6))
			alpha := []string{"a", "b", "e", "é", " ", "\n", "0", "!", "啊", "ab", "aa", "😀"}
			for i := range 3000 {
				var b strings.Builder
				n := 1 + r.IntN(shortPiece)
				if i%10 == 0 {
					n = 1 + r.IntN(5000)
				}
				unit := pick(r, alpha)
				for b.Len() < n {
					if r.IntN(8) == 0 {
						unit = pick(r, alpha)
					}
					b.WriteString(unit)
				}
				piece := b.String()
				heap := h.bpeHeap(nil, h.bytesToIDs(piece))
				if len(piece) <= shortPiece {
					if got := h.bpeShort(nil, piece); !slices.Equal(got, heap) {
						t.Fatalf("bpeShort(%q) = %v, heap %v", piece, got, heap)
					}
				}
				if got := h.bpeRuns(nil, piece); !slices.Equal(got, heap) {
					t.Fatalf("bpeRuns(%q) = %v, heap %v", piece, got, heap)
				}
			}
		})
	}
}

// FuzzHF checks the invariants on arbitrary text, seeded from the
// differential corpus.
func FuzzHF(f *testing.F) {
	for _, s := range hfCorpusTexts(11, 200) {
		f.Add(s)
	}
	f.Add(strings.Repeat("a", 3000))
	f.Add("\xff\xfe<|im_start|>x")
	models := map[string]*HF{}
	caches := map[string]*Cached{}
	for _, m := range testedHFModels() {
		h := loadHFT(f, m)
		models[m] = h
		caches[m] = newCachedHF(f, h, 32)
	}
	f.Fuzz(func(t *testing.T, text string) {
		for _, m := range testedHFModels() {
			checkHFInvariants(t, models[m], caches[m], text)
		}
	})
}
