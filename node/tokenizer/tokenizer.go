package tokenizer

import (
	"errors"
	"fmt"
	"strings"
	"sync"
)

// hfShared holds one loaded HF tokenizer per directory.
var hfShared sync.Map // dir -> func() (*HF, error)

// loadHFShared loads dir once per process (a tokenizer.json is tens of MB).
func loadHFShared(dir string) (Tokenizer, error) {
	f, _ := hfShared.LoadOrStore(dir, sync.OnceValues(func() (*HF, error) { return LoadHF(dir) }))
	h, err := f.(func() (*HF, error))()
	if err != nil {
		return nil, err
	}
	return h, nil
}

// ErrUnknownTokenizer is returned by New for a name it does not know.
var ErrUnknownTokenizer = errors.New("tokenizer: unknown tokenizer")

// ErrUnknownToken is returned by a Decoder for a token ID outside its
// vocabulary.
var ErrUnknownToken = errors.New("tokenizer: unknown token id")

// ErrLoad is returned by New when a tokenizer's vocabulary cannot be loaded.
var ErrLoad = errors.New("tokenizer: cannot load vocabulary")

// Tokenizer encodes text into token IDs. Implementations are safe for
// concurrent use and never keep the input.
type Tokenizer interface {
	// Name is the name New accepts for this tokenizer.
	Name() string
	// Encode appends the tokens of text to dst and returns the result.
	Encode(dst []uint32, text string) []uint32
}

// Decoder is implemented by tokenizers that can turn token IDs back into
// text. Decode is safe for concurrent use and does not keep its inputs.
type Decoder interface {
	// Decode appends the bytes of tokens to dst and returns the result.
	// For an ID outside the vocabulary it returns the bytes decoded so far
	// and an error wrapping ErrUnknownToken. A single token need not be
	// valid UTF-8 on its own (BPE tokens may split a multi-byte rune).
	Decode(dst []byte, tokens []uint32) ([]byte, error)
}

// Names New accepts.
const (
	NameBytes     = "bytes"       // one token per byte; see Bytes
	NameCharacter = "character"   // alias of NameBytes (AIBrix's name)
	NameTiktoken  = "tiktoken"    // OpenAI cl100k_base BPE, loaded offline
	NameCL100K    = "cl100k_base" // alias of NameTiktoken
)

// New returns the tokenizer called name: "bytes" (alias "character"),
// "tiktoken" (alias "cl100k_base") or "hf:<dir>" (LoadHF(dir)). The
// tiktoken vocabulary and each hf directory are loaded on the first call
// that asks for them and shared by every later call; New
// returns an error wrapping ErrLoad if that load fails. An unknown name
// returns an error wrapping ErrUnknownTokenizer.
func New(name string) (Tokenizer, error) {
	switch name {
	case NameBytes, NameCharacter:
		return Bytes{}, nil
	case NameTiktoken, NameCL100K:
		return loadCL100K()
	default:
		if dir, ok := strings.CutPrefix(name, NameHFPrefix); ok && dir != "" {
			return loadHFShared(dir)
		}
		return nil, fmt.Errorf("%w %q (want %q, %q, %q, %q or %q)", ErrUnknownTokenizer,
			name, NameBytes, NameCharacter, NameTiktoken, NameCL100K, NameHFPrefix+"<dir>")
	}
}

// Bytes is the byte tokenizer: one token per byte of UTF-8 text. It is
// exact, allocation-free and fast, and is what AIBrix's "character" mode
// hashes.
type Bytes struct{}

var (
	_ Tokenizer = Bytes{}
	_ Decoder   = Bytes{}
)

// Name implements Tokenizer.
func (Bytes) Name() string { return "bytes" }

// Encode implements Tokenizer.
func (Bytes) Encode(dst []uint32, text string) []uint32 {
	for i := 0; i < len(text); i++ {
		dst = append(dst, uint32(text[i]))
	}
	return dst
}

// Decode implements Decoder: every token must be a byte value (< 256).
func (Bytes) Decode(dst []byte, tokens []uint32) ([]byte, error) {
	for _, t := range tokens {
		if t > 0xff {
			return dst, fmt.Errorf("%w %d for bytes", ErrUnknownToken, t)
		}
		dst = append(dst, byte(t))
	}
	return dst, nil
}
