package study

import "errors"

var (
	// ErrInvalidConfig is returned by Config.Validate and wraps the reason.
	ErrInvalidConfig = errors.New("study: invalid config")
	// ErrUnknownScenario is returned for a scenario name the package does
	// not know.
	ErrUnknownScenario = errors.New("study: unknown scenario")
	// ErrInitFailed is returned when a scenario could not establish its
	// initial state (for example the hot-spot placement after all retries).
	ErrInitFailed = errors.New("study: scenario initialisation failed")
	// ErrEngine wraps failures of the Engine's control operations.
	ErrEngine = errors.New("study: engine operation failed")
	// ErrBadRecord is returned by ReadRequests for a malformed line.
	ErrBadRecord = errors.New("study: malformed request record")
)
