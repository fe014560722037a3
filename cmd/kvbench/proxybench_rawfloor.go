package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/spf13/cobra"
)

// The raw floor (proxybench --raw-floor) is the least a Go program can do
// as this proxy: no net/http on either side. One goroutine per client
// connection reads each request head and its Content-Length body, writes
// them to a kept-alive engine connection (round-robin, pooled per engine)
// in one write, and passes the engine's response through verbatim: one
// client write per upstream read, the chunked framing only scanned to
// find where the answer ends. It keys nothing, routes nothing, watches no
// client for disconnects and times nothing out; it understands exactly
// the requests proxybench sends and the answers its engine gives.
//
// Measured in the same run as kvmesh and nginx, it separates what a Go
// HTTP server costs on these cores (the go-floor) from what the Go runtime
// costs at all: goroutine wake-ups, the scheduler, the netpoller. Where
// kvmesh misses a figure that the raw floor meets, the difference lies in
// net/http's server and in the gateway's own work; where the raw floor
// misses it too, no Go proxy here meets it.

// rawFloor is the raw floor's state: the engines and their idle
// connections.
type rawFloor struct {
	engines []string
	next    atomic.Uint64
	mu      sync.Mutex
	idle    map[string][]*rawUpstream
}

func newRawFloor(engines []string) *rawFloor {
	return &rawFloor{engines: engines, idle: map[string][]*rawUpstream{}}
}

// run accepts connections on ln and serves each in its own goroutine
// until ctx ends; it closes ln.
func (f *rawFloor) run(ctx context.Context, ln net.Listener) error {
	stop := context.AfterFunc(ctx, func() { _ = ln.Close() })
	defer stop()
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		go f.serve(c)
	}
}

// rawUpstream is one kept-alive engine connection.
type rawUpstream struct {
	addr string
	c    net.Conn
	br   *bufio.Reader
}

func (f *rawFloor) get(addr string) (*rawUpstream, error) {
	f.mu.Lock()
	if l := f.idle[addr]; len(l) > 0 {
		u := l[len(l)-1]
		f.idle[addr] = l[:len(l)-1]
		f.mu.Unlock()
		return u, nil
	}
	f.mu.Unlock()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	return &rawUpstream{addr: addr, c: c, br: bufio.NewReaderSize(c, 32<<10)}, nil
}

func (f *rawFloor) put(u *rawUpstream) {
	f.mu.Lock()
	f.idle[u.addr] = append(f.idle[u.addr], u)
	f.mu.Unlock()
}

// readHead reads an HTTP/1.1 message head (through the empty line) into
// dst and returns it with the Content-Length header's value (−1: none)
// and whether Transfer-Encoding is chunked.
func readHead(br *bufio.Reader, dst []byte) (head []byte, length int64, chunked bool, err error) {
	length = -1
	for first := true; ; first = false {
		line, err := br.ReadSlice('\n')
		if err != nil {
			if first && err == io.EOF && len(line) == 0 {
				return nil, 0, false, io.EOF
			}
			return nil, 0, false, fmt.Errorf("reading a message head: %w", err)
		}
		dst = append(dst, line...)
		if len(dst) > 64<<10 {
			return nil, 0, false, errors.New("message head over 64 KiB")
		}
		l := bytes.TrimRight(line, "\r\n")
		if len(l) == 0 {
			return dst, length, chunked, nil
		}
		name, value, ok := bytes.Cut(l, []byte(":"))
		if !ok || first {
			continue
		}
		value = bytes.TrimSpace(value)
		switch {
		case bytes.EqualFold(name, []byte("Content-Length")):
			if length, err = strconv.ParseInt(string(value), 10, 64); err != nil || length < 0 {
				return nil, 0, false, fmt.Errorf("bad Content-Length %q", value)
			}
		case bytes.EqualFold(name, []byte("Transfer-Encoding")):
			chunked = bytes.EqualFold(value, []byte("chunked"))
		}
	}
}

// chunkEnd scans chunked framing as it passes, to say where the body
// ends; the bytes themselves are not changed.
type chunkEnd struct {
	state  uint8 // 0 size line, 1 data, 2 data's CRLF, 3 trailer, 4 done
	size   int64
	remain int64
	ext    bool // past the size digits on a size line
	empty  bool // the trailer line so far is empty
}

// feed consumes b and reports whether the body ended in it (bytes after
// the end are an error: the engine sends nothing unasked).
func (s *chunkEnd) feed(b []byte) (done bool, err error) {
	for i := 0; i < len(b); i++ {
		c := b[i]
		switch s.state {
		case 0:
			switch {
			case c == '\n':
				if s.size == 0 {
					s.state, s.empty = 3, true
				} else {
					s.state, s.remain = 1, s.size
				}
				s.size, s.ext = 0, false
			case s.ext:
			case c >= '0' && c <= '9':
				s.size = s.size<<4 | int64(c-'0')
			case c >= 'a' && c <= 'f':
				s.size = s.size<<4 | int64(c-'a'+10)
			case c >= 'A' && c <= 'F':
				s.size = s.size<<4 | int64(c-'A'+10)
			default: // CR, or an extension after the size
				s.ext = true
			}
		case 1:
			n := min(s.remain, int64(len(b)-i))
			s.remain -= n
			i += int(n) - 1
			if s.remain == 0 {
				s.state = 2
			}
		case 2:
			if c == '\n' {
				s.state = 0
			}
		case 3:
			switch c {
			case '\n':
				if s.empty {
					s.state = 4
				}
				s.empty = true
			case '\r':
			default:
				s.empty = false
			}
		case 4:
			return true, errors.New("bytes after the end of a chunked body")
		}
	}
	return s.state == 4, nil
}

// serve handles one client connection until it closes or fails.
func (f *rawFloor) serve(c net.Conn) {
	defer c.Close()
	br := bufio.NewReaderSize(c, 32<<10)
	var head, out []byte
	buf := make([]byte, 32<<10)
	for {
		h, length, _, err := readHead(br, head[:0])
		if err != nil {
			return
		}
		head = h
		if length < 0 || length > 1<<20 {
			return // proxybench always sends a sized body
		}
		out = append(out[:0], head...)
		start := len(out)
		out = append(out, make([]byte, length)...)
		if _, err := io.ReadFull(br, out[start:]); err != nil {
			return
		}
		addr := f.engines[f.next.Add(1)%uint64(len(f.engines))]
		u, err := f.get(addr)
		if err != nil {
			_, _ = c.Write([]byte("HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"))
			return
		}
		if !f.exchange(c, u, out, buf) {
			u.c.Close()
			return
		}
		f.put(u)
	}
}

// exchange sends req on u and relays the answer to c; false means that
// either connection is no longer usable.
func (f *rawFloor) exchange(c net.Conn, u *rawUpstream, req, buf []byte) bool {
	if _, err := u.c.Write(req); err != nil {
		return false
	}
	head, length, chunked, err := readHead(u.br, buf[:0])
	if err != nil || (!chunked && length < 0) {
		return false
	}
	// The head goes out with whatever of the body is buffered already;
	// then each read from the engine is one write to the client.
	out := head
	var sc chunkEnd
	done := !chunked && length == 0
	for {
		if n := u.br.Buffered(); n > 0 && !done {
			if !chunked {
				n = int(min(int64(n), length))
			}
			b, _ := u.br.Peek(n)
			out = append(out, b...)
			_, _ = u.br.Discard(n)
			if chunked {
				if done, err = sc.feed(b); err != nil {
					return false
				}
			} else {
				length -= int64(n)
				done = length == 0
			}
		}
		if len(out) > 0 {
			if _, err := c.Write(out); err != nil {
				return false
			}
			out = buf[:0]
		}
		if done {
			return true
		}
		// Nothing buffered: one read (blocking) fills the buffer.
		if _, err := u.br.Peek(1); err != nil {
			return false
		}
	}
}

func newProxybenchRawFloorCmd() *cobra.Command {
	var (
		addr      string
		upstreams []string
	)
	cmd := &cobra.Command{
		Use:    "proxybench-rawfloor",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if len(upstreams) == 0 {
				return errors.New("at least one --upstream")
			}
			ln, ctx, cancel, err := listenChild(cmd, addr)
			if err != nil {
				return err
			}
			defer cancel()
			return newRawFloor(upstreams).run(ctx, ln)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&addr, "addr", "127.0.0.1:0", "listen address (loopback)")
	fl.StringArrayVar(&upstreams, "upstream", nil, "engine address host:port (repeat; round-robin)")
	return cmd
}
