package tokenizer

import (
	"fmt"
	"strings"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// NameHFPrefix starts the name of a Hugging Face tokenizer: "hf:<dir>"
// loads <dir>/tokenizer.json and <dir>/tokenizer_config.json (LoadHF).
const NameHFPrefix = "hf:"

// HF is a Hugging Face byte-level BPE tokenizer (Qwen2/2.5/3, Llama 3.x,
// DeepSeek V3 and others with the same components), loaded from tokenizer.json by
// LoadHF and run natively: the added-token split, NFC, the split regex
// (hand-written scanners, hf_pretok.go and hf_pretok_ds.go), byte-level BPE over the merges
// (hf_bpe.go) and the post-processor's special tokens. Its ids equal the
// Rust tokenizers library's (what vLLM runs); hf_diff_test.go checks them
// against an independent JS implementation on a generated corpus.
//
// HF is safe for concurrent use; it keeps a bounded cache of the tokens of
// short pre-tokenizer pieces, so warm encodes do not allocate.
//
// Why not a library: github.com/sugarme/tokenizer v0.3.0 compiles Split
// regexes with Go's regexp, which has no lookahead, and panics on the
// Qwen3 and Llama 3 patterns (\s+(?!\S); its issue #75); a regexp2-based
// split would also be ~50x slower than a scanner (fast.go measured that
// for cl100k). github.com/gomlx/go-huggingface was not evaluated.
type HF struct {
	name string

	nfc          bool // NFC normalizer
	maxDigits    int  // \p{N}{1,maxDigits} in the split regex
	deepseek     bool // DeepSeek V3's three-stage pre-tokenizer (hf_pretok_ds.go)
	ignoreMerges bool // a piece that is a vocabulary token is that token

	tokBytes []string          // id -> bytes (added tokens: their content)
	vocab    map[string]uint32 // bytes -> id, BPE vocabulary only
	byteID   [256]uint32       // id of each single byte
	merges   map[uint64]uint64 // a<<32|b -> rank<<32|merged id
	// monotone: a merge never creates a pair of lower rank than its own,
	// so BPE can apply merges rule by rule (hf_bpe.go, encodeRuns).
	monotone bool
	// minUsed[t] is the lowest rank of a merge consuming token t.
	minUsed []uint32
	// selfEnc[id]: BPE of the token's own bytes is that token, so a piece
	// equal to it needs no merging.
	selfEnc []bool

	added      []addedToken
	rawTrie    addedTrie // added tokens matched on raw text
	normTrie   addedTrie // ... and on normalized text (normalized tokens)
	hasNormTok bool

	postPrefix, postSuffix []uint32 // add_special_tokens=true

	chatTemplate, bosToken, eosToken string
	chat                             chatTemplate // compiled on first use

	pieces pieceCache
}

// addedToken is one of tokenizer.json's added_tokens.
type addedToken struct {
	content    string
	id         uint32
	special    bool
	normalized bool // matched in the normalized text
}

var (
	_ Tokenizer = (*HF)(nil)
	_ Decoder   = (*HF)(nil)
)

// Name implements Tokenizer: "hf:<dir>".
func (h *HF) Name() string { return h.name }

// VocabSize is one more than the highest token id Decode accepts.
func (h *HF) VocabSize() int { return len(h.tokBytes) }

// Encode implements Tokenizer: the tokens of text without the
// post-processor's special tokens (Hugging Face's add_special_tokens=false,
// what vLLM uses for a rendered chat prompt). Added and special tokens
// written in the text ("<|im_start|>") are recognized, as in Hugging Face.
func (h *HF) Encode(dst []uint32, text string) []uint32 {
	if !utf8.ValidString(text) {
		text = string([]rune(text)) // each invalid byte becomes U+FFFD
	}
	for len(text) > 0 {
		at, tok := h.nextAdded(text, false)
		if tok == nil {
			return h.encodeNormalized(dst, text)
		}
		dst = h.encodeNormalized(dst, text[:at])
		dst = append(dst, tok.id)
		text = text[at+len(tok.content):]
	}
	return dst
}

// EncodeSpecial is Encode with, when addSpecial, the post-processor's
// special tokens around the result (add_special_tokens=true, what vLLM
// uses for a completion prompt).
func (h *HF) EncodeSpecial(dst []uint32, text string, addSpecial bool) []uint32 {
	if addSpecial {
		dst = append(dst, h.postPrefix...)
	}
	dst = h.Encode(dst, text)
	if addSpecial {
		dst = append(dst, h.postSuffix...)
	}
	return dst
}

// SpecialPrefix returns the tokens add_special_tokens puts before a
// prompt (e.g. a BOS), SpecialSuffix those after. Callers must not modify
// them.
func (h *HF) SpecialPrefix() []uint32 { return h.postPrefix }

// SpecialSuffix: see SpecialPrefix.
func (h *HF) SpecialSuffix() []uint32 { return h.postSuffix }

// Decode implements Decoder: the bytes of each token (an added token's
// content).
func (h *HF) Decode(dst []byte, tokens []uint32) ([]byte, error) {
	for _, id := range tokens {
		if int(id) >= len(h.tokBytes) || h.tokBytes[id] == "" {
			return dst, fmt.Errorf("%w %d for %s", ErrUnknownToken, id, h.name)
		}
		dst = append(dst, h.tokBytes[id]...)
	}
	return dst, nil
}

// encodeNormalized encodes text that holds no raw-matched added token:
// NFC (if configured), then normalized added tokens, then pre-tokenizer
// pieces and BPE.
func (h *HF) encodeNormalized(dst []uint32, text string) []uint32 {
	if text == "" {
		return dst
	}
	if h.nfc && !isNFC(text) {
		text = normNFC(text)
	}
	if !h.hasNormTok {
		return h.encodePieces(dst, text)
	}
	for len(text) > 0 {
		at, tok := h.nextAdded(text, true)
		if tok == nil {
			return h.encodePieces(dst, text)
		}
		dst = h.encodePieces(dst, text[:at])
		dst = append(dst, tok.id)
		text = text[at+len(tok.content):]
	}
	return dst
}

// normNFC returns the NFC form of s.
func normNFC(s string) string { return norm.NFC.String(s) }

// isNFC reports whether s is in NFC. Runes below U+0300 are starters
// with NFC_Quick_Check=Yes, so a prefix of them needs no table lookup; the
// check resumes at the last of them, the only starter a later combining
// mark could compose with.
func isNFC(s string) bool {
	prev := 0
	for i := 0; i < len(s); {
		c := s[i]
		switch {
		case c < utf8.RuneSelf:
			prev = i
			i++
		case c >= 0xc2 && c <= 0xcb && i+1 < len(s): // U+0080..U+02FF
			prev = i
			i += 2
		default:
			return norm.NFC.IsNormalString(s[prev:])
		}
	}
	return true
}

// encodePieces pre-tokenizes text and appends each piece's BPE tokens.
func (h *HF) encodePieces(dst []uint32, text string) []uint32 {
	for i := 0; i < len(text); {
		j := h.nextPiece(text, i)
		dst = h.encodePiece(dst, text[i:j])
		i = j
	}
	return dst
}

// nextPiece returns the end of the pre-tokenizer piece starting at i.
func (h *HF) nextPiece(text string, i int) int {
	if h.deepseek {
		return dsNextPiece(text, i)
	}
	return hfNextPiece(text, i, h.maxDigits)
}

// addedTrie is a byte trie of added tokens, for leftmost-longest matching
// in time proportional to the bytes matched (a model may have hundreds of
// added tokens sharing a prefix like "<|").
type addedTrie struct {
	nodes []trieNode
	first [256]bool // first bytes of the tokens
}

type trieNode struct {
	edges []trieEdge
	tok   int32 // index into HF.added, or -1
}

type trieEdge struct {
	b     byte
	child int32
}

func (t *addedTrie) add(content string, tok int32) {
	if len(t.nodes) == 0 {
		t.nodes = append(t.nodes, trieNode{tok: -1})
	}
	t.first[content[0]] = true
	n := int32(0)
	for i := 0; i < len(content); i++ {
		next := int32(-1)
		for _, e := range t.nodes[n].edges {
			if e.b == content[i] {
				next = e.child
				break
			}
		}
		if next < 0 {
			next = int32(len(t.nodes))
			t.nodes = append(t.nodes, trieNode{tok: -1})
			t.nodes[n].edges = append(t.nodes[n].edges, trieEdge{content[i], next})
		}
		n = next
	}
	if t.nodes[n].tok < 0 { // the first of equal contents wins
		t.nodes[n].tok = tok
	}
}

// longest returns the index of the longest token that prefixes s, or -1.
func (t *addedTrie) longest(s string) int32 {
	best, n := int32(-1), int32(0)
	for i := 0; i < len(s); i++ {
		next := int32(-1)
		for _, e := range t.nodes[n].edges {
			if e.b == s[i] {
				next = e.child
				break
			}
		}
		if next < 0 {
			break
		}
		n = next
		if tok := t.nodes[n].tok; tok >= 0 {
			best = tok
		}
	}
	return best
}

// buildAddedMatcher indexes the added tokens in two tries: those matched
// in the raw text and the normalized ones.
func (h *HF) buildAddedMatcher() {
	for i, t := range h.added {
		if t.normalized {
			h.normTrie.add(t.content, int32(i))
			h.hasNormTok = true
		} else {
			h.rawTrie.add(t.content, int32(i))
		}
	}
}

// nextAdded finds the leftmost, then longest, added token in text among
// the raw-matched (normalized false) or normalized ones.
func (h *HF) nextAdded(text string, normalized bool) (int, *addedToken) {
	t := &h.rawTrie
	if normalized {
		t = &h.normTrie
	}
	if len(t.nodes) == 0 {
		return -1, nil
	}
	for i := 0; i < len(text); i++ {
		if !t.first[text[i]] {
			continue
		}
		if k := t.longest(text[i:]); k >= 0 {
			return i, &h.added[k]
		}
	}
	return -1, nil
}

// splitSafe reports whether split.go's rules hold for h: no added token
// holds a space or a newline.
func (h *HF) splitSafe() bool {
	for _, t := range h.added {
		if strings.ContainsAny(t.content, " \n") {
			return false
		}
	}
	return true
}
