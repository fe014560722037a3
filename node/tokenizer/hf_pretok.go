package tokenizer

import "unicode/utf8"

// The split regexes of Qwen2 and Llama 3 (patQwen2, patLlama3) as a
// hand-written scanner, like fast.go's for cl100k_base; the two patterns
// differ only in how many digits one piece may hold (\p{N} vs \p{N}{1,3}).
//
// Hugging Face's Rust tokenizers (what vLLM runs) match these patterns with
// Oniguruma, whose classes are Unicode properties: \s is White_Space (Go's
// unicode.IsSpace: it includes U+0085 and excludes U+FEFF), \p{L} and \p{N}
// the general categories. Its case-insensitive group (?i:'s|...) folds
// with Unicode's simple case folding, under which U+017F (LATIN SMALL
// LETTER LONG S) matches 's'; no other non-ASCII rune folds onto a letter
// of the contractions. Split with the Isolated behavior makes every match
// a piece; the pattern matches every character, so there are no gaps.

// hfNextPiece returns the end of the piece starting at i < len(s) in valid
// UTF-8 s. It tries the alternatives in order, as the regex engine does.
func hfNextPiece(s string, i, maxDigits int) int {
	n := len(s)
	c := s[i]
	cl, size := classAt(s, i)

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
		case 0xc5 | 0x20: // U+017F is C5 BF; 0xc5|0x20 == 0xe5 is no ASCII letter
			if s[i+1] == 0xc5 && i+2 < n && s[i+2] == 0xbf {
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
	// Whitespace.
	return spaceRunEnd(s, i)
}
