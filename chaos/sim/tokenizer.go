package sim

import (
	"fmt"

	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// newTokenizer returns the named tokenizer ("" means bytes).
func newTokenizer(name string) (tokenizer.Tokenizer, error) {
	if name == "" {
		name = tokenizer.NameBytes
	}
	tok, err := tokenizer.New(name)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return tok, nil
}

// asHF returns tok as an HF tokenizer, or nil.
func asHF(tok tokenizer.Tokenizer) *tokenizer.HF {
	h, _ := tok.(*tokenizer.HF)
	return h
}
