package faultctl_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/chaos/faultctl"
	"github.com/kvmesh/kvmesh/kvevents"
)

const token = "test-control-token"

// control starts a Manager behind the real control API on loopback.
func control(t *testing.T) *faultctl.Client {
	t.Helper()
	m := faultctl.NewManager(nil)
	h, err := faultctl.Handler(m, token)
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(func() {
		srv.Close()
		require.NoError(t, m.Close())
	})
	return &faultctl.Client{Base: srv.URL, Token: token}
}

type recorder struct {
	mu   sync.Mutex
	last kvevents.Seq
	n    int
}

func (r *recorder) HandleBatch(_ string, seq kvevents.Seq, _ *kvevents.Batch) {
	r.mu.Lock()
	r.last, r.n = seq, r.n+1
	r.mu.Unlock()
}

func (r *recorder) HandleReset(string, kvevents.ResetReason) {}

func (r *recorder) get() (kvevents.Seq, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.last, r.n
}

// zmqRig is publisher -> relay created through the API -> subscriber,
// replay straight to the publisher, as a gateway is wired in front of an
// engine whose event port is behind kvmesh faultproxy.
type zmqRig struct {
	pub  *kvevents.Publisher
	m    *kvevents.Metrics
	rec  *recorder
	next int
}

func (z *zmqRig) publish(t *testing.T, n int) {
	t.Helper()
	for range n {
		_, err := z.pub.Publish(kvevents.Batch{TS: float64(z.next), Events: []kvevents.Event{{Kind: kvevents.KindBlockRemoved,
			Removed: &kvevents.BlockRemoved{BlockHashes: []kvevents.EngineHash{kvevents.EngineHash(z.next + 1)}}}}})
		require.NoError(t, err)
		z.next++
	}
}

// await waits until the subscriber delivered the last seq published.
func (z *zmqRig) await(t *testing.T) {
	t.Helper()
	want := kvevents.Seq(z.next - 1)
	require.Eventually(t, func() bool { last, _ := z.rec.get(); return last == want }, 10*time.Second, 2*time.Millisecond)
}

func TestControlAPIZMQFaultsShowInSubscriberCounters(t *testing.T) {
	ctx := t.Context()
	cl := control(t)

	pc := kvevents.DefaultPublisherConfig()
	pc.Endpoint, pc.AlwaysBind, pc.ReplayEndpoint = "tcp://127.0.0.1:0", true, "tcp://127.0.0.1:0"
	pub, err := kvevents.NewPublisher(pc, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	pi, err := cl.CreateProxy(ctx, faultctl.ProxySpec{Name: "e0-events", Kind: faultctl.KindZMQ, Listen: "tcp://127.0.0.1:0", Upstream: pub.Addr()})
	require.NoError(t, err)
	require.NotEmpty(t, pi.Addr)

	z := &zmqRig{pub: pub, m: kvevents.NewMetrics(), rec: &recorder{}}
	sc := kvevents.DefaultSubscriberConfig()
	sc.Replica, sc.Endpoint, sc.ReplayEndpoint = "e0", pi.Addr, pub.ReplayAddr()
	sub, err := kvevents.NewSubscriber(sc, z.rec, z.m, nil)
	require.NoError(t, err)
	require.NoError(t, sub.Start(ctx))
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	reg := prometheus.NewRegistry()
	require.NoError(t, z.m.Register(reg))
	counter := func(name string, labels map[string]string) func() float64 {
		return func() float64 { return cluster.CounterSum(reg, "kvmesh_kvevents_"+name, labels) }
	}
	batches, replayed := counter("batches_total", nil), counter("replayed_batches_total", nil)
	// PUB/SUB loses what is sent before both hops subscribed: publish
	// until a batch arrives live, then until the last one did. Until the
	// first live batch the subscriber keeps catching up through replay,
	// and such a catch-up during the fault below would count as a second
	// complete replay (ci802).
	require.Eventually(t, func() bool { z.publish(t, 1); return batches()-replayed() > 0 }, 10*time.Second, 10*time.Millisecond)
	z.await(t)

	gaps := counter("gaps_total", nil)
	dups := counter("duplicates_total", nil)
	replays := counter("replays_total", map[string]string{"result": "complete"})
	rewinds := counter("resets_total", map[string]string{"reason": "rewind"})
	// The warm-up may have counted a gap (a batch published while the
	// second hop subscribed): figures below are deltas.
	g0, d0, r0, w0 := gaps(), dups(), replays(), rewinds()

	// Drop exactly three consecutive batches: one gap, one complete replay.
	fi, err := cl.AddFault(ctx, "e0-events", faultctl.FaultSpec{Type: faultctl.FaultDrop, Count: 3})
	require.NoError(t, err)
	require.Equal(t, "drop", fi.Name)
	z.publish(t, 8)
	z.await(t)
	require.Equal(t, g0+1, gaps(), "three consecutive drops are one gap")
	require.Equal(t, r0+1, replays(), "and one complete replay")
	require.Equal(t, d0, dups())
	pi, err = cl.Proxy(ctx, "e0-events")
	require.NoError(t, err)
	require.Equal(t, uint64(3), pi.ZMQ.Dropped)
	require.Equal(t, []faultctl.FaultInfo{{FaultSpec: faultctl.FaultSpec{Name: "drop", Type: "drop", Probability: 1, Count: 3}, Fired: 3, Done: true}}, pi.Faults)
	require.NoError(t, cl.RemoveFault(ctx, "e0-events", "drop"))

	// Duplicate four batches: four duplicates dropped by the subscriber.
	_, err = cl.AddFault(ctx, "e0-events", faultctl.FaultSpec{Type: faultctl.FaultDuplicate, Count: 4})
	require.NoError(t, err)
	z.publish(t, 8)
	z.await(t)
	require.Eventually(t, func() bool { return dups() == d0+4 }, 5*time.Second, 2*time.Millisecond, "duplicates %v", dups())
	require.Equal(t, g0+1, gaps(), "duplicates open no gap")
	require.NoError(t, cl.Heal(ctx, "e0-events"))

	// Reorder one pair: the later batch first is a gap (replayed), the
	// earlier one then arrives below the last seq, which the subscriber
	// takes for an engine restart: one rewind reset.
	_, err = cl.AddFault(ctx, "e0-events", faultctl.FaultSpec{Type: faultctl.FaultReorder, Count: 1})
	require.NoError(t, err)
	z.publish(t, 8)
	z.await(t)
	require.Eventually(t, func() bool { return rewinds() == w0+1 }, 5*time.Second, 2*time.Millisecond, "rewinds %v", rewinds())
	// Gaps: n+1 before n, then n+2 after the reset's join replay
	// delivered up to n.
	require.Equal(t, g0+3, gaps(), "a swapped pair is two gaps")
	pi, err = cl.Proxy(ctx, "e0-events")
	require.NoError(t, err)
	require.Equal(t, uint64(1), pi.ZMQ.Swapped)
	require.Equal(t, uint64(4), pi.ZMQ.Duplicated)

	// A tcp-only fault on a zmq proxy is refused.
	_, err = cl.AddFault(ctx, "e0-events", faultctl.FaultSpec{Type: faultctl.FaultLatency, LatencyMS: 5})
	require.ErrorIs(t, err, faultctl.ErrInvalid)
}

// streamServer writes a line every 5 ms for up to 5 s on /stream, and
// reports on gone when a stream's client went away; /ok answers "ok".
func streamServer(t *testing.T) (addr string, gone <-chan struct{}) {
	t.Helper()
	g := make(chan struct{}, 16)
	mux := http.NewServeMux()
	mux.HandleFunc("/ok", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	mux.HandleFunc("/big", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(make([]byte, 20<<10)) })
	mux.HandleFunc("/stream", func(w http.ResponseWriter, r *http.Request) {
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		deadline := time.After(5 * time.Second)
		for i := 0; ; i++ {
			if _, err := fmt.Fprintf(w, "line %d\n", i); err != nil {
				g <- struct{}{}
				return
			}
			w.(http.Flusher).Flush()
			select {
			case <-r.Context().Done():
				g <- struct{}{}
				return
			case <-deadline:
				return
			case <-tick.C:
			}
		}
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String(), g
}

func TestControlAPITCPFaultsGiveTheClientErrorsExpected(t *testing.T) {
	ctx := t.Context()
	cl := control(t)
	backend, gone := streamServer(t)

	// Without the token nothing but /healthz answers.
	bad := &faultctl.Client{Base: cl.Base, Token: "wrong"}
	_, err := bad.Proxies(ctx)
	require.ErrorIs(t, err, faultctl.ErrUnauthorized)
	resp, err := http.Get(cl.Base + "/healthz")
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusOK, resp.StatusCode)

	pi, err := cl.CreateProxy(ctx, faultctl.ProxySpec{Name: "e0-http", Kind: faultctl.KindTCP, Listen: "127.0.0.1:0", Upstream: backend})
	require.NoError(t, err)
	_, err = cl.CreateProxy(ctx, faultctl.ProxySpec{Name: "e0-http", Kind: faultctl.KindTCP, Upstream: backend})
	require.ErrorIs(t, err, faultctl.ErrConflict, "a second proxy of that name")
	base := "http://" + pi.Addr
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	get := func(path string, timeout time.Duration) (string, error) {
		rctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		req, err := http.NewRequestWithContext(rctx, http.MethodGet, base+path, nil)
		require.NoError(t, err)
		resp, err := hc.Do(req)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	}
	body, err := get("/ok", 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, "ok", body)

	// Cut: a stream in flight ends with an unexpected EOF.
	stream := func() (*bufio.Reader, func()) {
		// Connections of earlier requests close asynchronously: wait
		// for none, so that a cut acts on this stream alone.
		require.Eventually(t, func() bool {
			p, err := cl.Proxy(ctx, "e0-http")
			require.NoError(t, err)
			return p.TCP.Active == 0
		}, 10*time.Second, 2*time.Millisecond)
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/stream", nil)
		require.NoError(t, err)
		resp, err := hc.Do(req)
		require.NoError(t, err)
		br := bufio.NewReader(resp.Body)
		_, err = br.ReadString('\n')
		require.NoError(t, err)
		return br, func() { _ = resp.Body.Close() }
	}
	br, done := stream()
	n, err := cl.Cut(ctx, "e0-http")
	require.NoError(t, err)
	require.Equal(t, 1, n)
	_, err = io.ReadAll(br)
	require.ErrorIs(t, err, io.ErrUnexpectedEOF, "a cut stream is an error the client sees")
	done()
	<-gone

	// Refuse: new connections are refused by the kernel.
	_, err = cl.AddFault(ctx, "e0-http", faultctl.FaultSpec{Type: faultctl.FaultRefuse})
	require.NoError(t, err)
	_, err = get("/ok", 5*time.Second)
	require.ErrorIs(t, err, syscall.ECONNREFUSED)
	require.NoError(t, cl.RemoveFault(ctx, "e0-http", "refuse"))
	_, err = get("/ok", 5*time.Second)
	require.NoError(t, err)

	// Drop both ways: the request times out on the client's deadline.
	_, err = cl.AddFault(ctx, "e0-http", faultctl.FaultSpec{Type: faultctl.FaultDrop})
	require.NoError(t, err)
	_, err = get("/ok", 300*time.Millisecond)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	_, err = cl.AddFault(ctx, "e0-http", faultctl.FaultSpec{Type: faultctl.FaultDrop, Direction: "down"})
	require.ErrorIs(t, err, faultctl.ErrConflict, "drop on down overlaps drop on both")
	require.NoError(t, cl.Heal(ctx, "e0-http"))

	// Latency on the way down: at least the latency added.
	_, err = cl.AddFault(ctx, "e0-http", faultctl.FaultSpec{Type: faultctl.FaultLatency, Direction: "down", LatencyMS: 150, JitterMS: 20})
	require.NoError(t, err)
	start := time.Now()
	_, err = get("/ok", 10*time.Second)
	require.NoError(t, err)
	require.GreaterOrEqual(t, time.Since(start), 150*time.Millisecond)
	require.NoError(t, cl.Heal(ctx, "e0-http"))

	// Bandwidth: 20 KiB at 64 KiB/s takes at least ~0.3 s.
	_, err = cl.AddFault(ctx, "e0-http", faultctl.FaultSpec{Type: faultctl.FaultBandwidth, RateBytes: 64 << 10})
	require.NoError(t, err)
	start = time.Now()
	body, err = get("/big", 10*time.Second)
	require.NoError(t, err)
	require.Len(t, body, 20<<10)
	require.GreaterOrEqual(t, time.Since(start), 280*time.Millisecond)
	require.NoError(t, cl.Heal(ctx, "e0-http"))

	// Half-open: the backend sees its client go, the client sees neither
	// data nor EOF, only its own read deadline.
	br, done = stream()
	n, err = cl.HalfOpen(ctx, "e0-http")
	require.NoError(t, err)
	require.Equal(t, 1, n)
	select {
	case <-gone:
	case <-time.After(10 * time.Second):
		t.Fatal("the backend did not see the connection go")
	}
	lines := make(chan error, 1)
	go func() {
		for {
			if _, err := br.ReadString('\n'); err != nil {
				lines <- err
				return
			}
		}
	}()
	// Lines already in flight may still arrive; after them, silence: no
	// EOF for 300 ms.
	select {
	case err := <-lines:
		t.Fatalf("a half-open stream ended for the client: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	n, err = cl.Cut(ctx, "e0-http")
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Error(t, <-lines, "cut ends the half-open connection")
	done()

	var ae *faultctl.APIError
	_, err = cl.AddFault(ctx, "nope", faultctl.FaultSpec{Type: faultctl.FaultDrop})
	require.ErrorAs(t, err, &ae)
	require.Equal(t, http.StatusNotFound, ae.Status)
	_, err = cl.AddFault(ctx, "e0-http", faultctl.FaultSpec{Type: faultctl.FaultDuplicate})
	require.ErrorIs(t, err, faultctl.ErrInvalid, "duplicate is a zmq fault")
	require.NoError(t, cl.DeleteProxy(ctx, "e0-http"))
	_, err = get("/ok", 5*time.Second)
	var ne net.Error
	require.True(t, errors.Is(err, syscall.ECONNREFUSED) || errors.As(err, &ne), "the proxy is gone: %v", err)
}
