package node

import "errors"

// Sentinel errors. Callers match them with errors.Is; messages carry the
// "node:" prefix and wrapped detail.
var (
	// ErrInvalidConfig is wrapped by every Config.Validate failure.
	ErrInvalidConfig = errors.New("node: invalid config")
	// ErrBadReplicaSpec is returned by ParseReplicaSpec for a malformed
	// "name=url[,key=value...]" flag value.
	ErrBadReplicaSpec = errors.New("node: bad replica spec")
	// ErrAlreadyStarted is returned by a second call to Start.
	ErrAlreadyStarted = errors.New("node: already started")
	// ErrShutdown is returned by Start after Shutdown.
	ErrShutdown = errors.New("node: shut down")
	// ErrNoHealthyReplica means every replica of a model is ejected or down.
	ErrNoHealthyReplica = errors.New("node: no healthy replica")
	// ErrUpstream wraps failures talking to a replica.
	ErrUpstream = errors.New("node: upstream failure")
	// ErrRaftLog means the config store's raft log on disk cannot be read
	// at start (cluster mode).
	ErrRaftLog = errors.New("node: raft log unreadable")
	// ErrRemoteTokenize wraps failures of the engine's /tokenize endpoint.
	ErrRemoteTokenize = errors.New("node: remote tokenize failed")
)
