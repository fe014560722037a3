package sim

import "errors"

var (
	// ErrInvalidConfig wraps every configuration validation failure.
	ErrInvalidConfig = errors.New("sim: invalid config")
	// ErrUnknownProfile is returned for a profile name that is not built in.
	ErrUnknownProfile = errors.New("sim: unknown profile")
	// ErrPromptTooLong is returned when prompt plus max_tokens exceeds the
	// model's maximum length.
	ErrPromptTooLong = errors.New("sim: prompt too long")
	// ErrRequestTooLarge is returned when a request could never fit in the
	// block pool.
	ErrRequestTooLarge = errors.New("sim: request larger than the KV cache")
	// ErrBadRequest is returned for an invalid request (empty prompt,
	// max_tokens < 1, duplicate ID).
	ErrBadRequest = errors.New("sim: bad request")
	// ErrClosed is returned after the server or engine driver has stopped.
	ErrClosed = errors.New("sim: closed")
)
