package scenarios

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/kvevents"
)

var longFlag = flag.Bool("long", false, "run the long, heavier form of every scenario (or KVMESH_CHAOS_LONG=1)")

// long reports whether the long form runs.
func long() bool { return *longFlag || os.Getenv("KVMESH_CHAOS_LONG") == "1" }

// scale picks the short or the long figure.
func scale(short, lng int) int {
	if long() {
		return lng
	}
	return short
}

var report cluster.Report

var leakOpts = []goleak.Option{
	// Idle keep-alive connections of servers shut down by a scenario close
	// asynchronously.
	goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
	// zmq4 v0.17's PUB writer can miss its close signal and wait forever:
	// the library's goroutine, not ours (see chaos/sim).
	goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
	// zmq4 v0.17's SUB/DEALER reader sends each message into a 10-slot
	// channel without watching the socket's context: a socket closed while
	// that channel is full (an owner that stops ingesting a busy engine
	// when KV ownership moves, as after a partition heals) leaves it
	// blocked forever (only that send is ignored: its top frame). The
	// library's goroutine, not ours.
	goleak.IgnoreTopFunction("github.com/go-zeromq/zmq4.(*qreader).listen"),
}

func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	if rows := report.Rows(); len(rows) > 0 {
		mode := "short"
		if long() {
			mode = "long"
		}
		fmt.Printf("\nchaos suite (%s form)\n%s", mode, report.Table())
		for _, r := range rows {
			if r.Load.Lost != 0 {
				fmt.Printf("LOST REQUESTS in %s: %s\n", r.Scenario, r.Load)
				code = 1
			}
		}
	}
	if code == 0 {
		if err := goleak.Find(leakOpts...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// startCluster starts a cluster that the test shuts down at its end.
func startCluster(t *testing.T, cfg cluster.Config) *cluster.Cluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := cluster.Start(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		require.NoError(t, c.Shutdown(sctx))
	})
	require.NoError(t, c.WarmUp(ctx))
	return c
}

// prompts draws prompts from a few tenants that share long system prompts,
// with a unique tail: shared prefixes for affinity, distinct blocks for
// eviction pressure.
func prompt(tag string, i int) string {
	tenant := i % 7
	var b strings.Builder
	fmt.Fprintf(&b, "tenant %d system prompt: ", tenant)
	for b.Len() < 64+tenant*24 {
		fmt.Fprintf(&b, "policy %d applies to tenant %d. ", b.Len(), tenant)
	}
	fmt.Fprintf(&b, "%s request %d: ", tag, i)
	for j := 0; j < 16+(i*37)%160; j++ {
		b.WriteByte(byte('a' + (i*31+j*7)%26))
	}
	return b.String()
}

// gatewayTarget spreads requests over the gateways round robin.
func gatewayTarget(c *cluster.Cluster) func(int) string {
	gs := c.Gateways()
	return func(i int) string { return gs[i%len(gs)].URL() }
}

// loadConfig is a streaming load of n requests over the gateways.
func loadConfig(c *cluster.Cluster, tag string, n int) cluster.LoadConfig {
	lc := cluster.DefaultLoadConfig()
	lc.Requests, lc.Concurrency = n, 6
	lc.Model = c.Config().Model
	lc.Prompt = func(i int) string { return prompt(tag, i) }
	lc.Target = gatewayTarget(c)
	return lc
}

// precisionAtLeast is an AwaitTruth predicate.
func precisionAtLeast(p float64) func(cluster.Pair) bool {
	return func(x cluster.Pair) bool { return x.Precision() >= p }
}

// awaitWithin waits up to d for pred on every pair and fails the test
// otherwise; it returns the summary and the time it took.
func awaitWithin(t *testing.T, c *cluster.Cluster, step string, d time.Duration, pred func(cluster.Pair) bool) (cluster.Summary, time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	s, took, err := c.AwaitTruth(ctx, 5*time.Millisecond, pred)
	require.NoError(t, err, "%s", step)
	return s, took
}

// row logs and records a scenario's line. No request may be lost, and in
// a scenario that kills no gateway no connection may break either.
func row(t *testing.T, r cluster.Row) {
	t.Helper()
	report.Add(r)
	t.Log(r.Line())
	require.Zero(t, r.Load.Lost, "lost requests: %s", r.Load)
	require.Zero(t, r.Load.Reasons["failed/conn_error"], "broken connections without a gateway kill: %s", r.Load)
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// prometheusRegistry registers m on a fresh registry to read it back.
func prometheusRegistry(t *testing.T, m *kvevents.Metrics) *prometheus.Registry {
	t.Helper()
	reg := prometheus.NewRegistry()
	require.NoError(t, m.Register(reg))
	return reg
}
