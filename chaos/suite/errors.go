package suite

import "errors"

var (
	// ErrUnknownScenario: a name matches no scenario.
	ErrUnknownScenario = errors.New("suite: unknown scenario")
	// ErrFailed: a scenario's invariant failed (or it panicked).
	ErrFailed = errors.New("suite: scenario failed")
)
