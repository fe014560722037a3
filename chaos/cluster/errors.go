package cluster

import "errors"

var (
	// ErrInvalidConfig wraps every Config.Validate failure.
	ErrInvalidConfig = errors.New("cluster: invalid config")
	// ErrNotConverged: AwaitTruth's deadline passed before every
	// gateway-engine pair satisfied the predicate.
	ErrNotConverged = errors.New("cluster: ground truth not reached")
	// ErrShutdown is returned by operations after Shutdown.
	ErrShutdown = errors.New("cluster: shut down")
)
