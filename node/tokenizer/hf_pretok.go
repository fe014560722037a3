package tokenizer

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
// UTF-8 s: cl100k's scanner with the pattern's longest digit run and
// Oniguruma's long-s folding (pieceEnd).
func hfNextPiece(s string, i, maxDigits int) int { return pieceEnd(s, i, maxDigits, true) }
