package config

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestNoQuorumAfterAForwardIsNoQuorum: a write that found no leader to
// commit it within ApplyTimeout, the last attempt answered "not the
// leader" by a peer (a remote error, which carries that peer's gRPC
// status), goes to the client as NO_QUORUM: retry later. Taking the inner
// status instead sent NOT_LEADER (ci210: kvbench's mode switch did not
// recognise a leader election and gave up).
func TestNoQuorumAfterAForwardIsNoQuorum(t *testing.T) {
	fromLeader := fromStatus(toStatus(fmt.Errorf("forward: %w", ErrNotLeader))) // as Store.forward returns it
	require.ErrorIs(t, fromLeader, ErrNotLeader)
	err := fmt.Errorf("%w: after %v: %w", ErrNoQuorum, 3*time.Second, fromLeader) // as Store.Apply wraps it

	wire := toStatus(err)
	st, ok := status.FromError(wire)
	require.True(t, ok)
	require.Equal(t, codes.Unavailable, st.Code())
	require.Equal(t, err.Error(), st.Message(), "the whole story reaches the client")
	got := fromStatus(wire)
	require.ErrorIs(t, got, ErrNoQuorum)
	require.False(t, errors.Is(got, ErrNotLeader), "the client must not take it for a redirect")

	// A remote error alone keeps its own meaning, and a bare gRPC status
	// (a transport failure) passes unchanged.
	require.ErrorIs(t, fromStatus(toStatus(fromLeader)), ErrNotLeader)
	bare := status.Error(codes.Unavailable, "connection refused")
	require.Equal(t, bare, toStatus(bare))
}
