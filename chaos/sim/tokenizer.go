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
