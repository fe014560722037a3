package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"
)

// benchEngine is proxybench's trivial engine: every POST to
// /v1/completions or /v1/chat/completions answers the same SSE stream
// (benchStream) in chunks paced gap apart, the first one at once. It also
// answers /health and a minimal vLLM /metrics so that a gateway's health
// checks and scrapes find a healthy replica.
type benchEngine struct {
	chunks  [][]byte
	gap     time.Duration
	running atomic.Int64
}

// benchStream is the exact byte stream of one answer, split into the
// chunks the engine sends: tokens content events (one per chunk), then
// one chunk with the usage event and [DONE].
func benchStream(tokens int) [][]byte {
	out := make([][]byte, 0, tokens+1)
	for i := 0; i < tokens; i++ {
		out = append(out, fmt.Appendf(nil, "data: {\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":1,\"model\":\"M\",\"choices\":[{\"index\":0,\"text\":\" tok%d\",\"logprobs\":null,\"finish_reason\":null}]}\n\n", i))
	}
	out = append(out, fmt.Appendf(nil, "data: {\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":1,\"model\":\"M\",\"choices\":[],\"usage\":{\"prompt_tokens\":512,\"total_tokens\":%d,\"completion_tokens\":%d}}\n\ndata: [DONE]\n\n", 512+tokens, tokens))
	return out
}

func (e *benchEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/health":
		w.WriteHeader(http.StatusOK)
		return
	case "/metrics":
		fmt.Fprintf(w, "vllm:num_requests_running{model_name=\"M\"} %d\nvllm:num_requests_waiting{model_name=\"M\"} 0\nvllm:kv_cache_usage_perc{model_name=\"M\"} 0.1\n", e.running.Load())
		return
	case "/v1/completions", "/v1/chat/completions":
	default:
		http.NotFound(w, r)
		return
	}
	_, _ = io.Copy(io.Discard, r.Body)
	e.running.Add(1)
	defer e.running.Add(-1)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	rc := http.NewResponseController(w)
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for i, c := range e.chunks {
		if i > 0 {
			// Pacing the stream like an engine's decode steps.
			t.Reset(e.gap)
			select {
			case <-t.C:
			case <-r.Context().Done():
				return
			}
		}
		if _, err := w.Write(c); err != nil {
			return
		}
		if rc.Flush() != nil {
			return
		}
	}
}

// newProxybenchEngineCmd is the hidden subcommand proxybench starts its
// engines with (a separate process each); it prints "listening ADDR" once
// it serves and stops when its stdin closes (its parent went away).
func newProxybenchEngineCmd() *cobra.Command {
	var (
		addr   string
		tokens int
		gap    time.Duration
	)
	cmd := &cobra.Command{
		Use:    "proxybench-engine",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return serveChild(cmd, addr, &benchEngine{chunks: benchStream(tokens), gap: gap})
		},
	}
	f := cmd.Flags()
	f.StringVar(&addr, "addr", "127.0.0.1:0", "listen address (loopback)")
	f.IntVar(&tokens, "tokens", 8, "content events per answer")
	f.DurationVar(&gap, "gap", 20*time.Millisecond, "pause between chunks")
	return cmd
}

// serveChild serves h on addr for a hidden proxybench subcommand: it
// prints "listening ADDR" (what startChild waits for) and serves until
// its stdin closes (startChild's proc.stop) or the command's context ends.
func serveChild(cmd *cobra.Command, addr string, h http.Handler) error {
	ln, ctx, cancel, err := listenChild(cmd, addr)
	if err != nil {
		return err
	}
	defer cancel()
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	if err := srv.Serve(ln); err != http.ErrServerClosed {
		return err
	}
	return nil
}

// listenChild listens on addr for a hidden proxybench subcommand, prints
// "listening ADDR" (what startChild waits for) and returns a context that
// ends when the command's stdin closes (startChild's proc.stop) or its
// own context ends.
func listenChild(cmd *cobra.Command, addr string) (net.Listener, context.Context, context.CancelFunc, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, nil, nil, err
	}
	fmt.Fprintf(cmd.OutOrStdout(), "listening %s\n", ln.Addr())
	ctx, cancel := context.WithCancel(cmd.Context())
	go func() {
		_, _ = io.Copy(io.Discard, cmd.InOrStdin())
		cancel()
	}()
	return ln, ctx, cancel, nil
}
