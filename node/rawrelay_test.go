package node

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// decodeSplit feeds wire to a fresh decoder in pieces of at most step
// bytes and returns the payload, whether the body ended, extra and err.
func decodeSplit(d bodyDecoder, wire []byte, step int) (payload []byte, done, extra bool, err error) {
	for len(wire) > 0 {
		k := min(step, len(wire))
		in := append([]byte(nil), wire[:k]...) // decode reuses its input
		wire = wire[k:]
		p, x, e := d.decode(in)
		payload = append(payload, p...)
		extra = extra || x
		if e != nil {
			return payload, d.state == chDone, extra, e
		}
	}
	return payload, d.state == chDone, extra, nil
}

// TestBodyDecoderChunked checks the chunked decoder against net/http's
// own chunked writer and reader, for every split of the wire bytes into
// pieces of 1 to 9 bytes and in one piece.
func TestBodyDecoderChunked(t *testing.T) {
	var want []byte
	var wire bytes.Buffer
	cw := httputil.NewChunkedWriter(&wire)
	for i, ev := range []string{"data: {\"choices\":[{\"text\":\"a\"}]}\n\n", "x", strings.Repeat("y", 300), "data: [DONE]\n\n"} {
		_, err := cw.Write([]byte(ev))
		require.NoError(t, err, i)
		want = append(want, ev...)
	}
	require.NoError(t, cw.Close())
	wire.WriteString("\r\n") // no trailer
	// net/http's reader agrees on the payload.
	got, err := io.ReadAll(httputil.NewChunkedReader(bufio.NewReader(bytes.NewReader(wire.Bytes()))))
	require.NoError(t, err)
	require.Equal(t, want, got)

	for _, step := range []int{1, 2, 3, 5, 9, wire.Len()} {
		p, done, extra, err := decodeSplit(bodyDecoder{chunked: true}, wire.Bytes(), step)
		require.NoError(t, err, "step %d", step)
		assert.Equal(t, string(want), string(p), "step %d", step)
		assert.True(t, done, "step %d", step)
		assert.False(t, extra, "step %d", step)
	}

	// Extensions and trailers are skipped; bytes after the end are extra.
	w2 := "3;ext=1\r\nabc\r\n0\r\nX-T: 1\r\n\r\nHTTP/1.1"
	p, done, extra, err := decodeSplit(bodyDecoder{chunked: true}, []byte(w2), len(w2))
	require.NoError(t, err)
	assert.Equal(t, "abc", string(p))
	assert.True(t, done)
	assert.True(t, extra)

	// An unfinished body is not done.
	p, done, _, err = decodeSplit(bodyDecoder{chunked: true}, []byte("5\r\nab"), 2)
	require.NoError(t, err)
	assert.Equal(t, "ab", string(p))
	assert.False(t, done)
}

// TestBodyDecoderMalformed checks that what net/http's chunked reader
// refuses is refused.
func TestBodyDecoderMalformed(t *testing.T) {
	for _, wire := range []string{
		"3\nabc\r\n0\r\n\r\n",     // bare LF after the size
		"3\r\nabcX\n0\r\n\r\n",    // no CRLF after the data
		"3\r\r\nabc\r\n",          // a CR inside the line
		"zz\r\nabc\r\n",           // not hex
		"\r\nabc\r\n",             // empty size
		"10000000000000000\r\n",   // too large
		strings.Repeat("1", 5000), // line too long
	} {
		_, err := io.ReadAll(httputil.NewChunkedReader(bufio.NewReader(strings.NewReader(wire))))
		require.Error(t, err, "net/http accepts %q", wire)
		_, _, _, err = decodeSplit(bodyDecoder{chunked: true}, []byte(wire), 4)
		assert.ErrorIs(t, err, errChunked, "%q", wire)
	}
}

// TestBodyDecoderLength checks a Content-Length body.
func TestBodyDecoderLength(t *testing.T) {
	p, done, extra, err := decodeSplit(bodyDecoder{remain: 5}, []byte("hello"), 2)
	require.NoError(t, err)
	assert.Equal(t, "hello", string(p))
	assert.True(t, done)
	assert.False(t, extra)
	p, done, extra, err = decodeSplit(bodyDecoder{remain: 5}, []byte("helloHTTP"), 9)
	require.NoError(t, err)
	assert.Equal(t, "hello", string(p))
	assert.True(t, done)
	assert.True(t, extra)
}

// TestRawRelayable checks which responses take relayRaw.
func TestRawRelayable(t *testing.T) {
	uc := &upConn{rc: nilRawConn{}}
	assert.True(t, rawRelayable(uc, &http.Response{TransferEncoding: []string{"chunked"}, ContentLength: -1}))
	assert.True(t, rawRelayable(uc, &http.Response{ContentLength: 10}))
	assert.False(t, rawRelayable(uc, &http.Response{ContentLength: 0}))
	assert.False(t, rawRelayable(uc, &http.Response{ContentLength: -1})) // until close
	assert.False(t, rawRelayable(nil, &http.Response{ContentLength: 10}))
	assert.False(t, rawRelayable(&upConn{}, &http.Response{ContentLength: 10}))
}

type nilRawConn struct{}

func (nilRawConn) Control(func(uintptr)) error    { return nil }
func (nilRawConn) Read(func(uintptr) bool) error  { return nil }
func (nilRawConn) Write(func(uintptr) bool) error { return nil }

// TestClientLeavingMidStreamCancelsUpstream: a client that leaves after
// the first event ends the engine's request (the proxy closes its
// upstream connection) while the engine still holds the next event.
func TestClientLeavingMidStreamCancelsUpstream(t *testing.T) {
	gone := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/completions" { // health checks and scrapes
			w.WriteHeader(http.StatusOK)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"text\":\"t0\"}]}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-r.Context().Done():
			close(gone)
		case <-time.After(20 * time.Second):
		}
	}))
	t.Cleanup(srv.Close)
	n := startNode(t, nil, rc("a", srv.URL))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+n.HTTPAddr()+"/v1/completions", strings.NewReader(streamReq))
	require.NoError(t, err)
	client := &http.Client{Transport: &http.Transport{}}
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Contains(t, readEvent(t, bufio.NewReader(resp.Body)), `"t0"`)
	cancel() // the client leaves: its connection closes
	select {
	case <-gone:
	case <-time.After(10 * time.Second):
		t.Fatal("the engine's request was not cancelled after the client left")
	}
}

// TestReplicaClosingRightAfterDataIsSeenSoon: an engine that sends an
// event and closes its connection at once (its FIN may reach the gateway
// together with the event, and is then not signalled on its own) ends the
// stream with an error event well before the idle timeout.
func TestReplicaClosingRightAfterDataIsSeenSoon(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	ev := "data: {\"choices\":[{\"index\":0,\"text\":\"t\"}]}\n\n"
	chunk := fmt.Sprintf("%x\r\n%s\r\n", len(ev), ev)
	var pause atomic.Int64
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, req.Body)
				_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"+chunk)
				// Every other stream pauses as between tokens, so that
				// the gateway waits for the next event; the others send
				// it and close at once, while the gateway is still busy
				// with the head.
				if pause.Add(1)%2 == 0 {
					time.Sleep(30 * time.Millisecond)
				}
				_, _ = io.WriteString(c, chunk)
			}()
		}
	}()
	n := startNode(t, func(c *Config) {
		c.HealthInterval, c.ScrapeInterval = 0, 0
		c.IdleTimeout = 5 * time.Second
		c.EjectAfter = 100 // every stream here breaks
	}, rc("a", "http://"+ln.Addr().String()))
	for i := 0; i < 20; i++ {
		start := time.Now()
		got := readAll(t, post(t, n, "/v1/completions", streamReq, nil))
		require.True(t, strings.HasPrefix(got, ev+ev), "%d: %q", i, got)
		assert.Contains(t, got, `"code":"upstream_stream_broken"`, "%d", i)
		assert.Less(t, time.Since(start), 3*time.Second, "%d: the close was seen only at the idle timeout", i)
	}
}

// countingFlusher counts flushes.
type countingFlusher struct{ n int }

func (f *countingFlusher) Flush() { f.n++ }

// TestRawRelayLeavesTheLastPayloadToTheHandlersReturn: every read's
// payload is written and flushed at once, except the one that ends the
// body: net/http writes it with the chunked terminator when the handler
// returns, in one write instead of two.
func TestRawRelayLeavesTheLastPayloadToTheHandlersReturn(t *testing.T) {
	var out bytes.Buffer
	fl := &countingFlusher{}
	rr := &rawRelay{w: &out, flusher: fl, d: bodyDecoder{chunked: true}}
	require.True(t, rr.handle([]byte("5\r\nhello\r\n")))
	assert.Equal(t, 1, fl.n, "a payload in the middle of the body is flushed")
	require.True(t, rr.handle([]byte("1\r\n,\r\n")))
	assert.Equal(t, 2, fl.n)
	require.False(t, rr.handle([]byte("6\r\n world\r\n0\r\n\r\n")), "the body ended")
	assert.Equal(t, 2, fl.n, "the last payload waits for the handler's return")
	assert.Equal(t, "hello, world", out.String())
	assert.EqualValues(t, 12, rr.res.bytes)

	// Content-Length bodies end the same way.
	out.Reset()
	fl.n = 0
	rr = &rawRelay{w: &out, flusher: fl, d: bodyDecoder{remain: 8}}
	require.True(t, rr.handle([]byte("abcd")))
	require.False(t, rr.handle([]byte("efgh")))
	assert.Equal(t, 1, fl.n)
	assert.Equal(t, "abcdefgh", out.String())
}
