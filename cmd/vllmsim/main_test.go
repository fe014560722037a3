package main

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/chaos/sim"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

func TestParseFlagsVLLMNames(t *testing.T) {
	cfg, _, err := parseFlags([]string{
		"Qwen/Qwen3-8B", "--host", "127.0.0.1", "--port=0", "--max-model-len", "8192",
		"--max-num-seqs", "4", "--max-num-batched-tokens", "2048", "--block-size", "32",
		"--num-gpu-blocks-override", "500", "--profile", "fast", "--speed", "10",
		"--tokenizer", "bytes", "--enable-reset-endpoint",
		"--kv-events-config", `{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"t","buffer_steps":100,"hwm":10}`,
		"--kv-events-encoding", "array", "--kv-events-replay-form", "no-topic",
	}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, "Qwen/Qwen3-8B", cfg.ServedModelName)
	require.Equal(t, "127.0.0.1", cfg.Host)
	require.Equal(t, 0, cfg.Port)
	require.Equal(t, 8192, cfg.MaxModelLen)
	require.Equal(t, 4, cfg.MaxNumSeqs)
	require.Equal(t, 2048, cfg.MaxNumBatchedTokens)
	require.Equal(t, 32, cfg.BlockSize)
	require.Equal(t, 500, cfg.NumGPUBlocks)
	require.Equal(t, sim.ProfileFast, cfg.Profile)
	require.Equal(t, 10.0, cfg.Speed)
	require.True(t, cfg.EnableResetEndpoint)
	require.Equal(t, sim.KVEventsConfig{
		EnableKVCacheEvents: true, Publisher: "zmq", Endpoint: "tcp://*:5557", ReplayEndpoint: "tcp://*:5558",
		Topic: "t", BufferSteps: 100, HWM: 10, Encoding: "array", ReplayForm: "no-topic",
	}, cfg.KVEvents)

	_, _, err = parseFlags([]string{"--served-model-name", "m", "--kv-events-config", `{"enable_kv_cache_event":true}`}, io.Discard)
	require.Error(t, err, "unknown kv-events-config field")
	cfg, _, err = parseFlags([]string{"--kv-events-config", `{"enable_kv_cache_events":true,"publisher":"null","max_queue_size":5}`}, io.Discard)
	require.NoError(t, err, "vLLM's null publisher and max_queue_size are accepted")
	require.Equal(t, "null", cfg.KVEvents.Publisher)
	_, _, err = parseFlags([]string{"--kv-events-config", `{"enable_kv_cache_events":true,"publisher":"kafka"}`}, io.Discard)
	require.ErrorIs(t, err, sim.ErrInvalidConfig)
	_, _, err = parseFlags([]string{"--profile", "h100"}, io.Discard)
	require.ErrorIs(t, err, sim.ErrUnknownProfile)
	_, _, err = parseFlags([]string{"--speed", "0"}, io.Discard)
	require.ErrorIs(t, err, sim.ErrInvalidConfig)
	_, _, err = parseFlags([]string{"--kv-events-encoding", "json", "--kv-events-config", `{"enable_kv_cache_events":true}`}, io.Discard)
	require.ErrorIs(t, err, sim.ErrInvalidConfig)
	cfg, _, err = parseFlags([]string{"--hybrid-sliding-window", "4096", "--hybrid-window-blocks", "300"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, 4096, cfg.HybridSlidingWindow)
	require.Equal(t, 300, cfg.HybridWindowBlocks)
	_, _, err = parseFlags([]string{"--hybrid-sliding-window", "1"}, io.Discard)
	require.ErrorIs(t, err, sim.ErrInvalidConfig)
	_, _, err = parseFlags([]string{"--hybrid-sliding-window", "4096", "--kv-offload-blocks", "10"}, io.Discard)
	require.ErrorIs(t, err, sim.ErrInvalidConfig, "the window group with an offload tier is not modelled")
}

func TestRunServesAndStopsOnCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ready := make(chan sim.Serving, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--host", "127.0.0.1", "--port", "0", "--profile", "fast", "--tokenizer", "bytes",
			"--served-model-name", "m",
			"--kv-events-config", `{"enable_kv_cache_events":true,"endpoint":"tcp://*:0","replay_endpoint":"tcp://127.0.0.1:0"}`},
			io.Discard, func(s sim.Serving) { ready <- s })
	}()
	var s sim.Serving
	select {
	case s = <-ready:
	case err := <-done:
		t.Fatalf("run exited: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("server did not start")
	}
	require.NotEmpty(t, s.KVEventsAddr())
	resp, err := http.Post(s.URL()+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hello","max_tokens":2}`))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(15 * time.Second):
		t.Fatal("run did not stop")
	}
}

// TestParseFlagsGNUStyle: long flags take two dashes, as in vLLM; a single
// dash is an error that says so, and --version answers without serving.
func TestParseFlagsGNUStyle(t *testing.T) {
	_, _, err := parseFlags([]string{"-port", "8001"}, io.Discard)
	require.Error(t, err)
	require.Contains(t, err.Error(), "two dashes")
	var out strings.Builder
	_, _, err = parseFlags([]string{"--version"}, &out)
	require.ErrorIs(t, err, errVersion)
	require.True(t, strings.HasPrefix(out.String(), "vllmsim "), out.String())
	cfg, _, err := parseFlags([]string{"--port=8001", "--served-model-name=M"}, io.Discard)
	require.NoError(t, err)
	require.Equal(t, 8001, cfg.Port)
	require.Equal(t, "M", cfg.ServedModelName)
}
