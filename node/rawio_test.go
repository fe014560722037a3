package node

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// rawPair is a connected loopback pair: a is a rawIOConn, b a plain
// TCPConn.
func rawPair(t *testing.T) (*rawIOConn, *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type res struct {
		c   net.Conn
		err error
	}
	ch := make(chan res, 1)
	go func() {
		c, err := ln.Accept()
		ch <- res{c, err}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	a, ok := newRawIOConn(c).(*rawIOConn)
	if !ok {
		t.Fatalf("newRawIOConn(%T) did not wrap it", c)
	}
	t.Cleanup(func() { _ = a.Close(); _ = r.c.Close() })
	return a, r.c.(*net.TCPConn)
}

// TestRawIOConnReadWrite: bytes go both ways unchanged, including a write
// far larger than the socket buffers (partial writes and waits for
// writability inside one Write), and a zero-length read returns at once.
func TestRawIOConnReadWrite(t *testing.T) {
	a, b := rawPair(t)
	if n, err := a.Read(nil); n != 0 || err != nil {
		t.Fatalf("Read(nil) = %d, %v", n, err)
	}
	big := bytes.Repeat([]byte("0123456789abcdef"), 1<<18) // 4 MiB
	done := make(chan error, 1)
	go func() {
		n, err := a.Write(big)
		if err == nil && n != len(big) {
			err = fmt.Errorf("Write wrote %d of %d", n, len(big))
		}
		done <- err
	}()
	got := make([]byte, len(big))
	if _, err := io.ReadFull(b, got); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, big) {
		t.Fatal("bytes differ")
	}
	if _, err := b.Write([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	n, err := io.ReadAtLeast(a, buf, 4)
	if err != nil || string(buf[:n]) != "pong" {
		t.Fatalf("Read = %q, %v", buf[:n], err)
	}
}

// TestRawIOConnErrors: the errors net/http and the proxy look at keep
// their net.Conn form: bare io.EOF at the peer's close, a timeout
// *net.OpError for a passed deadline (also one set while the read waits),
// net.ErrClosed after Close, ECONNRESET/EPIPE for a write to a peer that
// is gone.
func TestRawIOConnErrors(t *testing.T) {
	t.Run("eof", func(t *testing.T) {
		a, b := rawPair(t)
		_ = b.Close()
		n, err := a.Read(make([]byte, 8))
		if n != 0 || err != io.EOF {
			t.Fatalf("Read after peer close = %d, %v; want 0, io.EOF", n, err)
		}
	})
	t.Run("deadline", func(t *testing.T) {
		a, _ := rawPair(t)
		_ = a.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
		_, err := a.Read(make([]byte, 8))
		var ne net.Error
		var oe *net.OpError
		if !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &oe) || oe.Op != "read" || oe.Addr == nil || oe.Addr.String() != a.RemoteAddr().String() {
			t.Fatalf("Read past deadline = %v (%T)", err, err)
		}
	})
	t.Run("deadline set while waiting", func(t *testing.T) {
		a, _ := rawPair(t)
		done := make(chan error, 1)
		go func() {
			_, err := a.Read(make([]byte, 8))
			done <- err
		}()
		// net/http aborts its background read like this.
		deadline := time.Now().Add(10 * time.Second)
		for {
			_ = a.SetReadDeadline(aLongTimeAgo)
			select {
			case err := <-done:
				if !errors.Is(err, os.ErrDeadlineExceeded) {
					t.Fatalf("aborted Read = %v", err)
				}
				return
			case <-time.After(5 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				t.Fatal("Read not aborted by a past deadline")
			}
			_ = a.SetReadDeadline(time.Time{})
		}
	})
	t.Run("closed", func(t *testing.T) {
		a, _ := rawPair(t)
		_ = a.Close()
		if _, err := a.Read(make([]byte, 8)); !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Read after Close = %v", err)
		}
		if _, err := a.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Write after Close = %v", err)
		}
	})
	t.Run("peer reset", func(t *testing.T) {
		a, b := rawPair(t)
		_ = b.SetLinger(0)
		_ = b.Close()
		// The first write may still be accepted; one soon fails.
		var err error
		deadline := time.Now().Add(10 * time.Second)
		for err == nil && time.Now().Before(deadline) {
			_, err = a.Write([]byte("data after the peer left"))
		}
		var oe *net.OpError
		if !errors.As(err, &oe) || oe.Op != "write" || !(errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)) {
			t.Fatalf("Write to a reset peer = %v", err)
		}
		if !isConnClosed(err) {
			t.Fatalf("isConnClosed(%v) = false", err)
		}
	})
}

// TestRawIOConnConcurrentWrites: concurrent Writes (net.Conn allows them)
// each go out whole, never interleaved.
func TestRawIOConnConcurrentWrites(t *testing.T) {
	a, b := rawPair(t)
	const writers, each = 4, 200
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			line := []byte(strings.Repeat(string(rune('a'+w)), 999) + "\n")
			for range each {
				if _, err := a.Write(line); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	sc := bufio.NewScanner(b)
	for i := range writers * each {
		if !sc.Scan() {
			t.Fatalf("line %d: %v", i, sc.Err())
		}
		l := sc.Text()
		if len(l) != 999 || strings.Count(l, l[:1]) != 999 {
			t.Fatalf("line %d interleaved: %q...", i, l[:20])
		}
	}
	wg.Wait()
}

// TestRawIOListenerServesHTTP: net/http's server over rawIOListener
// serves keep-alive requests with bodies, and a client leaving mid-request
// cancels the request's context (net/http's background read sees EOF
// through rawIOConn.Read).
func TestRawIOListenerServesHTTP(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	started, gone := make(chan struct{}), make(chan struct{})
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/wait" {
			close(started)
			<-r.Context().Done()
			close(gone)
			return
		}
		b, _ := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%s:%d", r.URL.Path, len(b))
	})}
	go func() { _ = srv.Serve(rawIOListener{ln}) }()
	defer srv.Close()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	cl := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	for i := range 5 {
		body := strings.Repeat("x", i*50000)
		resp, err := cl.Post("http://"+ln.Addr().String()+fmt.Sprintf("/p%d", i), "text/plain", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if want := fmt.Sprintf("/p%d:%d", i, len(body)); string(got) != want {
			t.Fatalf("got %q, want %q", got, want)
		}
	}
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	// Close only once the handler runs (the server has read the head).
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not start")
	}
	_ = c.Close()
	select {
	case <-gone:
	case <-time.After(10 * time.Second):
		t.Fatal("the request context was not cancelled when the client left")
	}
}
