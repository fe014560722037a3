package tokenizer

import "strings"

// Safe split points for cl100k_base.
//
// A position p (0 < p < len(text)) is a safe split of text when
//
//	Encode(text) == Encode(text[:p]) ++ Encode(text[p:])
//
// tiktoken applies BPE to each piece matched by the pre-tokenizer regex
// (cl100kPattern) separately, scanning left to right with no anchors and no
// lookbehind, and every alternative consumes at least one character. So p
// is safe when (A) no piece of text crosses p, and (B) the pieces the regex
// finds in text[:p] are the pieces of text that end at or before p: the
// pieces from p on are then found in text[p:] unchanged, because a match
// starting at p reads only text[p:].
//
// The alternatives are, in order: (1) (?i:'s|'t|'re|'ve|'m|'ll|'d),
// (2) [^\r\n\p{L}\p{N}]?\p{L}+, (3) \p{N}{1,3}, (4) ?[^\s\p{L}\p{N}]+[\r\n]*,
// (5) \s*[\r\n]+, (6) \s+(?!\S), (7) \s+. For (B), the two texts differ
// only at p, where text has a character c and text[:p] has end of input.
// Every character test fails at end of input; only the negative lookahead
// (?!\S) in (6) succeeds there. So the matches agree when, on every path
// the engine can take to position p, the element tried at p also fails on
// c and no lookahead is evaluated at p.
//
// Rule N (newline): text[p-1] == '\n' and text[p] is printable ASCII other
// than space (0x21..0x7e).
//
//	(A) '\n' is excluded from (1), (2) and (3) and from the optional
//	prefix of (2); in (4) it occurs only in the trailing [\r\n]*; (5), (6)
//	and (7) are all whitespace. So a piece holding '\n' is followed within
//	the piece only by whitespace, and c is not whitespace.
//	(B) Paths that consume text[p-1] == '\n' are (4)'s [\r\n]*, (5)'s \s*
//	and [\r\n]+, and the \s+ of (6) and (7). At p they test c against
//	[\r\n] or \s, which fails on c as on end of input. The lookahead of
//	(6) would be evaluated at p only if (6) were tried at a start i whose
//	whitespace run reaches p-1; but that run holds '\n', so (5) matches
//	at i first and (6) is never tried there.
//
// Rule W (word): text[p-1] is an ASCII letter and text[p] == ' '.
//
//	(A) The only pieces that can hold a letter are (1) (a quote then
//	letters) and (2) (one optional non-letter, non-digit, non-newline
//	character, then letters); in both, a letter is followed only by
//	letters. So no piece holds text[p-1] followed by the space.
//	(B) Paths that consume the letter at p-1 are (1) and (2); at p they
//	test c == ' ' against a letter (a contraction's next letter, or
//	\p{L}+), which fails as on end of input. No lookahead follows a letter.
//
// Both rules look only at text[p-1] and text[p], so a safe split of text
// is also a safe split of any substring that keeps both bytes, which makes
// splitting at several points valid by induction. ASCII bytes never occur
// inside a multi-byte UTF-8 sequence, and tiktoken-go turns each invalid
// byte into U+FFFD on its own, so the rules are unaffected by invalid
// UTF-8. The same rules are trivially safe for Bytes.
//
// cached_test.go checks the rules against full tiktoken encodes on random
// and seed-shaped texts.
//
// The same rules hold for HF (Qwen2 and Llama 3 patterns), by the same
// argument: the two patterns differ from cl100k's only in \p{N}{1,n}, which
// neither rule involves, and the extra contraction match ('ſ) neither
// starts nor ends at a newline or an ASCII letter followed by a space. Two
// more stages come first there. The added-token split: a token that holds
// no space and no newline (HF.splitSafe) cannot cross p, and a
// leftmost-longest match on either side of p is the same match in the
// whole text. NFC: '\n' and ' ' are starters that compose with nothing,
// and the rune after p is ASCII, so NFC never merges across p.
// hf_cached_test.go checks Cached(HF) against HF on the corpus.

// splitNewline reports whether rule N holds at p.
func splitNewline(text string, p int) bool {
	return p > 0 && p < len(text) && text[p-1] == '\n' && text[p] >= 0x21 && text[p] <= 0x7e
}

// splitWord reports whether rule W holds at p.
func splitWord(text string, p int) bool {
	if p <= 0 || p >= len(text) || text[p] != ' ' {
		return false
	}
	c := text[p-1] | 0x20 // lower-case ASCII letters; other bytes stay non-letters
	return c >= 'a' && c <= 'z'
}

// isSafeSplit reports whether p is a safe split of text (rule N or W).
func isSafeSplit(text string, p int) bool {
	return splitNewline(text, p) || splitWord(text, p)
}

// nextSafeSplit returns the smallest safe split p >= from, or -1.
func nextSafeSplit(text string, from int) int {
	if from < 1 {
		from = 1
	}
	for p := from; p < len(text); p++ {
		if isSafeSplit(text, p) {
			return p
		}
	}
	return -1
}

// prevNewlineSplit returns the largest rule-N split p with lo < p < hi, or
// -1.
func prevNewlineSplit(text string, lo, hi int) int {
	if hi > len(text) {
		hi = len(text)
	}
	for hi-1 > lo {
		i := strings.LastIndexByte(text[lo:hi-1], '\n')
		if i < 0 {
			return -1
		}
		p := lo + i + 1
		if splitNewline(text, p) {
			return p
		}
		hi = p
	}
	return -1
}
