package node

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
	"syscall"
	"time"
)

// The raw relay reads a response body from the proxy's own upstream
// connection without net/http's body reader and without a read that
// returns EAGAIN per chunk.
//
// A Go conn.Read first tries read(2) and only then parks the goroutine
// until the netpoller reports the socket readable, so every chunk that an
// engine sends after a pause costs one read returning EAGAIN before the
// one that returns it (issue 21: half of the gateway's reads). Within one
// syscall.RawConn.Read call the readiness flag is not reset between
// waits, so the relay runs inside one such call: after a read that
// returned less than the buffer (the socket was drained: TCP returns
// everything queued), it waits for readiness before reading again, as
// nginx does with epoll. Data arriving after the read raises a new
// (edge-triggered) readiness event, so no data is missed; a stale event
// only costs the EAGAIN read that was there before. A FIN or RST is
// different: when it comes in the same readiness event as the data before
// it, the read returns the data and nothing signals the close again (Go
// does not expose EPOLLRDHUP). So the wait after a short read is bounded
// by rawProbe, after which one read looks; streams whose chunks come
// closer together than rawProbe never probe. Each RawConn.Read call
// starts with a read, because the call resets the readiness flag.
//
// The body is decoded here (chunked or Content-Length), so the payload of
// every chunk the read returned is written to the client in one Write and
// one Flush per read.

// chunk decoder states
const (
	chSize    uint8 = iota // reading a chunk-size line
	chData                 // reading chunk data (remain bytes left)
	chDataCR               // expecting the CR after chunk data
	chDataLF               // expecting the LF after chunk data
	chTrailer              // reading trailer lines after the last chunk
	chDone                 // the body ended
)

// rawProbe bounds how long relayRaw waits for readiness after a short
// read before it reads once anyway: the netpoller cannot say that a FIN
// or RST arrived together with the data the read returned, so a replica
// that closes (crashes) right after sending data is seen within rawProbe,
// not at the idle timeout. Streams whose chunks come closer together than
// this never probe.
const rawProbe = 100 * time.Millisecond

// errChunked marks malformed chunked encoding from a replica.
var errChunked = errors.New("malformed chunked encoding")

// bodyDecoder decodes an HTTP/1.1 response body that arrives in pieces:
// chunked (RFC 9112 §7.1, as strict as net/http: CRLF line ends, chunk
// extensions ignored, trailers skipped) or of a known length.
type bodyDecoder struct {
	chunked bool
	state   uint8
	remain  int64  // payload bytes left: of the current chunk, or of the body
	line    []byte // the current size or trailer line so far (without its LF)
	excess  int64  // non-payload overhead, bounded as net/http bounds it
}

// maxChunkLine bounds a chunk-size or trailer line (net/http's limit).
const maxChunkLine = 4096

// decode moves in's payload bytes to its front and returns them (in's
// memory is reused), and whether the body ended; bytes after the end make
// extra true.
func (d *bodyDecoder) decode(in []byte) (payload []byte, extra bool, err error) {
	out := in[:0]
	if !d.chunked {
		if int64(len(in)) > d.remain {
			extra = true
			in = in[:d.remain]
		}
		d.remain -= int64(len(in))
		if d.remain == 0 {
			d.state = chDone
		}
		return in, extra, nil
	}
	for len(in) > 0 {
		switch d.state {
		case chSize, chTrailer:
			i := bytes.IndexByte(in, '\n')
			part := in
			if i >= 0 {
				part = in[:i]
			}
			if len(d.line)+len(part) >= maxChunkLine {
				return out, false, errChunked
			}
			d.line = append(d.line, part...)
			if i < 0 {
				return out, false, nil
			}
			in = in[i+1:]
			line := d.line
			d.line = d.line[:0]
			// The line must end in CRLF with no other CR.
			if j := bytes.IndexByte(line, '\r'); j < 0 || j != len(line)-1 {
				return out, false, errChunked
			}
			line = line[:len(line)-1]
			if d.state == chTrailer {
				if len(line) == 0 {
					d.state = chDone
				}
				continue
			}
			d.excess += int64(len(line)) + 2 // as net/http counts it
			n, err := parseChunkSize(line)
			if err != nil {
				return out, false, err
			}
			d.excess = max(d.excess-16-2*n, 0)
			if d.excess > 16<<10 {
				return out, false, errChunked
			}
			if n == 0 {
				d.state = chTrailer
			} else {
				d.state, d.remain = chData, n
			}
		case chData:
			k := int64(len(in))
			if k > d.remain {
				k = d.remain
			}
			out = append(out, in[:k]...)
			in = in[k:]
			if d.remain -= k; d.remain == 0 {
				d.state = chDataCR
			}
		case chDataCR, chDataLF:
			want := byte('\r')
			if d.state == chDataLF {
				want = '\n'
			}
			if in[0] != want {
				return out, false, errChunked
			}
			in = in[1:]
			if d.state == chDataCR {
				d.state = chDataLF
			} else {
				d.state = chSize
			}
		case chDone:
			return out, true, nil
		}
	}
	return out, false, nil
}

// parseChunkSize reads a chunk-size line (hex digits, then an optional
// extension after ';').
func parseChunkSize(line []byte) (int64, error) {
	if i := bytes.IndexByte(line, ';'); i >= 0 {
		line = line[:i]
	}
	line = bytes.TrimRight(line, " \t")
	if len(line) == 0 || len(line) > 16 {
		return 0, errChunked
	}
	var n int64
	for _, c := range line {
		switch {
		case c >= '0' && c <= '9':
			c -= '0'
		case c >= 'a' && c <= 'f':
			c -= 'a' - 10
		case c >= 'A' && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, errChunked
		}
		if n>>58 != 0 { // a size no replica sends; net/http fails reading it
			return 0, errChunked
		}
		n = n<<4 | int64(c)
	}
	return n, nil
}

// rawRelayable reports whether relayRaw can read resp's body: chunked or
// of a known, non-zero length on the proxy's own connection.
func rawRelayable(uc *upConn, resp *http.Response) bool {
	if uc == nil || uc.rc == nil {
		return false
	}
	te := resp.TransferEncoding
	return (len(te) == 1 && te[0] == "chunked") || (len(te) == 0 && resp.ContentLength > 0)
}

// relayRaw is relay for a response on the proxy's own connection uc
// (rawRelayable): the same contract (bytes unchanged, one write and flush
// per upstream read, but the last one's flush is the handler's return;
// idle timeout through the read deadline, the client's leaving through
// ctx's AfterFunc setting a past deadline). At the first
// body byte it takes queued off rep's queued prefill (relay's onFirst; a
// function value would cost the caller two allocations). res.dirty is set
// when the replica sent bytes after the body.
func (n *Node) relayRaw(clientCtx context.Context, uc *upConn, resp *http.Response, w io.Writer, flusher http.Flusher,
	streaming bool, rep *replica, queued int64) relayResult {
	rr := rawRelayPool.Get().(*rawRelay)
	te := resp.TransferEncoding
	rr.n, rr.clientCtx, rr.uc, rr.w, rr.flusher, rr.streaming = n, clientCtx, uc, w, flusher, streaming
	rr.rep, rr.queued = rep, queued
	rr.d = bodyDecoder{chunked: len(te) == 1 && te[0] == "chunked", remain: resp.ContentLength, line: rr.d.line[:0]}
	rr.run()
	res := rr.res
	*rr = rawRelay{buf: rr.buf, readFn: rr.readFn, d: bodyDecoder{line: rr.d.line[:0]}}
	if cap(rr.d.line) <= 256 { // a long trailer line's buffer is not kept
		rawRelayPool.Put(rr)
	}
	return res
}

// rawRelay is one relayRaw's state, pooled: its read callback is bound
// once, so a relay allocates nothing.
type rawRelay struct {
	n         *Node
	clientCtx context.Context
	uc        *upConn
	w         io.Writer
	flusher   http.Flusher
	streaming bool
	rep       *replica
	queued    int64 // taken off rep.queuedPrefill at the first body byte

	res     relayResult
	d       bodyDecoder
	buf     []byte
	last    time.Time // when the last bytes came
	probing bool      // the read deadline is the probe's
	stopped bool      // handle or a read error ended the relay
	rerr    error     // the read callback's error
	readFn  func(fd uintptr) bool
}

var rawRelayPool = sync.Pool{New: func() any {
	rr := &rawRelay{buf: make([]byte, 32<<10), d: bodyDecoder{line: make([]byte, 0, 64)}}
	rr.readFn = rr.read
	return rr
}}

// handle relays one read's bytes; false ends the relay.
func (rr *rawRelay) handle(in []byte) bool {
	res := &rr.res
	payload, extra, err := rr.d.decode(in)
	if len(payload) > 0 {
		now := time.Now().UnixNano()
		if res.firstAt == 0 {
			res.firstAt = now
			if rr.queued != 0 {
				rr.rep.queuedPrefill.Add(-rr.queued)
			}
		}
		res.lastAt = now
		if rr.streaming {
			res.sse.feed(payload, now, rr.rep)
		} else {
			res.body.feed(payload)
		}
		if _, werr := rr.w.Write(payload); werr != nil {
			res.clientGone, res.writeFailed = true, true
			return false
		}
		// The last payload is not flushed here: the handler returns at
		// once, and net/http then writes it together with the chunked
		// body's terminator, one write instead of two (as nginx sends
		// its last buffer).
		if rr.flusher != nil && rr.d.state != chDone {
			rr.flusher.Flush()
		}
		res.bytes += int64(len(payload))
		if k := len(payload); k >= 2 {
			res.tail = [2]byte{payload[k-2], payload[k-1]}
		} else {
			res.tail = [2]byte{res.tail[1], payload[0]}
		}
	}
	res.dirty = res.dirty || extra
	if err != nil {
		res.err = err
		return false
	}
	return rr.d.state != chDone
}

// arm sets the read deadline: the idle timeout after the last bytes, or
// the probe's when sooner. It returns false when the client has left
// (the past deadline its leaving set would have been overwritten).
func (rr *rawRelay) arm(probe bool) bool {
	d := rr.last.Add(rr.n.cfg.IdleTimeout)
	if probe {
		if p := time.Now().Add(rawProbe); p.Before(d) {
			d = p
		}
	}
	rr.probing = probe
	_ = rr.uc.SetReadDeadline(d)
	if rr.clientCtx.Err() != nil {
		rr.res.clientGone, rr.stopped = true, true
		return false
	}
	return true
}

// read is the RawConn.Read callback: it reads and relays until the
// socket is drained (false: wait for readiness) or the relay ends.
func (rr *rawRelay) read(fd uintptr) bool {
	for {
		nr, err := rawRead(fd, rr.buf)
		switch {
		case err == syscall.EAGAIN:
			if rr.probing && !rr.arm(false) {
				return true
			}
			return false
		case err != 0:
			rr.rerr = os.NewSyscallError("read", err)
			return true
		case nr == 0:
			rr.rerr = io.ErrUnexpectedEOF
			return true
		}
		rr.last = time.Now()
		if !rr.handle(rr.buf[:nr]) {
			rr.stopped = true
			return true
		}
		if nr < len(rr.buf) {
			// Drained: wait for readiness before reading again, for
			// at most rawProbe.
			return !rr.arm(true)
		}
	}
}

func (rr *rawRelay) run() {
	res := &rr.res
	// The bytes that came with the response head.
	if k := rr.uc.br.Buffered(); k > 0 {
		b, _ := rr.uc.br.Peek(k)
		k = copy(rr.buf, b)
		_, _ = rr.uc.br.Discard(k)
		if !rr.handle(rr.buf[:k]) {
			return
		}
	}
	rr.last = time.Now()
	var err error
	for {
		if !rr.arm(false) {
			return
		}
		err = rr.uc.rc.Read(rr.readFn)
		if rr.stopped {
			return
		}
		if err == nil {
			err = rr.rerr
			break
		}
		if rr.clientCtx.Err() != nil {
			res.clientGone = true
			return
		}
		var ne net.Error
		if !rr.probing || !errors.As(err, &ne) || !ne.Timeout() || time.Since(rr.last) >= rr.n.cfg.IdleTimeout {
			break
		}
		// The probe's deadline passed: Read starts over with a read.
	}
	if rr.clientCtx.Err() != nil {
		res.clientGone = true
		return
	}
	var ne net.Error
	res.idle = errors.As(err, &ne) && ne.Timeout()
	res.err = err
}
