package des

import "errors"

var (
	// ErrInvalidOptions wraps every Options.Validate failure.
	ErrInvalidOptions = errors.New("des: invalid options")
	// ErrClosed is returned by a World's control operations after Close.
	ErrClosed = errors.New("des: closed")
	// ErrStalled is returned by Run when work is pending but no event is
	// scheduled (an engine bug: a request that can never finish).
	ErrStalled = errors.New("des: stalled with pending work")
	// ErrReset is returned by ResetCaches when an engine refuses to reset.
	ErrReset = errors.New("des: prefix cache reset refused")
	// ErrNotIdle is returned by WaitIdle when an engine still holds requests.
	ErrNotIdle = errors.New("des: engines not idle")
)
