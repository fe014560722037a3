package config

import (
	"errors"
	"strings"
)

// Sentinel errors. Every error the package returns wraps one of them (test
// with errors.Is); gRPC and HTTP answers map them to stable codes.
var (
	// ErrInvalidConfig: a routing config (or a patch or command producing
	// one) failed validation. The wrapping *FieldError names the field.
	ErrInvalidConfig = errors.New("config: invalid config")
	// ErrVersionConflict: a compare-and-set write named a version other
	// than the current one.
	ErrVersionConflict = errors.New("config: version conflict")
	// ErrNoQuorum: no raft leader could commit the write within the
	// timeout (this node is in a minority partition, or the cluster has
	// not formed yet). The last applied config keeps serving.
	ErrNoQuorum = errors.New("config: no raft quorum (write refused; the last applied config stays in force)")
	// ErrNotLeader: a forwarded command reached a node that is not the
	// leader. Callers of Store never see it: the store re-resolves.
	ErrNotLeader = errors.New("config: not the raft leader")
	// ErrNotFound: a command named a model or replica that does not exist.
	ErrNotFound = errors.New("config: not found")
	// ErrUnauthenticated: an admin call without the right bearer token.
	ErrUnauthenticated = errors.New("config: unauthenticated")
	// ErrUnavailable: a diagnostic provider (index stats, explain,
	// snapshot) is not wired on this node.
	ErrUnavailable = errors.New("config: not available on this node")
	// ErrBadRequest: an admin request is malformed (a diagnostic
	// provider may also return it, e.g. for an unknown model).
	ErrBadRequest = errors.New("config: bad request")
	// ErrClosed: the store was shut down.
	ErrClosed = errors.New("config: store closed")
	// ErrInvalidStoreConfig: a StoreConfig or ServerConfig failed Validate.
	ErrInvalidStoreConfig = errors.New("config: invalid store config")
	// ErrBadCommand: a raft log entry or forwarded command could not be
	// decoded.
	ErrBadCommand = errors.New("config: malformed command")
)

// FieldError is one invalid field of a RoutingConfig. Path uses the
// document's JSON names, e.g. models["chat"].replicas[1].url.
type FieldError struct {
	Path string
	Err  error
}

func (e *FieldError) Error() string {
	return ErrInvalidConfig.Error() + ": " + e.Path + ": " + strings.TrimPrefix(e.Err.Error(), ErrInvalidConfig.Error()+": ")
}

// Unwrap makes errors.Is(err, ErrInvalidConfig) hold, and keeps the cause
// (for example route.ErrInvalidConfig) reachable.
func (e *FieldError) Unwrap() []error { return []error{ErrInvalidConfig, e.Err} }
