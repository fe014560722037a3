package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/faultctl"
)

func TestChaosRunWritesTheReport(t *testing.T) {
	dir := t.TempDir()
	root := newRootCmd()
	var out, errOut bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetArgs([]string{"chaos", "run", "eviction", "--factor", "0.25", "--out", dir})
	require.NoError(t, root.ExecuteContext(t.Context()), errOut.String())
	require.Contains(t, out.String(), "1 eviction-pressure")
	require.Contains(t, errOut.String(), "[1/1] eviction ok")
	md, err := os.ReadFile(filepath.Join(dir, "report.md"))
	require.NoError(t, err)
	require.Contains(t, string(md), "| 1 eviction-pressure | ok | 60 |")
	js, err := os.ReadFile(filepath.Join(dir, "report.json"))
	require.NoError(t, err)
	require.Contains(t, string(js), `"passed": true`)

	root = newRootCmd()
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	root.SetArgs([]string{"chaos", "run", "no-such-scenario", "--out", dir})
	require.ErrorContains(t, root.Execute(), "unknown scenario")
}

// syncBuffer is a bytes.Buffer safe to read while the command writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestFaultproxyServesItsRelaysAndControlAPI(t *testing.T) {
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "hi") }))
	defer backend.Close()
	t.Setenv("KVMESH_FAULTPROXY_TOKEN", "tok")
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	root := newRootCmd()
	var out syncBuffer
	root.SetOut(&out)
	root.SetErr(io.Discard)
	root.SetArgs([]string{"faultproxy", "--control-addr", "127.0.0.1:0", "--tcp", "e0," + "127.0.0.1:0," + backend.Listener.Addr().String()})
	done := make(chan error, 1)
	go func() { done <- root.ExecuteContext(ctx) }()
	var base string
	require.Eventually(t, func() bool {
		for _, l := range strings.Split(out.String(), "\n") {
			if u, ok := strings.CutPrefix(l, "control\t"); ok {
				base = u
				return true
			}
		}
		return false
	}, 10*time.Second, 5*time.Millisecond)
	cl := &faultctl.Client{Base: base, Token: "tok"}
	ps, err := cl.Proxies(ctx)
	require.NoError(t, err)
	require.Len(t, ps, 1)
	require.Equal(t, "e0", ps[0].Name)
	resp, err := http.Get("http://" + ps[0].Addr)
	require.NoError(t, err)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, "hi", string(b))
	_, err = (&faultctl.Client{Base: base, Token: "bad"}).Proxies(ctx)
	require.ErrorIs(t, err, faultctl.ErrUnauthorized)
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("kvmesh faultproxy did not stop on its context")
	}
}

func TestFaultproxyNeedsAToken(t *testing.T) {
	t.Setenv("KVMESH_FAULTPROXY_TOKEN", "")
	root := newRootCmd()
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	root.SetArgs([]string{"faultproxy", "--control-addr", "127.0.0.1:0"})
	require.ErrorIs(t, root.Execute(), ErrNoControlToken)
}
