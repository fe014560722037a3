package node

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/sim"
)

// consecutivePorts returns a port p on 127.0.0.1 such that p..p+n-1 were free a
// moment ago (a data-parallel engine binds rank r's publisher on p+r).
func consecutivePorts(t *testing.T, n int) int {
	t.Helper()
	for range 50 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		p := ln.Addr().(*net.TCPAddr).Port
		lns := []net.Listener{ln}
		ok := p+n-1 <= 65535
		for r := 1; ok && r < n; r++ {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p+r))
			if err != nil {
				ok = false
				break
			}
			lns = append(lns, l)
		}
		for _, l := range lns {
			_ = l.Close()
		}
		if ok {
			return p
		}
	}
	t.Fatal("no free consecutive ports")
	return 0
}

func TestExpandRanks(t *testing.T) {
	rcs, err := expandRanks([]ReplicaConfig{
		{Name: "a", URL: "http://h:1"},
		{Name: "e", URL: "http://h:2", KVEndpoint: "tcp://h:5557", ReplayEndpoint: "tcp://h:5600", DataParallelSize: 3},
	})
	require.NoError(t, err)
	require.Len(t, rcs, 4)
	require.Equal(t, "a", rcs[0].Name)
	for r := range 3 {
		x := rcs[1+r]
		require.Equal(t, fmt.Sprintf("e#%d", r), x.Name)
		require.Equal(t, "http://h:2", x.URL)
		require.Equal(t, fmt.Sprintf("tcp://h:%d", 5557+r), x.KVEndpoint)
		require.Equal(t, fmt.Sprintf("tcp://h:%d", 5600+r), x.ReplayEndpoint)
		require.Equal(t, r, x.DataParallelRank)
	}
	_, err = expandRanks([]ReplicaConfig{{Name: "e", URL: "http://h:2", KVEndpoint: "ipc:///tmp/x", DataParallelSize: 2}})
	require.ErrorIs(t, err, ErrInvalidConfig)

	r, _, err := ParseReplicaSpec("e=http://h:2,kv=tcp://h:5557,dp=4")
	require.NoError(t, err)
	require.Equal(t, 4, r.DataParallelSize)
	_, _, err = ParseReplicaSpec("e=http://h:2,dp=0")
	require.ErrorIs(t, err, ErrBadReplicaSpec)
}

// TestDataParallelRanksRouteByHeader: a simulated vLLM server with two
// data-parallel ranks publishes each rank's KV events on its own port
// (real ZMQ); the gateway, given the replica once with dp=2, subscribes to
// both, keeps each rank's residency apart and sends a prompt that rank 1
// holds to rank 1 with X-data-parallel-rank, which the engine's own
// balancer (both ranks idle: rank 0) would not have chosen.
func TestDataParallelRanksRouteByHeader(t *testing.T) {
	port := consecutivePorts(t, 2)
	cfg := sim.LocalConfig()
	cfg.ServedModelName = "m"
	cfg.Logger = slog.New(slog.DiscardHandler)
	cfg.DataParallelSize = 2
	cfg.KVEvents.EnableKVCacheEvents = true
	cfg.KVEvents.Endpoint = fmt.Sprintf("tcp://*:%d", port)
	cfg.KVEvents.ReplayEndpoint = ""
	d, err := sim.NewDPServer(cfg)
	require.NoError(t, err)
	require.NoError(t, d.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = d.Shutdown(ctx)
	})
	n := startNode(t, simKeying, ReplicaConfig{Name: "e", URL: d.URL(), KVEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", port), DataParallelSize: 2})
	// The front's /metrics carries each rank's series, labelled by engine
	// as vLLM labels them, so each rank replica scrapes its own load.
	mresp, err := http.Get(d.URL() + "/metrics")
	require.NoError(t, err)
	metrics := readAll(t, mresp)
	require.Contains(t, metrics, `vllm:num_requests_running{engine="1",model_name="m"}`)
	l, err := parseRankLoad([]byte(metrics), "1")
	require.NoError(t, err)
	require.Equal(t, int64(0), l.running)
	waitSubscribed(t, n, d.Rank(0), "e#0")
	waitSubscribed(t, n, d.Rank(1), "e#1")

	// Rank 1 computes the prompt (sent to it directly): only e#1 holds it.
	prompt := "Rank document\n" + strings.Repeat("Data-parallel engines keep one KV pool per rank. ", 10)
	body := fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":2}`, prompt)
	resp, err := http.Post(d.Rank(1).URL()+"/v1/completions", "application/json", strings.NewReader(body))
	require.NoError(t, err)
	readAll(t, resp)
	blocks := len(prompt) / 16
	require.Eventually(t, func() bool {
		rep := debugRoute(t, n, "prefix-cache", prompt)
		return matchedOf(rep, "e#1") == blocks && matchedOf(rep, "e#0") == 0
	}, 10*time.Second, 10*time.Millisecond)

	// Requests each rank's engine finished (the gateway's probes, such as
	// /tokenize, also pass the front, so its routing counts are not used).
	finished := func(r int) uint64 {
		var n uint64
		for _, v := range d.Rank(r).Stats().Finished {
			n += v
		}
		return n
	}
	before0, before1 := finished(0), finished(1)
	for range 3 {
		resp := post(t, n, "/v1/completions", body, map[string]string{HeaderStrategy: "prefix-cache"})
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, "e#1", resp.Header.Get(HeaderReplica))
		readAll(t, resp)
	}
	require.Equal(t, before1+3, finished(1), "the front sent the requests to rank 1")
	require.Equal(t, before0, finished(0))
	// Without the header the engine's own balancer picks rank 0 once both
	// ranks are idle (a finished stream leaves its engine at a step end).
	require.Eventually(t, func() bool {
		a, b := d.Rank(0).Stats(), d.Rank(1).Stats()
		return a.Running+a.Waiting+b.Running+b.Waiting == 0
	}, 10*time.Second, 5*time.Millisecond)
	resp, err = http.Post(d.URL()+"/v1/completions", "application/json", strings.NewReader(body))
	require.NoError(t, err)
	readAll(t, resp)
	require.Equal(t, before0+1, finished(0))
}

// TestParseRankLoad: a rank replica reads its own engine core's series
// (vLLM's engine label), and the whole engine's when none is labelled.
func TestParseRankLoad(t *testing.T) {
	text := `# HELP vllm:num_requests_running x
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:num_requests_running{engine="1",model_name="m"} 5
vllm:num_requests_waiting{engine="0",model_name="m"} 1
vllm:num_requests_waiting{engine="1",model_name="m"} 0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.9
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.2
vllm:num_requests_running{engine="10",model_name="m"} 7
`
	l, err := parseRankLoad([]byte(text), "1")
	require.NoError(t, err)
	require.Equal(t, engineLoad{running: 5, waiting: 0, kvUsage: 0.2}, l)
	l, err = parseRankLoad([]byte(text), "0")
	require.NoError(t, err)
	require.Equal(t, engineLoad{running: 3, waiting: 1, kvUsage: 0.9}, l)
	l, err = parseRankLoad([]byte("vllm:num_requests_running{model_name=\"m\"} 4\n"), "1")
	require.NoError(t, err)
	require.Equal(t, int64(4), l.running)
}
