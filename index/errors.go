package index

import "errors"

// ErrUnknownMode is returned by ParseMode for a name it does not know.
var ErrUnknownMode = errors.New("index: unknown mode")
