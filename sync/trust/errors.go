package trust

import "errors"

var (
	// ErrNoKey means neither a key file nor KVMESH_CLUSTER_KEY gave a key.
	ErrNoKey = errors.New("trust: no cluster key")
	// ErrBadKey wraps every problem with key text (not base64, too short).
	ErrBadKey = errors.New("trust: bad cluster key")
	// ErrUntrusted wraps a peer certificate that no cluster CA signed.
	ErrUntrusted = errors.New("trust: peer does not hold the cluster key")
)
