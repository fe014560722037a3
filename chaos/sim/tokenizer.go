package sim

import (
	"fmt"

	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// newTokenizer returns the named tokenizer.
func newTokenizer(name string) (tokenizer.Tokenizer, error) {
	switch name {
	case "bytes", "":
		return tokenizer.Bytes{}, nil
	}
	return nil, fmt.Errorf("%w: tokenizer %q", ErrInvalidConfig, name)
}
