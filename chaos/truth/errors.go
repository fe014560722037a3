package truth

import "errors"

var (
	// ErrBlockSize: the engine block size is not a positive multiple of the
	// index block size, so engine blocks do not map onto index blocks.
	ErrBlockSize = errors.New("truth: engine block size is not a multiple of the index block size")
	// ErrMalformedBlock: a cached block's token chain is inconsistent (its
	// prefix does not end with its tokens).
	ErrMalformedBlock = errors.New("truth: malformed cached block")
	// ErrTimeout: Await's deadline passed before the comparison held.
	ErrTimeout = errors.New("truth: condition not reached before the deadline")
)
