package trust

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"sync"
	"time"
)

// HandshakeTimeout bounds a server-side TLS handshake in Listener: a
// connection that has not proven the key by then is closed.
const HandshakeTimeout = 10 * time.Second

// Listener is a net.Listener whose Accept returns only connections that
// completed a TLS handshake with cfg (for a cluster config: proved the
// cluster key). Each handshake runs in its own goroutine with a deadline,
// so a client that connects and sends nothing delays nobody; a failed
// handshake is closed, reported to Reject and never returned. The user of
// the listener (raft's transport, say) therefore never reads a byte from
// an unauthenticated peer.
type Listener struct {
	inner   net.Listener
	cfg     *tls.Config
	timeout time.Duration
	reject  func(error)

	ready chan net.Conn
	errc  chan error
	done  chan struct{}
	base  context.Context // cancelled by Close: ends handshakes in progress
	stop  context.CancelFunc
	once  sync.Once
	wg    sync.WaitGroup
}

var _ net.Listener = (*Listener)(nil)

// NewListener starts accepting on inner. reject (may be nil) is called
// once per refused connection, from the handshake goroutine; a peer that
// closes before sending a byte (a port probe) is not refused, just gone.
// timeout 0 means HandshakeTimeout. Close stops the accept goroutine,
// closes inner and waits for the handshakes in progress.
func NewListener(inner net.Listener, cfg *tls.Config, timeout time.Duration, reject func(error)) *Listener {
	if timeout <= 0 {
		timeout = HandshakeTimeout
	}
	l := &Listener{inner: inner, cfg: cfg, timeout: timeout, reject: reject,
		ready: make(chan net.Conn), errc: make(chan error, 1), done: make(chan struct{})}
	l.base, l.stop = context.WithCancel(context.Background())
	l.wg.Add(1)
	go l.acceptLoop()
	return l
}

func (l *Listener) acceptLoop() {
	defer l.wg.Done()
	for {
		c, err := l.inner.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			select {
			case l.errc <- err:
			default:
			}
			return
		}
		l.wg.Add(1)
		go l.handshake(c)
	}
}

func (l *Listener) handshake(raw net.Conn) {
	defer l.wg.Done()
	tc := tls.Server(raw, l.cfg)
	ctx, cancel := context.WithTimeout(l.base, l.timeout)
	err := tc.HandshakeContext(ctx)
	cancel()
	if err != nil {
		_ = raw.Close()
		if l.reject != nil && !errors.Is(err, io.EOF) && l.base.Err() == nil {
			l.reject(err)
		}
		return
	}
	select {
	case l.ready <- tc:
	case <-l.done:
		_ = tc.Close()
	}
}

// Accept returns the next authenticated connection (a *tls.Conn).
func (l *Listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ready:
		return c, nil
	case err := <-l.errc:
		l.errc <- err // every later Accept fails too
		return nil, err
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close closes the inner listener and waits for the goroutines.
func (l *Listener) Close() error {
	var err error
	l.once.Do(func() {
		close(l.done)
		l.stop()
		err = l.inner.Close()
		l.wg.Wait()
	})
	return err
}

// Addr is the inner listener's address.
func (l *Listener) Addr() net.Addr { return l.inner.Addr() }
