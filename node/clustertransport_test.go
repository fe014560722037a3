package node

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/stretchr/testify/require"

	kvsync "github.com/kvmesh/kvmesh/sync"
	"github.com/kvmesh/kvmesh/sync/config"
)

// TestClusterInjectedTransports runs two gateways whose gossip goes over
// a sync.MemNetwork and whose raft goes over raft.InmemTransport
// (ClusterConfig.GossipTransport and RaftTransport): each advertises the
// injected transports' addresses (gossip join address, raft address in its
// metadata and in the raft configuration), a config write through the
// follower applies on both, and once both links are cut a write is
// refused with ErrNoQuorum (each side is a minority of two voters).
func TestClusterInjectedTransports(t *testing.T) {
	if testing.Short() {
		t.Skip("starts two clustered gateways")
	}
	s := startSimM(t)
	var mem kvsync.MemNetwork
	addrA, ta := raft.NewInmemTransport("raft-a")
	addrB, tb := raft.NewInmemTransport("raft-b")
	ta.Connect(addrB, tb)
	tb.Connect(addrA, ta)
	t.Cleanup(func() {
		_ = ta.Close()
		_ = tb.Close()
	})

	cfgA := gwConfig("a", t.TempDir(), nil, 2, simReplica("e0", s))
	cfgA.Cluster.GossipTransport = mem.NewTransport("a")
	cfgA.Cluster.RaftTransport = ta
	// An address no test could bind: proof that the injected transports,
	// not these, are used.
	cfgA.Cluster.GossipAddr, cfgA.Cluster.RaftAddr = "192.0.2.1:7946", "192.0.2.1:7949"
	a, _ := startGateway(t, cfgA)
	gossipA := a.Cluster().GossipAddr()
	require.True(t, strings.HasPrefix(gossipA, "127.0.0.1:"), gossipA)
	require.Equal(t, string(addrA), a.ConfigStore().RaftAddr())

	cfgB := gwConfig("b", t.TempDir(), []string{gossipA}, 2, simReplica("e0", s))
	cfgB.Cluster.GossipTransport = mem.NewTransport("b")
	cfgB.Cluster.RaftTransport = tb
	b, _ := startGateway(t, cfgB)
	waitReady(t, a, b)

	for _, n := range []*Node{a, b} {
		require.Eventually(t, func() bool { return len(n.Cluster().Members()) == 2 }, 10*time.Second, 5*time.Millisecond)
		raftAddrs := map[string]string{}
		for _, m := range n.Cluster().Members() {
			raftAddrs[m.Name] = m.Meta.RaftAddr
		}
		require.Equal(t, map[string]string{"a": string(addrA), "b": string(addrB)}, raftAddrs, "raft addresses in %s's gossip view", n.NodeID())
	}
	require.Eventually(t, func() bool {
		ms := a.ConfigStore().Members()
		if len(ms) != 2 {
			return false
		}
		for _, m := range ms {
			if m.Suffrage != config.SuffrageVoter || m.RaftAddr != "raft-"+m.ID {
				return false
			}
		}
		return true
	}, 10*time.Second, 5*time.Millisecond, "both gateways are raft voters at their inmem addresses")

	follower := a
	if a.ConfigStore().IsLeader() {
		follower = b
	}
	code, out := admin(t, follower, http.MethodPatch, "/admin/v1/config", `{"prefix_cache":{"imbalance_abs_count":23}}`)
	require.Equal(t, http.StatusOK, code, out)
	for _, n := range []*Node{a, b} {
		require.Eventually(t, func() bool {
			v := n.ConfigStore().Current()
			return v.Config != nil && v.Config.PrefixCache.ImbalanceAbsCount == 23
		}, 10*time.Second, 5*time.Millisecond)
	}

	// Cut raft both ways (gossip too): neither side has a quorum.
	mem.Partition("a", "b")
	ta.Disconnect(addrB)
	tb.Disconnect(addrA)
	require.Eventually(t, func() bool {
		id, _ := follower.ConfigStore().Leader()
		return id == ""
	}, 10*time.Second, 5*time.Millisecond, "the cut follower forgets the leader")
	start := time.Now()
	_, err := follower.ConfigStore().Patch(context.Background(), []byte(`{"prefix_cache":{"imbalance_abs_count":24}}`), nil)
	require.True(t, errors.Is(err, config.ErrNoQuorum), "write without a quorum: %v", err)
	require.Less(t, time.Since(start), 10*time.Second)
}
