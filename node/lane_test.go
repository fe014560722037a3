package node

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestScreenHead(t *testing.T) {
	const ok = ""
	for _, tc := range []struct {
		name, head, want string
	}{
		{"post", "POST /v1/completions HTTP/1.1\r\nHost: gw:8080\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n", ok},
		{"get", "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", ok},
		{"keep-alive and close", "POST /v1/chat/completions HTTP/1.1\r\nhost: [::1]:80\r\nConnection: keep-alive, Close\r\nContent-Length: 0\r\n\r\n", ok},
		{"value with tab and obs-text", "GET / HTTP/1.1\r\nHost: h\r\nX-A:\ta b \xc3\xa9\r\n\r\n", ok},
		{"http/1.0", "GET / HTTP/1.0\r\nHost: h\r\n\r\n", handoffVersion},
		{"http/2 preface", "PRI * HTTP/2.0\r\n\r\n", handoffVersion},
		{"head", "HEAD / HTTP/1.1\r\nHost: h\r\n\r\n", handoffMethod},
		{"options", "OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n", handoffMethod},
		{"absolute form", "GET http://h/ HTTP/1.1\r\nHost: h\r\n\r\n", handoffTarget},
		{"space in target", "GET /a b HTTP/1.1\r\nHost: h\r\n\r\n", handoffVersion},
		{"control in target", "GET /a\x01 HTTP/1.1\r\nHost: h\r\n\r\n", handoffTarget},
		{"chunked", "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n", handoffFraming},
		{"two lengths", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n", handoffFraming},
		{"signed length", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: +1\r\n\r\n", handoffFraming},
		{"huge length", "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1234567890123456789\r\n\r\n", handoffFraming},
		{"get with body", "GET / HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\n", handoffFraming},
		{"trailer", "POST / HTTP/1.1\r\nHost: h\r\nTrailer: X\r\nContent-Length: 1\r\n\r\n", handoffFraming},
		{"expect", "POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n", handoffExpect},
		{"upgrade", "GET / HTTP/1.1\r\nHost: h\r\nUpgrade: websocket\r\n\r\n", handoffUpgrade},
		{"connection upgrade", "GET / HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\n\r\n", handoffUpgrade},
		{"h2c", "GET / HTTP/1.1\r\nHost: h\r\nHTTP2-Settings: AAA\r\n\r\n", handoffUpgrade},
		{"no host", "GET / HTTP/1.1\r\nX: y\r\n\r\n", handoffMalformed},
		{"two hosts", "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", handoffMalformed},
		{"empty host", "GET / HTTP/1.1\r\nHost: \r\n\r\n", handoffMalformed},
		{"odd host", "GET / HTTP/1.1\r\nHost: a/b\r\n\r\n", handoffMalformed},
		{"space in name", "GET / HTTP/1.1\r\nHost: h\r\nX Y: z\r\n\r\n", handoffMalformed},
		{"space before colon", "GET / HTTP/1.1\r\nHost : h\r\n\r\n", handoffMalformed},
		{"obs-fold", "GET / HTTP/1.1\r\nHost: h\r\nX: a\r\n b\r\n\r\n", handoffMalformed},
		{"no colon", "GET / HTTP/1.1\r\nHost: h\r\nXY\r\n\r\n", handoffMalformed},
		{"bare LF in value", "GET / HTTP/1.1\r\nHost: h\r\nX: a\nY: b\r\n\r\n", handoffMalformed},
		{"NUL in value", "GET / HTTP/1.1\r\nHost: h\r\nX: a\x00\r\n\r\n", handoffMalformed},
		{"no version", "GET /\r\nHost: h\r\n\r\n", handoffMalformed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, screenHead([]byte(tc.head)))
		})
	}
}

// rawExchange writes raw to a new connection to addr and reads n
// responses from it.
func rawExchange(t *testing.T, addr, raw string, n int) []*http.Response {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	require.NoError(t, c.SetDeadline(time.Now().Add(20*time.Second)))
	_, err = io.WriteString(c, raw)
	require.NoError(t, err)
	br := bufio.NewReader(c)
	var out []*http.Response
	// The first response answers raw's first request (HEAD has no body).
	first := &http.Request{Method: raw[:strings.IndexByte(raw, ' ')]}
	for i := range n {
		if i > 0 {
			first = nil
		}
		resp, err := http.ReadResponse(br, first)
		require.NoError(t, err, "response %d of %d", len(out)+1, n)
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		resp.Body = io.NopCloser(strings.NewReader(string(body)))
		out = append(out, resp)
	}
	return out
}

func bodyOf(t *testing.T, resp *http.Response) string {
	t.Helper()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}

// TestLaneHandsOffUnusualRequests: each request the lane does not serve
// reaches net/http's server with every byte the lane had read, and is
// answered as net/http answers it; an ordinary request pipelined behind
// it on the same connection is answered too (by net/http, which owns the
// connection from then on). Each hand-off is counted by its reason.
func TestLaneHandsOffUnusualRequests(t *testing.T) {
	e := newFakeEngine(t, "a")
	n := startNode(t, nil, rc("a", e.url()))
	require.NotNil(t, n.lane, "the lane is on by default")
	const next = "GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"
	body := `{"model":"m","prompt":"hello","max_tokens":2}`
	for _, tc := range []struct {
		name, raw, reason string
		status            int
	}{
		{"chunked body", "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n" +
			fmt.Sprintf("%x\r\n%s\r\n0\r\n\r\n", len(body), body), handoffFraming, http.StatusOK},
		{"http/1.0 keep-alive", "POST /v1/completions HTTP/1.0\r\nHost: gw\r\nConnection: keep-alive\r\nContent-Length: " +
			fmt.Sprint(len(body)) + "\r\n\r\n" + body, handoffVersion, http.StatusOK},
		{"large head", "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nX-Pad: " + strings.Repeat("p", 9000) +
			"\r\nContent-Length: " + fmt.Sprint(len(body)) + "\r\n\r\n" + body, handoffLargeHead, http.StatusOK},
		{"head", "HEAD /health HTTP/1.1\r\nHost: gw\r\n\r\n", handoffMethod, http.StatusOK},
		{"conflicting lengths", "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", handoffFraming, http.StatusBadRequest},
		{"no host", "GET /health HTTP/1.1\r\n\r\n", handoffMalformed, http.StatusBadRequest},
		{"bare LF line ends", "GET /health HTTP/1.1\nHost: gw\n\n", handoffMalformed, http.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := value(n.m.handoffs.WithLabelValues(tc.reason))
			want := 2
			if tc.status == http.StatusBadRequest {
				want = 1 // net/http closes after a 400
			}
			resps := rawExchange(t, n.HTTPAddr(), tc.raw+next, want)
			assert.Equal(t, tc.status, resps[0].StatusCode, bodyOf(t, resps[0]))
			if want == 2 {
				assert.Equal(t, http.StatusOK, resps[1].StatusCode, "the pipelined request behind it")
			}
			assert.Equal(t, before+1, value(n.m.handoffs.WithLabelValues(tc.reason)))
		})
	}
	t.Run("expect 100-continue", func(t *testing.T) {
		c, err := net.Dial("tcp", n.HTTPAddr())
		require.NoError(t, err)
		defer c.Close()
		require.NoError(t, c.SetDeadline(time.Now().Add(20*time.Second)))
		_, err = fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n", len(body))
		require.NoError(t, err)
		br := bufio.NewReader(c)
		line, err := br.ReadString('\n')
		require.NoError(t, err)
		assert.Equal(t, "HTTP/1.1 100 Continue\r\n", line, "net/http asks for the body")
		_, err = br.ReadString('\n')
		require.NoError(t, err)
		_, err = io.WriteString(c, body)
		require.NoError(t, err)
		resp, err := http.ReadResponse(br, nil)
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, resp.StatusCode, bodyOf(t, resp))
	})
	t.Run("ordinary requests stay in the lane", func(t *testing.T) {
		total := func() (s float64) {
			for _, r := range handoffReasons {
				s += value(n.m.handoffs.WithLabelValues(r))
			}
			return s
		}
		before := total()
		raw := fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		resps := rawExchange(t, n.HTTPAddr(), raw+raw+next, 3)
		for _, r := range resps {
			assert.Equal(t, http.StatusOK, r.StatusCode)
		}
		assert.Equal(t, before, total(), "nothing handed off")
	})
}

// laneOnly serves h through a lane alone on a loopback listener.
func laneOnly(t *testing.T, h http.Handler) (addr string, l *lane) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	l = newLane(h, context.Background(), 5*time.Second, 5*time.Second, slog.New(slog.DiscardHandler), func(string) {})
	std := l.listener(ln)
	srv := &http.Server{Handler: h}
	go func() { _ = srv.Serve(std) }()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = l.serve()
	}()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		assert.NoError(t, l.shutdown(ctx))
		_ = srv.Close()
		<-done
	})
	return ln.Addr().String(), l
}

// TestLaneResponseFraming: the lane frames responses as net/http does
// where clients can tell: a body that ends before the write buffer is
// flushed gets a Content-Length, a flushed one is chunked, a missing
// Content-Type is sniffed, 204 has no body, and a Date is set.
func TestLaneResponseFraming(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("/small", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "<html>hi</html>") })
	mux.HandleFunc("/flushed", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: 1\n\n")
		w.(http.Flusher).Flush()
		_, _ = io.WriteString(w, "data: 2\n\n")
	})
	mux.HandleFunc("/big", func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte(strings.Repeat("x", 3*laneWriteBuf)))
	})
	mux.HandleFunc("/empty", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) })
	mux.HandleFunc("/odd", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(599) })
	mux.HandleFunc("/echo", func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		_, _ = fmt.Fprintf(w, "%s %t %s", r.Host, r.RemoteAddr != "", b)
	})
	addr, _ := laneOnly(t, mux)
	get := func(path string) string { return "GET " + path + " HTTP/1.1\r\nHost: gw\r\n\r\n" }

	resps := rawExchange(t, addr, get("/small")+get("/flushed")+get("/big")+get("/empty")+get("/odd")+
		"POST /echo HTTP/1.1\r\nHost: gw:1\r\nContent-Length: 5\r\n\r\nhello", 6)
	small, flushed, big, empty, odd, echo := resps[0], resps[1], resps[2], resps[3], resps[4], resps[5]

	assert.Equal(t, int64(15), small.ContentLength)
	assert.Equal(t, "text/html; charset=utf-8", small.Header.Get("Content-Type"), "sniffed")
	assert.NotEmpty(t, small.Header.Get("Date"))
	_, err := http.ParseTime(small.Header.Get("Date"))
	assert.NoError(t, err)
	assert.Equal(t, "<html>hi</html>", bodyOf(t, small))

	assert.Equal(t, []string{"chunked"}, flushed.TransferEncoding)
	assert.Equal(t, "text/event-stream", flushed.Header.Get("Content-Type"))
	assert.Equal(t, "data: 1\n\ndata: 2\n\n", bodyOf(t, flushed))

	assert.Equal(t, []string{"chunked"}, big.TransferEncoding, "too big to hold back")
	assert.Len(t, bodyOf(t, big), 3*laneWriteBuf)

	assert.Equal(t, http.StatusNoContent, empty.StatusCode)
	assert.Empty(t, bodyOf(t, empty))
	assert.Equal(t, "599 status code 599", odd.Status)

	assert.Equal(t, "gw:1 true hello", bodyOf(t, echo))
}

// TestLaneShortBodyClosesConnection: a handler that declares more than it
// writes leaves the client a body it can tell is short.
func TestLaneShortBodyClosesConnection(t *testing.T) {
	addr, _ := laneOnly(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "10")
		_, _ = io.WriteString(w, "12345")
	}))
	resp, err := http.Get("http://" + addr + "/")
	require.NoError(t, err)
	defer resp.Body.Close()
	_, err = io.ReadAll(resp.Body)
	assert.ErrorIs(t, err, io.ErrUnexpectedEOF)
}

// TestLaneUnreadBodies: a handler that returns without reading its body
// leaves the connection usable when the rest is small (it is read and
// dropped), and closed after the answer when it is large.
func TestLaneUnreadBodies(t *testing.T) {
	var served atomic.Int64
	addr, _ := laneOnly(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		http.Error(w, "nope", http.StatusNotFound)
	}))
	small := "POST /x HTTP/1.1\r\nHost: gw\r\nContent-Length: 1000\r\n\r\n" + strings.Repeat("b", 1000)
	resps := rawExchange(t, addr, small+small, 2)
	assert.Equal(t, http.StatusNotFound, resps[0].StatusCode)
	assert.Equal(t, http.StatusNotFound, resps[1].StatusCode, "the connection served on")

	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(20*time.Second)))
	_, err = fmt.Fprintf(c, "POST /x HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n", 2*laneMaxDiscard)
	require.NoError(t, err)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	require.NoError(t, err)
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)
	_, _ = io.Copy(io.Discard, resp.Body)
	_, err = br.ReadByte()
	assert.ErrorIs(t, err, io.EOF, "a body too large to drop closes the connection")
}

// TestLaneClientLeavingCancelsHandler: once the body is read, the
// connection's read sees the client leave and ends the handler's context.
func TestLaneClientLeavingCancelsHandler(t *testing.T) {
	started := make(chan struct{})
	cause := make(chan error, 1)
	addr, _ := laneOnly(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		w.(http.Flusher).Flush()
		close(started)
		select {
		case <-r.Context().Done():
			cause <- context.Cause(r.Context())
		case <-time.After(20 * time.Second):
			cause <- nil
		}
	}))
	c, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	_, err = io.WriteString(c, "POST / HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}")
	require.NoError(t, err)
	<-started
	require.NoError(t, c.Close())
	assert.ErrorIs(t, <-cause, context.Canceled)
}

// TestLanePanics: a handler panic closes the connection without an
// answer that looks complete; http.ErrAbortHandler does so quietly.
func TestLanePanics(t *testing.T) {
	for _, p := range []any{http.ErrAbortHandler, "boom"} {
		t.Run(fmt.Sprint(p), func(t *testing.T) {
			addr, _ := laneOnly(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/plain")
				_, _ = io.WriteString(w, "partial")
				w.(http.Flusher).Flush()
				panic(p)
			}))
			resp, err := http.Get("http://" + addr + "/")
			require.NoError(t, err)
			defer resp.Body.Close()
			_, err = io.ReadAll(resp.Body)
			assert.ErrorIs(t, err, io.ErrUnexpectedEOF, "the chunked body never ends")
		})
	}
}

// TestStdHTTPServerStreams: with the lane off, net/http serves the
// proxy's streams as before: byte-identical, relayed chunk by chunk, and
// cancelled upstream when the client leaves.
func TestStdHTTPServerStreams(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.chunks.Store(20)
	n := startNode(t, func(c *Config) { c.StdHTTPServer = true }, rc("a", e.url()))
	require.Nil(t, n.lane)
	resp := post(t, n, "/v1/completions", streamReq, nil)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, streamBody("a", 20), readAll(t, resp))

	e.chunks.Store(3)
	e.chunkDelay.Store(int64(time.Hour))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+n.HTTPAddr()+"/v1/completions", strings.NewReader(streamReq))
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	assert.True(t, strings.HasPrefix(line, `data: {"id":"cmpl-a"`), line)
	cancel()
	require.Eventually(t, func() bool { return e.cancelled.Load() == 1 }, 5*time.Second, 5*time.Millisecond)
}
