package suite

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/hashicorp/raft"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/proto/adminpb"
	peerv1 "github.com/kvmesh/kvmesh/proto/peer/v1"
	kvsync "github.com/kvmesh/kvmesh/sync"
	"github.com/kvmesh/kvmesh/sync/trust"
)

// intruderSink is the intruder's own listener, which it advertises as its
// peer, raft, admin and NATS route address in the gossip metadata it
// tries to join with: a gateway that took the intruder for a member would
// dial it (snapshot pulls, raft replication, NATS routes) and could send
// it a credential. It records every connection and byte.
type intruderSink struct {
	ln    net.Listener
	conns atomic.Int64
	bytes atomic.Int64
	token atomic.Bool // the admin token was among the bytes
	done  chan struct{}
}

func newIntruderSink(t *R) *intruderSink {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &intruderSink{ln: ln, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.conns.Add(1)
			_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
			b, _ := io.ReadAll(c)
			_ = c.Close()
			s.bytes.Add(int64(len(b)))
			if strings.Contains(string(b), cluster.AdminToken) {
				s.token.Store(true)
			}
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); <-s.done })
	return s
}

// intruderDelegate advertises the sink in kvmesh's node metadata format.
type intruderDelegate struct{ meta []byte }

func (d intruderDelegate) NodeMeta(int) []byte                { return d.meta }
func (intruderDelegate) NotifyMsg([]byte)                     {}
func (intruderDelegate) GetBroadcasts(int, int) [][]byte      { return nil }
func (intruderDelegate) LocalState(bool) []byte               { return nil }
func (intruderDelegate) MergeRemoteState([]byte, bool)        {}
func (intruderDelegate) String() string                       { return "intruder" }
func (d intruderDelegate) withMeta(m []byte) intruderDelegate { d.meta = m; return d }

// Intruder (scenario 9): a process without the cluster key replays
// the attacks of issue 14 against a three-gateway cluster under load: raft
// heartbeats and AppendEntries (carrying a config of its own) to a
// follower and to the leader, a gossip join advertising its own peer,
// raft and NATS addresses, NATS client and route connections, peer gRPC
// calls in plaintext and with a certificate of another key, admin gRPC
// calls without the token. Then a real member that does not own engine
// e0 sends a forged reset and a batch with seq 2^40 for it. Invariants:
// each attempt is refused and counted on the gateways; the config
// version, leader and membership are unchanged; no request is lost or
// fails; every view is exact after the attacks (the forged reset cleared
// nothing) and still follows the engines afterwards (the 2^40 seq stalled
// nothing); the intruder's listener received no connection, so no token
// and no config.
func intruder(t *R) {
	c := startClusterMode(t, 3, 2, nil)
	ctx := context.Background()
	sink := newIntruderSink(t)
	_, _ = settle(t, c, "baseline")
	before := c.ConfigVersions()
	// A loaded machine can hold an election right after settling: wait
	// for a leader rather than expect one at this instant.
	var leader, follower *cluster.Gateway
	require.Eventually(t, func() bool { leader = leaderOf(c.Gateways()); return leader != nil },
		10*time.Second, 5*time.Millisecond, "a raft leader")
	for _, g := range c.Gateways() {
		if g != leader {
			follower = g
			break
		}
	}
	rounds := t.Scale(1, 5)

	lc := loadConfig(c, "intruder", t.Scale(120, 900))
	load, err := cluster.StartLoad(ctx, lc)
	require.NoError(t, err)
	defer load.Stop()

	count := func(name string, match map[string]string) float64 { return c.GatewayCounter(name, match) }
	raftUnauth := map[string]string{"kind": "unauthenticated"}
	var notes []string

	for round := range rounds {
		// 1. Raft: heartbeat to learn the term, then AppendEntries with a
		// config that points the model at the intruder, to a follower and
		// to the leader.
		r0 := count("kvmesh_config_raft_transport_errors_total", raftUnauth)
		plain, err := raft.NewTCPTransport("127.0.0.1:0", nil, 1, 2*time.Second, io.Discard)
		require.NoError(t, err)
		evil := fmt.Sprintf(`{"models":{"%s":{"replicas":[{"name":"evil","url":"http://%s"}]}}}`, c.Config().Model, sink.ln.Addr())
		for _, g := range []*cluster.Gateway{follower, leader} {
			addr := raft.ServerAddress(g.Node.ConfigStore().RaftAddr())
			var resp raft.AppendEntriesResponse
			require.Error(t, plain.AppendEntries(raft.ServerID(g.Name), addr, &raft.AppendEntriesRequest{
				RPCHeader: raft.RPCHeader{ID: []byte("intruder"), Addr: []byte(sink.ln.Addr().String())}, Term: 1 << 20}, &resp))
			require.Error(t, plain.AppendEntries(raft.ServerID(g.Name), addr, &raft.AppendEntriesRequest{
				RPCHeader: raft.RPCHeader{ID: []byte("intruder"), Addr: []byte(sink.ln.Addr().String())}, Term: 1 << 20,
				Entries: []*raft.Log{{Index: 1 << 20, Term: 1 << 20, Type: raft.LogCommand, Data: []byte(evil)}}}, &resp))
		}
		require.NoError(t, plain.Close())
		rN := awaitCounter(t, c, "kvmesh_config_raft_transport_errors_total", raftUnauth, r0+4) - r0

		// 2. Gossip: join with metadata that names the intruder's listener.
		g0 := count("kvmesh_sync_gossip_rejected_total", nil)
		meta, err := kvsync.AppendMeta(nil, kvsync.NodeMeta{Cluster: "kvmesh", Version: "dev", PeerAddr: sink.ln.Addr().String(),
			RaftAddr: sink.ln.Addr().String(), AdminAddr: sink.ln.Addr().String(), NATSRoute: "nats-route://" + sink.ln.Addr().String()},
			memberlist.MetaMaxSize)
		require.NoError(t, err)
		mc := memberlist.DefaultLocalConfig()
		mc.Name = fmt.Sprintf("a-intruder-%d", round) // sorts first: the bootstrap order the issue abused
		mc.BindAddr, mc.BindPort = "127.0.0.1", 0
		mc.Delegate = intruderDelegate{}.withMeta(meta)
		mc.LogOutput = io.Discard
		ml, err := memberlist.Create(mc)
		require.NoError(t, err)
		_, err = ml.Join([]string{c.Gateways()[0].Node.Cluster().GossipAddr()})
		require.Error(t, err, "gossip join without the key")
		require.NoError(t, ml.Shutdown())
		gN := awaitCounter(t, c, "kvmesh_sync_gossip_rejected_total", nil, g0+1) - g0

		// 3. NATS client port of every gateway, and a foreign server
		// routing into every gateway's route port.
		n0 := count("kvmesh_sync_nats_rejected_total", map[string]string{"port": "client"})
		r1 := count("kvmesh_sync_nats_rejected_total", map[string]string{"port": "route"})
		for _, g := range c.Gateways() {
			self := selfMeta(t, g)
			nc, err := nats.Connect(self.NATSClient, nats.Name("intruder"), nats.Timeout(2*time.Second))
			if err == nil {
				nc.Close()
			}
			require.Error(t, err, "NATS client without the key on %s", g.Name)
			u, err := url.Parse(self.NATSRoute)
			require.NoError(t, err)
			s, err := natsserver.NewServer(&natsserver.Options{ServerName: "intruder-" + g.Name, Host: "127.0.0.1", Port: -1,
				NoLog: true, NoSigs: true, Cluster: natsserver.ClusterOpts{Name: "kvmesh", Host: "127.0.0.1", Port: -1},
				Routes: []*url.URL{u}})
			require.NoError(t, err)
			s.Start()
			require.True(t, s.ReadyForConnections(5*time.Second))
			want := r1 + 1
			awaitCounter(t, c, "kvmesh_sync_nats_rejected_total", map[string]string{"port": "route"}, want)
			r1 = want
			require.Zero(t, s.NumRoutes(), "the foreign server routes nowhere")
			s.Shutdown()
			s.WaitForShutdown()
		}
		nN := awaitCounter(t, c, "kvmesh_sync_nats_rejected_total", map[string]string{"port": "client"}, n0+3) - n0

		// 4. Peer gRPC without credentials and with another key's
		// certificate; admin gRPC without the token.
		p0 := count("kvmesh_sync_peer_unauthenticated_total", nil)
		a0 := count("kvmesh_config_admin_rejected_total", map[string]string{"api": "grpc"})
		other := otherRing(t)
		for _, g := range c.Gateways() {
			for _, conn := range []*grpc.ClientConn{grpcConn(t, g.Node.Cluster().PeerAddr(), ""),
				dialTLS(t, g.Node.Cluster().PeerAddr(), other)} {
				cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				st, err := peerv1.NewPeerClient(conn).Snapshot(cctx, &peerv1.SnapshotRequest{Cluster: "kvmesh", Requester: "intruder"})
				if err == nil {
					_, err = st.Recv()
				}
				require.Equal(t, codes.Unavailable, status.Code(err), "peer snapshot without the key: %v", err)
				_, err = adminpb.NewAdminClient(conn).Status(cctx, &adminpb.StatusRequest{})
				require.Error(t, err, "status probe on the peer port without the key")
				cancel()
				require.NoError(t, conn.Close())
			}
			conn := grpcConn(t, g.Node.AdminAddr(), "")
			cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			_, err := adminpb.NewAdminClient(conn).GetConfig(cctx, &adminpb.GetConfigRequest{})
			require.Equal(t, codes.Unauthenticated, status.Code(err), "admin GetConfig without the token")
			_, err = adminpb.NewAdminClient(conn).SetConfig(cctx, &adminpb.SetConfigRequest{ConfigJson: []byte(evil)})
			require.Equal(t, codes.Unauthenticated, status.Code(err), "admin SetConfig without the token")
			cancel()
			require.NoError(t, conn.Close())
		}
		pN := awaitCounter(t, c, "kvmesh_sync_peer_unauthenticated_total", nil, p0+6) - p0
		aN := awaitCounter(t, c, "kvmesh_config_admin_rejected_total", map[string]string{"api": "grpc"}, a0+6) - a0
		if round == 0 {
			notes = append(notes, fmt.Sprintf("per round: raft AppendEntries to follower+leader -> %.0f unauthenticated; "+
				"gossip join -> %.0f refused; NATS client x3 -> %.0f refused, foreign route x3 -> refused; "+
				"peer gRPC plaintext+wrong key x3 -> %.0f unauthenticated; admin gRPC without token x3 -> %.0f refused", rN, gN, nN, pN, aN))
		}
	}
	res := load.Wait()
	require.Equal(t, res.Sent, res.OK, "every request served during the attacks: %s", res)
	_, _ = settle(t, c, "after the network attacks")

	// 5. A member that does not own e0 forges a reset and a seq 2^40 batch.
	forgery := forgeFromNonOwner(t, c, "e0")
	ps, err := c.Compare()
	require.NoError(t, err)
	for _, p := range ps {
		require.Equal(t, 1.0, p.Precision(), "%s/%s after the forged reset: %s", p.Gateway, p.Engine, p.Comparison)
		require.Equal(t, 1.0, p.Recall(), "%s/%s after the forged reset: %s", p.Gateway, p.Engine, p.Comparison)
	}
	// The engines' real streams still flow into every view.
	res2, err := cluster.RunLoad(ctx, loadConfig(c, "intruder-after", t.Scale(40, 200)))
	require.NoError(t, err)
	require.Equal(t, res2.Sent, res2.OK, "%s", res2)
	res.Add(res2)
	s, took := settle(t, c, "after the forged KV batches")

	require.Equal(t, before, c.ConfigVersions(), "config unchanged by the intruder")
	for _, g := range c.Gateways() {
		require.Len(t, g.Node.Cluster().Members(), 3, "no intruder among %s's members", g.Name)
	}
	require.Zero(t, sink.conns.Load(), "no gateway connected to the intruder (%d bytes)", sink.bytes.Load())
	require.False(t, sink.token.Load(), "the intruder never saw the admin token")
	notes = append(notes, forgery, fmt.Sprintf("intruder listener: %d connections, %d bytes; config %s before and after; %d rounds",
		sink.conns.Load(), sink.bytes.Load(), before, rounds))
	t.Row(cluster.Row{Scenario: "9 intruder", Load: res, Precision: s.MinPrecision, Recall: s.MinRecall, Converge: took,
		ConfigVersions: c.ConfigVersions(), Note: strings.Join(notes, "; ")})
}

// selfMeta is gateway g's own gossip metadata.
func selfMeta(t *R, g *cluster.Gateway) kvsync.NodeMeta {
	t.Helper()
	for _, m := range g.Node.Cluster().Members() {
		if m.Self {
			return m.Meta
		}
	}
	t.Fatalf("%s does not see itself", g.Name)
	return kvsync.NodeMeta{}
}

// otherRing is credentials from a key that is not the cluster's.
func otherRing(t *R) *trust.Ring {
	t.Helper()
	k, err := trust.Generate()
	require.NoError(t, err)
	keys, err := trust.ParseKeys(k)
	require.NoError(t, err)
	r, err := trust.New(keys, "intruder")
	require.NoError(t, err)
	return r
}

// dialTLS dials addr with ring's mutual-TLS credentials.
func dialTLS(t *R, addr string, ring *trust.Ring) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(ring.TLSConfig())))
	require.NoError(t, err)
	return conn
}

// forgeFromNonOwner publishes, as a member (the NATS client token of the
// cluster key) that does not own engine, a reset and a batch with seq
// 2^40 for it under that member's origin, and waits until the gateways
// that received them refused both as not_owner. It returns a note.
func forgeFromNonOwner(t *R, c *cluster.Cluster, engine string) string {
	t.Helper()
	gs := c.Gateways()
	names := make([]string, len(gs))
	for i, g := range gs {
		names[i] = g.Name
	}
	owner := kvsync.Owner(engine, names)
	var member *cluster.Gateway
	for _, g := range gs {
		if g.Name != owner {
			member = g
			break
		}
	}
	keys, err := trust.ParseKeys(c.ClusterKey())
	require.NoError(t, err)
	ring, err := trust.New(keys, "forger")
	require.NoError(t, err)
	nc, err := nats.Connect(selfMeta(t, member).NATSClient, nats.Token(ring.Secret(trust.LabelNATSClient)))
	require.NoError(t, err, "a member's own NATS connection")
	defer nc.Close()
	notOwner := map[string]string{"reason": "not_owner"}
	before := c.GatewayCounter("kvmesh_sync_kv_rejected_total", notOwner)
	now := float64(time.Now().UnixNano()) / 1e9
	subject := "kvmesh.kvmesh.kv." + engine // kvmesh.<cluster name>.kv.<replica>
	for _, b := range []kvsync.KVBatch{
		{Origin: member.Node.Cluster().Origin(), Replica: engine, SentAt: time.Now().UnixNano(), Reset: true},
		{Origin: member.Node.Cluster().Origin(), Replica: engine, Seq: 1 << 40, EngineTS: now, SentAt: time.Now().UnixNano()},
	} {
		msg, err := kvsync.AppendKV(nil, &b)
		require.NoError(t, err)
		require.NoError(t, nc.Publish(subject, msg))
	}
	require.NoError(t, nc.Flush())
	// The member itself drops its own origin; the two others refuse both.
	got := awaitCounter(t, c, "kvmesh_sync_kv_rejected_total", notOwner, before+4) - before
	return fmt.Sprintf("member %s (not %s's owner %s) sent a reset and a seq 2^40 batch -> %.0f refused not_owner", member.Name, engine, owner, got)
}
