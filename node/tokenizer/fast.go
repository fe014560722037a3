package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// A native cl100k_base encoder.
//
// tiktoken-go spends ~7 ms on a 28 KB prompt, mostly in regexp2 and in
// per-piece allocations. The pre-tokenizer regex (cl100kPattern) is simple
// enough to run as a hand-written scanner, and BPE can run on a stack
// buffer; together they are about 50x faster and allocate nothing.
//
// The scanner reproduces regexp2's matching exactly, because regexp2
// classifies characters with Go's unicode package, the same tables this
// binary uses: \s is unicode.IsSpace, \p{L} is unicode.Is(unicode.L, r),
// \p{N} is unicode.Is(unicode.N, r), and (?i) compares unicode.ToLower of
// the input, which maps no non-ASCII rune onto the letters of the
// contractions. tiktoken-go matches on []rune(text), which turns each
// invalid UTF-8 byte into U+FFFD; encodeFast does the same conversion
// first. TestFastEncodeEqualsReference and FuzzFastEncode compare the
// result with tiktoken-go.

// Character classes of the pattern.
const (
	clOther   = iota // [^\s\p{L}\p{N}]
	clLetter         // \p{L}
	clDigit          // \p{N}
	clSpace          // \s other than \r and \n
	clNewline        // \r or \n
)

var asciiClass = func() (t [128]uint8) {
	for c := range 128 {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z':
			t[c] = clLetter
		case c >= '0' && c <= '9':
			t[c] = clDigit
		case c == '\r' || c == '\n':
			t[c] = clNewline
		case c == '\t' || c == '\v' || c == '\f' || c == ' ':
			t[c] = clSpace
		default:
			t[c] = clOther
		}
	}
	return t
}()

// classAt returns the class and byte length of the rune at s[i] (valid
// UTF-8, i < len(s)).
func classAt(s string, i int) (uint8, int) {
	if c := s[i]; c < utf8.RuneSelf {
		return asciiClass[c], 1
	}
	r, n := utf8.DecodeRuneInString(s[i:])
	switch {
	case unicode.IsLetter(r): // = unicode.Is(unicode.L, r), with a Latin-1 table
		return clLetter, n
	case unicode.IsNumber(r): // = unicode.Is(unicode.N, r)
		return clDigit, n
	case unicode.IsSpace(r):
		return clSpace, n
	}
	return clOther, n
}

// nextPiece returns the end of the pre-tokenizer piece that starts at
// i < len(s) in valid UTF-8 text s, by cl100k_base's pattern.
func nextPiece(s string, i int) int { return pieceEnd(s, i, 3, false) }

// pieceEnd returns the end of the piece that starts at i < len(s) in valid
// UTF-8 text s, by the pattern cl100k_base shares with the Qwen2 and
// Llama 3 split patterns; they differ only in the longest digit run
// (maxDigits) and in whether the contraction alternative folds case the
// Oniguruma way, where 's also matches U+017F LATIN SMALL LETTER LONG S
// (foldLongS: what the Hugging Face tokenizers' regex does; tiktoken's
// does not). It tries the alternatives in order, as the regex engine does;
// the comments name each one.
func pieceEnd(s string, i, maxDigits int, foldLongS bool) int {
	n := len(s)
	c := s[i]
	cl, size := classAt(s, i)

	// (1) (?i:'s|'t|'re|'ve|'m|'ll|'d). A byte >= 0x80 never ORs to ASCII.
	if c == '\'' && i+1 < n {
		switch s[i+1] | 0x20 {
		case 's', 't', 'm', 'd':
			return i + 2
		case 'r', 'v':
			if i+2 < n && s[i+2]|0x20 == 'e' {
				return i + 3
			}
		case 'l':
			if i+2 < n && s[i+2]|0x20 == 'l' {
				return i + 3
			}
		case 0xc5 | 0x20: // U+017F is C5 BF; 0xc5|0x20 == 0xe5 is no ASCII letter
			if foldLongS && s[i+1] == 0xc5 && i+2 < n && s[i+2] == 0xbf {
				return i + 3
			}
		}
	}
	// (2) [^\r\n\p{L}\p{N}]?\p{L}+
	if cl == clLetter {
		return letterRun(s, i+size)
	}
	if (cl == clOther || cl == clSpace) && i+size < n {
		if cl2, size2 := classAt(s, i+size); cl2 == clLetter {
			return letterRun(s, i+size+size2)
		}
	}
	// (3) \p{N}{1,maxDigits}
	if cl == clDigit {
		j := i + size
		for k := 1; k < maxDigits && j < n; k++ {
			cl2, size2 := classAt(s, j)
			if cl2 != clDigit {
				break
			}
			j += size2
		}
		return j
	}
	// (4) ' ?[^\s\p{L}\p{N}]+[\r\n]*'
	j := i
	if c == ' ' && i+1 < n {
		if cl2, _ := classAt(s, i+1); cl2 == clOther {
			j = i + 1
		}
	}
	if cl2, _ := classAt(s, j); cl2 == clOther {
		for j < n {
			if c := s[j]; c < utf8.RuneSelf {
				if asciiClass[c] != clOther {
					break
				}
				j++
				continue
			}
			cl2, size2 := classAt(s, j)
			if cl2 != clOther {
				break
			}
			j += size2
		}
		for j < n && (s[j] == '\r' || s[j] == '\n') {
			j++
		}
		return j
	}
	// Only whitespace is left: cl is clSpace or clNewline.
	return spaceRunEnd(s, i)
}

// spaceRunEnd is the end of the whitespace piece starting at s[i], by the
// last three alternatives that cl100k's pattern and the Qwen2/Llama 3
// split patterns share: \s*[\r\n]+, \s+(?!\S) and \s+. It finds the run,
// its last newline and the start of its last rune.
func spaceRunEnd(s string, i int) int {
	n := len(s)
	end, last, lastNL := i, i, -1
	for end < n {
		cl2, size2 := classAt(s, end)
		if cl2 != clSpace && cl2 != clNewline {
			break
		}
		if cl2 == clNewline {
			lastNL = end
		}
		last = end
		end += size2
	}
	// (5) \s*[\r\n]+ : \s* backs off to the run's last newline.
	if lastNL >= 0 {
		return lastNL + 1
	}
	// (6) \s+(?!\S) : the whole run at the end of text, else all but its
	// last rune (which then starts the next piece).
	if end == n {
		return end
	}
	if last > i {
		return last
	}
	// (7) \s+
	return end
}

// letterRun returns the end of the run of letters starting at j.
func letterRun(s string, j int) int {
	for j < len(s) {
		if c := s[j]; c < utf8.RuneSelf {
			if asciiClass[c] != clLetter {
				return j
			}
			j++
			continue
		}
		cl, size := classAt(s, j)
		if cl != clLetter {
			return j
		}
		j += size
	}
	return j
}

// mergeCand is a candidate merge of the part starting at start with the
// part after it, whose result has rank rank.
type mergeCand struct {
	rank  int
	start int32
}

// less orders candidates by rank, then leftmost first: the order in which
// the rescanning variant picks merges.
func (a mergeCand) less(b mergeCand) bool {
	return a.rank < b.rank || (a.rank == b.rank && a.start < b.start)
}

// bytePairEncodeLong is the same BPE as bytePairEncodeShort with the parts
// in a linked list and the candidate merges in a min-heap. A popped
// candidate is stale if its part was merged away or its rank changed since;
// a (start, rank) pair that is still current names the same two parts,
// because the rank fixes the merged bytes and so where they end.
func (t *Tiktoken) bytePairEncodeLong(dst []uint32, piece string) []uint32 {
	const dead = -1
	n := len(piece)
	next := make([]int32, n) // start of the next part, n after the last
	prev := make([]int32, n) // start of the previous part, -1 for the first
	rank := make([]int, n)   // rank of merging with the next part, noRank or dead
	h := make([]mergeCand, 0, n)
	push := func(c mergeCand) {
		h = append(h, c)
		for i := len(h) - 1; i > 0; {
			p := (i - 1) / 2
			if !h[i].less(h[p]) {
				break
			}
			h[i], h[p] = h[p], h[i]
			i = p
		}
	}
	pop := func() mergeCand {
		top := h[0]
		last := len(h) - 1
		h[0] = h[last]
		h = h[:last]
		for i := 0; ; {
			l, m := 2*i+1, i
			if l < len(h) && h[l].less(h[m]) {
				m = l
			}
			if l+1 < len(h) && h[l+1].less(h[m]) {
				m = l + 1
			}
			if m == i {
				break
			}
			h[i], h[m] = h[m], h[i]
			i = m
		}
		return top
	}
	pairRank := func(i int32) int {
		j := next[i]
		if int(j) >= n {
			return noRank
		}
		if r, ok := t.ranks[piece[i:next[j]]]; ok {
			return r
		}
		return noRank
	}
	for i := range n {
		next[i], prev[i] = int32(i+1), int32(i-1)
	}
	for i := range int32(n) {
		if rank[i] = pairRank(i); rank[i] != noRank {
			push(mergeCand{rank[i], i})
		}
	}
	for len(h) > 0 {
		c := pop()
		i := c.start
		if rank[i] != c.rank {
			continue // stale
		}
		j := next[i]
		k := next[j]
		rank[j] = dead
		next[i] = k
		if int(k) < n {
			prev[k] = i
		}
		if rank[i] = pairRank(i); rank[i] != noRank {
			push(mergeCand{rank[i], i})
		}
		if p := prev[i]; p >= 0 {
			if rank[p] = pairRank(p); rank[p] != noRank {
				push(mergeCand{rank[p], p})
			}
		}
	}
	for i := int32(0); int(i) < n; i = next[i] {
		dst = append(dst, uint32(t.ranks[piece[i:next[i]]]))
	}
	return dst
}

// encodeFast appends the tokens of text, exactly as tiktoken-go's
// EncodeOrdinary does.
func (t *Tiktoken) encodeFast(dst []uint32, text string) []uint32 {
	if !utf8.ValidString(text) {
		text = string([]rune(text)) // each invalid byte becomes U+FFFD, as in tiktoken-go
	}
	for i := 0; i < len(text); {
		j := nextPiece(text, i)
		dst = t.encodePiece(dst, text[i:j])
		i = j
	}
	return dst
}

// encodePiece appends the BPE tokens of one piece.
func (t *Tiktoken) encodePiece(dst []uint32, piece string) []uint32 {
	if id, ok := t.ranks[piece]; ok {
		return append(dst, uint32(id))
	}
	return t.bytePairEncode(dst, piece)
}

// bpePart is a part of a piece during byte-pair merging: it starts at
// start, and merging it with the next part would give a token of rank rank.
type bpePart struct {
	start int
	rank  int
}

const noRank = int(^uint(0) >> 1)

// longPiece is the piece length from which BPE uses the O(n log n) heap
// variant: the simple variant rescans all parts per merge, O(n²), which a
// long run of letters or punctuation would turn into seconds of CPU.
const longPiece = 128

// bytePairEncode runs BPE on piece: start from single bytes and repeatedly
// merge the adjacent pair whose concatenation has the lowest rank (the
// leftmost one on a tie) until no pair is a token.
func (t *Tiktoken) bytePairEncode(dst []uint32, piece string) []uint32 {
	if len(piece) >= longPiece {
		return t.runsCore().bpeRuns(dst, piece)
	}
	return t.bytePairEncodeShort(dst, piece)
}

// bytePairEncodeShort is BPE by rescanning, on a stack buffer.
func (t *Tiktoken) bytePairEncodeShort(dst []uint32, piece string) []uint32 {
	var buf [longPiece + 1]bpePart
	var parts []bpePart
	if len(piece)+1 <= len(buf) {
		parts = buf[:len(piece)+1]
	} else {
		parts = make([]bpePart, len(piece)+1)
	}
	// rankAt is the rank of parts[i] merged with parts[i+1].
	rankAt := func(i int) int {
		if i+2 < len(parts) {
			if r, ok := t.ranks[piece[parts[i].start:parts[i+2].start]]; ok {
				return r
			}
		}
		return noRank
	}
	for i := range parts {
		parts[i].start = i
	}
	for i := range parts {
		parts[i].rank = rankAt(i)
	}
	for len(parts) > 1 {
		minRank, at := noRank, -1
		for i := 0; i < len(parts)-1; i++ {
			if parts[i].rank < minRank {
				minRank, at = parts[i].rank, i
			}
		}
		if at < 0 {
			break
		}
		// Merge parts[at] and parts[at+1].
		parts = append(parts[:at+1], parts[at+2:]...)
		parts[at].rank = rankAt(at)
		if at > 0 {
			parts[at-1].rank = rankAt(at - 1)
		}
	}
	for i := 0; i < len(parts)-1; i++ {
		dst = append(dst, uint32(t.ranks[piece[parts[i].start:parts[i+1].start]]))
	}
	return dst
}

// encodeReference appends tiktoken-go's tokens of text.
func (t *Tiktoken) encodeReference(dst []uint32, text string) []uint32 {
	if text == "" {
		return dst
	}
	ids := t.tk.EncodeOrdinary(text)
	dst = growU32(dst, len(ids))
	for _, id := range ids {
		dst = append(dst, uint32(id))
	}
	return dst
}
