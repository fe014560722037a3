package faultctl

import "errors"

var (
	// ErrInvalid: a proxy or fault spec that does not validate (400).
	ErrInvalid = errors.New("faultctl: invalid")
	// ErrNotFound: no proxy or fault of that name (404).
	ErrNotFound = errors.New("faultctl: not found")
	// ErrExists: a proxy of that name exists already (409).
	ErrExists = errors.New("faultctl: exists")
	// ErrConflict: the fault clashes with one installed (409).
	ErrConflict = errors.New("faultctl: conflict")
	// ErrUnauthorized: missing or wrong bearer token (401).
	ErrUnauthorized = errors.New("faultctl: unauthorized")
	// ErrClosed: the Manager is closed.
	ErrClosed = errors.New("faultctl: closed")
)
