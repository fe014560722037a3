package gosched

import (
	"bytes"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// scrape reads url, a /metrics endpoint.
func scrape(t *testing.T, url string) []byte {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return b
}

// TestParseARealCollector reads the Go collector's own output, as a
// gateway's /metrics serves it, before and after some GC and wake-ups.
func TestParseARealCollector(t *testing.T) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(
		collectors.GoRuntimeMetricsRule{Matcher: regexp.MustCompile(`^/sched/latencies:seconds$`)})))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()

	a, err := Parse(bytes.NewReader(scrape(t, srv.URL)))
	require.NoError(t, err)
	assert.GreaterOrEqual(t, a.GCs, int64(0))
	require.NotEmpty(t, a.Sched)
	assert.Contains(t, a.Sched, math.Inf(1))
	runtime.GC()
	var wg sync.WaitGroup
	for range 100 { // wake-ups for the histogram
		wg.Add(1)
		go func() { defer wg.Done() }()
	}
	wg.Wait()
	b, err := Parse(bytes.NewReader(scrape(t, srv.URL)))
	require.NoError(t, err)
	assert.Greater(t, b.GCs, a.GCs)
	d := b.Sched.Sub(a.Sched)
	assert.Positive(t, d[math.Inf(1)])
	w := b.Sched.Waits()
	assert.Equal(t, b.Sched[math.Inf(1)], w.Wakeups)
	assert.InDelta(t, 0.92e-3, w.Bound1, 0.1e-3, "the runtime's bucket nearest 1 ms")
	assert.InDelta(t, 10.5e-3, w.Bound10, 1e-3, "the runtime's bucket nearest 10 ms")
}

func TestParseWithoutTheSeries(t *testing.T) {
	rt, err := Parse(strings.NewReader("# HELP x y\nx 1\n"))
	require.NoError(t, err)
	assert.Equal(t, int64(-1), rt.GCs)
	assert.Empty(t, rt.Sched)
	assert.Zero(t, rt.Sched.Waits())
	assert.Nil(t, rt.Sched.Sub(Histogram{1: 1}))

	for _, bad := range []string{
		"go_gc_duration_seconds_count x\n",
		`go_sched_latencies_seconds_bucket{le="0.1"}` + "\n",
		`go_sched_latencies_seconds_bucket{le="z"} 3` + "\n",
		`go_sched_latencies_seconds_bucket{le="0.1"} y` + "\n",
	} {
		_, err := Parse(strings.NewReader(bad))
		assert.Error(t, err, bad)
	}
}

func TestWaits(t *testing.T) {
	// 1,000 wake-ups: 900 within 0.9 ms, 990 within 10.5 ms.
	h := Histogram{6.4e-8: 100, 8.192e-5: 600, 0.000917504: 900, 0.01048576: 990, 0.117440512: 1000, math.Inf(1): 1000}
	w := h.Waits()
	assert.Equal(t, 1000.0, w.Wakeups)
	assert.InDelta(t, 0.10, w.Over1, 1e-9)
	assert.Equal(t, 0.000917504, w.Bound1)
	assert.InDelta(t, 0.01, w.Over10, 1e-9)
	assert.Equal(t, 0.01048576, w.Bound10)
	assert.Zero(t, Histogram(nil).Waits())
}
