package node

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// upstreamClient is the proxy's own HTTP/1.1 client for http:// replicas.
//
// net/http's Transport hands every request to two goroutines per
// connection (writeLoop writes it, readLoop reads the response head) and
// back: four goroutine wake-ups per request, on top of the one per body
// chunk, and on a busy two-core machine each wake-up costs futex calls and
// spinning threads (issue 21's profile). Here the handler's own goroutine
// writes the request (head and body in one write), reads the response
// head and the body, and puts the connection back on its replica's idle
// stack when the body ended cleanly. It also knows what the Transport
// hides: whether more response bytes are already buffered, so that the
// relay flushes only when the upstream has nothing more to give.
//
// https:// replicas and Config.UpstreamHTTP2 keep the Transport.
type upstreamClient struct {
	dialer  net.Dialer
	maxIdle int           // idle connections kept per replica address
	idleTTL time.Duration // an idle connection older than this is closed, not reused
	// firstByte bounds the wait for the response head after the request
	// was written (the Transport's ResponseHeaderTimeout); 0 = none.
	firstByte time.Duration

	mu     sync.Mutex
	idle   map[string][]*upConn // dial address → stack, most recent last
	closed bool
}

func newUpstreamClient(cfg Config) *upstreamClient {
	return &upstreamClient{
		dialer:    net.Dialer{Timeout: cfg.ConnectTimeout, KeepAlive: 30 * time.Second},
		maxIdle:   cfg.MaxIdleConnsPerHost,
		idleTTL:   90 * time.Second, // as the Transport's IdleConnTimeout
		firstByte: cfg.FirstByteTimeout,
		idle:      map[string][]*upConn{},
	}
}

// upConn is one upstream connection.
type upConn struct {
	net.Conn
	addr   string
	br     *bufio.Reader
	idleAt time.Time
	reused bool            // taken from the idle stack
	rc     syscall.RawConn // for relayRaw; nil if the connection has none
	raw    *rawIOConn      // Conn when it is one (send writes through it)
	stop   func() bool     // unregisters the cancellation hook (context.AfterFunc)

	// send's state for its RawConn.Read callback, bound once per
	// connection so that a request allocates nothing.
	sreq  []byte
	sn    int
	serr  error
	sent  bool
	sendF func(fd uintptr) bool
}

// brPool recycles the connections' read buffers: a connection that is
// closed returns its 32 KiB to the pool instead of to the collector.
var brPool = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 32<<10) }}

// reqBufPool holds request serialisation buffers (head plus body).
var reqBufPool = sync.Pool{New: func() any { b := make([]byte, 0, 8<<10); return &b }}

// aLongTimeAgo is a deadline in the past: setting it unblocks any read or
// write in progress on a connection.
var aLongTimeAgo = time.Unix(1, 0)

// get pops an idle connection to addr or dials one.
func (c *upstreamClient) get(ctx context.Context, addr string) (*upConn, error) {
	now := time.Now()
	c.mu.Lock()
	for s := c.idle[addr]; len(s) > 0; s = c.idle[addr] {
		uc := s[len(s)-1]
		s[len(s)-1] = nil
		c.idle[addr] = s[:len(s)-1]
		if now.Sub(uc.idleAt) > c.idleTTL {
			c.mu.Unlock()
			uc.close()
			c.mu.Lock()
			continue
		}
		c.mu.Unlock()
		uc.reused = true
		return uc, nil
	}
	c.mu.Unlock()
	return c.dial(ctx, addr)
}

func (c *upstreamClient) dial(ctx context.Context, addr string) (*upConn, error) {
	conn, err := c.dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	conn = newRawIOConn(conn)
	br := brPool.Get().(*bufio.Reader)
	br.Reset(conn)
	uc := &upConn{Conn: conn, addr: addr, br: br}
	if rc, ok := conn.(*rawIOConn); ok {
		uc.rc, uc.raw = rc.rc, rc
		uc.sendF = uc.sendCB
	}
	return uc, nil
}

// put returns a connection whose last response was read to its end.
func (c *upstreamClient) put(uc *upConn) {
	if uc.br.Buffered() > 0 { // bytes past the response: not a clean stream
		uc.close()
		return
	}
	if err := uc.SetDeadline(time.Time{}); err != nil {
		uc.close()
		return
	}
	uc.idleAt = time.Now()
	c.mu.Lock()
	s := c.idle[uc.addr]
	if c.closed || len(s) >= c.maxIdle {
		c.mu.Unlock()
		uc.close()
		return
	}
	c.idle[uc.addr] = append(s, uc)
	c.mu.Unlock()
}

func (uc *upConn) close() {
	_ = uc.Conn.Close()
	if uc.br != nil {
		uc.br.Reset(nil)
		brPool.Put(uc.br)
		uc.br = nil
	}
}

// dropIdle closes the idle connections to addr.
func (c *upstreamClient) dropIdle(addr string) {
	c.mu.Lock()
	s := c.idle[addr]
	delete(c.idle, addr)
	c.mu.Unlock()
	for _, uc := range s {
		uc.close()
	}
}

// closeIdle closes every idle connection; when stop is set the client
// keeps none from then on (connections in use are closed when released).
func (c *upstreamClient) closeIdle(stop bool) {
	c.mu.Lock()
	idle := c.idle
	c.idle = map[string][]*upConn{}
	if stop {
		c.closed = true
	}
	c.mu.Unlock()
	for _, s := range idle {
		for _, uc := range s {
			uc.close()
		}
	}
}

// upstreamReq is what the proxy sends: a POST of body to path (with the
// query) on the replica at addr (host:port), with hdr's end-to-end fields.
type upstreamReq struct {
	addr, host, path, rawQuery string
	hdr                        http.Header
	body                       []byte
	// dpRank, when non-empty, is sent as HeaderDataParallelRank in place
	// of any the client sent (a data-parallel rank replica).
	dpRank string
}

// canonicalDPRank is HeaderDataParallelRank as net/http keys it.
var canonicalDPRank = http.CanonicalHeaderKey(HeaderDataParallelRank)

// gatewayHeaders are the client's header fields (canonical, as net/http
// keys them) the gateway consumes itself and never forwards, besides
// hop-by-hop ones.
var gatewayHeaders = func() []string {
	out := []string{"Content-Length", "Host"}
	for _, h := range []string{HeaderStrategy, HeaderPinReplica, HeaderAdminToken} {
		out = append(out, http.CanonicalHeaderKey(h))
	}
	return out
}()

// appendRequest serialises r (HTTP/1.1, body included) onto b.
func appendRequest(b []byte, r *upstreamReq) []byte {
	b = append(b, "POST "...)
	b = append(b, r.path...)
	if r.rawQuery != "" {
		b = append(b, '?')
		b = append(b, r.rawQuery...)
	}
	b = append(b, " HTTP/1.1\r\nHost: "...)
	b = append(b, r.host...)
	b = append(b, "\r\n"...)
	conn := r.hdr["Connection"]
	for k, vs := range r.hdr {
		if !forwarded(k, conn) || (r.dpRank != "" && k == canonicalDPRank) {
			continue
		}
		for _, v := range vs {
			b = append(b, k...)
			b = append(b, ": "...)
			b = append(b, v...)
			b = append(b, "\r\n"...)
		}
	}
	if r.dpRank != "" {
		b = append(b, HeaderDataParallelRank...)
		b = append(b, ": "...)
		b = append(b, r.dpRank...)
		b = append(b, "\r\n"...)
	}
	b = append(b, "Content-Length: "...)
	b = strconv.AppendInt(b, int64(len(r.body)), 10)
	b = append(b, "\r\n\r\n"...)
	return append(b, r.body...)
}

// forwarded reports whether header field k goes upstream: not hop-by-hop
// (RFC 9110 §7.6.1, including the fields the client's Connection header
// names) and not one the gateway consumes.
func forwarded(k string, connection []string) bool {
	for _, h := range hopHeaders {
		if k == h {
			return false
		}
	}
	for _, h := range gatewayHeaders {
		if k == h {
			return false
		}
	}
	for _, v := range connection {
		for len(v) > 0 {
			f := v
			if i := strings.IndexByte(v, ','); i >= 0 {
				f, v = v[:i], v[i+1:]
			} else {
				v = ""
			}
			if strings.EqualFold(strings.TrimSpace(f), k) {
				return false
			}
		}
	}
	return true
}

// errStaleConn marks a reused idle connection the replica had closed: the
// request never reached it, so it is sent again on a new connection.
var errStaleConn = errors.New("idle upstream connection was closed by the replica")

// roundTrip sends r and reads the response head. The response body reads
// from uc; the caller must not Close the body but release uc with
// c.release once done with it. Until then ctx ending (the client left)
// unblocks any read or write on uc. Errors keep the Transport's shapes: a
// dial failure is a *net.OpError with Op "dial", a response head missing
// after firstByte a timeout net.Error.
func (c *upstreamClient) roundTrip(ctx context.Context, r *upstreamReq) (*http.Response, *upConn, error) {
	bp := reqBufPool.Get().(*[]byte)
	buf := appendRequest((*bp)[:0], r)
	defer func() {
		if cap(buf) <= 1<<20 { // a huge prompt's buffer is not kept
			*bp = buf[:0]
			reqBufPool.Put(bp)
		}
	}()
	for try := 0; ; try++ {
		var uc *upConn
		var err error
		if try == 0 {
			uc, err = c.get(ctx, r.addr)
		} else {
			// The replica closed an idle connection: it most likely
			// restarted or timed its keep-alives out, so the other idle
			// ones are stale too. The retry dials.
			c.dropIdle(r.addr)
			uc, err = c.dial(ctx, r.addr)
		}
		if err != nil {
			return nil, nil, err
		}
		uc.stop = context.AfterFunc(ctx, func() { _ = uc.SetDeadline(aLongTimeAgo) })
		resp, err := c.exchange(ctx, uc, buf)
		if err == nil {
			return resp, uc, nil
		}
		c.release(uc, false)
		if errors.Is(err, errStaleConn) && try == 0 && ctx.Err() == nil {
			continue
		}
		return nil, nil, err
	}
}

// release ends uc's use: a connection whose response body was read to its
// end (clean) and that the client's leaving did not touch goes back on
// the idle stack, any other is closed.
func (c *upstreamClient) release(uc *upConn, clean bool) {
	untouched := uc.stop()
	if clean && untouched {
		c.put(uc)
		return
	}
	uc.close()
}

// exchange writes one request on uc and reads the response head.
func (c *upstreamClient) exchange(ctx context.Context, uc *upConn, req []byte) (*http.Response, error) {
	// The first-byte deadline is a read deadline: setting it before the
	// write lets send's wait for the answer keep to it.
	if c.firstByte > 0 {
		if err := uc.SetReadDeadline(time.Now().Add(c.firstByte)); err != nil {
			return nil, err
		}
		// Had ctx ended before the deadline was set, the past deadline
		// set on cancellation would be overwritten.
		if err := ctx.Err(); err != nil {
			return nil, err
		}
	}
	if err := uc.send(req); err != nil {
		if uc.reused && ctx.Err() == nil && isConnClosed(err) {
			return nil, errStaleConn
		}
		return nil, err
	}
	for {
		if _, err := uc.br.Peek(1); err != nil {
			if uc.reused && ctx.Err() == nil && isConnClosed(err) {
				return nil, errStaleConn
			}
			return nil, err
		}
		resp, err := http.ReadResponse(uc.br, nil)
		if err != nil {
			return nil, err
		}
		// 1xx answers (other than 101, which a POST never asks for)
		// precede the final one.
		if resp.StatusCode >= 100 && resp.StatusCode < 200 && resp.StatusCode != http.StatusSwitchingProtocols {
			continue
		}
		return resp, nil
	}
}

// send writes req and, on a connection with a RawConn, waits until the
// answer can be read, without the read that would return EAGAIN.
//
// A Go read tries read(2) before it parks the goroutine, and an engine
// never answers within the microseconds between the write and that read:
// so every request cost one read returning EAGAIN (issue 21's syscall
// counts: about one in seven of the gateway's reads). Here the write is
// made inside a RawConn.Read call, whose start resets the connection's
// readiness: an answer can only arrive after the write, so its readiness
// event comes after that reset and wakes the wait; an event left over
// from before the reset costs one read that finds nothing, as before. A
// closed or reset connection wakes the wait too. The read deadline (the
// first-byte timeout, the client's leaving) ends it; the caller's read
// then reports it. When the socket's send buffer fills, the rest of req
// is written the ordinary way.
func (uc *upConn) send(req []byte) error {
	if uc.raw == nil {
		_, err := uc.Write(req)
		return err
	}
	uc.sreq, uc.sn, uc.serr, uc.sent = req, 0, nil, false
	_ = uc.rc.Read(uc.sendF) // a wait's error is the next read's
	n, serr, sent := uc.sn, uc.serr, uc.sent
	uc.sreq, uc.serr = nil, nil
	switch {
	case serr != nil:
		return uc.raw.opError("write", serr)
	case !sent:
		_, err := uc.Write(req[n:])
		return err
	}
	return nil
}

// sendCB is send's RawConn.Read callback: the first call writes the
// request and asks to wait for readability, the next one (readable)
// ends the wait without reading.
func (uc *upConn) sendCB(fd uintptr) bool {
	if uc.sent {
		return true
	}
	for uc.sn < len(uc.sreq) {
		n, e := rawWrite(fd, uc.sreq[uc.sn:])
		if e == syscall.EAGAIN {
			return true // send writes the rest
		}
		if e != 0 {
			uc.serr = os.NewSyscallError("write", e)
			return true
		}
		uc.sn += n
	}
	uc.sent = true
	return false
}

// isConnClosed reports whether err says the peer closed the connection.
func isConnClosed(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}
