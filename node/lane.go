package node

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// The lane is the gateway's own HTTP/1.1 server loop for ordinary
// requests (issue 21). net/http's server costs every request a
// background-read goroutine, a deadline interrupt to stop it, and
// wake-ups around both; at 200 concurrent streams on two cores those
// wake-ups queue behind each other and show in the added p99. Here the
// connection's goroutine runs the handler on a goroutine of its own and,
// once the request body is read, waits on the client connection itself:
// a read that returns an error is the client leaving (the request's
// context is cancelled), a read that returns bytes is the next request.
// The wait for the next request is the same read, so nothing is started
// or interrupted between two requests.
//
// The lane serves only requests whose head it fully understands, checked
// on the raw bytes before anything is consumed (screenHead): GET or POST,
// HTTP/1.1, an origin-form target, one Host, a Content-Length body or
// none, no Expect, Upgrade or Transfer-Encoding, and plain header names
// and values. Any other request, including one whose head does not fit
// the 8 KiB read buffer, is handed to net/http's server with the
// connection and every byte read so far; net/http then serves that
// connection for the rest of its life, with its own checks and errors.
// kvmesh_http_handoffs_total counts those by reason.
//
// Config.StdHTTPServer turns the lane off: net/http serves everything.

// laneReadBuf is the per-connection read buffer: a request head must fit
// in it to be served by the lane.
const laneReadBuf = 8 << 10

// laneWriteBuf is the per-connection write buffer, and the most body a
// response holds back to send with a Content-Length when the handler ends
// without flushing (as net/http does).
const laneWriteBuf = 4 << 10

// laneMaxDiscard is the most unread request body the lane reads and drops
// after the handler returned to keep the connection (net/http's figure).
const laneMaxDiscard = 256 << 10

// Hand-off reasons, the `reason` label of kvmesh_http_handoffs_total.
const (
	handoffVersion   = "version"    // not HTTP/1.1 (HTTP/1.0, the HTTP/2 preface)
	handoffMethod    = "method"     // not GET or POST
	handoffTarget    = "target"     // not an origin-form target
	handoffFraming   = "framing"    // Transfer-Encoding, an odd Content-Length
	handoffExpect    = "expect"     // Expect (100-continue)
	handoffUpgrade   = "upgrade"    // Upgrade, or a Connection option beyond close/keep-alive
	handoffMalformed = "malformed"  // anything else the screen does not accept
	handoffLargeHead = "large_head" // the head does not fit laneReadBuf
)

var handoffReasons = []string{handoffVersion, handoffMethod, handoffTarget, handoffFraming,
	handoffExpect, handoffUpgrade, handoffMalformed, handoffLargeHead}

// laneState is a lane connection's state for Shutdown (as net/http's
// ConnState): new until its first request's head was read, active from a
// request's head until its handler returned, idle between requests.
type laneState uint8

const (
	laneNew laneState = iota
	laneActive
	laneIdle
)

// lane serves a listener's connections (see above).
type lane struct {
	handler       http.Handler
	base          context.Context
	headerTimeout time.Duration
	idleTimeout   time.Duration
	log           *slog.Logger
	handoffs      map[string]func() // reason → counter increment

	// std is the listener net/http's server accepts handed-off
	// connections from.
	std *handoffListener

	mu      sync.Mutex
	ln      net.Listener
	conns   map[*laneConn]laneState
	closing bool // from Shutdown on: quiet connections are closed at once
	wg      sync.WaitGroup
}

func newLane(h http.Handler, base context.Context, headerTimeout, idleTimeout time.Duration,
	log *slog.Logger, handoff func(reason string)) *lane {
	l := &lane{
		handler: h, base: base, headerTimeout: headerTimeout, idleTimeout: idleTimeout, log: log,
		handoffs: make(map[string]func(), len(handoffReasons)),
		conns:    make(map[*laneConn]laneState),
	}
	for _, r := range handoffReasons {
		l.handoffs[r] = func() { handoff(r) }
	}
	return l
}

// listener makes the lane serve ln (from serve on) and returns the
// listener net/http's server is to serve: its Accept returns the
// connections the lane hands off, and its Close stops them.
func (l *lane) listener(ln net.Listener) *handoffListener {
	l.mu.Lock()
	l.ln = ln
	l.std = &handoffListener{addr: ln.Addr(), conns: make(chan net.Conn), done: make(chan struct{})}
	l.mu.Unlock()
	return l.std
}

// serve is the accept loop; it returns when the listener is closed.
func (l *lane) serve() error {
	var backoff time.Duration
	for {
		c, err := l.ln.Accept()
		if err != nil {
			l.mu.Lock()
			closing := l.closing
			l.mu.Unlock()
			if closing || errors.Is(err, net.ErrClosed) {
				return nil
			}
			// Out of file descriptors and the like: back off as net/http
			// does, instead of spinning or giving up.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			l.log.Warn("http accept failed; retrying", "err", err, "in", backoff)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		lc := &laneConn{l: l, c: c}
		if !l.track(lc) {
			_ = c.Close()
			continue
		}
		go lc.serve()
	}
}

// track adds a new connection; false when the lane is shutting down.
func (l *lane) track(lc *laneConn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closing {
		return false
	}
	l.conns[lc] = laneNew
	l.wg.Add(1)
	return true
}

// setState moves lc to st; when the lane is shutting down and st is
// quiet, it closes lc instead and returns false.
func (l *lane) setState(lc *laneConn, st laneState) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.conns[lc]; !ok {
		return false
	}
	if l.closing && st != laneActive {
		lc.close()
		return false
	}
	l.conns[lc] = st
	return true
}

// untrack forgets lc (closed or handed off).
func (l *lane) untrack(lc *laneConn) {
	l.mu.Lock()
	delete(l.conns, lc)
	l.mu.Unlock()
	l.wg.Done()
}

// closeQuiet stops accepting, closes every connection that carries no
// request and every one that becomes so later; it returns how many it
// closed. Handed-off connections are net/http's (connTracker).
func (l *lane) closeQuiet() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.closing {
		l.closing = true
		if l.ln != nil {
			_ = l.ln.Close()
		}
	}
	closed := 0
	for lc, st := range l.conns {
		if st != laneActive {
			lc.close()
			closed++
		}
	}
	return closed
}

// shutdown closes quiet connections and waits until every connection's
// request finished (each response then closes its connection) or ctx
// ends.
func (l *lane) shutdown(ctx context.Context) error {
	l.closeQuiet()
	done := make(chan struct{})
	go func() {
		l.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// close closes every connection the lane still serves.
func (l *lane) close() {
	l.closeQuiet()
	l.mu.Lock()
	defer l.mu.Unlock()
	for lc := range l.conns {
		lc.close()
	}
}

// handOff gives lc, with what its reader holds, to net/http's server.
func (l *lane) handOff(lc *laneConn, reason string) {
	l.handoffs[reason]()
	_ = lc.c.SetReadDeadline(time.Time{})
	hc := &handedConn{Conn: lc.c, r: lc.br}
	lc.br = nil // the handed connection reads the rest of it
	lc.handed = true
	select {
	case l.std.conns <- hc:
	case <-l.std.done:
		_ = hc.Close()
	}
}

// handoffListener is the listener net/http's server serves: its Accept
// returns the connections the lane hands off.
type handoffListener struct {
	addr  net.Addr
	conns chan net.Conn
	once  sync.Once
	done  chan struct{}
}

func (h *handoffListener) Accept() (net.Conn, error) {
	select {
	case c := <-h.conns:
		return c, nil
	case <-h.done:
		return nil, net.ErrClosed
	}
}

func (h *handoffListener) Close() error {
	h.once.Do(func() { close(h.done) })
	return nil
}

func (h *handoffListener) Addr() net.Addr { return h.addr }

// handedConn is a connection handed to net/http: it reads what the lane's
// reader buffered before reading the connection again.
type handedConn struct {
	net.Conn
	r *bufio.Reader // nil once drained
}

func (h *handedConn) Read(p []byte) (int, error) {
	if h.r != nil {
		if h.r.Buffered() > 0 {
			return h.r.Read(p)
		}
		h.r = nil
	}
	return h.Conn.Read(p)
}

var (
	laneReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, laneReadBuf) }}
	laneWriters = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, laneWriteBuf) }}
)

// laneConn is one client connection the lane serves.
type laneConn struct {
	l      *lane
	c      net.Conn
	br     *bufio.Reader
	bw     *bufio.Writer
	remote string
	handed bool // given to net/http: not closed, reader not pooled

	closeOnce sync.Once
	closed    atomic.Bool

	// Per-connection caches for responses: the held-back body's buffer
	// and the Date header.
	pending []byte
	dateSec int64
	date    []byte
}

func (lc *laneConn) close() {
	lc.closeOnce.Do(func() {
		lc.closed.Store(true)
		_ = lc.c.Close()
	})
}

// serve reads and serves lc's requests until the connection closes, a
// request fails, or it is handed off.
func (lc *laneConn) serve() {
	l := lc.l
	lc.br = laneReaders.Get().(*bufio.Reader)
	lc.br.Reset(lc.c)
	lc.bw = laneWriters.Get().(*bufio.Writer)
	lc.bw.Reset(lc.c)
	lc.remote = lc.c.RemoteAddr().String()
	defer func() {
		if !lc.handed {
			lc.close()
			lc.br.Reset(nil)
			laneReaders.Put(lc.br)
		}
		lc.bw.Reset(nil)
		laneWriters.Put(lc.bw)
		l.untrack(lc)
	}()

	// The first request's head, including the wait for its first byte,
	// must arrive within headerTimeout (as net/http's ReadHeaderTimeout).
	_ = lc.c.SetReadDeadline(time.Now().Add(l.headerTimeout))
	var cur *laneRequest
	for {
		// Wait for the next request's first byte. While a handler runs,
		// this read is also what sees the client leave.
		_, err := lc.br.Peek(1)
		if cur != nil {
			select {
			case <-cur.done:
			default:
				if err != nil {
					cur.cancel(nil) // the client left: the handler's context ends
				}
				<-cur.done
			}
			cur = nil
			if lc.closed.Load() {
				return
			}
		}
		if err != nil {
			return
		}
		_ = lc.c.SetReadDeadline(time.Now().Add(l.headerTimeout))
		head, err := lc.peekHead()
		if errors.Is(err, bufio.ErrBufferFull) {
			l.handOff(lc, handoffLargeHead)
			return
		}
		if errors.Is(err, errBareLF) {
			l.handOff(lc, handoffMalformed)
			return
		}
		if err != nil {
			return // timeout or EOF mid-head: closed without an answer, as net/http does
		}
		if reason := screenHead(head); reason != "" {
			l.handOff(lc, reason)
			return
		}
		// Active from a whole head on, as net/http counts it: Shutdown
		// closes a connection still sending its head.
		if !l.setState(lc, laneActive) {
			return
		}
		req, err := http.ReadRequest(lc.br)
		if err != nil {
			lc.badRequest()
			return
		}
		_ = lc.c.SetReadDeadline(time.Time{})
		cur = lc.start(req)
		select {
		case <-cur.body.eof:
			continue // the read at the loop's top watches the client
		case <-cur.done:
		}
		// The handler returned before it read the whole body.
		if !lc.afterUnreadBody(cur) {
			return
		}
		cur = nil
	}
}

// errBareLF marks a head with a line that does not end in CRLF, which
// net/http's parser has its own rules for.
var errBareLF = errors.New("bare LF in request head")

// peekHead returns the request head (through its blank line) from lc's
// reader without consuming it; bufio.ErrBufferFull when it does not fit,
// errBareLF when a line ends in LF alone.
func (lc *laneConn) peekHead() ([]byte, error) {
	from := 0
	for {
		buf, err := lc.br.Peek(lc.br.Buffered())
		if err != nil {
			return nil, err
		}
		for i := from; i < len(buf); i++ {
			if buf[i] == '\n' && (i == 0 || buf[i-1] != '\r') {
				return nil, errBareLF
			}
		}
		// The blank line may straddle the previous look's end.
		if i := bytes.Index(buf[max(from-3, 0):], []byte("\r\n\r\n")); i >= 0 {
			return buf[:max(from-3, 0)+i+4], nil
		}
		from = len(buf)
		if _, err := lc.br.Peek(len(buf) + 1); err != nil {
			return nil, err
		}
	}
}

// badRequest answers a head net/http's parser refused and closes.
func (lc *laneConn) badRequest() {
	_, _ = lc.bw.WriteString("HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n400 Bad Request")
	_ = lc.bw.Flush()
}

// afterUnreadBody runs when cur's handler returned before its body's end:
// the rest is read and dropped when it is small, else the connection is
// closed. It reports whether the connection serves on.
func (lc *laneConn) afterUnreadBody(cur *laneRequest) bool {
	if lc.closed.Load() {
		return false
	}
	left := cur.body.remain
	if left > laneMaxDiscard {
		return false
	}
	_ = lc.c.SetReadDeadline(time.Now().Add(lc.l.headerTimeout))
	if n, err := lc.br.Discard(int(left)); err != nil || int64(n) != left {
		return false
	}
	_ = lc.c.SetReadDeadline(time.Now().Add(lc.l.idleTimeout))
	return lc.l.setState(lc, laneIdle)
}

// laneRequest is one request the lane serves: its handler runs on its own
// goroutine.
type laneRequest struct {
	cancel context.CancelCauseFunc
	done   chan struct{} // closed when the handler returned and the response ended
	body   laneBody
	w      laneResponse
}

// start runs the handler for req on a goroutine of its own.
func (lc *laneConn) start(req *http.Request) *laneRequest {
	ctx, cancel := context.WithCancelCause(lc.l.base)
	lr := &laneRequest{cancel: cancel, done: make(chan struct{})}
	lr.body = laneBody{br: lc.br, remain: req.ContentLength, eof: make(chan struct{})}
	if req.ContentLength == 0 {
		lr.body.hitEOF()
		req.Body = http.NoBody
	} else {
		req.Body = &lr.body
	}
	delete(req.Header, "Host")
	req.RemoteAddr = lc.remote
	req = req.WithContext(ctx)
	lr.w = laneResponse{lc: lc, header: make(http.Header), clen: -1, closeAfter: req.Close, pending: lc.pending[:0]}
	go lc.run(req, &lr.w, lr)
	return lr
}

// run calls the handler and ends the response.
func (lc *laneConn) run(req *http.Request, w *laneResponse, lr *laneRequest) {
	l := lc.l
	defer func() {
		abort := false
		if p := recover(); p != nil {
			abort = true
			if p != http.ErrAbortHandler {
				buf := make([]byte, 64<<10)
				buf = buf[:runtime.Stack(buf, false)]
				l.log.Error("http: panic serving request", "remote", lc.remote, "panic", fmt.Sprint(p), "stack", string(buf))
			}
		}
		if !abort {
			w.finish()
		}
		lc.pending = w.pending[:0] // the next response on lc reuses it
		lr.cancel(nil)
		switch {
		case abort || w.closeAfter || w.err != nil:
			lc.close()
		case lr.body.remain == 0:
			// The connection goroutine waits for the next request.
			_ = lc.c.SetReadDeadline(time.Now().Add(l.idleTimeout))
			l.setState(lc, laneIdle)
		}
		close(lr.done)
	}()
	l.handler.ServeHTTP(w, req)
}

// laneBody is a request's Content-Length body, read from the connection's
// reader.
type laneBody struct {
	br      *bufio.Reader
	remain  int64
	closed  bool
	eof     chan struct{} // closed once the whole body was read
	eofDone bool
}

func (b *laneBody) hitEOF() {
	if !b.eofDone {
		b.eofDone = true
		close(b.eof)
	}
}

func (b *laneBody) Read(p []byte) (int, error) {
	if b.closed {
		return 0, http.ErrBodyReadAfterClose
	}
	if b.remain == 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > b.remain {
		p = p[:b.remain]
	}
	n, err := b.br.Read(p)
	b.remain -= int64(n)
	if b.remain == 0 {
		b.hitEOF()
		return n, io.EOF
	}
	if err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return n, err
}

// Close stops further reads; what is left is dropped after the handler
// returned (laneConn.afterUnreadBody).
func (b *laneBody) Close() error {
	b.closed = true
	return nil
}

// laneResponse is the lane's http.ResponseWriter: HTTP/1.1 with a
// Content-Length when the handler set one or ended without flushing a
// body that fits laneWriteBuf, chunked otherwise.
type laneResponse struct {
	lc     *laneConn
	header http.Header

	status      int
	wroteHeader bool   // the status is decided
	sent        bool   // the head is in the write buffer
	pending     []byte // body held back until the head is sent
	chunked     bool
	clen        int64 // the declared Content-Length, -1 when none
	written     int64
	closeAfter  bool  // close the connection after this response
	err         error // the first write error
}

func (w *laneResponse) Header() http.Header { return w.header }

func (w *laneResponse) WriteHeader(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code))
	}
	if w.wroteHeader {
		return
	}
	if code >= 100 && code <= 199 && code != http.StatusSwitchingProtocols {
		// An informational answer goes out at once; the final one follows.
		w.writeStatusLine(code)
		_ = w.header.Write(w.lc.bw)
		_, _ = w.lc.bw.WriteString("\r\n")
		w.flushBuf()
		return
	}
	w.wroteHeader = true
	w.status = code
	if cl := w.header.Get("Content-Length"); cl != "" {
		if v, err := strconv.ParseInt(cl, 10, 64); err == nil && v >= 0 {
			w.clen = v
		} else {
			w.header.Del("Content-Length")
		}
	}
}

func (w *laneResponse) bodyAllowed() bool {
	return w.status >= 200 && w.status != http.StatusNoContent && w.status != http.StatusNotModified
}

func (w *laneResponse) Write(p []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if len(p) == 0 {
		return 0, w.err
	}
	if !w.bodyAllowed() {
		return 0, http.ErrBodyNotAllowed
	}
	if w.err != nil {
		return 0, w.err
	}
	if w.clen >= 0 && w.written+int64(len(p)) > w.clen {
		return 0, http.ErrContentLength
	}
	w.written += int64(len(p))
	if !w.sent {
		if len(w.pending)+len(p) <= laneWriteBuf {
			w.pending = append(w.pending, p...)
			return len(p), nil
		}
		w.sendHead(false)
	}
	w.writeBody(p)
	if w.err != nil {
		return 0, w.err
	}
	return len(p), nil
}

// Flush sends what is buffered (http.Flusher).
func (w *laneResponse) Flush() { _ = w.FlushError() }

// FlushError is Flush with its error (http.ResponseController).
func (w *laneResponse) FlushError() error {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if !w.sent {
		w.sendHead(false)
	}
	w.flushBuf()
	return w.err
}

// SetReadDeadline and SetWriteDeadline serve http.ResponseController.
func (w *laneResponse) SetReadDeadline(t time.Time) error  { return w.lc.c.SetReadDeadline(t) }
func (w *laneResponse) SetWriteDeadline(t time.Time) error { return w.lc.c.SetWriteDeadline(t) }

// EnableFullDuplex serves http.ResponseController: the lane lets a
// handler read its body while it writes anyway.
func (w *laneResponse) EnableFullDuplex() error { return nil }

// finish ends the response after the handler returned.
func (w *laneResponse) finish() {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if !w.sent {
		w.sendHead(true)
	}
	if w.chunked && w.err == nil {
		_, _ = w.lc.bw.WriteString("0\r\n\r\n")
	}
	w.flushBuf()
	if w.clen >= 0 && w.written < w.clen {
		w.closeAfter = true // the client reads a short body as an error
	}
}

func (w *laneResponse) flushBuf() {
	if w.err == nil {
		if err := w.lc.bw.Flush(); err != nil {
			w.err = err
		}
	}
}

func (w *laneResponse) writeStatusLine(code int) {
	bw := w.lc.bw
	if code == http.StatusOK {
		_, _ = bw.WriteString("HTTP/1.1 200 OK\r\n")
		return
	}
	var b [3]byte
	_, _ = bw.WriteString("HTTP/1.1 ")
	_, _ = bw.Write(strconv.AppendInt(b[:0], int64(code), 10))
	_ = bw.WriteByte(' ')
	if text := http.StatusText(code); text != "" {
		_, _ = bw.WriteString(text)
	} else {
		_, _ = bw.WriteString("status code ")
		_, _ = bw.Write(strconv.AppendInt(b[:0], int64(code), 10))
	}
	_, _ = bw.WriteString("\r\n")
}

// sendHead writes the status line and headers, then the held-back body.
// final says the handler has returned: a body that is all held back is
// sent with its Content-Length.
func (w *laneResponse) sendHead(final bool) {
	w.sent = true
	h := w.header
	h.Del("Transfer-Encoding")
	body := w.bodyAllowed()
	extraCL := false
	if body && w.clen < 0 {
		if final {
			w.clen = int64(len(w.pending))
			extraCL = true
		} else {
			w.chunked = true
		}
	}
	if body && len(w.pending) > 0 {
		if _, typed := h["Content-Type"]; !typed {
			h.Set("Content-Type", http.DetectContentType(w.pending))
		}
	}
	if w.lc.l.isClosing() {
		w.closeAfter = true
	}
	connClose := false
	for _, v := range h["Connection"] {
		if asciiEqualFold(v, "close") {
			w.closeAfter, connClose = true, true
		}
	}

	bw := w.lc.bw
	w.writeStatusLine(w.status)
	if err := h.Write(bw); err != nil {
		w.err = err
	}
	if _, dated := h["Date"]; !dated {
		_, _ = bw.WriteString("Date: ")
		_, _ = bw.Write(w.lc.httpDate())
		_, _ = bw.WriteString("\r\n")
	}
	if extraCL {
		var b [20]byte
		_, _ = bw.WriteString("Content-Length: ")
		_, _ = bw.Write(strconv.AppendInt(b[:0], w.clen, 10))
		_, _ = bw.WriteString("\r\n")
	}
	if w.chunked {
		_, _ = bw.WriteString("Transfer-Encoding: chunked\r\n")
	}
	if w.closeAfter && !connClose {
		_, _ = bw.WriteString("Connection: close\r\n")
	}
	_, _ = bw.WriteString("\r\n")
	if len(w.pending) > 0 {
		p := w.pending
		w.pending = w.pending[:0]
		w.writeBody(p)
	}
}

// writeBody writes p as body bytes (one chunk when chunked).
func (w *laneResponse) writeBody(p []byte) {
	bw := w.lc.bw
	var err error
	if w.chunked {
		var b [16]byte
		_, _ = bw.Write(strconv.AppendInt(b[:0], int64(len(p)), 16))
		_, _ = bw.WriteString("\r\n")
		_, _ = bw.Write(p)
		_, err = bw.WriteString("\r\n")
	} else {
		_, err = bw.Write(p)
	}
	if err != nil && w.err == nil {
		w.err = err
	}
}

func (l *lane) isClosing() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closing
}

// httpDate is the Date header's value for now, formatted once a second.
func (lc *laneConn) httpDate() []byte {
	now := time.Now()
	if s := now.Unix(); s != lc.dateSec || lc.date == nil {
		lc.dateSec = s
		lc.date = now.UTC().AppendFormat(lc.date[:0], http.TimeFormat)
	}
	return lc.date
}

// asciiEqualFold reports whether s equals the lower-case ASCII t, ignoring
// case.
func asciiEqualFold(s, t string) bool {
	if len(s) != len(t) {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != t[i] {
			return false
		}
	}
	return true
}

// screenHead reports why the lane does not serve a request with this head
// (one of the hand-off reasons), or "" when it does. It accepts a strict
// subset of HTTP/1.1 (RFC 9112): anything unusual goes to net/http, which
// answers it or refuses it with its own checks.
func screenHead(head []byte) string {
	line, rest, _ := bytes.Cut(head, []byte("\r\n"))
	method, line, ok1 := bytes.Cut(line, []byte(" "))
	target, version, ok2 := bytes.Cut(line, []byte(" "))
	switch {
	case !ok1 || !ok2:
		return handoffMalformed
	case string(version) != "HTTP/1.1":
		return handoffVersion
	case string(method) != "GET" && string(method) != "POST":
		return handoffMethod
	case len(target) == 0 || target[0] != '/':
		return handoffTarget
	}
	for _, c := range target {
		if c <= ' ' || c >= 0x7f {
			return handoffTarget
		}
	}
	hosts, lengths := 0, 0
	for len(rest) > 2 { // the head ends in the blank line's CRLF
		var hl []byte
		hl, rest, _ = bytes.Cut(rest, []byte("\r\n"))
		name, value, ok := bytes.Cut(hl, []byte(":"))
		if !ok || len(name) == 0 {
			return handoffMalformed // includes obs-fold continuation lines
		}
		for _, c := range name {
			if !isTokenByte(c) {
				return handoffMalformed
			}
		}
		for _, c := range value {
			if (c < ' ' && c != '\t') || c == 0x7f {
				return handoffMalformed
			}
		}
		value = bytes.Trim(value, " \t")
		switch {
		case asciiEqualFold(string(name), "host"):
			hosts++
			if len(value) == 0 || !validHost(value) {
				return handoffMalformed
			}
		case asciiEqualFold(string(name), "content-length"):
			lengths++
			if len(value) == 0 || len(value) > 18 {
				return handoffFraming
			}
			for _, c := range value {
				if c < '0' || c > '9' {
					return handoffFraming
				}
			}
			if string(method) == "GET" && string(value) != "0" {
				return handoffFraming
			}
		case asciiEqualFold(string(name), "transfer-encoding"), asciiEqualFold(string(name), "trailer"):
			return handoffFraming
		case asciiEqualFold(string(name), "expect"):
			return handoffExpect
		case asciiEqualFold(string(name), "upgrade"), asciiEqualFold(string(name), "http2-settings"):
			return handoffUpgrade
		case asciiEqualFold(string(name), "connection"):
			for opt := range bytes.SplitSeq(value, []byte(",")) {
				opt = bytes.Trim(opt, " \t")
				if !asciiEqualFold(string(opt), "close") && !asciiEqualFold(string(opt), "keep-alive") {
					return handoffUpgrade
				}
			}
		}
	}
	if hosts != 1 {
		return handoffMalformed
	}
	if lengths > 1 {
		return handoffFraming
	}
	return ""
}

// isTokenByte reports whether c may appear in a header name (RFC 9110
// tchar).
func isTokenByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return c != 0 && bytes.IndexByte([]byte("!#$%&'*+-.^_`|~"), c) >= 0
}

// validHost accepts a Host value of the usual shape: a name or an IPv4
// address with an optional port, or a bracketed IPv6 address. Anything
// else goes to net/http's own check.
func validHost(v []byte) bool {
	for _, c := range v {
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case c == '.', c == '-', c == ':', c == '[', c == ']', c == '_':
		default:
			return false
		}
	}
	return true
}
