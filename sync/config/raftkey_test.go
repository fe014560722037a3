package config

import (
	"io"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/sync/trust"
)

func testKeys(t *testing.T) [][]byte {
	t.Helper()
	k, err := trust.Generate()
	require.NoError(t, err)
	keys, err := trust.ParseKeys(k)
	require.NoError(t, err)
	return keys
}

func testRing(t *testing.T, keys [][]byte, node string) *trust.Ring {
	t.Helper()
	r, err := trust.New(keys, node)
	require.NoError(t, err)
	return r
}

// TestRaftTransportRequiresClusterKey: a cluster whose raft runs under the
// cluster key commits as usual; the attack (a raft client that
// heartbeats a node to learn its term, then sends AppendEntries with a
// config of its own) is refused on the follower and on the leader, in
// plaintext and with a certificate of another key: each connection is
// closed before raft reads it and counted as kind "unauthenticated", and
// config, leader and term stay as they were.
func TestRaftTransportRequiresClusterKey(t *testing.T) {
	keys := testKeys(t)
	c := newCluster(t, 3, 3, false, func(cfg *StoreConfig) {
		steadyRaft(cfg) // the test asserts leader and term did not change
		cfg.Trust = testRing(t, keys, cfg.NodeID)
	})
	leader := c.waitLeader(20 * time.Second)
	v, err := leader.client(t, testToken).SetConfig(ctxT(t, 10*time.Second), ptr(testConfig()), nil)
	require.NoError(t, err)
	c.waitVersion(v, c.nodes...)
	follower := c.follower()
	term := leader.store.raft.CurrentTerm()

	plain, err := raft.NewTCPTransport("127.0.0.1:0", nil, 1, 2*time.Second, io.Discard)
	require.NoError(t, err)
	defer plain.Close()
	other := testRing(t, testKeys(t), "intruder")
	layer, err := newTLSStreamLayer("127.0.0.1:0", nil, other.TLSConfig(), other.TLSConfig(), nil)
	require.NoError(t, err)
	wrongKey := raft.NewNetworkTransport(layer, 1, 2*time.Second, io.Discard)
	defer wrongKey.Close()

	unauth := func(nd *testNode) float64 {
		return counterValue(t, nd.store.metrics.raftTransportErrors.WithLabelValues("unauthenticated"))
	}
	decode := func(nd *testNode) float64 {
		return counterValue(t, nd.store.metrics.raftTransportErrors.WithLabelValues("decode"))
	}
	evil := testConfig()
	evil.Strategy = "random"
	forged, err := encodeCommand(SetCommand(evil, nil))
	require.NoError(t, err)
	for _, target := range []*testNode{follower, leader} {
		for name, tr := range map[string]*raft.NetworkTransport{"plaintext": plain, "wrong key": wrongKey} {
			before := unauth(target)
			addr := raft.ServerAddress(target.store.RaftAddr())
			var hb raft.AppendEntriesResponse
			err := tr.AppendEntries(raft.ServerID(target.id), addr, &raft.AppendEntriesRequest{
				RPCHeader: raft.RPCHeader{ID: []byte("intruder"), Addr: []byte("127.0.0.1:1")}, Term: term + 1}, &hb)
			require.Error(t, err, "%s heartbeat to %s", name, target.id)
			var resp raft.AppendEntriesResponse
			err = tr.AppendEntries(raft.ServerID(target.id), addr, &raft.AppendEntriesRequest{
				RPCHeader: raft.RPCHeader{ID: []byte("intruder"), Addr: []byte("127.0.0.1:1")},
				Term:      term + 1, PrevLogEntry: leader.store.raft.LastIndex(), PrevLogTerm: term,
				Entries: []*raft.Log{{Index: leader.store.raft.LastIndex() + 1, Term: term + 1, Type: raft.LogCommand, Data: forged}},
			}, &resp)
			require.Error(t, err, "%s AppendEntries to %s", name, target.id)
			require.Eventually(t, func() bool { return unauth(target) >= before+2 }, 5*time.Second, 5*time.Millisecond,
				"%s connections to %s counted", name, target.id)
		}
		require.Zero(t, decode(target), "raft never read the intruder's bytes")
	}
	for _, nd := range c.nodes {
		require.Equal(t, v, nd.store.Current().Version, "config unchanged on %s", nd.id)
	}
	require.Equal(t, leader, c.waitLeader(5*time.Second), "leadership unchanged")
	require.Equal(t, term, leader.store.raft.CurrentTerm(), "no term bump from the intruder")
	v2, err := leader.client(t, testToken).PatchConfig(ctxT(t, 10*time.Second), []byte(`{"strategy":"random"}`), nil)
	require.NoError(t, err, "the cluster still commits")
	c.waitVersion(v2, c.nodes...)
}
