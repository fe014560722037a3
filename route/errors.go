package route

import "errors"

var (
	// ErrInvalidConfig is returned (wrapped) by the Validate methods.
	ErrInvalidConfig = errors.New("route: invalid config")
	// ErrUnknownStrategy is returned by Set.Get and ParseName for a name
	// that is not one of the strategies this package implements.
	ErrUnknownStrategy = errors.New("route: unknown strategy")
)
