package node

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/sim"
)

// cutOutcome is what one client saw of a stream Shutdown cut.
type cutOutcome struct {
	status   int
	body     string
	err      error // transport error while reading the body
	complete bool  // the body carried [DONE]
}

// TestShutdownDeadlineCutStreamsSignalTheCut: long streams from a slow
// simulated engine are in flight when Shutdown's deadline passes. Every
// client must see the cut, as an SSE error event with code
// gateway_shutdown or as a transport error, never a body that ends cleanly
// without [DONE] (the client could not tell a truncated answer from a
// complete one).
func TestShutdownDeadlineCutStreamsSignalTheCut(t *testing.T) {
	const streams, rounds = 8, 3
	// A simulated engine at the modelled L20 speed (tens of ms per token):
	// 3000-token streams outlast the test by far.
	scfg := sim.LocalConfig()
	scfg.ServedModelName = "m"
	scfg.Profile = sim.DefaultConfig().Profile
	scfg.MaxNumSeqs = 2 * streams
	scfg.Logger = slog.New(slog.DiscardHandler)
	s, err := sim.NewServer(scfg)
	require.NoError(t, err)
	require.NoError(t, s.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Shutdown(ctx)
	})
	events, aborted := 0, 0
	for round := range rounds {
		cfg := testConfig()
		cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", s.URL())}}}
		n, err := New(cfg, nil)
		require.NoError(t, err)
		require.NoError(t, n.Start(context.Background()))

		client := &http.Client{Transport: &http.Transport{}}
		started := make(chan struct{}, streams)
		out := make([]cutOutcome, streams)
		var wg sync.WaitGroup
		for i := range streams {
			wg.Add(1)
			go func() {
				defer wg.Done()
				body := fmt.Sprintf(`{"model":"m","prompt":"cut round %d stream %d","max_tokens":3000,"stream":true}`, round, i)
				resp, err := client.Post("http://"+n.HTTPAddr()+"/v1/completions", "application/json", strings.NewReader(body))
				if err != nil {
					out[i].err = err
					started <- struct{}{}
					return
				}
				defer resp.Body.Close()
				out[i].status = resp.StatusCode
				br := bufio.NewReader(resp.Body)
				first, err := br.ReadString('\n') // the first event is under way
				started <- struct{}{}
				var sb strings.Builder
				sb.WriteString(first)
				if err == nil {
					_, err = io.Copy(&sb, br)
				}
				out[i].body, out[i].err = sb.String(), err
				out[i].complete = strings.Contains(out[i].body, "data: [DONE]")
			}()
		}
		for range streams {
			<-started
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		err = n.Shutdown(ctx)
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded, "the streams outlast the deadline")
		wg.Wait()
		client.CloseIdleConnections()
		for i, o := range out {
			switch {
			case o.err != nil && !errors.Is(o.err, io.EOF):
				aborted++ // the connection was aborted: a visible failure
			case strings.Contains(o.body, `"code":"gateway_shutdown"`):
				events++
				assert.Equal(t, http.StatusOK, o.status)
				assert.True(t, strings.HasSuffix(o.body, "\n\n"), "the error event is complete")
			default:
				assert.Failf(t, "a cut stream ended cleanly", "round %d stream %d: status %d, [DONE] %v, %d bytes ending %q",
					round, i, o.status, o.complete, len(o.body), o.body[max(0, len(o.body)-80):])
			}
		}
	}
	t.Logf("%d streams cut: %d with a gateway_shutdown event, %d aborted", streams*rounds, events, aborted)
	assert.Positive(t, events, "a client that reads gets the error event before the connection closes")
}

// TestShutdownClosesConnectionsWithoutRequests: a connection that never
// sent a request (http.StateNew, which Go's Shutdown waits 5 s for) and an
// idle keep-alive one do not hold a graceful Shutdown with a short
// deadline; both are closed at once.
func TestShutdownClosesConnectionsWithoutRequests(t *testing.T) {
	e := newFakeEngine(t, "a")
	cfg := testConfig()
	cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", e.url())}}}
	n, err := New(cfg, nil)
	require.NoError(t, err)
	require.NoError(t, n.Start(context.Background()))

	// An idle keep-alive connection: one request answered, left open.
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Get("http://" + n.HTTPAddr() + "/health")
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	require.NoError(t, resp.Body.Close())

	// A connection that sent nothing, and one that sent half a request line.
	silent, err := net.Dial("tcp", n.HTTPAddr())
	require.NoError(t, err)
	defer silent.Close()
	half, err := net.Dial("tcp", n.HTTPAddr())
	require.NoError(t, err)
	defer half.Close()
	_, err = half.Write([]byte("POST /v1/compl"))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		n.conns.mu.Lock()
		defer n.conns.mu.Unlock()
		return len(n.conns.conns) == 3
	}, 5*time.Second, time.Millisecond, "the server tracks all three connections")

	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	t0 := time.Now()
	require.NoError(t, n.Shutdown(ctx), "no connection holds the drain past a 1 s deadline")
	assert.Less(t, time.Since(t0), time.Second)
	for _, c := range []net.Conn{silent, half} {
		require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
		_, err := c.Read(make([]byte, 1))
		require.Error(t, err)
		var ne net.Error
		assert.False(t, errors.As(err, &ne) && ne.Timeout(), "the gateway closed the connection: %v", err)
	}
}
