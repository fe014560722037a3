// Package tokenizer turns prompt text into token IDs: a byte tokenizer for
// tests and AIBrix-style character mode, and a real BPE tokenizer (tiktoken
// cl100k, loaded offline) whose counts look like a real model's.
package tokenizer

import "errors"

// ErrUnknownTokenizer is returned by New for a name it does not know.
var ErrUnknownTokenizer = errors.New("tokenizer: unknown tokenizer")

// Tokenizer encodes text into token IDs. Implementations are safe for
// concurrent use and never keep the input.
type Tokenizer interface {
	// Name is the name New accepts for this tokenizer.
	Name() string
	// Encode appends the tokens of text to dst and returns the result.
	Encode(dst []uint32, text string) []uint32
}

// Bytes is the byte tokenizer: one token per byte of UTF-8 text. It is
// exact, allocation-free and fast, and is what AIBrix's "character" mode
// hashes.
type Bytes struct{}

var _ Tokenizer = Bytes{}

// Name implements Tokenizer.
func (Bytes) Name() string { return "bytes" }

// Encode implements Tokenizer.
func (Bytes) Encode(dst []uint32, text string) []uint32 {
	for i := 0; i < len(text); i++ {
		dst = append(dst, uint32(text[i]))
	}
	return dst
}
