package suite

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/internal/logx"
	"github.com/kvmesh/kvmesh/kvevents"
)

// T is the part of *testing.T a scenario uses. *testing.T implements it, and
// so does the runner behind Run (kvmesh chaos): FailNow and Fatalf end the
// scenario's goroutine, Cleanup functions run last-in first-out after it,
// Context is cancelled just before they run.
type T interface {
	Helper()
	Name() string
	Log(args ...any)
	Logf(format string, args ...any)
	Errorf(format string, args ...any)
	Fatalf(format string, args ...any)
	FailNow()
	Failed() bool
	Cleanup(func())
	TempDir() string
	Context() context.Context
}

// Size chooses how heavy a run is.
type Size struct {
	// Long selects the long form: more requests and rounds, and in
	// scenario 6 more partition rounds.
	Long bool
	// Factor multiplies every request and round count of the chosen form
	// (0 or 1: the form as is). Rounds never drop below 1.
	Factor float64
}

// R is one scenario's run: the T it reports to, its size and the report its
// rows go to.
type R struct {
	T
	// Long is true in the long form.
	Long   bool
	factor float64
	report *cluster.Report
}

// NewR returns a run of one scenario on t that records its rows in rep.
func NewR(t T, size Size, rep *cluster.Report) *R {
	return &R{T: t, Long: size.Long, factor: size.Factor, report: rep}
}

// Scale picks the short or the long figure, times the size's factor.
func (t *R) Scale(short, long int) int {
	n := short
	if t.Long {
		n = long
	}
	if t.factor > 0 && t.factor != 1 {
		n = max(1, int(float64(n)*t.factor+0.5))
	}
	return n
}

// Row logs and records a scenario's line. No request may be lost, and in
// a scenario that kills no gateway no connection may break either.
func (t *R) Row(r cluster.Row) {
	t.Helper()
	t.report.Add(r)
	t.Log(r.Line())
	require.Zero(t, r.Load.Lost, "lost requests: %s", r.Load)
	require.Zero(t, r.Load.Reasons["failed/conn_error"], "broken connections without a gateway kill: %s", r.Load)
}

// startCluster starts a cluster that the scenario shuts down at its end.
// Unless cfg brings a logger, the cluster logs into a tail of its last
// logTailLines lines that a failed scenario prints before the cluster
// shuts down (every line to stderr instead with $KVMESH_CHAOS_LOG set).
func startCluster(t *R, cfg cluster.Config) *cluster.Cluster {
	t.Helper()
	var printTail func()
	if cfg.Logger == nil {
		cfg.Logger, printTail = clusterLogger(t)
		t.Cleanup(printTail) // a failure before the shutdown's cleanup is registered
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := cluster.Start(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		require.NoError(t, c.Shutdown(sctx))
	})
	if printTail != nil {
		t.Cleanup(printTail) // runs first: the lines up to the failure, not the shutdown's
	}
	require.NoError(t, c.WarmUp(ctx))
	return c
}

// logTailLines is how many of a cluster's last log lines a failed
// scenario prints.
const logTailLines = 5000

// clusterLogger returns the logger of a scenario's cluster (debug level)
// and a function that prints its tail once if the scenario failed; with
// $KVMESH_CHAOS_LOG set, every line goes to stderr and there is no tail.
func clusterLogger(t *R) (*slog.Logger, func()) {
	opts := &slog.HandlerOptions{Level: slog.LevelDebug}
	if os.Getenv("KVMESH_CHAOS_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, opts)).With("scenario", t.Name()), func() {}
	}
	tail := logx.NewTail(logTailLines)
	var once sync.Once
	return slog.New(slog.NewTextHandler(tail, opts)), func() {
		if t.Failed() {
			once.Do(func() { t.Logf("the cluster's last %d log lines:\n%s", tail.Len(), tail.String()) })
		}
	}
}

// prompt draws prompts from a few tenants that share long system prompts,
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

// awaitWithin waits up to d for pred on every pair and fails the scenario
// otherwise; it returns the summary and the time it took.
func awaitWithin(t *R, c *cluster.Cluster, step string, d time.Duration, pred func(cluster.Pair) bool) (cluster.Summary, time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	s, took, err := c.AwaitTruth(ctx, 5*time.Millisecond, pred)
	require.NoError(t, err, "%s", step)
	return s, took
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// prometheusRegistry registers m on a fresh registry to read it back.
func prometheusRegistry(t *R, m *kvevents.Metrics) *prometheus.Registry {
	t.Helper()
	reg := prometheus.NewRegistry()
	require.NoError(t, m.Register(reg))
	return reg
}
