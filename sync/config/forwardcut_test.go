package config

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/kvmesh/kvmesh/proto/adminpb"
)

// stallingForwarder is a leader's Forward that never answers: it reports
// each call on entered and holds it until the caller's side goes away.
type stallingForwarder struct {
	adminpb.UnimplementedAdminServer
	entered chan struct{}
}

func (f *stallingForwarder) Forward(ctx context.Context, _ *adminpb.ForwardRequest) (*adminpb.ApplyResponse, error) {
	f.entered <- struct{}{}
	<-ctx.Done()
	return nil, ctx.Err()
}

// TestForwardCutMidCallIsNoQuorum: a follower's forwarded write whose
// connection to the leader this node closes during the call (pruneClients,
// when membership stops listing the address it was sent to: under load a
// memberlist flap does that) fails with ErrNoQuorum, "may still apply",
// as a timeout does, so callers retry an idempotent write instead of
// failing on a raw gRPC Canceled (ci481: kvbench's index-mode switch did).
func TestForwardCutMidCallIsNoQuorum(t *testing.T) {
	c := newCluster(t, 3, 3, false, steadyRaft)
	leader := c.waitLeader(10 * time.Second)
	f := c.follower()

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	stall := &stallingForwarder{entered: make(chan struct{}, 1)}
	gs := grpc.NewServer()
	adminpb.RegisterAdminServer(gs, stall)
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)

	// The follower now sends forwarded writes to the stalling address.
	real := Member{ID: leader.id, RaftAddr: leader.store.RaftAddr(), AdminAddr: leader.admin}
	moved := real
	moved.ForwardAddr = lis.Addr().String()
	c.members.Upsert(moved)

	type result struct {
		v   uint64
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := f.store.Patch(context.Background(), []byte(`{"prefix_cache":{"imbalance_abs_count":41}}`), nil)
		done <- result{v, err}
	}()
	select {
	case <-stall.entered:
	case r := <-done:
		t.Fatalf("the write ended before it reached the stalling leader: %d, %v", r.v, r.err)
	case <-time.After(20 * time.Second):
		t.Fatal("the forwarded write never reached the stalling leader")
	}
	// Membership lists the leader's own address again: the follower's
	// store prunes its client to the stalling one, with the call in it.
	c.members.Upsert(real)

	var r result
	select {
	case r = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("the write did not end after its connection was closed")
	}
	require.ErrorIs(t, r.err, ErrNoQuorum)
	require.True(t, strings.Contains(r.err.Error(), "closed during the call"), "%v", r.err)
	require.Zero(t, r.v)
}
