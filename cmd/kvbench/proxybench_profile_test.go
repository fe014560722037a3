package main

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"net/http/pprof"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// topSample is go tool pprof -top output in the layout of Go 1.26's
// pprof (figures made up so that each share below is known).
const topSample = `File: kvmesh
Build ID: 0123
Type: cpu
Duration: 10s, Total samples = 4s (40.00%)
Showing nodes accounting for 4s, 100% of 4s total
      flat  flat%   sum%        cum   cum%
     1.60s 40.00% 40.00%      1.60s 40.00%  internal/runtime/syscall/linux.Syscall6
     0.20s  5.00% 45.00%      0.20s  5.00%  runtime.futex
     0.08s  2.00% 47.00%      0.08s  2.00%  runtime.usleep
     0.04s  1.00% 48.00%      1.70s 42.50%  syscall.RawSyscall6
     0.12s  3.00% 51.00%      2.40s 60.00%  github.com/kvmesh/kvmesh/node.(*Node).proxy
     0.04s  1.00% 52.00%      1.00s 25.00%  github.com/kvmesh/kvmesh/node.retryEINTR (inline)
     0.08s  2.00% 54.00%      0.30s  7.50%  net/http.(*conn).serve
     0.04s  1.00% 55.00%      0.60s 15.00%  runtime.findRunnable
     0.02s  0.50% 55.50%      0.10s  2.50%  runtime.gcBgMarkWorker
     0.06s  1.50% 57.00%      0.16s  4.00%  runtime.mallocgc
     0.02s  0.50% 57.50%      0.02s  0.50%  bytes.Index
`

// TestProxybenchProfileShares: the summary adds the flat samples of the
// system calls (the kernel entry points the runtime and the syscall
// packages use), of kvmesh and of net/http, and reads the cumulative
// share of the scheduler, GC and allocation.
func TestProxybenchProfileShares(t *testing.T) {
	got := map[string]float64{}
	for _, s := range profileShares(topSample) {
		got[s.What] = s.Percent
	}
	assert.InDelta(t, 48.0, got["system calls (flat: read, write, epoll, futex, sleeps)"], 1e-9)
	assert.InDelta(t, 4.0, got["kvmesh's own code (flat)"], 1e-9)
	assert.InDelta(t, 2.0, got["net/http (flat)"], 1e-9)
	assert.InDelta(t, 15.0, got["runtime.findRunnable (cum: the scheduler looking for work)"], 1e-9)
	assert.InDelta(t, 2.5, got["runtime.gcBgMarkWorker (cum: GC's background marking)"], 1e-9)
	assert.InDelta(t, 4.0, got["runtime.mallocgc (cum: allocation)"], 1e-9)

	table := topTable(topSample, 2)
	assert.Contains(t, table, "Total samples = 4s")
	assert.Contains(t, table, "flat%")
	assert.Contains(t, table, "runtime.futex")
	assert.NotContains(t, table, "runtime.usleep", "two function lines only")
	assert.NotContains(t, table, "Build ID")
}

// TestProxybenchProfileBlock takes a real CPU profile (net/http/pprof's
// handler, behind a bearer token as the gateway serves it) while blocks
// stream through the same server, and summarises it with go tool pprof.
// A wrong token is reported, not written.
func TestProxybenchProfileBlock(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("go tool pprof needs the go command")
	}
	ctx, tg, bodies, want := captureTarget(t)
	dir := t.TempDir()

	res := profileBlock(ctx, tg, captureToken, 1, dir, bodies, want, 2, 1, 0)
	b := readCapture(t, res.Error, res.Requests, res.File)
	require.True(t, bytes.HasPrefix(b, []byte{0x1f, 0x8b}), "a pprof profile is gzipped")
	require.Len(t, res.Shares, 6)
	assert.Contains(t, res.Top, "flat%")

	bad := profileBlock(ctx, tg, "not-the-token", 1, t.TempDir(), bodies, want, 2, 1, 0)
	assert.Contains(t, bad.Error, "401")
	assert.Contains(t, bad.Error, "admin token")
	assert.Empty(t, bad.File)
}

// TestProxybenchTraceBlock takes a real execution trace the same way and
// summarises what the server's goroutines waited for.
func TestProxybenchTraceBlock(t *testing.T) {
	ctx, tg, bodies, want := captureTarget(t)
	dir := t.TempDir()

	res := traceBlock(ctx, tg, captureToken, 1, dir, bodies, want, 2, 1, 0)
	b := readCapture(t, res.Error, res.Requests, res.File)
	require.True(t, bytes.HasPrefix(b, []byte("go 1.")), "an execution trace starts with its Go version")
	require.NotNil(t, res.Summary)
	assert.Positive(t, res.Summary.Wakeups, "the streams woke the server's goroutines")
	assert.Positive(t, res.Summary.Runs)
	assert.GreaterOrEqual(t, res.Summary.Span, 500*time.Millisecond, "a 1 s trace spans most of its second")
	var out strings.Builder
	rep := proxyReport{Traces: []traceResult{res}}
	rep.write(&out)
	assert.Contains(t, out.String(), "Execution trace, kvmesh at 2 streams (1 s, ")
	assert.Contains(t, out.String(), "goroutine wake-ups in")

	bad := traceBlock(ctx, tg, "not-the-token", 1, t.TempDir(), bodies, want, 2, 1, 0)
	assert.Contains(t, bad.Error, "401")
	assert.Empty(t, bad.File)
	assert.Nil(t, bad.Summary)
}

// readCapture checks that a capture was taken while blocks ran and
// returns the file it was written to.
func readCapture(t *testing.T, errText string, requests int, file string) []byte {
	t.Helper()
	require.Empty(t, errText)
	assert.Positive(t, requests, "blocks ran while the capture was taken")
	b, err := os.ReadFile(file)
	require.NoError(t, err)
	return b
}

// captureToken is the admin token of captureTarget's server.
const captureToken = "capture-test-token"

// captureTarget serves a streaming engine and net/http/pprof's profile and
// trace handlers (behind captureToken, as the gateway serves them) on one
// server, and returns it as a kvmesh target with the blocks' bodies and
// the stream each answer must be.
func captureTarget(t *testing.T) (context.Context, *target, func(int) []byte, []byte) {
	t.Helper()
	chunks := benchStream(2)
	want := bytes.Join(chunks, nil)
	mux := http.NewServeMux()
	mux.Handle("/v1/completions", &benchEngine{chunks: chunks, gap: 5 * time.Millisecond})
	for path, h := range map[string]http.HandlerFunc{"/debug/pprof/profile": pprof.Profile, "/debug/pprof/trace": pprof.Trace} {
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("Authorization") != "Bearer "+captureToken {
				http.Error(w, `{"error":{"message":"profiles require the admin token"}}`, http.StatusUnauthorized)
				return
			}
			h(w, r)
		})
	}
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	c := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	t.Cleanup(c.CloseIdleConnections)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	tg := &target{name: targetKvmesh, urls: []string{srv.URL + "/v1/completions"}, client: c, base: srv.URL}
	return ctx, tg, func(int) []byte { return []byte(`{}`) }, want
}
