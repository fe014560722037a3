package tokenizer

import "unicode/utf8"

// Bounded work per prompt (issue 14).
//
// Routing keys only need a prompt's first tokens, and BPE on one long
// pre-tokenizer piece (a megabyte of one character) costs far more per
// byte than on prose. EncodeLimited stops after Limit.MaxTokens tokens and
// before any piece longer than Limit.MaxPieceBytes. Pieces are BPE'd
// independently (and added tokens stand alone), so what it returns is
// always exactly a prefix of Encode(text): a limited encode never yields a
// token the full encode would not have in that position.

// Limit bounds one EncodeLimited call. A zero field means no limit.
type Limit struct {
	// MaxTokens stops encoding once this many tokens are produced.
	MaxTokens int
	// MaxPieceBytes stops encoding before a pre-tokenizer piece longer
	// than this (Bytes has no pieces and ignores it).
	MaxPieceBytes int
}

// LimitedEncoder is implemented by every Tokenizer in this package.
type LimitedEncoder interface {
	// EncodeLimited appends the tokens of text within lim and reports
	// whether it stopped early (truncated; it may also report true when
	// the limit is reached exactly at the end of text). The tokens
	// appended are always a prefix of Encode(text). Safe for concurrent
	// use; does not keep text.
	EncodeLimited(dst []uint32, text string, lim Limit) ([]uint32, bool)
}

var (
	_ LimitedEncoder = Bytes{}
	_ LimitedEncoder = (*Tiktoken)(nil)
	_ LimitedEncoder = (*HF)(nil)
	_ LimitedEncoder = (*Cached)(nil)
)

// EncodeLimited is tok's EncodeLimited if it has one, else its Encode
// cut to lim.MaxTokens (with no bound on the work).
func EncodeLimited(tok Tokenizer, dst []uint32, text string, lim Limit) ([]uint32, bool) {
	return encodeLimited(tok, dst, text, lim)
}

func encodeLimited(tok Tokenizer, dst []uint32, text string, lim Limit) ([]uint32, bool) {
	if le, ok := tok.(LimitedEncoder); ok {
		return le.EncodeLimited(dst, text, lim)
	}
	base := len(dst)
	dst = tok.Encode(dst, text)
	if lim.MaxTokens > 0 && len(dst)-base > lim.MaxTokens {
		return dst[:base+lim.MaxTokens], true
	}
	return dst, false
}

// budget tracks a Limit during one encode.
type budget struct {
	lim  Limit
	base int
}

// pieceOK reports whether a piece of n bytes may be encoded.
func (b budget) pieceOK(n int) bool { return b.lim.MaxPieceBytes <= 0 || n <= b.lim.MaxPieceBytes }

// full reports whether dst holds the most tokens allowed.
func (b budget) full(dst []uint32) bool {
	return b.lim.MaxTokens > 0 && len(dst)-b.base >= b.lim.MaxTokens
}

// cut trims dst to the token limit.
func (b budget) cut(dst []uint32) []uint32 {
	if b.lim.MaxTokens > 0 && len(dst)-b.base > b.lim.MaxTokens {
		return dst[:b.base+b.lim.MaxTokens]
	}
	return dst
}

// EncodeLimited implements LimitedEncoder.
func (Bytes) EncodeLimited(dst []uint32, text string, lim Limit) ([]uint32, bool) {
	if lim.MaxTokens > 0 && len(text) > lim.MaxTokens {
		return Bytes{}.Encode(dst, text[:lim.MaxTokens]), true
	}
	return Bytes{}.Encode(dst, text), false
}

// EncodeLimited implements LimitedEncoder.
func (t *Tiktoken) EncodeLimited(dst []uint32, text string, lim Limit) ([]uint32, bool) {
	if !utf8.ValidString(text) {
		text = string([]rune(text))
	}
	b := budget{lim, len(dst)}
	for i := 0; i < len(text); {
		if b.full(dst) {
			return b.cut(dst), true
		}
		j := nextPiece(text, i)
		if !b.pieceOK(j - i) {
			return dst, true
		}
		dst = t.encodePiece(dst, text[i:j])
		i = j
	}
	out := b.cut(dst)
	return out, len(out) < len(dst)
}

// EncodeLimited implements LimitedEncoder (without the post-processor's
// special tokens, like Encode).
func (h *HF) EncodeLimited(dst []uint32, text string, lim Limit) ([]uint32, bool) {
	if !utf8.ValidString(text) {
		text = string([]rune(text))
	}
	b := budget{lim, len(dst)}
	stop := false
	for len(text) > 0 && !stop {
		at, tok := h.nextAdded(text, false)
		if tok == nil {
			dst, stop = h.encodeNormalizedLimited(dst, text, b)
			break
		}
		if dst, stop = h.encodeNormalizedLimited(dst, text[:at], b); stop {
			break
		}
		if b.full(dst) {
			return b.cut(dst), true
		}
		dst = append(dst, tok.id)
		text = text[at+len(tok.content):]
	}
	out := b.cut(dst)
	return out, stop || len(out) < len(dst)
}

func (h *HF) encodeNormalizedLimited(dst []uint32, text string, b budget) ([]uint32, bool) {
	if text == "" {
		return dst, false
	}
	if h.nfc && !isNFC(text) {
		text = normNFC(text)
	}
	for len(text) > 0 {
		at, tok := len(text), (*addedToken)(nil)
		if h.hasNormTok {
			if a, t := h.nextAdded(text, true); t != nil {
				at, tok = a, t
			}
		}
		seg := text[:at]
		for i := 0; i < len(seg); {
			if b.full(dst) {
				return dst, true
			}
			j := h.nextPiece(seg, i)
			if !b.pieceOK(j - i) {
				return dst, true
			}
			dst = h.encodePiece(dst, seg[i:j])
			i = j
		}
		if tok == nil {
			return dst, false
		}
		if b.full(dst) {
			return dst, true
		}
		dst = append(dst, tok.id)
		text = text[at+len(tok.content):]
	}
	return dst, false
}
