package faultproxy_test

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/chaos/faultproxy"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// zmq4 v0.17's PUB writer can miss its close signal and wait forever:
		// the library's goroutine, not ours (kvevents and chaos/sim ignore it too).
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
	)
}

// echoServer echoes every byte and records what it received.
type echoServer struct {
	ln  net.Listener
	wg  sync.WaitGroup
	mu  sync.Mutex
	got []byte
	cs  []net.Conn
}

func newEcho(t *testing.T) *echoServer {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	e := &echoServer{ln: ln}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			e.mu.Lock()
			e.cs = append(e.cs, c)
			e.mu.Unlock()
			e.wg.Add(1)
			go func() {
				defer e.wg.Done()
				buf := make([]byte, 4096)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						e.mu.Lock()
						e.got = append(e.got, buf[:n]...)
						e.mu.Unlock()
						if _, werr := c.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		e.mu.Lock()
		for _, c := range e.cs {
			_ = c.Close()
		}
		e.mu.Unlock()
		e.wg.Wait()
	})
	return e
}

func (e *echoServer) received() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return string(e.got)
}

func newProxy(t *testing.T, target string) *faultproxy.Proxy {
	cfg := faultproxy.DefaultConfig()
	cfg.Name = t.Name()
	cfg.Target = target
	p, err := faultproxy.New(cfg)
	require.NoError(t, err)
	require.NoError(t, p.Start())
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return p
}

func dial(t *testing.T, p *faultproxy.Proxy) net.Conn {
	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func roundTrip(t *testing.T, c net.Conn, msg string, within time.Duration) (string, error) {
	t.Helper()
	_, err := c.Write([]byte(msg))
	require.NoError(t, err)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(within)))
	buf := make([]byte, len(msg))
	n, err := io.ReadFull(c, buf)
	return string(buf[:n]), err
}

func isTimeout(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }

func TestForwards(t *testing.T) {
	e := newEcho(t)
	p := newProxy(t, e.ln.Addr().String())
	c := dial(t, p)
	got, err := roundTrip(t, c, "hello", 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, "hello", got)
	// The counters move right after each write, so the client may read the
	// echo before the last one is counted.
	require.Eventually(t, func() bool {
		s := p.Stats()
		return s.Accepted == 1 && s.Active == 1 && s.Forwarded[faultproxy.Up] == 5 && s.Forwarded[faultproxy.Down] == 5
	}, 5*time.Second, time.Millisecond, "%+v", p.Stats())
}

func TestDelay(t *testing.T) {
	e := newEcho(t)
	p := newProxy(t, e.ln.Addr().String())
	c := dial(t, p)
	p.SetDelay(100*time.Millisecond, faultproxy.Up)
	start := time.Now()
	got, err := roundTrip(t, c, "slow", 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, "slow", got)
	require.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond, "a round trip crosses the delayed direction once")

	// A delay line keeps order and throughput: many chunks in flight pay
	// the delay about once, not once each.
	p.SetDelay(50*time.Millisecond, faultproxy.Both...)
	start = time.Now()
	for i := range 20 {
		_, err := c.Write([]byte{byte('a' + i)})
		require.NoError(t, err)
	}
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	buf := make([]byte, 20)
	_, err = io.ReadFull(c, buf)
	require.NoError(t, err)
	require.Equal(t, "abcdefghijklmnopqrst", string(buf))
	require.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond)

	p.SetDelay(0, faultproxy.Both...)
	got, err = roundTrip(t, c, "fast", 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, "fast", got)
}

func TestDropBothWays(t *testing.T) {
	e := newEcho(t)
	p := newProxy(t, e.ln.Addr().String())
	c := dial(t, p)
	_, err := roundTrip(t, c, "x", 5*time.Second)
	require.NoError(t, err)

	p.SetDrop(true, faultproxy.Both...)
	_, err = roundTrip(t, c, "lost", 100*time.Millisecond)
	require.True(t, isTimeout(err), "blackholed: %v", err)
	require.Equal(t, "x", e.received(), "nothing reached the target")
	require.Equal(t, uint64(4), p.Stats().Dropped[faultproxy.Up])

	require.NoError(t, p.Heal())
	got, err := roundTrip(t, c, "back", 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, "back", got)
}

func TestOneWayPartition(t *testing.T) {
	e := newEcho(t)
	p := newProxy(t, e.ln.Addr().String())
	c := dial(t, p)

	// Down dropped: the target hears the client, the client hears nothing.
	p.SetDrop(true, faultproxy.Down)
	_, err := roundTrip(t, c, "one", 100*time.Millisecond)
	require.True(t, isTimeout(err), "%v", err)
	require.Eventually(t, func() bool { return e.received() == "one" }, 5*time.Second, time.Millisecond)
	require.Eventually(t, func() bool { return p.Stats().Dropped[faultproxy.Down] == 3 }, 5*time.Second, time.Millisecond)

	// Up dropped: the target hears nothing more.
	p.SetDrop(false, faultproxy.Down)
	p.SetDrop(true, faultproxy.Up)
	_, err = roundTrip(t, c, "two", 100*time.Millisecond)
	require.True(t, isTimeout(err), "%v", err)
	require.Equal(t, "one", e.received())
}

func TestCut(t *testing.T) {
	e := newEcho(t)
	p := newProxy(t, e.ln.Addr().String())
	c := dial(t, p)
	_, err := roundTrip(t, c, "x", 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, 1, p.Cut())
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err = c.Read(make([]byte, 1))
	require.Error(t, err)
	require.False(t, isTimeout(err), "the cut connection ends at once: %v", err)
	require.Eventually(t, func() bool { return p.Stats().Active == 0 }, 5*time.Second, time.Millisecond)

	// New connections work.
	got, err := roundTrip(t, dial(t, p), "again", 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, "again", got)
	require.Equal(t, uint64(1), p.Stats().Cut)
}

func TestRefuse(t *testing.T) {
	e := newEcho(t)
	p := newProxy(t, e.ln.Addr().String())
	old := dial(t, p)
	_, err := roundTrip(t, old, "x", 5*time.Second)
	require.NoError(t, err)

	require.NoError(t, p.SetRefuse(true))
	_, err = net.DialTimeout("tcp", p.Addr(), time.Second)
	require.Error(t, err, "a refusing proxy's port takes no connections")
	if runtime.GOOS == "linux" {
		require.ErrorIs(t, err, syscall.ECONNREFUSED, "refused, as a port with nothing on it")
	}
	got, err := roundTrip(t, old, "still", 5*time.Second)
	require.NoError(t, err, "existing connections keep working")
	require.Equal(t, "still", got)

	require.NoError(t, p.SetRefuse(false))
	_, err = roundTrip(t, dial(t, p), "ok", 5*time.Second)
	require.NoError(t, err, "the same address accepts again")
}

func TestHoldAndRelease(t *testing.T) {
	e := newEcho(t)
	p := newProxy(t, e.ln.Addr().String())
	p.Hold()
	c := dial(t, p)
	_, err := roundTrip(t, c, "held", 100*time.Millisecond)
	require.True(t, isTimeout(err), "%v", err)
	p.Release()
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	buf := make([]byte, 4)
	_, err = io.ReadFull(c, buf)
	require.NoError(t, err)
	require.Equal(t, "held", string(buf), "bytes sent while held are forwarded on release")
}

// SetTarget moves the connections accepted from then on; an open one
// keeps its upstream.
func TestSetTarget(t *testing.T) {
	a, b := newEcho(t), newEcho(t)
	p := newProxy(t, a.ln.Addr().String())
	before := dial(t, p)
	got, err := roundTrip(t, before, "to a", 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, "to a", got)

	p.SetTarget(b.ln.Addr().String())
	require.Equal(t, b.ln.Addr().String(), p.Target())
	after := dial(t, p)
	got, err = roundTrip(t, after, "to b", 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, "to b", got)
	got, err = roundTrip(t, before, " still a", 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, " still a", got)
	require.Equal(t, "to a still a", a.received())
	require.Equal(t, "to b", b.received())
}

func TestTargetDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	p := newProxy(t, addr)
	c := dial(t, p)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err = c.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF)
	require.Eventually(t, func() bool { return p.Stats().DialFails == 1 }, 5*time.Second, time.Millisecond)
}

func TestHTTPThroughProxyAndCloseIdempotent(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("pong"))
	})}
	var wg sync.WaitGroup
	wg.Go(func() { _ = srv.Serve(ln) })
	defer func() { _ = srv.Close(); wg.Wait() }()

	cfg := faultproxy.DefaultConfig()
	cfg.Target = ln.Addr().String()
	p, err := faultproxy.New(cfg)
	require.NoError(t, err)
	require.NoError(t, p.Start())
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Get("http://" + p.Addr() + "/")
	require.NoError(t, err)
	line, err := bufio.NewReader(resp.Body).ReadString('\n')
	require.ErrorIs(t, err, io.EOF)
	require.Equal(t, "pong", line)
	require.NoError(t, resp.Body.Close())

	require.NoError(t, p.Close())
	require.NoError(t, p.Close())
	require.ErrorIs(t, p.Start(), faultproxy.ErrClosed)
	_, err = net.DialTimeout("tcp", p.Addr(), time.Second)
	require.Error(t, err, "closed proxy does not accept")
}

func TestConfigValidate(t *testing.T) {
	_, err := faultproxy.New(faultproxy.DefaultConfig())
	require.ErrorIs(t, err, faultproxy.ErrInvalidConfig)
	cfg := faultproxy.DefaultConfig()
	cfg.Target = "127.0.0.1:1"
	cfg.QueueChunks = 0
	require.ErrorIs(t, cfg.Validate(), faultproxy.ErrInvalidConfig)
}
