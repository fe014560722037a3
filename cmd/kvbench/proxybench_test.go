package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
