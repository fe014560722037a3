package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// The DeepSeek V3 pre-tokenizer: three Split stages, each applied to the
// pieces the previous one left (Isolated: matches and the gaps between
// them are both pieces), as a hand-written scanner.
//
//	1. \p{N}{1,3}
//	2. [\x{4e00}-\x{9fa5}\x{3040}-\x{309f}\x{30a0}-\x{30ff}]+   (CJK, kana)
//	3. [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+
//	   |[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
//	   | ?[\p{P}\p{S}]+[\r\n]*
//	   |\s*[\r\n]+|\s+(?!\S)|\s+
//
// Stage 3 runs on the stretches between stage 1 and 2 pieces; so for it a
// number or CJK character is the end of its text (dsBoundary), which makes
// the scanner stateless: the next piece depends only on where it starts.

const (
	// patDeepSeekDigits, patDeepSeekCJK and patDeepSeekWords are the
	// three Split regexes LoadHF accepts as the DeepSeek V3 pre-tokenizer.
	patDeepSeekDigits = `\p{N}{1,3}`
	patDeepSeekCJK    = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
	patDeepSeekWords  = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)

func dsCJK(r rune) bool {
	return (r >= 0x4e00 && r <= 0x9fa5) || (r >= 0x3040 && r <= 0x309f) || (r >= 0x30a0 && r <= 0x30ff)
}

// dsRune decodes the rune at s[i]; ok is false at the end of s or at a
// stage 1/2 character (the end of stage 3's text).
func dsRune(s string, i int) (r rune, size int, ok bool) {
	if i >= len(s) {
		return 0, 0, false
	}
	if c := s[i]; c < utf8.RuneSelf {
		return rune(c), 1, c < '0' || c > '9'
	}
	r, size = utf8.DecodeRuneInString(s[i:])
	return r, size, !unicode.IsNumber(r) && !dsCJK(r)
}

func isPS(r rune) bool { return unicode.IsPunct(r) || unicode.IsSymbol(r) }
func isLM(r rune) bool { return unicode.IsLetter(r) || unicode.IsMark(r) }

// dsNextPiece returns the end of the piece starting at i < len(s) (valid
// UTF-8).
func dsNextPiece(s string, i int) int {
	r, size := utf8.DecodeRuneInString(s[i:])
	switch {
	case unicode.IsNumber(r): // stage 1: up to three numbers
		j := i + size
		for k := 1; k < 3 && j < len(s); k++ {
			r2, size2 := utf8.DecodeRuneInString(s[j:])
			if !unicode.IsNumber(r2) {
				break
			}
			j += size2
		}
		return j
	case dsCJK(r): // stage 2
		j := i + size
		for j < len(s) {
			r2, size2 := utf8.DecodeRuneInString(s[j:])
			if !dsCJK(r2) {
				break
			}
			j += size2
		}
		return j
	}
	if j := dsMatch(s, i); j > i {
		return j
	}
	// A gap of stage 3: up to where a match starts or its text ends.
	j := i + size
	for {
		if _, _, ok := dsRune(s, j); !ok || dsMatch(s, j) > j {
			return j
		}
		_, size2, _ := dsRune(s, j)
		j += size2
	}
}

// dsMatch returns the end of stage 3's match at i, or -1 if no
// alternative matches there. s[i] starts a stage 3 character.
func dsMatch(s string, i int) int {
	r, size, _ := dsRune(s, i)
	r2, size2, ok2 := dsRune(s, i+size)
	// (1) ASCII punctuation, then ASCII letters.
	if r < utf8.RuneSelf && isASCIIPunct(byte(r)) && ok2 && isASCIILetter(r2) {
		j := i + size
		for j < len(s) && isASCIILetter(rune(s[j])) {
			j++
		}
		return j
	}
	// (2) [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
	lmRun := func(j int) int {
		for {
			r, size, ok := dsRune(s, j)
			if !ok || !isLM(r) {
				return j
			}
			j += size
		}
	}
	if r != '\r' && r != '\n' && !unicode.IsLetter(r) && !isPS(r) && ok2 && isLM(r2) {
		return lmRun(i + size + size2)
	}
	if isLM(r) {
		return lmRun(i + size)
	}
	// (3) ' ?[\p{P}\p{S}]+[\r\n]*'
	j := i
	if r == ' ' && ok2 && isPS(r2) {
		j = i + size
	}
	if r3, _, ok3 := dsRune(s, j); ok3 && isPS(r3) {
		for {
			r4, size4, ok4 := dsRune(s, j)
			if !ok4 || !isPS(r4) {
				break
			}
			j += size4
		}
		for j < len(s) && (s[j] == '\r' || s[j] == '\n') {
			j++
		}
		return j
	}
	if !unicode.IsSpace(r) {
		return -1
	}
	// Whitespace: the run, its last newline and its last rune.
	end, last, lastNL := i, i, -1
	for {
		r4, size4, ok4 := dsRune(s, end)
		if !ok4 || !unicode.IsSpace(r4) {
			break
		}
		if r4 == '\r' || r4 == '\n' {
			lastNL = end
		}
		last = end
		end += size4
	}
	// (4) \s*[\r\n]+
	if lastNL >= 0 {
		return lastNL + 1
	}
	// (5) \s+(?!\S): at the end of stage 3's text the whole run.
	if _, _, ok := dsRune(s, end); !ok {
		return end
	}
	if last > i {
		return last
	}
	// (6) \s+
	return end
}

func isASCIILetter(r rune) bool { return (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') }

func isASCIIPunct(c byte) bool {
	return (c >= '!' && c <= '/') || (c >= ':' && c <= '@') || (c >= '[' && c <= '`') || (c >= '{' && c <= '~')
}
