package node

import (
	"io"
	"net"
	"os"
	"sync"
	"syscall"
)

// Socket I/O that does not wake the runtime's sysmon thread (issue 21).
//
// A Go read or write on a socket goes through syscall.Read/Write, which
// tell the scheduler that the goroutine enters a possibly blocking system
// call. When every P was idle before (the gateway between two chunks),
// that wakes sysmon from its deep sleep and resets it to polling every
// 20 µs until the process is idle again: on the 2-core machine it
// accounted for 13.6 nanosleep and a good part of the 8.2 futex calls per
// proxied request, about 10 % of the gateway's CPU samples and half its
// context switches. Sockets here are non-blocking, so a read or write
// returns at once; making it a raw system call (the way the runtime's own
// epoll and futex calls are made) keeps the P and leaves sysmon asleep.
// Waiting for readiness is still the netpoller's, through
// syscall.RawConn, so deadlines, Close and the goroutine parking behave
// as with net.Conn.
//
// What sysmon does for a busy process (preempting a goroutine that ran
// 10 ms, polling the network when no P did for 10 ms) resumes at its next
// timer instead of at the first syscall after an idle spell (while the
// raw relay streams, its deadline is at most rawProbe away); a raw call
// never blocks, so there is no P in a syscall for sysmon to retake.
//
// Under the race detector (rawio_race.go) the calls are syscall.Read and
// syscall.Write, whose annotations tell the detector that a read follows
// the write that sent its bytes; without them it would report races that
// the sockets order.

// rawRead is read(2) on a non-blocking fd without the scheduler's
// syscall hooks; it retries EINTR.
func rawRead(fd uintptr, p []byte) (int, syscall.Errno) { return retryEINTR(sysRead, fd, p) }

// rawWrite is write(2) on a non-blocking fd without the scheduler's
// syscall hooks; it retries EINTR.
func rawWrite(fd uintptr, p []byte) (int, syscall.Errno) { return retryEINTR(sysWrite, fd, p) }

// retryEINTR makes call (sysRead or sysWrite) on p unless p is empty,
// again while a signal interrupts it; a failed call counts no bytes.
func retryEINTR(call func(uintptr, []byte) (int, syscall.Errno), fd uintptr, p []byte) (int, syscall.Errno) {
	if len(p) == 0 {
		return 0, 0
	}
	for {
		n, e := call(fd, p)
		switch e {
		case syscall.EINTR:
			continue
		case 0:
			return n, 0
		}
		return 0, e
	}
}

// rawIOConn is a TCP connection whose Read and Write use rawRead and
// rawWrite inside syscall.RawConn callbacks. Everything else (deadlines,
// Close, CloseWrite, addresses) is the TCPConn's. Read and Write follow
// net.Conn's contract: errors are *net.OpError (io.EOF bare), a deadline
// that passed gives os.ErrDeadlineExceeded, a closed conn net.ErrClosed.
type rawIOConn struct {
	*net.TCPConn
	rc syscall.RawConn

	// Read and Write state for the callbacks, created once so that a
	// call allocates nothing; rmu and wmu serialise concurrent callers
	// (net.Conn allows them).
	rmu   sync.Mutex
	rbuf  []byte
	rn    int
	rerr  error
	readF func(fd uintptr) bool

	wmu    sync.Mutex
	wbuf   []byte
	wn     int
	werr   error
	writeF func(fd uintptr) bool
}

// newRawIOConn wraps c when it is a *net.TCPConn with a RawConn, and
// returns c unchanged otherwise.
func newRawIOConn(c net.Conn) net.Conn {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return c
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return c
	}
	rc2 := &rawIOConn{TCPConn: tc, rc: rc}
	rc2.readF = rc2.readCB
	rc2.writeF = rc2.writeCB
	return rc2
}

func (c *rawIOConn) readCB(fd uintptr) bool {
	n, e := rawRead(fd, c.rbuf)
	switch {
	case e == syscall.EAGAIN:
		return false
	case e != 0:
		c.rerr = os.NewSyscallError("read", e)
	case n == 0:
		c.rerr = io.EOF
	default:
		c.rn = n
	}
	return true
}

func (c *rawIOConn) writeCB(fd uintptr) bool {
	for c.wn < len(c.wbuf) {
		n, e := rawWrite(fd, c.wbuf[c.wn:])
		if e == syscall.EAGAIN {
			return false
		}
		if e != 0 {
			c.werr = os.NewSyscallError("write", e)
			return true
		}
		c.wn += n
	}
	return true
}

// Read reads like net.Conn.Read.
func (c *rawIOConn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	c.rmu.Lock()
	c.rbuf, c.rn, c.rerr = p, 0, nil
	err := c.rc.Read(c.readF)
	n, cbErr := c.rn, c.rerr
	c.rbuf, c.rerr = nil, nil
	c.rmu.Unlock()
	if err == nil {
		err = cbErr
	}
	if err == nil || err == io.EOF {
		return n, err
	}
	return n, c.opError("read", err)
}

// Write writes like net.Conn.Write: all of p, or an error.
func (c *rawIOConn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	c.wbuf, c.wn, c.werr = p, 0, nil
	err := c.rc.Write(c.writeF)
	n, cbErr := c.wn, c.werr
	c.wbuf, c.werr = nil, nil
	c.wmu.Unlock()
	if err == nil {
		err = cbErr
	}
	if err == nil {
		return n, nil
	}
	return n, c.opError("write", err)
}

// opError gives err net.Conn's shape. RawConn wraps the netpoller's
// errors (deadline, closed) in a new *net.OpError of its own ("raw-read",
// no remote address), which is corrected in place rather than wrapped
// again (net/http's aborted background read gets one per request); the
// callback's system call errors are wrapped.
func (c *rawIOConn) opError(op string, err error) error {
	if oe, ok := err.(*net.OpError); ok {
		oe.Op, oe.Source, oe.Addr = op, c.LocalAddr(), c.RemoteAddr()
		return oe
	}
	return &net.OpError{Op: op, Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
}

// rawIOListener wraps each accepted TCP connection in a rawIOConn.
type rawIOListener struct {
	net.Listener
}

// Accept accepts like the wrapped listener's.
func (l rawIOListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return newRawIOConn(c), nil
}
