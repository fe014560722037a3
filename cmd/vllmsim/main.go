// Command vllmsim is a vLLM-compatible engine simulator: one process is one
// vLLM replica serving one model, started with vLLM's own flag names so that
// scripts written for one work with the other. See package chaos/sim.
//
//	vllmsim --port 8000 --served-model-name qwen --max-num-seqs 8 \
//	  --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}' \
//	  --profile l20-qwen27b-fp8 --speed 10 --enable-reset-endpoint
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/internal/buildinfo"
	"github.com/kvmesh/kvmesh/internal/logx"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stderr, nil); err != nil {
		if errors.Is(err, pflag.ErrHelp) || errors.Is(err, errVersion) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "vllmsim:", err)
		os.Exit(2)
	}
}

// errVersion ends run after --version printed the version.
var errVersion = errors.New("version printed")

// shutdownGrace bounds how long in-flight requests may finish after SIGTERM.
const shutdownGrace = 10 * time.Second

// run parses args, starts the server, calls ready with its address, and
// serves until ctx ends.
func run(ctx context.Context, args []string, logw io.Writer, ready func(sim.Serving)) error {
	cfg, level, err := parseFlags(args, logw)
	if err != nil {
		return err
	}
	log := slog.New(logx.Dedup(slog.NewTextHandler(logw, &slog.HandlerOptions{Level: level})))
	cfg.Logger = log
	s, err := sim.NewServing(cfg)
	if err != nil {
		return err
	}
	if err := s.Start(ctx); err != nil {
		return err
	}
	log.Info("vllmsim serving", "addr", s.Addr(), "kv_events", s.KVEventsAddr(), "kv_replay", s.KVReplayAddr())
	if ready != nil {
		ready(s)
	}
	<-ctx.Done()
	log.Info("vllmsim shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
	defer cancel()
	return s.Shutdown(sctx)
}

// parseFlags maps vLLM's flags (and the simulator's own) onto sim.Config.
// Flags are GNU style, as vLLM's and the other two commands': --name value
// or --name=value; a single dash is not a long flag. --version prints the
// version to out and returns errVersion.
func parseFlags(args []string, out io.Writer) (sim.Config, slog.Level, error) {
	cfg := sim.DefaultConfig()
	fs := pflag.NewFlagSet("vllmsim", pflag.ContinueOnError)
	fs.SetOutput(out)
	fs.SortFlags = false
	fs.Usage = func() {
		fmt.Fprintf(out, "vllmsim is a vLLM-compatible engine simulator; it takes vLLM's flag names.\n\nUsage:\n  vllmsim [MODEL] [flags]\n\nFlags:\n%s", fs.FlagUsages())
	}
	var (
		model, profile, kvJSON, kvEnc, kvForm, logLevel string
		served                                          string
		enablePrefixCaching, showVersion                bool
	)
	fs.StringVar(&cfg.Host, "host", cfg.Host, "HTTP listen host")
	fs.IntVar(&cfg.Port, "port", cfg.Port, "HTTP listen port (0 picks one)")
	fs.StringVar(&model, "model", "", "model name (vLLM's positional MODEL also works); the served name defaults to it")
	fs.StringVar(&served, "served-model-name", "", "model name served by the API (default: --model, else "+cfg.ServedModelName+")")
	fs.IntVar(&cfg.MaxModelLen, "max-model-len", cfg.MaxModelLen, "maximum prompt + output tokens")
	fs.IntVar(&cfg.MaxNumSeqs, "max-num-seqs", cfg.MaxNumSeqs, "maximum running requests per step")
	fs.IntVar(&cfg.MaxNumBatchedTokens, "max-num-batched-tokens", cfg.MaxNumBatchedTokens, "token budget per step (chunked prefill)")
	fs.IntVar(&cfg.BlockSize, "block-size", cfg.BlockSize, "tokens per KV block")
	fs.IntVar(&cfg.NumGPUBlocks, "num-gpu-blocks-override", cfg.NumGPUBlocks, "KV cache capacity in blocks")
	fs.IntVar(&cfg.KVOffloadBlocks, "kv-offload-blocks", 0, "CPU offload tier capacity in blocks (0: none): evicted blocks go there, publish medium CPU events, and load instead of recomputing")
	fs.Float64Var(&cfg.KVOffloadTokensPerSecond, "kv-offload-tokens-per-second", 50_000, "load bandwidth of the CPU offload tier, in prompt tokens per second")
	fs.IntVar(&cfg.HybridSlidingWindow, "hybrid-sliding-window", 0, "simulate a hybrid-attention model (0: off): a full-attention KV-cache group and a sliding-window group of this many tokens that evict independently and publish group_idx 0 and 1; prefix hits follow vLLM's hybrid rule")
	fs.IntVar(&cfg.HybridWindowBlocks, "hybrid-window-blocks", 0, "KV capacity of the sliding-window group in blocks (0: --num-gpu-blocks-override)")
	fs.StringVar(&kvJSON, "kv-events-config", "", `vLLM KV events config JSON: {"enable_kv_cache_events","publisher","endpoint","replay_endpoint","topic","buffer_steps","hwm"}`)
	fs.StringVar(&kvEnc, "kv-events-encoding", cfg.KVEvents.Encoding, "KV event payload form: map (vLLM v0.26), array (older), map-envelope (newest)")
	fs.StringVar(&kvForm, "kv-events-replay-form", cfg.KVEvents.ReplayForm, "replay reply form: with-topic (v0.26) or no-topic (<= v0.25)")
	fs.StringVar(&profile, "profile", cfg.Profile.Name, "step-time profile: "+strings.Join(sim.ProfileNames(), ", "))
	fs.Float64Var(&cfg.Speed, "speed", cfg.Speed, "divide every modelled duration by this factor (a host too slow to keep up shows in kvmesh_sim_driver_lag_seconds, not in model time)")
	fs.StringVar(&cfg.Tokenizer, "tokenizer", cfg.Tokenizer, "tokenizer: tiktoken (cl100k), bytes, or hf:<dir> (a model's tokenizer.json and tokenizer_config.json: prompts, chat templates and /tokenize as vLLM)")
	fs.BoolVar(&cfg.EnableResetEndpoint, "enable-reset-endpoint", false, "serve POST /reset_prefix_cache")
	fs.IntVar(&cfg.DataParallelSize, "data-parallel-size", 1, "data-parallel ranks (engines) behind this server: each its own KV pool, scheduler and KV-event publisher on the endpoint's port + rank; a request's X-data-parallel-rank header picks one, else the least loaded")
	fs.Uint64Var(&cfg.HashSeed, "hash-seed", 0, "engine block hash seed (0 = random per process, like vLLM)")
	fs.BoolVar(&enablePrefixCaching, "enable-prefix-caching", true, "accepted for vLLM compatibility; prefix caching is always on")
	fs.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error")
	fs.BoolVar(&showVersion, "version", false, "print the version and exit")
	// vLLM's "vllm serve MODEL [flags]": a leading positional model name.
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		model, args = args[0], args[1:]
	}
	if err := fs.Parse(args); err != nil {
		for _, a := range args {
			if len(a) > 2 && a[0] == '-' && a[1] != '-' {
				return cfg, 0, fmt.Errorf("%w (long flags take two dashes, as in vLLM: -%s)", err, a)
			}
		}
		return cfg, 0, err
	}
	if showVersion {
		fmt.Fprintln(out, buildinfo.String("vllmsim"))
		return cfg, 0, errVersion
	}
	if fs.NArg() > 0 {
		return cfg, 0, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	switch {
	case served != "":
		cfg.ServedModelName = served
	case model != "":
		cfg.ServedModelName = model
	}
	p, err := sim.LookupProfile(profile)
	if err != nil {
		return cfg, 0, err
	}
	cfg.Profile = p
	if kvJSON != "" {
		dec := json.NewDecoder(bytes.NewReader([]byte(kvJSON)))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&cfg.KVEvents); err != nil {
			return cfg, 0, fmt.Errorf("--kv-events-config: %w", err)
		}
	}
	cfg.KVEvents.Encoding = kvEnc
	cfg.KVEvents.ReplayForm = kvForm
	var level slog.Level
	if err := level.UnmarshalText([]byte(logLevel)); err != nil {
		return cfg, 0, fmt.Errorf("--log-level: %w", err)
	}
	return cfg, level, cfg.Validate()
}
