package sync

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/internal/logx"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/sync/trust"
)

// fakeLoad is a LoadSource with settable counts.
type fakeLoad struct {
	mu sync.Mutex
	m  map[string]int // in flight
	q  map[string]int // queued prefill tokens
}

func (f *fakeLoad) setQueued(r string, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.q == nil {
		f.q = make(map[string]int)
	}
	f.q[r] = n
}

func (f *fakeLoad) set(r string, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.m == nil {
		f.m = make(map[string]int)
	}
	f.m[r] = n
}

func (f *fakeLoad) AppendInFlight(dst []ReplicaLoad) []ReplicaLoad {
	f.mu.Lock()
	defer f.mu.Unlock()
	for r, n := range f.m {
		dst = append(dst, ReplicaLoad{Replica: r, InFlight: n, QueuedPrefillTokens: f.q[r]})
	}
	for r, n := range f.q {
		if _, ok := f.m[r]; !ok {
			dst = append(dst, ReplicaLoad{Replica: r, QueuedPrefillTokens: n})
		}
	}
	return dst
}

// gw is one gateway under test: its index, registry and cluster.
type gw struct {
	name string
	ix   *index.Index
	reg  *prometheus.Registry
	load *fakeLoad
	c    *Cluster
	held []net.Listener // NATS ports held during a test's outage (natsDown)
}

// converge bounds the waits for a cluster to converge (membership, KV
// ownership, indexes alike). Under -race on a lightly loaded machine each
// of those tests passes in under 3 s, cluster start included; the bound is
// for a machine running several race-enabled test binaries at
// once, where 10 s ran out (three CI runs in parallel, load 15). A longer
// bound costs nothing when the condition holds. Every wait in this
// package for gateways to see each other's state uses it; waits that
// time a claim (cleared by a report before LoadTTL, failure detection)
// keep their own bounds.
const converge = 30 * time.Second

var testReplicas = []string{"r0", "r1", "r2"}

// testKey is the cluster key of every test gateway of this package (one
// per test binary, as an operator generates one per cluster).
var testKey = func() [][]byte {
	k, err := trust.Generate()
	if err != nil {
		panic(err)
	}
	keys, err := trust.ParseKeys(k)
	if err != nil {
		panic(err)
	}
	return keys
}()

// testRing derives a test gateway's credentials from keys (testKey when
// nil).
func testRing(t testing.TB, name string, keys [][]byte) *trust.Ring {
	t.Helper()
	if keys == nil {
		keys = testKey
	}
	r, err := trust.New(keys, name)
	require.NoError(t, err)
	return r
}

// testLogger is the gateways' logger: every line to stderr with
// $KVMESH_SYNC_LOG set; otherwise a test's gateways share a ring of their
// last logTailLines lines, printed if the test fails, so that a failure on
// a busy CI machine shows what the cluster did (memberlist's suspicions,
// ownership moves, refused batches, repairs) without a rerun.
func testLogger(t testing.TB) *slog.Logger {
	opts := &slog.HandlerOptions{Level: slog.LevelDebug}
	if os.Getenv("KVMESH_SYNC_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, opts)).With("test", t.Name())
	}
	tt, ok := t.(*testing.T)
	if !ok {
		return nil // benchmarks log nothing
	}
	v, loaded := logTails.LoadOrStore(tt, logx.NewTail(logTailLines))
	tail := v.(*logx.Tail)
	if !loaded {
		t.Cleanup(func() {
			logTails.Delete(tt)
			if tt.Failed() {
				t.Logf("the gateways' last log lines:\n%s", tail.String())
			}
		})
	}
	return slog.New(slog.NewTextHandler(tail, opts))
}

// logTails holds each running test's log tail.
var logTails sync.Map // *testing.T → *logx.Tail

const logTailLines = 3000

// memberOf returns g's member entry of the gateway name, waiting while g
// does not list it: under load memberlist takes a live gateway for dead
// for a moment (ci1113 failed a test that required the entry at once).
func memberOf(t *testing.T, g *gw, name string) Member {
	t.Helper()
	var m Member
	require.Eventually(t, func() bool {
		var ok bool
		m, ok = g.c.ms.member(name)
		return ok
	}, converge, 10*time.Millisecond, "%s lists %s as a member", g.name, name)
	return m
}

func newIndex(t testing.TB) *index.Index {
	icfg := index.DefaultConfig()
	icfg.Capacity = 1 << 22
	// Speculative entries live 3 s by default: on a busy machine a test
	// that records them and waits for every peer to hold them all could
	// outlast them and never see its condition (TestDecisionsConverge ran
	// out its 30 s bound under five parallel race-enabled CI runs, load
	// 18). No test here is about their expiry.
	icfg.SpeculativeTTL = 10 * time.Minute
	ix, err := index.New(icfg)
	require.NoError(t, err)
	h := ix.Hasher()
	for i := range testReplicas {
		ix.SetReplicaRoot(index.ReplicaID(i), h.Root("m", "", ""))
		ix.SetPublishesEvents(index.ReplicaID(i), true)
	}
	return ix
}

// natsHost is the loopback address the tests' embedded NATS servers listen
// on: one per test process, not 127.0.0.1. natsDown and natsUp free a
// server's ports for a moment, and on a busy host any connect() to
// 127.0.0.1 may take a freed ephemeral port as its local port (ci1217:
// "NATS port ... taken right after the server stopped"). Such a socket
// does not conflict with a bind of the same port on another 127/8 address.
var natsHost = fmt.Sprintf("127.77.%d.%d", os.Getpid()/250%250+1, os.Getpid()%250+1)

// newGW builds (not starts) a gateway; mutate adjusts its config.
func newGW(t testing.TB, name string, tr memberlist.Transport, mutate func(*Config)) *gw {
	cfg := LocalConfig(name)
	cfg.Trust = testRing(t, name, nil)
	cfg.NATSClientAddr = net.JoinHostPort(natsHost, "0")
	cfg.NATSClusterAddr = net.JoinHostPort(natsHost, "0")
	if mutate != nil {
		mutate(&cfg)
	}
	g := &gw{name: name, ix: newIndex(t), reg: prometheus.NewRegistry(), load: &fakeLoad{}}
	kvm := kvevents.NewMetrics()
	require.NoError(t, kvm.Register(g.reg))
	c, err := New(cfg, Deps{
		Index: g.ix, Replicas: newReplicaTable(testReplicas), Load: g.load,
		Registerer: g.reg, KVMetrics: kvm, Logger: testLogger(t), Transport: tr,
	})
	require.NoError(t, err)
	g.c = c
	return g
}

func (g *gw) start(t testing.TB) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, g.c.Start(ctx))
}

func (g *gw) stop(t testing.TB) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	require.NoError(t, g.c.Shutdown(ctx))
}

// startCluster starts n gateways on loopback, each joining the first.
func startCluster(t testing.TB, n int, tr func(name string) memberlist.Transport, mutate func(*Config)) []*gw {
	gws := make([]*gw, n)
	for i := range gws {
		name := fmt.Sprintf("g%d", i)
		var trans memberlist.Transport
		if tr != nil {
			trans = tr(name)
		}
		gws[i] = newGW(t, name, trans, func(c *Config) {
			if i > 0 {
				c.Join = []string{gws[0].c.GossipAddr()}
			}
			if mutate != nil {
				mutate(c)
			}
		})
		gws[i].start(t)
		t.Cleanup(func() { gws[i].stop(t) })
	}
	waitMembers(t, gws, n)
	return gws
}

func waitMembers(t testing.TB, gws []*gw, n int) {
	t.Helper()
	if !assert.Eventually(t, func() bool {
		for _, g := range gws {
			if len(g.c.Members()) != n {
				return false
			}
		}
		return true
	}, 30*time.Second, 10*time.Millisecond, "members did not converge to %d", n) {
		for _, g := range gws {
			var names []string
			for _, m := range g.c.Members() {
				names = append(names, m.Name+"@"+m.Addr)
			}
			t.Logf("%s (%s) sees %v", g.name, g.c.GossipAddr(), names)
		}
		t.FailNow()
	}
	require.Eventually(t, func() bool {
		for _, g := range gws {
			if g.c.cfg.NATSURL == "" && g.c.bus.numRemotes() != n-1 {
				return false
			}
		}
		return true
	}, converge, 10*time.Millisecond, "NATS routes did not form a full mesh")
	// Data flows between every pair: each gateway received every peer's
	// load report since now (so subscription interest crossed the routes;
	// a report from before a NATS restart, still within LoadTTL, proves
	// nothing about the new routes).
	since := time.Now()
	require.Eventually(t, func() bool {
		for _, g := range gws {
			g.c.peers.mu.Lock()
			n := 0
			for _, e := range g.c.peers.reports {
				if e.at.After(since) {
					n++
				}
			}
			g.c.peers.mu.Unlock()
			if g.c.cfg.NATSURL == "" && n != len(gws)-1 {
				return false
			}
		}
		return true
	}, converge, 10*time.Millisecond, "load reports did not reach every peer")
}

// counter reads a counter or gauge value from a registry by name and labels.
func metricValue(t testing.TB, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for k, v := range labels {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == k && lp.GetValue() == v {
						found = true
					}
				}
				if !found {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				sum += m.Counter.GetValue()
			case m.Gauge != nil:
				sum += m.Gauge.GetValue()
			case m.Histogram != nil:
				sum += float64(m.Histogram.GetSampleCount())
			}
		}
	}
	return sum
}

// logCounters logs every non-zero kvmesh_sync_* counter of each gateway,
// labels included: what a failed check on one of them can be read against
// (drops by reason, refusals, NATS disconnects, owner changes).
func logCounters(t testing.TB, gws []*gw) {
	t.Helper()
	for _, g := range gws {
		mfs, err := g.reg.Gather()
		if err != nil {
			t.Logf("%s: gather: %v", g.name, err)
			continue
		}
		var lines []string
		for _, mf := range mfs {
			if !strings.HasPrefix(mf.GetName(), "kvmesh_sync_") {
				continue
			}
			for _, m := range mf.GetMetric() {
				if m.Counter == nil || m.Counter.GetValue() == 0 {
					continue
				}
				var ls []string
				for _, lp := range m.GetLabel() {
					ls = append(ls, lp.GetName()+"="+lp.GetValue())
				}
				lines = append(lines, fmt.Sprintf("%s{%s} %v", mf.GetName(), strings.Join(ls, ","), m.Counter.GetValue()))
			}
		}
		t.Logf("%s counters:\n  %s", g.name, strings.Join(lines, "\n  "))
	}
}

// natsDown stops g's embedded NATS server (an outage) and holds its client
// and route ports until natsUp restarts it on them, as a restarted server
// with configured ports would. Without the hold, any bind(0) on this busy
// host could take a freed port during the outage, and the server could
// not come back. (The moments between the server's close and the hold, and
// between the hold's close and the restart, are why natsHost is not
// 127.0.0.1.)
func natsDown(t testing.TB, g *gw) {
	t.Helper()
	b := g.c.bus
	b.stopServer()
	b.mu.Lock()
	host, ports := b.opts.Host, []int{b.opts.Port, b.opts.Cluster.Port}
	b.mu.Unlock()
	for _, p := range ports {
		l, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(p)))
		require.NoError(t, err, "%s: NATS port %d taken right after the server stopped", g.name, p)
		g.held = append(g.held, l)
		t.Cleanup(func() { _ = l.Close() }) // if the test ends before natsUp
	}
}

// natsUp releases the ports natsDown held and restarts the server.
func natsUp(t testing.TB, g *gw) {
	t.Helper()
	for _, l := range g.held {
		require.NoError(t, l.Close())
	}
	g.held = nil
	require.NoError(t, g.c.bus.startServer())
}
