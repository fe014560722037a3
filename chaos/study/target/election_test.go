package target

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPatchWaitsOutAnElection: a config write refused for want of a raft
// leader (HTTP 503, as a gateway answers during an election) is sent again
// until it lands; any other refusal is returned at once. The admin
// endpoint here is a stand-in that only answers PATCH (an election cannot
// be timed in a real cluster); TestProbeAndModeSwitch covers the real API.
func TestPatchWaitsOutAnElection(t *testing.T) {
	var calls, status atomic.Int32
	status.Store(http.StatusServiceUnavailable)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		assert.Equal(t, http.MethodPatch, r.Method)
		assert.Equal(t, "/admin/v1/config", r.URL.Path)
		if calls.Add(1) <= 2 {
			w.WriteHeader(int(status.Load()))
			_, _ = w.Write([]byte(`{"error":"no_quorum"}`))
			return
		}
		_, _ = w.Write([]byte(`{"version":7}`))
	}))
	t.Cleanup(srv.Close)
	cfg := DefaultConfig()
	cfg.Gateways = []string{srv.URL}
	cfg.Poll = 5 * time.Millisecond
	d := &Deployment{cfg: cfg, hc: srv.Client()}
	ctx := context.Background()

	v, err := d.patchThroughElection(ctx, 0, []byte(`{"index_mode":"hybrid"}`))
	require.NoError(t, err)
	require.Equal(t, uint64(7), v)
	require.Equal(t, int32(3), calls.Load(), "two refusals, then the write")

	calls.Store(0)
	status.Store(http.StatusBadRequest)
	_, err = d.patchThroughElection(ctx, 0, []byte(`{"index_mode":"nope"}`))
	require.Error(t, err)
	require.False(t, errors.Is(err, errNoLeader))
	require.Equal(t, int32(1), calls.Load(), "a bad request is not sent again")

	// No leader for longer than the caller waits: the wait ends with the
	// caller's deadline, with the last refusal or, if the deadline cut an
	// attempt short, with that (a busy machine decides which).
	calls.Store(-1 << 20)
	status.Store(http.StatusServiceUnavailable)
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_, err = d.patchThroughElection(short, 0, []byte(`{"index_mode":"hybrid"}`))
	require.True(t, errors.Is(err, errNoLeader) || errors.Is(err, context.DeadlineExceeded), "%v", err)
	require.Greater(t, calls.Load(), int32(-1<<20), "the write was tried")
}
