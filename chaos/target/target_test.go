package target_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/chaos/faultctl"
	"github.com/kvmesh/kvmesh/chaos/faultproxy"
	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/chaos/suite"
	"github.com/kvmesh/kvmesh/chaos/target"
	"github.com/kvmesh/kvmesh/internal/logx"
	"github.com/kvmesh/kvmesh/node"
)

const adminToken = "target-test-admin"

// deployment is what an operator runs, in process: two vllmsim engines
// of blocks KV blocks each, kvmesh faultproxy with a zmq relay in front of
// e0's event port, and a standalone gateway that reads e0's events through
// it.
func deployment(t *testing.T, blocks int) *target.Config {
	t.Helper()
	engine := func() *sim.Server {
		cfg := sim.LocalConfig()
		cfg.ServedModelName = "M"
		cfg.NumGPUBlocks = blocks
		cfg.KVEvents.EnableKVCacheEvents = true
		cfg.Logger = slog.New(slog.DiscardHandler)
		s, err := sim.NewServer(cfg)
		require.NoError(t, err)
		require.NoError(t, s.Start(context.Background()))
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = s.Shutdown(ctx)
		})
		return s
	}
	e0, e1 := engine(), engine()

	m := faultctl.NewManager(nil)
	h, err := faultctl.Handler(m, "fp-token")
	require.NoError(t, err)
	ctl := httptest.NewServer(h)
	t.Cleanup(func() { ctl.Close(); _ = m.Close() })
	fp := &faultctl.Client{Base: ctl.URL, Token: "fp-token"}
	relay, err := fp.CreateProxy(t.Context(), faultctl.ProxySpec{Name: "e0-events", Kind: faultctl.KindZMQ, Listen: "tcp://127.0.0.1:0", Upstream: e0.KVEventsAddr()})
	require.NoError(t, err)

	cfg := node.LocalConfig()
	cfg.DebugPublic = false
	cfg.AdminToken = adminToken
	cfg.IndexMode = "kv-events"
	cfg.BlockSize = 16
	cfg.Models = []node.ModelConfig{{Name: "M", Replicas: []node.ReplicaConfig{
		{Name: "e0", URL: e0.URL(), KVEndpoint: relay.Addr, ReplayEndpoint: e0.KVReplayAddr()},
		{Name: "e1", URL: e1.URL(), KVEndpoint: e1.KVEventsAddr(), ReplayEndpoint: e1.KVReplayAddr()},
	}}}
	n, err := node.New(cfg, nil)
	require.NoError(t, err)
	require.NoError(t, n.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = n.Shutdown(ctx)
	})
	return &target.Config{
		Gateways: []string{"http://" + n.HTTPAddr()}, AdminToken: adminToken, Model: "M",
		Replica: "e0", EngineURL: e0.URL(), FaultProxy: fp, KVProxy: "e0-events", Requests: 8,
		// The waits poll and end as soon as the views are right; the
		// operator default (15 s) ran out once under five parallel CI
		// runs (load 18), with recall at 0.95.
		Converge: time.Minute,
	}
}

// poolBlocks holds every probe the scenarios send (58 blocks each): with
// 1,024 (sim.LocalConfig's), a kv-events phase whose fault took two
// rounds of 8 to fire (the engine's batches coalesce on a busy machine)
// sent 18 probes, 1,044 blocks, and the engine evicted the first.
const poolBlocks = 8192

func TestTargetScenariosAgainstADeployment(t *testing.T) {
	cfg := deployment(t, poolBlocks)
	scs, skipped, err := target.Suite(cfg, nil)
	require.NoError(t, err)
	names := make([]string, 0, len(scs))
	for _, s := range scs {
		names = append(names, s.Name)
	}
	require.Equal(t, []string{"kv-events", "engine-reset"}, names)
	require.Len(t, skipped, 2, "nats-outage and gateway-restart need what this deployment lacks: %v", skipped)

	rs := suite.Run(t.Context(), scs, suite.Options{})
	for _, r := range rs {
		require.True(t, r.Passed, "%s: %v", r.Name, r.Failures)
		require.Len(t, r.Rows, 1)
		require.Zero(t, r.Rows[0].Load.Lost)
		require.Equal(t, 1.0, r.Rows[0].Precision, r.Rows[0].Line())
		t.Log(r.Rows[0].Line())
	}
	require.Contains(t, rs[0].Rows[0].Note, "drop x3")

	_, _, err = target.Suite(cfg, []string{"nats-outage"})
	require.ErrorIs(t, err, target.ErrNotApplicable, "a scenario named but not applicable is an error")
}

// A fault proxy that does not carry the replica's events is caught: the
// fault never fires, and the scenario fails instead of passing vacuously.
func TestTargetKVEventsFailsWhenTheProxyIsNotInThePath(t *testing.T) {
	cfg := deployment(t, poolBlocks)
	_, err := cfg.FaultProxy.CreateProxy(t.Context(), faultctl.ProxySpec{Name: "elsewhere", Kind: faultctl.KindZMQ, Listen: "tcp://127.0.0.1:0", Upstream: "tcp://127.0.0.1:1"})
	require.NoError(t, err)
	cfg.KVProxy = "elsewhere"
	cfg.Requests = 2
	scs, _, err := target.Suite(cfg, []string{"kv-events"})
	require.NoError(t, err)
	res := suite.RunOne(t.Context(), scs[0], suite.Options{})
	require.False(t, res.Passed)
	require.Contains(t, res.Failures[0], "the fault acted on 0 of 3 batches")
}

// An engine whose KV pool cannot hold the probes evicts some, and the
// scenario says so when the views miss them, rather than leaving the
// operator to suspect the gateways.
func TestTargetSaysWhenTheEngineEvictedProbes(t *testing.T) {
	cfg := deployment(t, 128) // two probes of 58 blocks
	cfg.Converge = 2 * time.Second
	scs, _, err := target.Suite(cfg, []string{"kv-events"})
	require.NoError(t, err)
	res := suite.RunOne(t.Context(), scs[0], suite.Options{})
	require.False(t, res.Passed)
	require.Contains(t, res.Failures[0], "gateway-prompt pairs not as expected")
	require.Contains(t, res.Failures[0], "the gateways saw e0 evict")
	t.Log(res.Failures[0])
}

// nats-outage against a three-gateway cluster whose NATS is behind a tcp
// relay of kvmesh faultproxy (NATS outside the gateways, as --nats-url).
func TestTargetNATSOutage(t *testing.T) {
	ns, err := natsserver.NewServer(&natsserver.Options{Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true, MaxPayload: 8 << 20})
	require.NoError(t, err)
	ns.Start()
	t.Cleanup(ns.Shutdown)
	require.True(t, ns.ReadyForConnections(10*time.Second))

	m := faultctl.NewManager(nil)
	h, err := faultctl.Handler(m, "fp-token")
	require.NoError(t, err)
	ctl := httptest.NewServer(h)
	t.Cleanup(func() { ctl.Close(); _ = m.Close() })
	fp := &faultctl.Client{Base: ctl.URL, Token: "fp-token"}
	relay, err := fp.CreateProxy(t.Context(), faultctl.ProxySpec{Name: "nats", Kind: faultctl.KindTCP, Listen: "127.0.0.1:0", Upstream: ns.Addr().String()})
	require.NoError(t, err)

	c := startCluster(t, "nats://"+relay.Addr)
	tc := &target.Config{AdminToken: cluster.AdminToken, Model: c.Config().Model, FaultProxy: fp, NATSProxy: "nats",
		Requests: 8, Outage: 500 * time.Millisecond}
	for _, g := range c.Gateways() {
		tc.Gateways = append(tc.Gateways, g.URL())
	}
	scs, _, err := target.Suite(tc, []string{"nats-outage"})
	require.NoError(t, err)
	res := suite.RunOne(t.Context(), scs[0], suite.Options{})
	require.True(t, res.Passed, "%v", res.Failures)
	require.Len(t, res.Rows, 1)
	t.Log(res.Rows[0].Line())
	// However many prompts the outage had time for, it sent at most
	// 4·Requests: the engines' pools must hold every one it checks.
	require.LessOrEqual(t, res.Rows[0].Load.Sent, 4*tc.Requests)
	p, err := fp.Proxy(t.Context(), "nats")
	require.NoError(t, err)
	require.Positive(t, p.TCP.Cut, "the outage cut the gateways' NATS connections")
	require.Empty(t, p.Faults, "healed")
}

// gateway-restart against a three-gateway cluster, through a restart
// command run by sh -c as an operator's script would be: the command (this
// test binary, see TestRestartHookHelper) asks the test to restart the
// gateway named in $KVMESH_CHAOS_GATEWAY. The cluster restarts it in
// process on a new port; a proxy in front keeps the address the scenario
// knows it by.
func TestTargetGatewayRestart(t *testing.T) {
	c := startCluster(t, "")
	gws := c.Gateways()
	last := gws[len(gws)-1]
	// The address the scenario knows the gateway by outlives the gateway,
	// as a Service in front of a restarted pod: a proxy retargeted to the
	// restarted one.
	pcfg := faultproxy.DefaultConfig()
	pcfg.Name, pcfg.Target = "front", strings.TrimPrefix(last.URL(), "http://")
	front, err := faultproxy.New(pcfg)
	require.NoError(t, err)
	require.NoError(t, front.Start())
	t.Cleanup(func() { _ = front.Close() })
	frontURL := "http://" + front.Addr()
	var restarts atomic.Int32
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if got := r.URL.Query().Get("gateway"); got != frontURL {
			http.Error(w, fmt.Sprintf("$KVMESH_CHAOS_GATEWAY is %q, want %q", got, frontURL), http.StatusBadRequest)
			return
		}
		rctx, cancel := context.WithTimeout(r.Context(), 60*time.Second)
		defer cancel()
		if err := c.StopGateway(rctx, last); err != nil {
			http.Error(w, "stop: "+err.Error(), http.StatusInternalServerError)
			return
		}
		g, err := c.RestartGateway(rctx, last)
		if err != nil {
			http.Error(w, "restart: "+err.Error(), http.StatusInternalServerError)
			return
		}
		front.SetTarget(strings.TrimPrefix(g.URL(), "http://"))
		restarts.Add(1)
	}))
	t.Cleanup(hook.Close)

	tc := &target.Config{AdminToken: cluster.AdminToken, Model: c.Config().Model, Requests: 8,
		RestartCmd: fmt.Sprintf("KVMESH_TARGET_RESTART_HOOK=%s '%s' -test.run '^TestRestartHookHelper$'", hook.URL, os.Args[0]),
		// As deployment(): the waits poll, the bound only has to hold
		// on a busy machine.
		Converge: time.Minute}
	for _, g := range gws[:len(gws)-1] {
		tc.Gateways = append(tc.Gateways, g.URL())
	}
	tc.Gateways = append(tc.Gateways, frontURL)
	scs, _, err := target.Suite(tc, []string{"gateway-restart"})
	require.NoError(t, err)
	res := suite.RunOne(t.Context(), scs[0], suite.Options{})
	require.True(t, res.Passed, "%v", res.Failures)
	require.Equal(t, int32(1), restarts.Load(), "the command restarted the gateway once")
	require.Len(t, res.Rows, 1)
	row := res.Rows[0]
	t.Log(row.Line())
	require.Zero(t, row.Load.Lost)
	require.Equal(t, 1.0, row.Precision)
	// While the gateway restarts the others serve at most 4·Requests
	// prompts, however long the restart takes (the pools must hold them),
	// and the restarted gateway two more.
	require.LessOrEqual(t, row.Load.Sent, 4*tc.Requests+2)
}

// startCluster starts three clustered gateways over two engines whose
// pools hold every probe (poolBlocks: the scenarios check that the views
// follow the engines, not eviction, scenario 1's business), with NATS at
// natsURL ("": embedded), warmed up. When the test fails it prints the
// cluster's last log lines.
func startCluster(t *testing.T, natsURL string) *cluster.Cluster {
	t.Helper()
	cfg := cluster.DefaultConfig()
	cfg.Gateways, cfg.Engines = 3, 2
	cfg.ClusterMode = true
	cfg.NATSURL = natsURL
	cfg.NumGPUBlocks = poolBlocks
	cfg.DataDir = t.TempDir()
	tail := logx.NewTail(3000)
	cfg.Logger = slog.New(slog.NewTextHandler(tail, &slog.HandlerOptions{Level: slog.LevelDebug}))
	// A bound, not a pace: a three-gateway raft cluster under the race
	// detector on an oversubscribed machine took longer than 30 s once.
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	c, err := cluster.Start(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		require.NoError(t, c.Shutdown(sctx))
	})
	t.Cleanup(func() { // runs first: the lines up to the failure, not the shutdown's
		if t.Failed() {
			t.Logf("the cluster's last %d log lines:\n%s", tail.Len(), tail.String())
		}
	})
	require.NoError(t, c.WarmUp(ctx))
	return c
}

// TestRestartHookHelper is not a test: it is the restart command of
// TestTargetGatewayRestart, which runs this binary through sh -c. It asks
// the test's hook to restart the gateway in $KVMESH_CHAOS_GATEWAY and
// fails (exits non-zero) if the hook could not.
func TestRestartHookHelper(t *testing.T) {
	hook := os.Getenv("KVMESH_TARGET_RESTART_HOOK")
	if hook == "" {
		t.Skip("the restart command of TestTargetGatewayRestart, run by it")
	}
	resp, err := http.Post(hook+"?gateway="+url.QueryEscape(os.Getenv("KVMESH_CHAOS_GATEWAY")), "text/plain", nil)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
}
