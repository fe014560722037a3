package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"
)

// errShutdownCut is the cause of every request context Shutdown cancels
// when its deadline passed with requests still in flight.
var errShutdownCut = fmt.Errorf("%w: deadline reached, request cut", ErrShutdown)

// cutWriteTimeout bounds how long a cut handler may take to write its
// gateway_shutdown error to a client that does not read.
const cutWriteTimeout = 250 * time.Millisecond

// shutdownCut reports whether r's context was cancelled by Shutdown's cut
// (not by the client leaving).
func shutdownCut(r *http.Request) bool {
	return errors.Is(context.Cause(r.Context()), errShutdownCut)
}

// abortResponse makes net/http drop the connection instead of finishing
// the response: the client sees a transport error, never a body that
// looks complete.
func abortResponse() { panic(http.ErrAbortHandler) }

// writeCutEvent ends a stream cut by Shutdown with an SSE error event
// (code gateway_shutdown), after terminating a partially relayed event;
// tail is the last two bytes relayed. When the event cannot be written
// and flushed within cutWriteTimeout the connection is aborted.
func writeCutEvent(w http.ResponseWriter, tail [2]byte, relayed int64) {
	rc := http.NewResponseController(w)
	_ = rc.SetWriteDeadline(time.Now().Add(cutWriteTimeout))
	b := streamErrorEvent(tail, http.StatusServiceUnavailable, CodeGatewayShutdown,
		fmt.Sprintf("gateway shutting down: stream cut after %d bytes", relayed))
	if _, err := w.Write(b); err != nil {
		abortResponse()
	}
	if err := rc.Flush(); err != nil {
		abortResponse()
	}
}

// streamErrorEvent renders an SSE error event that starts on a fresh
// event boundary whatever the stream's last two bytes (tail) were.
func streamErrorEvent(tail [2]byte, status int, code, msg string) []byte {
	var b bytes.Buffer
	switch {
	case tail == [2]byte{'\n', '\n'} || tail == [2]byte{}:
	case tail[1] == '\n':
		b.WriteByte('\n')
	default:
		b.WriteString("\n\n")
	}
	b.WriteString("data: ")
	b.Write(errorJSON(status, code, msg))
	b.WriteString("\n\n")
	return b.Bytes()
}

// activeCount counts running inference handlers; zero returns a channel
// closed once none is left.
type activeCount struct {
	mu      sync.Mutex
	n       int
	waiters []chan struct{}
}

func (a *activeCount) add() {
	a.mu.Lock()
	a.n++
	a.mu.Unlock()
}

func (a *activeCount) done() {
	a.mu.Lock()
	a.n--
	if a.n == 0 {
		for _, c := range a.waiters {
			close(c)
		}
		a.waiters = nil
	}
	a.mu.Unlock()
}

func (a *activeCount) load() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.n
}

func (a *activeCount) zero() <-chan struct{} {
	c := make(chan struct{})
	a.mu.Lock()
	if a.n == 0 {
		close(c)
	} else {
		a.waiters = append(a.waiters, c)
	}
	a.mu.Unlock()
	return c
}

// connTracker follows the HTTP server's connections (http.Server.ConnState)
// so that Shutdown can close at once those that carry no request: Go's
// own Shutdown treats a connection that never sent a request as active for
// 5 s, longer than a short drain deadline.
type connTracker struct {
	mu      sync.Mutex
	conns   map[net.Conn]http.ConnState
	closing bool // from closeQuiet on: quiet connections are closed at once
}

// track is the server's ConnState hook.
func (c *connTracker) track(conn net.Conn, st http.ConnState) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch st {
	case http.StateHijacked, http.StateClosed:
		delete(c.conns, conn)
		return
	}
	if c.closing && (st == http.StateNew || st == http.StateIdle) {
		delete(c.conns, conn)
		_ = conn.Close()
		return
	}
	if c.conns == nil {
		c.conns = make(map[net.Conn]http.ConnState)
	}
	c.conns[conn] = st
}

// closeQuiet closes every connection that is new (no request read yet:
// idle since accept, or half-open) or idle between keep-alive requests,
// and every one that becomes so later. It returns how many it closed.
func (c *connTracker) closeQuiet() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closing = true
	closed := 0
	for conn, st := range c.conns {
		if st == http.StateNew || st == http.StateIdle {
			delete(c.conns, conn)
			_ = conn.Close()
			closed++
		}
	}
	return closed
}
