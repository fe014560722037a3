package sync

import "errors"

// Sentinel errors. Callers match them with errors.Is; messages carry the
// "sync:" prefix and wrapped detail.
var (
	// ErrInvalidConfig is wrapped by every Config.Validate failure.
	ErrInvalidConfig = errors.New("sync: invalid config")
	// ErrMalformed is wrapped by every decoder failure: a peer message that
	// is truncated, has a wrong magic or version, or breaks a bound.
	ErrMalformed = errors.New("sync: malformed message")
	// ErrTooLarge is returned by encoders when a message would exceed the
	// wire limit.
	ErrTooLarge = errors.New("sync: message too large")
	// ErrShutdown is returned by Start after Shutdown and by calls on a
	// stopped Cluster.
	ErrShutdown = errors.New("sync: cluster shut down")
	// ErrAlreadyStarted is returned by a second Start.
	ErrAlreadyStarted = errors.New("sync: already started")
	// ErrNotStarted is returned by calls that need a running Cluster.
	ErrNotStarted = errors.New("sync: not started")
	// ErrNoPeer means no live peer could serve a snapshot.
	ErrNoPeer = errors.New("sync: no peer available")
	// ErrWrongCluster is returned by the peer service to a caller of
	// another cluster.
	ErrWrongCluster = errors.New("sync: wrong cluster")
	// ErrUnauthenticated is returned by the peer service to a call without
	// the cluster's PeerToken, and wrapped by a snapshot pull it refused.
	ErrUnauthenticated = errors.New("sync: unauthenticated")
	// ErrMetaTooLarge means the node metadata does not fit memberlist's
	// metadata limit.
	ErrMetaTooLarge = errors.New("sync: node metadata too large")
)
