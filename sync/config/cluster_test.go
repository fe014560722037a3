package config

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const testToken = "s3cret-admin-token"

// testNode is one gateway of a test cluster: a Store, its admin Server
// and a real gRPC server on 127.0.0.1:0.
type testNode struct {
	id     string
	dir    string
	store  *Store
	srv    *Server
	gs     *grpc.Server
	admin  string
	reg    *prometheus.Registry
	served sync.WaitGroup
	trans  *raft.InmemTransport // non-nil in in-memory clusters
	down   bool
}

// testCluster is a set of nodes sharing a StaticMembership.
type testCluster struct {
	t       *testing.T
	members *StaticMembership
	nodes   []*testNode
	tune    func(*StoreConfig)
	srvTune func(*ServerConfig)
	inmem   bool
	expect  int
	grpcTLS TLSFiles
}

func newCluster(t *testing.T, n, expect int, inmem bool, tune func(*StoreConfig)) *testCluster {
	t.Helper()
	return newClusterWith(t, &testCluster{expect: expect, inmem: inmem, tune: tune}, n)
}

// newClusterWith starts n nodes configured by c's fields.
func newClusterWith(t *testing.T, c *testCluster, n int) *testCluster {
	t.Helper()
	c.t = t
	if c.members == nil {
		c.members = NewStaticMembership()
	}
	for i := range n {
		c.nodes = append(c.nodes, &testNode{id: fmt.Sprintf("n%d", i), dir: t.TempDir()})
	}
	for _, nd := range c.nodes {
		c.start(nd)
	}
	if c.inmem {
		c.heal()
	}
	t.Cleanup(c.stopAll)
	return c
}

func testLogger(t *testing.T, id string) *slog.Logger {
	if os.Getenv("KVMESH_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("test", t.Name())
	}
	return slog.New(slog.DiscardHandler)
}

// start (re)starts nd with its data dir, on fresh ports.
func (c *testCluster) start(nd *testNode) {
	t := c.t
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	nd.admin = lis.Addr().String()
	nd.reg = prometheus.NewRegistry()
	cfg := LocalStoreConfig()
	cfg.NodeID = nd.id
	cfg.DataDir = nd.dir
	cfg.BootstrapExpect = c.expect
	cfg.Membership = c.members
	cfg.Forward = ClientOptions{Token: testToken}
	cfg.Logger = testLogger(t, nd.id)
	cfg.Registerer = nd.reg
	if c.inmem {
		var addr raft.ServerAddress // a restarted node keeps its address
		if nd.trans != nil {
			addr = nd.trans.LocalAddr()
		}
		_, nd.trans = raft.NewInmemTransport(addr)
		cfg.Transport = nd.trans
	}
	if c.tune != nil {
		c.tune(&cfg)
	}
	nd.store, err = Open(cfg)
	require.NoError(t, err)
	scfg := ServerConfig{Token: testToken, Logger: cfg.Logger}
	if c.srvTune != nil {
		c.srvTune(&scfg)
	}
	nd.srv, err = NewServer(nd.store, scfg)
	require.NoError(t, err)
	nd.gs, err = NewGRPCServer(nd.srv, c.grpcTLS)
	require.NoError(t, err)
	nd.served.Add(1)
	go func() {
		defer nd.served.Done()
		_ = nd.gs.Serve(lis)
	}()
	nd.down = false
	c.members.Upsert(Member{ID: nd.id, RaftAddr: nd.store.RaftAddr(), AdminAddr: nd.admin})
}

// stop kills nd: it leaves membership, its gRPC server and store stop.
// A node whose first start failed part way (its store did not open, say
// on a full disk) has no server or store yet: the cleanup stops what it
// has, so the test reports the start's error instead of a nil
// dereference.
func (c *testCluster) stop(nd *testNode) {
	if nd.down {
		return
	}
	nd.down = true
	c.members.Remove(nd.id)
	if nd.gs != nil {
		nd.gs.Stop()
	}
	nd.served.Wait()
	if nd.store != nil {
		require.NoError(c.t, nd.store.Shutdown())
		require.NoError(c.t, nd.store.Shutdown(), "Shutdown is idempotent")
	}
}

func (c *testCluster) stopAll() {
	for _, nd := range c.nodes {
		c.stop(nd)
	}
	if c.inmem {
		for _, nd := range c.nodes {
			_ = nd.trans.Close()
		}
	}
}

func (c *testCluster) live() []*testNode {
	var out []*testNode
	for _, nd := range c.nodes {
		if !nd.down {
			out = append(out, nd)
		}
	}
	return out
}

// waitLeader waits until every live node agrees on one leader among them
// and returns it.
func (c *testCluster) waitLeader(within time.Duration) *testNode {
	c.t.Helper()
	var leader *testNode
	require.Eventually(c.t, func() bool {
		leader = nil
		var id string
		for _, nd := range c.live() {
			lid, _ := nd.store.Leader()
			if lid == "" || (id != "" && lid != id) {
				return false
			}
			id = lid
		}
		for _, nd := range c.live() {
			if nd.id == id && nd.store.IsLeader() {
				leader = nd
			}
		}
		return leader != nil
	}, within, 10*time.Millisecond, "no agreed leader")
	return leader
}

func (c *testCluster) follower() *testNode {
	for _, nd := range c.live() {
		if !nd.store.IsLeader() {
			return nd
		}
	}
	c.t.Fatal("no follower")
	return nil
}

// waitVersion waits until every node in nodes has applied version v.
func (c *testCluster) waitVersion(v uint64, nodes ...*testNode) {
	c.t.Helper()
	require.Eventually(c.t, func() bool {
		for _, nd := range nodes {
			if nd.store.Current().Version != v {
				return false
			}
		}
		return true
	}, 5*time.Second, 5*time.Millisecond, "version %d not applied everywhere", v)
}

func (nd *testNode) client(t *testing.T, token string) *Client {
	t.Helper()
	cl, err := Dial(nd.admin, ClientOptions{Token: token})
	require.NoError(t, err)
	t.Cleanup(func() { _ = cl.Close() })
	return cl
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// steadyRaft gives a test cluster raft timeouts that a busy machine does
// not trip: for tests that assert the leader or term did NOT change, or that
// a write commits in one go. LocalStoreConfig's 200 ms heartbeat and 100 ms
// lease are for tests about elections; under -race on an oversubscribed
// 2-core machine a goroutine can stall that long, the leader steps down and
// such tests fail on an election nobody caused ("leadership unchanged",
// "leadership lost while committing", "leadership transfer timeout").
func steadyRaft(cfg *StoreConfig) {
	cfg.HeartbeatTimeout = 2 * time.Second
	cfg.ElectionTimeout = 2 * time.Second
	cfg.LeaderLeaseTimeout = time.Second
}

// electionBound is how long a new leader may take: raft picks an election
// timeout in [ElectionTimeout, 2·ElectionTimeout) after HeartbeatTimeout of
// silence; a few rounds may split on a loaded 2-core machine.
func electionBound(cfg StoreConfig) time.Duration {
	return cfg.HeartbeatTimeout + 6*cfg.ElectionTimeout + 2*time.Second
}
