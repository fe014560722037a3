package main

import (
	"bytes"
	"context"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/internal/gosched"
)

// TestProxybenchStreamOnce: the load generator reads the engine's stream,
// checks it byte for byte and sees one gap per chunk.
func TestProxybenchStreamOnce(t *testing.T) {
	chunks := benchStream(3)
	require.Len(t, chunks, 4)
	srv := httptest.NewServer(&benchEngine{chunks: chunks, gap: 20 * time.Millisecond})
	defer srv.Close()
	c := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	defer c.CloseIdleConnections()
	var want []byte
	for _, ch := range chunks {
		want = append(want, ch...)
	}
	ctx := context.Background()
	ttfb, gaps, err := streamOnce(ctx, c, srv.URL+"/v1/completions", []byte(`{}`), want, nil)
	require.NoError(t, err)
	assert.Positive(t, ttfb)
	// Four chunks give three gaps (the usage event and [DONE] share one);
	// a client put off the CPU for longer than the engine's pause may read
	// two chunks at once, and then sees fewer.
	require.NotEmpty(t, gaps)
	require.LessOrEqual(t, len(gaps), 3)
	for _, g := range gaps {
		assert.Positive(t, g)
	}

	bad := append([]byte(nil), want...)
	bad[len(bad)-3] = 'X'
	_, _, err = streamOnce(ctx, c, srv.URL+"/v1/completions", []byte(`{}`), bad, nil)
	require.Error(t, err, "a stream that differs from the engine's is a failure")
	_, _, err = streamOnce(ctx, c, srv.URL+"/v1/completions", []byte(`{}`), append(want, 'x'), nil)
	require.Error(t, err, "a short stream is a failure")
}

func TestProxybenchProcStat(t *testing.T) {
	st, err := readStat(os.Getpid())
	require.NoError(t, err)
	assert.Equal(t, os.Getppid(), st.ppid)
	assert.GreaterOrEqual(t, st.ticks, int64(0))
	assert.Contains(t, childPIDs(os.Getppid()), os.Getpid())
}

func TestProxybenchNginxConf(t *testing.T) {
	conf := nginxConf("/tmp/x", 8123, []string{"127.0.0.1:1", "127.0.0.1:2"})
	for _, want := range []string{"worker_processes 1;", "server 127.0.0.1:1;", "server 127.0.0.1:2;",
		"keepalive 512;", "proxy_buffering off;", "proxy_http_version 1.1;", "listen 127.0.0.1:8123;", "access_log off;"} {
		assert.Contains(t, conf, want)
	}
	assert.Equal(t, 1, strings.Count(conf, "upstream engines"))
}

func TestProxybenchPercentile(t *testing.T) {
	d := []time.Duration{10, 20, 30, 40, 50}
	assert.Equal(t, time.Duration(30), pct(d, .5))
	assert.Equal(t, time.Duration(50), pct(d, 1))
	assert.Equal(t, time.Duration(0), pct(nil, .5))
}

// blocksOf builds one target's blocks: block r has TTFBs base+r·step+i µs
// for i in 0..n−1, and gaps of gapBase ms plus the same offsets.
func blocksOf(rounds, n int, base, step, gapBase time.Duration) []blockTimes {
	out := make([]blockTimes, rounds)
	for r := range out {
		for i := 0; i < n; i++ {
			d := base + time.Duration(r)*step + time.Duration(i)*time.Microsecond
			out[r].ttfb = append(out[r].ttfb, d)
			out[r].gaps = append(out[r].gaps, gapBase+d)
		}
	}
	return out
}

func bandOf(t *testing.T, b proxyBands, figure string) band {
	t.Helper()
	for _, x := range b.Bands {
		if x.Figure == figure {
			return x
		}
	}
	t.Fatalf("no band %q in %+v", figure, b)
	return band{}
}

func TestProxybenchBandsShiftWithoutNoise(t *testing.T) {
	// kvmesh is nginx plus exactly 1 ms in every round: whichever rounds a
	// resample draws, the difference is 1 ms, so the band is a point.
	byRound := map[string][]blockTimes{
		targetDirect: blocksOf(4, 100, time.Millisecond, 0, 20*time.Millisecond),
		targetNginx:  blocksOf(4, 100, 2*time.Millisecond, 0, 20*time.Millisecond),
		targetKvmesh: blocksOf(4, 100, 3*time.Millisecond, 0, 20*time.Millisecond),
	}
	b := roundBands(20, byRound, 50)
	assert.Equal(t, 4, b.Rounds)
	assert.Len(t, b.Bands, 4, "the go-floor figures need its blocks")
	for _, f := range []string{"kvmesh − nginx, TTFB p50", "kvmesh − nginx, TTFB p99"} {
		x := bandOf(t, b, f)
		assert.InDelta(t, 1, x.Value, 1e-9, f)
		assert.InDelta(t, 1, x.Lo, 1e-9, f)
		assert.InDelta(t, 1, x.Hi, 1e-9, f)
	}
	x := bandOf(t, b, "kvmesh added gap p99")
	assert.InDelta(t, 2, x.Value, 1e-9)
	assert.InDelta(t, 2, x.Lo, 1e-9)
	assert.InDelta(t, 2, x.Hi, 1e-9)
}

func TestProxybenchBandsWidenWithRoundNoise(t *testing.T) {
	// kvmesh's rounds differ by 2 ms each (a machine whose load changes
	// between rounds), nginx's do not: the TTFB bands must cover more than
	// one round's worth of that drift, and contain the all-rounds figure.
	byRound := map[string][]blockTimes{
		targetDirect: blocksOf(6, 200, time.Millisecond, 0, 20*time.Millisecond),
		targetNginx:  blocksOf(6, 200, 2*time.Millisecond, 0, 20*time.Millisecond),
		targetKvmesh: blocksOf(6, 200, 2*time.Millisecond, 2*time.Millisecond, 20*time.Millisecond),
	}
	b := roundBands(200, byRound, bandResamples)
	for _, f := range []string{"kvmesh − nginx, TTFB p50", "kvmesh − nginx, TTFB p99", "kvmesh added gap p99"} {
		x := bandOf(t, b, f)
		assert.Greater(t, x.Hi-x.Lo, 2.0, f)
		assert.LessOrEqual(t, x.Lo, x.Value, f)
		assert.GreaterOrEqual(t, x.Hi, x.Value, f)
	}
	// nginx's own gap is steady: a point band.
	x := bandOf(t, b, "nginx added gap p99")
	assert.InDelta(t, x.Lo, x.Hi, 1e-9)
	// The same blocks give the same bands.
	assert.Equal(t, b, roundBands(200, byRound, bandResamples))
}

func TestProxybenchBandsWithoutNginx(t *testing.T) {
	byRound := map[string][]blockTimes{
		targetDirect: blocksOf(3, 10, time.Millisecond, 0, 20*time.Millisecond),
		targetKvmesh: blocksOf(3, 10, 2*time.Millisecond, 0, 20*time.Millisecond),
	}
	b := roundBands(20, byRound, 20)
	require.Len(t, b.Bands, 1)
	assert.Equal(t, "kvmesh added gap p99", b.Bands[0].Figure)
	var out strings.Builder
	b.write(&out)
	assert.Contains(t, out.String(), "20 streams, 5th–95th percentile over 20 resamples of the 3 rounds: kvmesh added gap p99 +1.00 ms [+1.00, +1.00]")
	assert.Empty(t, roundBands(20, map[string][]blockTimes{targetDirect: byRound[targetDirect]}, 20).Bands)
}

// TestProxybenchPooledPercentile: pooledPct is pct of the multiset it
// stands for, whatever the multiplicities and ties.
func TestProxybenchPooledPercentile(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 21))
	for trial := 0; trial < 200; trial++ {
		rounds := 1 + rng.IntN(5)
		blocks := make([][]time.Duration, rounds)
		times := make([]int, rounds)
		var pooled []time.Duration
		for r := range blocks {
			for range rng.IntN(30) {
				blocks[r] = append(blocks[r], time.Duration(rng.IntN(50))) // ties
			}
			slices.Sort(blocks[r])
			times[r] = rng.IntN(3)
			for range times[r] {
				pooled = append(pooled, blocks[r]...)
			}
		}
		slices.Sort(pooled)
		for _, p := range []float64{0, .05, .5, .9, .99, 1} {
			require.Equal(t, pct(pooled, p), pooledPct(blocks, times, p), "trial %d p %v blocks %v times %v", trial, p, blocks, times)
		}
	}
}

// TestProxybenchGoFloor: the Go floor relays each chunk as the engine
// sends it (the engine holds its second chunk until the client has read
// the first through the proxy) and alternates between the engines.
func TestProxybenchGoFloor(t *testing.T) {
	var hits [2]atomic.Int32
	release := make(chan struct{})
	engine := func(i int) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hits[i].Add(1)
			heldAnswer(w, r, release)
		}))
	}
	e0, e1 := engine(0), engine(1)
	defer e0.Close()
	defer e1.Close()
	var ups []*url.URL
	for _, e := range []*httptest.Server{e0, e1} {
		u, err := url.Parse(e.URL)
		require.NoError(t, err)
		ups = append(ups, u)
	}
	proxy := httptest.NewServer(goFloorProxy(ups))
	defer proxy.Close()

	for range 2 {
		heldStream(t, http.DefaultClient, proxy.URL+"/v1/completions", release)
	}
	assert.Equal(t, int32(1), hits[0].Load())
	assert.Equal(t, int32(1), hits[1].Load())
}

// TestProxybenchRawFloor: the raw floor relays each chunk as the engine
// sends it (the engine holds its second chunk until the client has read
// the first through the proxy), alternates between the engines, passes
// answers of a known length, and keeps its engine connections alive.
func TestProxybenchRawFloor(t *testing.T) {
	var hits, conns [2]atomic.Int32
	release := make(chan struct{})
	engine := func(i int) *httptest.Server {
		s := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hits[i].Add(1)
			if r.URL.Path == "/fixed" {
				_, _ = io.Copy(io.Discard, r.Body)
				_, _ = io.WriteString(w, "fixed answer")
				return
			}
			heldAnswer(w, r, release)
		}))
		s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
			if st == http.StateNew {
				conns[i].Add(1)
			}
		}
		s.Start()
		return s
	}
	e0, e1 := engine(0), engine(1)
	defer e0.Close()
	defer e1.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- newRawFloor([]string{e0.Listener.Addr().String(), e1.Listener.Addr().String()}).run(ctx, ln)
	}()
	defer func() {
		cancel()
		require.NoError(t, <-done)
	}()
	client := &http.Client{Transport: &http.Transport{MaxConnsPerHost: 1}}
	defer client.CloseIdleConnections()
	base := "http://" + ln.Addr().String()

	for range 2 {
		heldStream(t, client, base+"/v1/completions", release)
	}
	assert.Equal(t, int32(1), hits[0].Load())
	assert.Equal(t, int32(1), hits[1].Load())

	for range 4 {
		resp, err := client.Post(base+"/fixed", "application/json", strings.NewReader(`{}`))
		require.NoError(t, err)
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		assert.Equal(t, "fixed answer", string(b))
		assert.Equal(t, int64(len("fixed answer")), resp.ContentLength)
	}
	assert.Equal(t, int32(3), hits[0].Load())
	assert.Equal(t, int32(3), hits[1].Load())
	assert.Equal(t, int32(1), conns[0].Load(), "one kept-alive connection to each engine")
	assert.Equal(t, int32(1), conns[1].Load(), "one kept-alive connection to each engine")
}

// TestRawFloorChunkEnd: the chunked-body scanner finds the end of a body
// with an extension and a trailer however the bytes are split, and
// rejects bytes after it.
func TestRawFloorChunkEnd(t *testing.T) {
	body := "5;ext=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nX-Trailer: t\r\n\r\n"
	for cut := 1; cut < len(body); cut++ {
		for _, parts := range [][]string{{body[:cut], body[cut:]}, strings.SplitAfter(body, "")} {
			var s chunkEnd
			for i, p := range parts {
				done, err := s.feed([]byte(p))
				require.NoError(t, err)
				require.Equal(t, i == len(parts)-1, done, "cut %d part %d", cut, i)
			}
		}
	}
	var s chunkEnd
	_, err := s.feed([]byte(body + "x"))
	require.Error(t, err)
}

// heldStream sends one streaming request through a floor proxy to an
// engine that answers "data: one", then holds its "data: [DONE]" until
// release: the first chunk must reach the client while the engine holds
// the second.
func heldStream(t *testing.T, client *http.Client, url string, release chan<- struct{}) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(`{"prompt":"p"}`))
	require.NoError(t, err)
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	first := make([]byte, len("data: one\n\n"))
	_, err = io.ReadFull(resp.Body, first)
	require.NoError(t, err, "the first chunk arrives while the engine holds the second")
	assert.Equal(t, "data: one\n\n", string(first))
	release <- struct{}{}
	rest, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	assert.Equal(t, "data: [DONE]\n\n", string(rest))
}

// heldAnswer is heldStream's engine side: it reads the request, answers
// "data: one" at once and "data: [DONE]" once release lets it.
func heldAnswer(w http.ResponseWriter, r *http.Request, release <-chan struct{}) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "text/event-stream")
	_, _ = io.WriteString(w, "data: one\n\n")
	w.(http.Flusher).Flush()
	select {
	case <-release:
	case <-r.Context().Done():
		return
	}
	_, _ = io.WriteString(w, "data: [DONE]\n\n")
}

// TestProxybenchGoRuntime: the GC count and the scheduling latency
// histogram are read over HTTP from /metrics; a process without the GC
// count, or none at all, reads as unknown (internal/gosched tests the
// parsing of a real collector and the summary).
func TestProxybenchGoRuntime(t *testing.T) {
	var text atomic.Value
	text.Store("go_gc_duration_seconds_count 7\n" +
		`go_sched_latencies_seconds_bucket{le="0.01"} 5` + "\n" +
		`go_sched_latencies_seconds_bucket{le="+Inf"} 6` + "\n")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, text.Load().(string))
	}))
	defer srv.Close()

	rt, ok := readGoRuntime(srv.URL)
	require.True(t, ok)
	assert.Equal(t, int64(7), rt.GCs)
	assert.Equal(t, gosched.Histogram{0.01: 5, math.Inf(1): 6}, rt.Sched)

	text.Store("other_series 1\n")
	_, ok = readGoRuntime(srv.URL)
	assert.False(t, ok, "no GC count")
	_, ok = readGoRuntime("")
	assert.False(t, ok)
	srv.Close()
	_, ok = readGoRuntime(srv.URL)
	assert.False(t, ok, "nothing listens")
}

// TestProxybenchBlockCountsLoadGeneratorCPU: a block counts the CPU this
// process (the load generator) spends during it, and the report prints
// it per stream count and target. The bodies burn a known amount of CPU
// in the client, so the count cannot be zero however busy the machine.
func TestProxybenchBlockCountsLoadGeneratorCPU(t *testing.T) {
	want := bytes.Join(benchStream(2), nil)
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = w.Write(want)
	}))
	defer engine.Close()
	burn := func(d time.Duration) { // CPU time of this process, not wall time
		var x uint64
		for start := cpuTicks([]int{os.Getpid()}); cpuTicks([]int{os.Getpid()})-start < int64(d/(time.Second/clkTck)); {
			for range 100_000 {
				x = x*6364136223846793005 + 1
			}
		}
		_ = x
	}
	bodies := func(int) []byte { burn(30 * time.Millisecond); return []byte(`{}`) }
	tg := &target{name: targetDirect, client: &http.Client{}, urls: []string{engine.URL + "/v1/completions"}}
	s := runBlock(context.Background(), tg, bodies, want, 2, 3, 0)
	require.Zero(t, s.failures, "%v", s.firstErr)
	// Each body returns once this process has spent 3 more ticks of CPU,
	// all of it within the block.
	assert.GreaterOrEqual(t, s.loadTicks, int64(3))

	rep := &proxyReport{Rows: []proxyRow{
		{Target: targetDirect, Streams: 20, LoadCPU1000s: 0.5},
		{Target: targetKvmesh, Streams: 20, LoadCPU1000s: 0.25},
		{Target: targetKvmesh, Streams: 200, LoadCPU1000s: 0.125},
	}}
	var out strings.Builder
	rep.write(&out)
	assert.Contains(t, out.String(), "load generator (this process) at 20 streams, CPU s per 1,000 requests during each target's blocks: direct 0.500, kvmesh 0.250\n")
	assert.Contains(t, out.String(), "load generator (this process) at 200 streams, CPU s per 1,000 requests during each target's blocks: kvmesh 0.125\n")
}
