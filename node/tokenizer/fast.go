package tokenizer

// A native cl100k_base encoder for ASCII text.
//
// tiktoken-go spends ~7 ms on a 28 KB prompt, mostly in regexp2 and in
// per-piece allocations. For ASCII text the pre-tokenizer regex
// (cl100kPattern) is simple enough to run as a hand-written scanner, and
// BPE can run on a stack buffer. Text with other bytes is cut at safe
// split points (split.go) and only the regions holding non-ASCII bytes go
// to tiktoken-go, so the result is always that of tiktoken-go (checked by
// TestFastEncodeEqualsReference and FuzzFastEncode).
//
// regexp2 evaluates \s, \p{L} and \p{N} with Go's unicode package, so on
// ASCII they are exactly: \s = [\t\n\v\f\r ], \p{L} = [A-Za-z],
// \p{N} = [0-9]. Every other ASCII byte (punctuation, the rest of the C0
// controls, DEL) is "other": [^\s\p{L}\p{N}].

// ASCII byte classes.
const (
	clOther = iota
	clLetter
	clDigit
	clSpace   // \s other than \r and \n
	clNewline // \r or \n
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

// isASCII reports whether s has no byte >= 0x80.
func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return false
		}
	}
	return true
}

// indexNonASCII returns the index of the first byte >= 0x80, or -1.
func indexNonASCII(s string) int {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return i
		}
	}
	return -1
}

// nextPieceASCII returns the end of the pre-tokenizer piece that starts at
// i (< len(s)) in ASCII text s. It follows the regex's alternatives in
// order; the comments give each one.
func nextPieceASCII(s string, i int) int {
	n := len(s)
	c := s[i]
	cl := asciiClass[c]

	// (1) (?i:'s|'t|'re|'ve|'m|'ll|'d)
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
		}
	}
	// (2) [^\r\n\p{L}\p{N}]?\p{L}+
	if cl == clLetter {
		return letterRun(s, i+1)
	}
	if (cl == clOther || cl == clSpace) && i+1 < n && asciiClass[s[i+1]] == clLetter {
		return letterRun(s, i+2)
	}
	// (3) \p{N}{1,3}
	if cl == clDigit {
		j := i + 1
		for j < n && j < i+3 && asciiClass[s[j]] == clDigit {
			j++
		}
		return j
	}
	// (4) ' ?[^\s\p{L}\p{N}]+[\r\n]*'
	j := i
	if c == ' ' && i+1 < n && asciiClass[s[i+1]] == clOther {
		j = i + 1
	}
	if asciiClass[s[j]] == clOther {
		for j < n && asciiClass[s[j]] == clOther {
			j++
		}
		for j < n && asciiClass[s[j]] == clNewline {
			j++
		}
		return j
	}
	// Only whitespace is left: cl is clSpace or clNewline. Find the run.
	end := i
	lastNL := -1
	for end < n && (asciiClass[s[end]] == clSpace || asciiClass[s[end]] == clNewline) {
		if asciiClass[s[end]] == clNewline {
			lastNL = end
		}
		end++
	}
	// (5) \s*[\r\n]+ : \s* backs off to the last newline of the run.
	if lastNL >= 0 {
		return lastNL + 1
	}
	// (6) \s+(?!\S) : the whole run at the end of text, else all but its
	// last character (which then starts the next piece).
	if end == n {
		return end
	}
	if end-1 > i {
		return end - 1
	}
	// (7) \s+
	return end
}

// letterRun returns the end of the run of ASCII letters starting at j.
func letterRun(s string, j int) int {
	for j < len(s) && asciiClass[s[j]] == clLetter {
		j++
	}
	return j
}

// encodeASCII appends the tokens of ASCII text s.
func (t *Tiktoken) encodeASCII(dst []uint32, s string) []uint32 {
	for i := 0; i < len(s); {
		j := nextPieceASCII(s, i)
		dst = t.encodePiece(dst, s[i:j])
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

// bytePairEncode runs BPE on piece: start from single bytes and repeatedly
// merge the adjacent pair whose concatenation has the lowest rank (the
// leftmost one on a tie) until no pair is a token.
func (t *Tiktoken) bytePairEncode(dst []uint32, piece string) []uint32 {
	var buf [64]bpePart
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

// encodeFast appends the tokens of text: ASCII regions natively, regions
// around non-ASCII bytes (cut at safe splits) with tiktoken-go.
func (t *Tiktoken) encodeFast(dst []uint32, text string) []uint32 {
	for pos := 0; pos < len(text); {
		k := indexNonASCII(text[pos:])
		if k < 0 {
			return t.encodeASCII(dst, text[pos:])
		}
		k += pos
		// The ASCII region before the last safe split at or before k.
		a := pos
		for p := k - 1; p > pos; p-- {
			if isSafeSplit(text, p) {
				a = p
				break
			}
		}
		dst = t.encodeASCII(dst, text[pos:a])
		// The region holding the non-ASCII bytes, up to the next safe split.
		b := nextSafeSplit(text, k+1)
		if b < 0 {
			b = len(text)
		}
		dst = t.encodeReference(dst, text[a:b])
		pos = b
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
