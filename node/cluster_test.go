package node

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/internal/admintest"
	kvsync "github.com/kvmesh/kvmesh/sync"
	"github.com/kvmesh/kvmesh/sync/trust"
)

const testToken = "test-admin-token"

// testClusterKey is the cluster key of the test gateways (one per test
// binary, as an operator makes one per cluster with kvmesh keygen).
var testClusterKey = func() string {
	k, err := trust.Generate()
	if err != nil {
		panic(err)
	}
	return k
}()

// gwConfig is one gateway of a loopback test cluster: real memberlist,
// embedded NATS and raft on 127.0.0.1 port 0, history mode over the
// simulator's byte tokenizer (16-token blocks, as its KV events).
func gwConfig(id, dataDir string, join []string, expect int, reps ...ReplicaConfig) Config {
	cfg := testConfig()
	cfg.Models = []ModelConfig{{Name: "m", Replicas: reps}}
	cfg.Tokenizer = TokenizerCharacter
	cfg.BlockSize = 16
	cfg.Cluster.Enabled = true
	cfg.Cluster.NodeID = id
	cfg.Cluster.DataDir = dataDir
	cfg.Cluster.Join = join
	cfg.Cluster.BootstrapExpect = expect
	cfg.Cluster.AdminToken = testToken
	cfg.Cluster.ClusterKey = testClusterKey
	return cfg
}

// startGateway starts a gateway of cfg; the returned stop is idempotent
// and also runs at cleanup.
func startGateway(t testing.TB, cfg Config) (*Node, func()) {
	t.Helper()
	var logger *slog.Logger
	if os.Getenv("KVMESH_TEST_LOG") != "" { // KVMESH_TEST_LOG=1 go test -v: gateway logs on stderr
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})).
			With("gw", cfg.Cluster.NodeID)
	}
	n, err := New(cfg, logger)
	require.NoError(t, err)
	require.NoError(t, n.Start(context.Background()))
	stop := func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, n.Shutdown(ctx))
	}
	t.Cleanup(stop)
	return n, stop
}

func stopNode(t testing.TB, n *Node) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, n.Shutdown(ctx))
}

func startSimM(t testing.TB) *sim.Server {
	t.Helper()
	return startSim(t, true)
}

// confirmedOn is how many of prompt's leading blocks n's index holds as
// confirmed (KV-event) entries of replica.
func confirmedOn(n *Node, replica, prompt string) int {
	id, ok := n.ids.ReplicaID(replica)
	if !ok {
		return -1
	}
	h := n.Index().Hasher()
	keys := h.AppendKeysString(nil, h.Root("m", "", ""), prompt)
	out := make([]int32, 1)
	n.Index().Match(keys, []index.ReplicaID{id}, index.ModeKVEvents, time.Now().UnixNano(), out)
	return int(out[0])
}

// gaugeValue reads a gauge from n's registry by name (0 when absent).
func gaugeValue(t testing.TB, n *Node, name string) float64 {
	t.Helper()
	mfs, err := n.Registry().Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) > 0 {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return 0
}

// sendToEngine runs prompt on the engine directly (not through a gateway),
// so only its KV events can tell the gateways about it.
func sendToEngine(t testing.TB, s *sim.Server, prompt string) {
	t.Helper()
	body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":1}`, prompt)
	resp, err := http.Post(s.URL()+"/v1/completions", "application/json", strings.NewReader(body))
	require.NoError(t, err)
	out := readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, out)
}

// admin calls the HTTP admin API of n. A write answered 503 no_quorum
// (raft between leaders: on a loaded 2-core machine short test timeouts
// can make leadership move) is retried until a leader answers, for up to
// 15 s, as a client would; retried reports whether that happened (the
// first attempt "may still apply").
func admin(t testing.TB, n *Node, method, path, body string) (code int, out string) {
	t.Helper()
	code, out, _ = adminRetry(t, n, method, path, body)
	return code, out
}

func adminRetry(t testing.TB, n *Node, method, path, body string) (code int, out string, retried bool) {
	t.Helper()
	code, b, retried := admintest.Call(t, method, "http://"+n.HTTPAddr()+path, testToken, body)
	return code, string(b), retried
}

func memberNames(ns []*Node) []string {
	var out []string
	for _, n := range ns {
		if n != nil {
			out = append(out, n.NodeID())
		}
	}
	return out
}

// settleCluster waits until every gateway sees all the others and one
// decision has reached every index (the embedded NATS servers finished
// routing to each other): Ready means joined, not that gossip and routes
// reached everyone.
func settleCluster(t testing.TB, gws []*Node) {
	t.Helper()
	for _, g := range gws {
		ok := assert.Eventually(t, func() bool { return len(g.Cluster().Members()) == len(gws) }, 10*time.Second, time.Millisecond)
		require.True(t, ok, "%s lists members %v", g.NodeID(), memberList(g))
	}
	warm := "warm-up " + strings.Repeat("w", 64)
	resp := post(t, gws[len(gws)-1], "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":1}`, warm), nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	pick := resp.Header.Get(HeaderReplica)
	readAll(t, resp)
	h := gws[0].Index().Hasher()
	keys := h.AppendKeysString(nil, h.Root("m", "", ""), warm)
	out := make([]int32, 1)
	for _, g := range gws {
		id, ok := g.ReplicaID(pick)
		require.True(t, ok)
		require.Eventually(t, func() bool {
			g.Index().Match(keys, []index.ReplicaID{id}, index.ModeHistory, time.Now().UnixNano(), out)
			return int(out[0]) == len(keys)
		}, 10*time.Second, time.Millisecond, "warm-up decision on %s never reached %s (members %d, NATS %v)",
			gws[len(gws)-1].NodeID(), g.NodeID(), len(g.Cluster().Members()), g.Cluster().NATSConnected())
	}
}

// memberList lists the gateways g's membership holds, for failure messages.
func memberList(g *Node) []string {
	var names []string
	for _, m := range g.Cluster().Members() {
		names = append(names, m.Name)
	}
	return names
}

func waitReady(t testing.TB, ns ...*Node) {
	t.Helper()
	require.Eventually(t, func() bool {
		for _, n := range ns {
			if !n.Ready() {
				return false
			}
		}
		return true
	}, 30*time.Second, 10*time.Millisecond, "gateways not ready")
}

// TestClusterThreeGateways runs three gateways in one process with real
// memberlist, embedded NATS, raft and simulated engines, and walks the
// cluster through convergence, KV ownership and its handover, restart
// catch-up, a config write through a follower, and engine scale-out/in.
func TestClusterThreeGateways(t *testing.T) {
	if testing.Short() {
		t.Skip("three-gateway cluster: skipped with -short")
	}
	e1, e2, e3 := startSimM(t), startSimM(t), startSimM(t)
	reps := []ReplicaConfig{simReplica("e1", e1), simReplica("e2", e2)}
	dirs := []string{t.TempDir(), t.TempDir(), t.TempDir()}
	ids := []string{"gw-a", "gw-b", "gw-c"}

	t0 := time.Now()
	gws := make([]*Node, 3)
	stops := make([]func(), 3)
	gws[0], stops[0] = startGateway(t, gwConfig(ids[0], dirs[0], nil, 3, reps...))
	seed := []string{gws[0].Cluster().GossipAddr()}
	for i := 1; i < 3; i++ {
		gws[i], stops[i] = startGateway(t, gwConfig(ids[i], dirs[i], seed, 3, reps...))
	}
	waitReady(t, gws...)
	t.Logf("3 gateways ready (joined, bootstrapped, raft config applied) in %v", time.Since(t0).Round(time.Millisecond))
	for _, g := range gws {
		assert.NotZero(t, g.ConfigVersion(), "the seed config from flags is applied everywhere")
		assert.Equal(t, gws[0].ConfigVersion(), g.ConfigVersion())
	}
	settleCluster(t, gws)

	// (a) A decision through gateway A makes B and C route the prefix to
	// the same replica.
	prompt := "Document 1\n" + strings.Repeat("Gateways share one prefix index through deltas. ", 10)
	blocks := len(prompt) / 16
	body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":2}`, prompt)
	resp := post(t, gws[0], "/v1/completions", body, map[string]string{HeaderStrategy: "prefix-cache"})
	require.Equal(t, http.StatusOK, resp.StatusCode)
	picked := resp.Header.Get(HeaderReplica)
	readAll(t, resp)
	tc := time.Now()
	for _, g := range gws[1:] {
		require.Eventually(t, func() bool {
			rep := debugRoute(t, g, "prefix-cache", prompt)
			return rep.Pick == picked && matchedOf(rep, picked) == blocks
		}, 10*time.Second, time.Millisecond, "gateway %s did not converge", g.NodeID())
	}
	t.Logf("(a) decision via %s → %s converged on both peers in %v", ids[0], picked, time.Since(tc).Round(time.Microsecond))

	// (b) KV events: exactly one gateway ingests each engine, and all three
	// apply its events.
	var owned float64
	for _, g := range gws {
		owned += gaugeValue(t, g, "kvmesh_sync_kv_owned_sources")
		for _, name := range []string{"e1", "e2"} {
			assert.Nil(t, g.tbl.Load().byName[name].sub, "the cluster's owner ingests %s, not every gateway", name)
		}
	}
	assert.Equal(t, 2.0, owned, "two engines, one owner each")
	kvPrompt := "Document 2\n" + strings.Repeat("Only the owner subscribes to the engine. ", 10)
	kvBlocks := len(kvPrompt) / 16
	ownerOf := func(replica string, live []*Node) int {
		o := kvsync.Owner(replica, memberNames(live))
		for i, g := range gws {
			if g != nil && g.NodeID() == o {
				return i
			}
		}
		t.Fatalf("no owner for %s", replica)
		return -1
	}
	// The owner's subscription may not be live yet: resend until the
	// events show up (PUB/SUB drops what precedes the subscription).
	tk := time.Now()
	i := 0
	require.Eventually(t, func() bool {
		i++
		p := fmt.Sprintf("%s %d", kvPrompt, i)
		sendToEngine(t, e1, p)
		deadline := time.Now().Add(500 * time.Millisecond)
		for time.Now().Before(deadline) {
			all := true
			for _, g := range gws {
				if confirmedOn(g, "e1", p) < kvBlocks {
					all = false
				}
			}
			if all {
				return true
			}
			time.Sleep(2 * time.Millisecond) // polling the indexes for the condition
		}
		return false
	}, 20*time.Second, time.Millisecond)
	t.Logf("(b) e1's KV events confirmed on all 3 gateways after %v (%d sends)", time.Since(tk).Round(time.Millisecond), i)

	owner := ownerOf("e1", gws)
	th := time.Now()
	stops[owner]()
	t.Logf("(b) graceful stop of the owner %s took %v", ids[owner], time.Since(th).Round(time.Millisecond))
	gone := gws[owner]
	gws[owner] = nil
	live := []*Node{}
	for _, g := range gws {
		if g != nil {
			live = append(live, g)
		}
	}
	require.Eventually(t, func() bool {
		id, _ := live[0].ConfigStore().Leader()
		return id != "" && id != ids[owner]
	}, 10*time.Second, time.Millisecond, "a live gateway leads raft")
	next := ownerOf("e1", live)
	require.Eventually(t, func() bool {
		return gaugeValue(t, gws[next], "kvmesh_sync_kv_owned_sources") >= 1 &&
			len(gws[next].Cluster().Members()) == 2
	}, 10*time.Second, 5*time.Millisecond)
	after := "Document 3\n" + strings.Repeat("Events keep flowing after the owner left. ", 10)
	i = 0
	require.Eventually(t, func() bool {
		i++
		p := fmt.Sprintf("%s %d", after, i)
		sendToEngine(t, e1, p)
		deadline := time.Now().Add(500 * time.Millisecond)
		for time.Now().Before(deadline) {
			all := true
			for _, g := range live {
				if confirmedOn(g, "e1", p) < len(p)/16 {
					all = false
				}
			}
			if all {
				return true
			}
			time.Sleep(2 * time.Millisecond) // polling the indexes for the condition
		}
		return false
	}, 20*time.Second, time.Millisecond)
	t.Logf("(b) owner %s stopped; %s took over e1 and events reached both live gateways in %v",
		ids[owner], ids[next], time.Since(th).Round(time.Millisecond))

	// (c) The stopped gateway restarts (same id and data dir, new ports)
	// and catches up through a snapshot: it routes the prompt of (a) like
	// its peers and holds e1's confirmed blocks.
	tr := time.Now()
	restarted, _ := startGateway(t, gwConfig(ids[owner], dirs[owner], []string{live[0].Cluster().GossipAddr()}, 3, reps...))
	gws[owner] = restarted
	waitReady(t, restarted)
	rep := debugRoute(t, restarted, "prefix-cache", prompt)
	assert.Equal(t, picked, rep.Pick)
	assert.Equal(t, blocks, matchedOf(rep, picked), "history from the snapshot")
	assert.Equal(t, len(after+" 1")/16, confirmedOn(restarted, "e1", after+" 1"), "confirmed entries from the snapshot")
	t.Logf("(c) %s restarted and caught up via snapshot in %v", ids[owner], time.Since(tr).Round(time.Millisecond))
	_ = gone

	// (d) A config write through a follower's admin API reaches every
	// gateway and hot-reloads the default strategy.
	var follower *Node
	for _, g := range gws {
		if !g.ConfigStore().IsLeader() {
			follower = g
			break
		}
	}
	require.NotNil(t, follower)
	twrite := time.Now()
	code, out := admin(t, follower, http.MethodPatch, "/admin/v1/config", `{"strategy":"least-request"}`)
	require.Equal(t, http.StatusOK, code, out)
	var applied struct{ Version uint64 }
	require.NoError(t, json.Unmarshal([]byte(out), &applied))
	for _, g := range gws {
		require.Eventually(t, func() bool { return g.ConfigVersion() >= applied.Version }, 10*time.Second, time.Millisecond)
		assert.Equal(t, "least-request", debugRoute(t, g, "", prompt).Strategy, g.NodeID())
		assert.Equal(t, float64(g.ConfigVersion()), gaugeValue(t, g, "kvmesh_config_version"))
	}
	t.Logf("(d) config v%d written via follower %s, applied on all 3 in %v", applied.Version, follower.NodeID(),
		time.Since(twrite).Round(time.Millisecond))
	// The admin diagnostics come from the Node: index stats, explain, the
	// index snapshot.
	code, out = admin(t, follower, http.MethodGet, "/admin/v1/index/stats", "")
	require.Equal(t, http.StatusOK, code, out)
	assert.Contains(t, out, `"gateway"`)
	code, out = admin(t, follower, http.MethodGet, "/admin/v1/explain?strategy=prefix-cache&model=m&prompt="+url.QueryEscape(prompt), "")
	require.Equal(t, http.StatusOK, code, out)
	assert.Contains(t, out, `"pick": "`+picked+`"`)
	code, out = admin(t, follower, http.MethodGet, "/admin/v1/explain?model=nope&prompt=x", "")
	assert.Equal(t, http.StatusNotFound, code, out)
	code, out = admin(t, follower, http.MethodGet, "/admin/v1/snapshot", "")
	require.Equal(t, http.StatusOK, code)
	assert.NotEmpty(t, out)
	code, out = admin(t, follower, http.MethodPatch, "/admin/v1/config", `{"strategy":"no-such-strategy"}`)
	assert.Equal(t, http.StatusBadRequest, code, out)
	req, err := http.NewRequest(http.MethodPatch, "http://"+follower.HTTPAddr()+"/admin/v1/config", strings.NewReader(`{}`))
	require.NoError(t, err)
	resp, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	readAll(t, resp)
	assert.Equal(t, http.StatusUnauthorized, resp.StatusCode, "writes without the token are refused")

	// (e) Engine scale-out: a replica added through the config gets
	// traffic on every gateway; scale-in: a removed one gets none.
	e3rc := simReplica("e3", e3)
	code, out, retried := adminRetry(t, gws[1], http.MethodPost, "/admin/v1/models/m/replicas",
		fmt.Sprintf(`{"name":"e3","url":%q,"kv":%q,"replay":%q}`, e3rc.URL, e3rc.KVEndpoint, e3rc.ReplayEndpoint))
	if !retried || code == http.StatusOK {
		require.Equal(t, http.StatusOK, code, out)
	} // else the first attempt applied and the retry found e3 there: the tables below tell
	for _, g := range gws {
		require.Eventually(t, func() bool { return g.tbl.Load().byName["e3"] != nil }, 10*time.Second, time.Millisecond)
	}
	// Its KV events have one owner for the whole cluster (the gateways
	// do not each subscribe), as the replicas configured at start do.
	kvOwners := func(replica string) (n int) {
		for _, g := range gws {
			if g.Cluster().OwnsKV(replica) {
				n++
			}
		}
		return n
	}
	require.Eventually(t, func() bool { return kvOwners("e3") == 1 }, 10*time.Second, time.Millisecond,
		"one gateway owns the added replica's KV events")
	for _, g := range gws {
		assert.Empty(t, g.KVBindAddr("e3"), "%s subscribes to e3 itself", g.NodeID())
	}
	var e3Prompt string
	for gi, g := range gws {
		got := false
		for k := 0; k < 60 && !got; k++ {
			p := fmt.Sprintf("scale-out %d %d %s", gi, k, strings.Repeat("z", 64))
			b := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":1}`, p)
			resp := post(t, g, "/v1/completions", b, map[string]string{HeaderStrategy: "random"})
			require.Equal(t, http.StatusOK, resp.StatusCode)
			got = resp.Header.Get(HeaderReplica) == "e3"
			readAll(t, resp)
			if got {
				e3Prompt = p
			}
		}
		assert.True(t, got, "gateway %s never sent traffic to the new replica", g.NodeID())
	}
	code, out, retried = adminRetry(t, gws[2], http.MethodDelete, "/admin/v1/models/m/replicas/e2", "")
	if !retried || code == http.StatusOK {
		require.Equal(t, http.StatusOK, code, out)
	}
	for _, g := range gws {
		require.Eventually(t, func() bool { return g.tbl.Load().byName["e2"] == nil }, 10*time.Second, time.Millisecond)
		for k := 0; k < 20; k++ {
			b := fmt.Sprintf(`{"model":"m","prompt":"scale-in %d","max_tokens":1}`, k)
			resp := post(t, g, "/v1/completions", b, map[string]string{HeaderStrategy: "random"})
			require.Equal(t, http.StatusOK, resp.StatusCode)
			assert.NotEqual(t, "e2", resp.Header.Get(HeaderReplica))
			readAll(t, resp)
		}
	}
	require.Eventually(t, func() bool { return kvOwners("e2") == 0 }, 10*time.Second, time.Millisecond,
		"no gateway still ingests the removed replica's KV events")
	t.Logf("(e) e3 added and got traffic on every gateway; e2 removed and got none")

	// (c, again) A gateway restarted with its original flags (e1, e2)
	// takes the pool from the raft config and keeps the entries of e3,
	// which its snapshot names before its config has it.
	ri := -1
	for i, g := range gws {
		if !g.ConfigStore().IsLeader() {
			ri = i
			break
		}
	}
	stopNode(t, gws[ri])
	tr = time.Now()
	gws[ri], _ = startGateway(t, gwConfig(ids[ri], dirs[ri], []string{gws[(ri+1)%3].Cluster().GossipAddr()}, 3, reps...))
	waitReady(t, gws[ri])
	assert.ElementsMatch(t, []string{"e1", "e3"}, gws[ri].Replicas(), "the pool comes from the raft config")
	require.Eventually(t, func() bool {
		rep := debugRoute(t, gws[ri], "prefix-cache", e3Prompt)
		return rep.Pick == "e3" && matchedOf(rep, "e3") == len(e3Prompt)/16
	}, 10*time.Second, time.Millisecond, "history of a replica added at run time survives the restart")
	t.Logf("(c) %s restarted with stale flags, took the raft pool and e3's entries in %v", ids[ri], time.Since(tr).Round(time.Millisecond))

	// A change of what shapes block keys is applied to the config but
	// flagged: it takes effect at restart.
	code, out = admin(t, gws[0], http.MethodPatch, "/admin/v1/config", `{"hash_seed":42}`)
	require.Equal(t, http.StatusOK, code, out)
	for _, g := range gws {
		require.Eventually(t, func() bool { return gaugeValue(t, g, "kvmesh_config_restart_required") == 1 },
			10*time.Second, time.Millisecond)
	}
	code, out = admin(t, gws[0], http.MethodPatch, "/admin/v1/config", `{"hash_seed":0}`)
	require.Equal(t, http.StatusOK, code, out)
	for _, g := range gws {
		require.Eventually(t, func() bool { return gaugeValue(t, g, "kvmesh_config_restart_required") == 0 },
			10*time.Second, time.Millisecond)
	}

	// (f) The raft leader stops gracefully: it hands leadership over, and
	// a write through a survivor succeeds at once.
	li := -1
	require.Eventually(t, func() bool {
		for i, g := range gws {
			if g.ConfigStore().IsLeader() {
				li = i
				return true
			}
		}
		return false
	}, 10*time.Second, time.Millisecond, "a leader")
	tl := time.Now()
	stopNode(t, gws[li])
	stopTook := time.Since(tl)
	survivor := gws[(li+1)%3]
	tw := time.Now()
	code, out = admin(t, survivor, http.MethodPatch, "/admin/v1/config", `{"strategy":"cost"}`)
	require.Equal(t, http.StatusOK, code, out)
	t.Logf("(f) leader %s stopped in %v; the next write via %s took %v", gws[li].NodeID(),
		stopTook.Round(time.Millisecond), survivor.NodeID(), time.Since(tw).Round(time.Millisecond))
}

// TestClusterStartFailureCleansUp starts a second gateway on the data dir
// another one holds: Start fails, and everything it opened is closed
// (goleak checks the goroutines at the end of the package).
func TestClusterStartFailureCleansUp(t *testing.T) {
	if testing.Short() {
		t.Skip("starts raft, memberlist and NATS: skipped with -short")
	}
	e := newFakeEngine(t, "a")
	dir := t.TempDir()
	first, _ := startGateway(t, gwConfig("gw-1", dir, nil, 1, rc("a", e.url())))
	waitReady(t, first)
	n, err := New(gwConfig("gw-2", dir, nil, 1, rc("a", e.url())), nil)
	require.NoError(t, err)
	require.Error(t, n.Start(context.Background()), "the data dir is locked by gw-1")
	require.NoError(t, n.Shutdown(context.Background()))
	assert.False(t, n.Ready())
	assert.True(t, first.Ready(), "the first gateway is unaffected")
}

// TestNoSyncIsStandalone: --no-sync keeps a gateway with cluster flags
// isolated: no cluster, no admin port, ready at once.
func TestNoSyncIsStandalone(t *testing.T) {
	e := newFakeEngine(t, "a")
	cfg := gwConfig("gw", t.TempDir(), []string{"127.0.0.1:1"}, 3, rc("a", e.url()))
	cfg.Cluster.NoSync = true
	cfg.Cluster.AdminToken = ""
	n, _ := startGateway(t, cfg)
	assert.Nil(t, n.Cluster())
	assert.Nil(t, n.ConfigStore())
	assert.Empty(t, n.AdminAddr())
	assert.True(t, n.Ready())
}

// TestClusterShutdownDrains stops a cluster gateway while a stream runs:
// the stream finishes within the grace, and Ready turns false at once.
func TestClusterShutdownDrains(t *testing.T) {
	if testing.Short() {
		t.Skip("starts raft, memberlist and NATS: skipped with -short")
	}
	slow := newFakeEngine(t, "slow")
	slow.chunks.Store(10)
	slow.chunkDelay.Store(int64(30 * time.Millisecond))
	n, _ := startGateway(t, gwConfig("solo", t.TempDir(), nil, 1, rc("slow", slow.url())))
	waitReady(t, n)
	done := make(chan string, 1)
	go func() {
		resp, err := http.Post("http://"+n.HTTPAddr()+"/v1/completions", "application/json", strings.NewReader(streamReq))
		if err != nil {
			done <- err.Error()
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- string(b)
	}()
	<-slow.started
	stopped := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		stopped <- n.Shutdown(ctx)
	}()
	require.Eventually(t, func() bool { return !n.Ready() }, 5*time.Second, time.Millisecond)
	out := <-done
	assert.True(t, strings.HasSuffix(out, "data: [DONE]\n\n"), "the stream drained: %q", out)
	require.NoError(t, <-stopped)
}
