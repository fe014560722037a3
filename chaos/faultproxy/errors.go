package faultproxy

import "errors"

var (
	// ErrInvalidConfig wraps every Config.Validate failure.
	ErrInvalidConfig = errors.New("faultproxy: invalid config")
	// ErrClosed is returned by Start after Close.
	ErrClosed = errors.New("faultproxy: closed")
)
