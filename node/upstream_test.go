package node

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// steppedEngine streams one SSE event per step: the handler sends event i
// only once it receives on next, so a test decides when each chunk leaves
// the engine. headFirst sends (and flushes) the response head alone before
// the first step; otherwise the head leaves with event 0.
type steppedEngine struct {
	srv       *httptest.Server
	next      chan struct{}
	headSent  chan struct{}
	events    []string
	headFirst bool
}

func newSteppedEngine(t *testing.T, events int, headFirst bool) *steppedEngine {
	e := &steppedEngine{next: make(chan struct{}), headSent: make(chan struct{}, 1), headFirst: headFirst}
	for i := 0; i < events; i++ {
		e.events = append(e.events, fmt.Sprintf("data: {\"choices\":[{\"index\":0,\"text\":\"t%d\"}]}\n\n", i))
	}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/completions" { // health checks and scrapes
			w.WriteHeader(http.StatusOK)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		if e.headFirst {
			w.WriteHeader(http.StatusOK)
			fl.Flush()
			e.headSent <- struct{}{}
		}
		for _, ev := range e.events {
			select {
			case <-e.next:
			case <-r.Context().Done():
				return
			}
			_, _ = io.WriteString(w, ev)
			fl.Flush()
		}
	}))
	t.Cleanup(e.srv.Close)
	return e
}

// readEvent reads one SSE event (up to its blank line) or fails the test
// when it does not come within the deadline.
func readEvent(t *testing.T, br *bufio.Reader) string {
	t.Helper()
	type res struct {
		s   string
		err error
	}
	ch := make(chan res, 1)
	go func() {
		var b strings.Builder
		for {
			l, err := br.ReadString('\n')
			b.WriteString(l)
			if err != nil || l == "\n" {
				ch <- res{b.String(), err}
				return
			}
		}
	}()
	select {
	case r := <-ch:
		require.NoError(t, r.err)
		return r.s
	case <-time.After(10 * time.Second):
		t.Fatal("the event did not reach the client while the engine held the next one back")
		return ""
	}
}

// TestEachChunkReachesClientBeforeEngineSendsNext: every event is flushed
// to the client while the engine still holds the next one, whether the
// response head came alone or with the first event.
func TestEachChunkReachesClientBeforeEngineSendsNext(t *testing.T) {
	for _, headFirst := range []bool{false, true} {
		t.Run(fmt.Sprintf("headFirst=%v", headFirst), func(t *testing.T) {
			e := newSteppedEngine(t, 4, headFirst)
			n := startNode(t, nil, rc("a", e.srv.URL))
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+n.HTTPAddr()+"/v1/completions", strings.NewReader(streamReq))
			require.NoError(t, err)
			type doRes struct {
				resp *http.Response
				err  error
			}
			done := make(chan doRes, 1)
			go func() {
				resp, err := http.DefaultClient.Do(req)
				done <- doRes{resp, err}
			}()
			var resp *http.Response
			if headFirst {
				<-e.headSent
				// The engine sent only its head: the client must get it
				// before any event exists.
				select {
				case r := <-done:
					require.NoError(t, r.err)
					resp = r.resp
				case <-time.After(10 * time.Second):
					t.Fatal("the response head was held back until the first event")
				}
				e.next <- struct{}{}
			} else {
				e.next <- struct{}{}
				r := <-done
				require.NoError(t, r.err)
				resp = r.resp
			}
			defer resp.Body.Close()
			require.Equal(t, http.StatusOK, resp.StatusCode)
			br := bufio.NewReader(resp.Body)
			for i, want := range e.events {
				assert.Equal(t, want, readEvent(t, br), "event %d", i)
				if i+1 < len(e.events) {
					e.next <- struct{}{}
				}
			}
			rest, err := io.ReadAll(br)
			require.NoError(t, err)
			assert.Empty(t, rest)
		})
	}
}

// TestUpstreamConnectionsAreReused: sequential streams to one replica
// share one keep-alive connection.
func TestUpstreamConnectionsAreReused(t *testing.T) {
	var conns atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/completions" { // health checks and scrapes
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for _, ev := range strings.SplitAfter(streamBody("a", 5), "\n\n") {
			_, _ = io.WriteString(w, ev)
			w.(http.Flusher).Flush()
		}
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	n := startNode(t, func(c *Config) { c.HealthInterval, c.ScrapeInterval = 0, 0 }, rc("a", srv.URL))
	for i := 0; i < 5; i++ {
		resp := post(t, n, "/v1/completions", streamReq, nil)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		assert.Equal(t, streamBody("a", 5), readAll(t, resp))
	}
	assert.EqualValues(t, 1, conns.Load(), "one upstream connection for five sequential streams")
}

// TestStaleIdleUpstreamConnectionIsRetried: an engine that closes idle
// keep-alive connections without saying so (as uvicorn does after its
// keep-alive timeout, or as a restarted engine has) costs no request: the
// gateway sends the request again, once, on a new connection, not on
// another idle one that is just as stale.
func TestStaleIdleUpstreamConnectionIsRetried(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	const together = 3 // the first requests are answered only once all arrived
	var requests, accepted atomic.Int64
	var barrier sync.WaitGroup
	barrier.Add(together)
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait) // runs after the listener is closed (cleanups run last first)
	t.Cleanup(func() { ln.Close() })
	serve := func(c net.Conn) {
		defer wg.Done()
		defer c.Close() // one response per connection, announced as keep-alive
		req, err := http.ReadRequest(bufio.NewReader(c))
		if err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, req.Body)
		if requests.Add(1) <= together {
			barrier.Done()
			barrier.Wait()
		}
		body := `{"id":"x","choices":[{"index":0,"text":"ok"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`
		_, _ = fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			wg.Add(1)
			go serve(c)
		}
	}()
	n := startNode(t, func(c *Config) { c.HealthInterval, c.ScrapeInterval = 0, 0 }, rc("a", "http://"+ln.Addr().String()))
	const nonStream = `{"model":"m","prompt":"hello there"}`
	// Three at once leave three idle connections the engine has closed.
	var cw sync.WaitGroup
	codes := make([]int, together)
	for i := range together {
		cw.Add(1)
		go func() {
			defer cw.Done()
			resp, err := http.Post("http://"+n.HTTPAddr()+"/v1/completions", "application/json", strings.NewReader(nonStream))
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			codes[i] = resp.StatusCode
		}()
	}
	cw.Wait()
	assert.Equal(t, []int{200, 200, 200}, codes)
	for i := 0; i < 3; i++ {
		resp := post(t, n, "/v1/completions", nonStream, nil)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		assert.Contains(t, readAll(t, resp), `"text":"ok"`)
	}
	assert.EqualValues(t, 6, requests.Load(), "each request reached the engine exactly once")
	assert.EqualValues(t, 6, accepted.Load(), "a retry dials; it does not take another stale idle connection")
}

func TestForwardedHeaders(t *testing.T) {
	conn := []string{"keep-alive, X-Drop"}
	for k, want := range map[string]bool{
		"Authorization": true, "Content-Type": true, "X-Drop": false, "Keep-Alive": false,
		"Connection": false, "Content-Length": false, "Host": false,
		"Routing-Strategy": false, "X-Kvmesh-Pin-Replica": false, "X-Kvmesh-Admin-Token": false,
	} {
		assert.Equal(t, want, forwarded(k, conn), k)
	}
	b := appendRequest(nil, &upstreamReq{host: "h:1", path: "/v1/completions", rawQuery: "a=1",
		hdr: http.Header{"Authorization": {"Bearer x"}, "Connection": {"close"}}, body: []byte("{}")})
	req, err := http.ReadRequest(bufio.NewReader(strings.NewReader(string(b))))
	require.NoError(t, err)
	assert.Equal(t, "/v1/completions?a=1", req.RequestURI)
	assert.Equal(t, "h:1", req.Host)
	assert.Equal(t, "Bearer x", req.Header.Get("Authorization"))
	assert.EqualValues(t, 2, req.ContentLength)
	assert.False(t, req.Close)
	body, err := io.ReadAll(req.Body)
	require.NoError(t, err)
	assert.Equal(t, "{}", string(body))
}

// BenchmarkProxyStream sends one streaming completion per op through a
// gateway to a fake engine that sends its 9 events at once (a 2 KB
// prompt), with the proxy's own client and with net/http's Transport
// (UpstreamHTTP2 routes plain-http replicas through it). Allocations and
// time are the client's, the engine's and the gateway's together: compare
// the two cases, not the absolute figures.
func BenchmarkProxyStream(b *testing.B) {
	for _, c := range []struct {
		name      string
		transport bool
	}{{"client=own", false}, {"client=transport", true}} {
		b.Run(c.name, func(b *testing.B) {
			e := newFakeEngine(b, "a")
			e.chunks.Store(8)
			n := startNode(b, func(cfg *Config) {
				cfg.UpstreamHTTP2 = c.transport
				cfg.HealthInterval, cfg.ScrapeInterval = 0, 0
				cfg.Tokenizer = TokenizerCharacter
			}, rc("a", e.url()))
			body := fmt.Sprintf(`{"model":"m","prompt":%q,"stream":true,"max_tokens":8}`, strings.Repeat("The quick brown fox jumps. ", 80))
			want := len(streamBody("a", 8))
			client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
			defer client.CloseIdleConnections()
			url := "http://" + n.HTTPAddr() + "/v1/completions"
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				resp, err := client.Post(url, "application/json", strings.NewReader(body))
				if err != nil {
					b.Fatal(err)
				}
				got, err := io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if err != nil || int(got) != want {
					b.Fatalf("stream of %d bytes (%v), want %d", got, err, want)
				}
			}
		})
	}
}

// TestUpstreamRequestLargerThanTheSendBuffer: a request body that does not
// fit in the socket's send buffer (send writes what fits inside its
// RawConn.Read call, the rest the ordinary way) reaches the engine intact,
// and the answer is read.
func TestUpstreamRequestLargerThanTheSendBuffer(t *testing.T) {
	body := bytes.Repeat([]byte("0123456789abcdef"), 1<<20) // 16 MiB, above Linux's largest default send buffer
	want := sha256.Sum256(body)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := sha256.New()
		n, err := io.Copy(h, r.Body)
		if err != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		fmt.Fprintf(w, "%d %x", n, h.Sum(nil))
	}))
	t.Cleanup(srv.Close)
	c := newUpstreamClient(Config{ConnectTimeout: 5 * time.Second, MaxIdleConnsPerHost: 2, FirstByteTimeout: time.Minute})
	addr := strings.TrimPrefix(srv.URL, "http://")
	for i := range 2 { // a new connection, then the reused one
		resp, uc, err := c.roundTrip(context.Background(), &upstreamReq{addr: addr, host: addr, path: "/v1/completions", body: body})
		require.NoError(t, err)
		got, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		assert.Equal(t, fmt.Sprintf("%d %x", len(body), want), string(got), "request %d", i)
		assert.Equal(t, i == 1, uc.reused)
		c.release(uc, true)
	}
	c.closeIdle(true)
}
