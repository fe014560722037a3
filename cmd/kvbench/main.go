// Command kvbench is the routing study harness: it runs the seed study's
// scenarios against in-process simulated vLLM replicas and kvmesh gateways
// and writes results.json, requests.jsonl, phases.json, report.md and
// report.html. `kvbench recompute requests.jsonl` recomputes the tables
// offline.
//
// The default grid (4 scenarios × 4 strategies × history and hybrid modes ×
// 2 rounds, 96 arrivals per phase at 1.6 RPS, speed 10) takes about 12.5
// minutes on two cores; --quick runs a reduced grid in well under a minute.
//
// The calibration grid against the seed's published table (history mode,
// the seed's 1,568-token attention blocks, a lower speed for fidelity on a
// shared host):
//
//	kvbench --modes history --engine-block-size 1568 --speed 5
//
// Every cell starts with a host check and every phase records how late its
// arrivals went out; both are reported, because a live engine at speed S
// turns each millisecond of host scheduling delay into S model
// milliseconds.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/chaos/study/live"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRootCmd(os.Stdout, os.Stderr).ExecuteContext(ctx)
	stop()
	if err != nil {
		os.Exit(1)
	}
}

// options are the flags that are not study.Config fields.
type options struct {
	quick    bool
	out      string
	logLevel string
	timeout  time.Duration
}

func newRootCmd(stdout, stderr io.Writer) *cobra.Command {
	cfg := study.DefaultConfig()
	var opt options
	root := &cobra.Command{
		Use:   "kvbench",
		Short: "Measure routing strategies and index modes side by side (the seed study, reproduced)",
		Long: `kvbench runs the seed study's scenarios (cold, warm, hot50, hot90, multiturn)
against in-process simulated vLLM replicas and kvmesh gateways on loopback, for
every strategy, index mode, gateway count and round, and writes results.json,
requests.jsonl, phases.json, report.md and report.html into --out.

All reported times are model time (wall time × --speed).`,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := resolve(cmd, cfg, opt)
			if err != nil {
				return err
			}
			return runStudy(cmd.Context(), c, opt, stdout, stderr)
		},
	}
	f := root.Flags()
	f.StringSliceVar(&cfg.Scenarios, "scenarios", cfg.Scenarios, "scenarios: cold, warm, hot50, hot90, multiturn")
	f.StringSliceVar(&cfg.Strategies, "strategies", cfg.Strategies, "strategies in round-1 order (even rounds reverse): random, least-request, prefix-cache, consistent-hash, cost")
	f.StringSliceVar(&cfg.Modes, "modes", cfg.Modes, "gateway index modes: history, kv-events, hybrid")
	f.IntSliceVar(&cfg.Gateways, "gateways", cfg.Gateways, "gateway counts; arrivals round-robin over gateways (>1: isolated gateways, no shared index yet)")
	f.IntVar(&cfg.Rounds, "rounds", cfg.Rounds, "rounds; even rounds run the strategies in reverse order")
	f.IntVar(&cfg.Replicas, "replicas", cfg.Replicas, "simulated engine replicas")
	f.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed for salts and arrival sequences (round r uses seed+r-1)")
	f.Float64Var(&cfg.Speed, "speed", cfg.Speed, "simulator time compression; reported times are model time")
	f.StringVar(&cfg.Profile, "profile", cfg.Profile, "simulator profile: l20-qwen27b-fp8 or fast")
	f.Float64Var(&cfg.RPS, "rps", cfg.RPS, "fixed arrival rate per phase (model time)")
	f.IntVar(&cfg.Arrivals, "arrivals", cfg.Arrivals, "scheduled arrivals per phase")
	f.IntVar(&cfg.InflightCap, "inflight-cap", cfg.InflightCap, "client in-flight cap; arrivals beyond it are unsent and fail")
	f.IntVar(&cfg.MaxTokens, "max-tokens", cfg.MaxTokens, "completion tokens per measured request")
	f.IntVar(&cfg.Turns, "turns", cfg.Turns, "turns per multiturn session")
	f.BoolVar(&opt.quick, "quick", false, "reduced grid (warm and hot50; least-request, prefix-cache, cost; history; 1 round; 48 arrivals; speed 10): about a minute")
	f.StringVar(&opt.out, "out", "kvbench-out", "output directory")
	f.StringVar(&opt.logLevel, "log-level", "warn", "log level of simulators and gateways (debug, info, warn, error)")
	f.IntVar(&cfg.EngineBlockSize, "engine-block-size", cfg.EngineBlockSize, "simulated engines' KV block size in tokens (1568 = the seed's hybrid-model granularity; history mode only)")
	f.DurationVar(&opt.timeout, "timeout", 0, "stop the study after this wall time (0: no limit)")
	root.AddCommand(newRecomputeCmd(stdout), newReportCmd(stdout))
	return root
}

// resolve applies --quick under the explicitly set flags.
func resolve(cmd *cobra.Command, flagged study.Config, opt options) (study.Config, error) {
	c := flagged
	if opt.quick {
		c = study.QuickConfig()
		f := cmd.Flags()
		set := func(name string, apply func()) {
			if f.Changed(name) {
				apply()
			}
		}
		set("scenarios", func() { c.Scenarios = flagged.Scenarios })
		set("strategies", func() { c.Strategies = flagged.Strategies })
		set("modes", func() { c.Modes = flagged.Modes })
		set("gateways", func() { c.Gateways = flagged.Gateways })
		set("rounds", func() { c.Rounds = flagged.Rounds })
		set("replicas", func() { c.Replicas = flagged.Replicas })
		set("seed", func() { c.Seed = flagged.Seed })
		set("speed", func() { c.Speed = flagged.Speed })
		set("profile", func() { c.Profile = flagged.Profile })
		set("rps", func() { c.RPS = flagged.RPS })
		set("arrivals", func() { c.Arrivals = flagged.Arrivals })
		set("inflight-cap", func() { c.InflightCap = flagged.InflightCap })
		set("max-tokens", func() { c.MaxTokens = flagged.MaxTokens })
		set("turns", func() { c.Turns = flagged.Turns })
		set("engine-block-size", func() { c.EngineBlockSize = flagged.EngineBlockSize })
	}
	c.Engine = "live"
	for _, g := range c.Gateways {
		if g > 1 {
			c.GatewaysIsolated = true
		}
	}
	return c, c.Validate()
}

func logger(level string, w io.Writer) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("kvbench: --log-level: %w", err)
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: l})), nil
}

func runStudy(ctx context.Context, cfg study.Config, opt options, stdout, stderr io.Writer) error {
	log, err := logger(opt.logLevel, stderr)
	if err != nil {
		return err
	}
	if opt.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, opt.timeout)
		defer cancel()
	}
	lc := live.DefaultConfig()
	lc.Profile = cfg.Profile
	lc.Speed = cfg.Speed
	lc.EngineBlockSize = cfg.EngineBlockSize
	lc.Logger = log
	phases := 0
	for _, s := range cfg.Scenarios {
		_ = s
		phases += len(cfg.Strategies)
	}
	phases *= cfg.Rounds * len(cfg.Modes) * len(cfg.Gateways)
	fmt.Fprintf(stderr, "kvbench: %d phases (%s × %s × modes %s × gateways %v × %d rounds), profile %s, speed %g, out %s\n",
		phases, strings.Join(cfg.Scenarios, ","), strings.Join(cfg.Strategies, ","), strings.Join(cfg.Modes, ","),
		cfg.Gateways, cfg.Rounds, cfg.Profile, cfg.Speed, opt.out)
	start := time.Now()
	rn := &study.Runner{Config: cfg, Factory: live.Factory(lc), Progress: study.NewProgress(stderr), Logger: log}
	res, runErr := rn.Run(ctx)
	if res == nil {
		return reportErr(stderr, runErr)
	}
	if err := study.WriteFiles(opt.out, res); err != nil {
		return reportErr(stderr, errors.Join(runErr, err))
	}
	fmt.Fprintln(stdout)
	study.WriteTables(stdout, res)
	fmt.Fprintf(stderr, "kvbench: %d runs in %s; wrote %s\n", len(res.Runs), time.Since(start).Round(time.Second),
		strings.Join([]string{
			filepath.Join(opt.out, study.FileResults), study.FileRequests, study.FilePhases, study.FileReport, study.FileHTML,
		}, ", "))
	return reportErr(stderr, runErr)
}

func reportErr(w io.Writer, err error) error {
	if err != nil {
		fmt.Fprintf(w, "kvbench: %v\n", err)
	}
	return err
}

func newRecomputeCmd(stdout io.Writer) *cobra.Command {
	var resultsPath string
	cmd := &cobra.Command{
		Use:   "recompute requests.jsonl",
		Short: "Recompute the tables offline from requests.jsonl",
		Long: `recompute reads requests.jsonl and recomputes every phase's arrivals, successes,
SLO passes, P95s and per-replica counts from the per-request records alone. Token
hit rate, selection counts and max waiting come from engine and gateway counters,
which are not per-request: they are taken from results.json next to the file
(or --results) when present. Any field where results.json disagrees with the
recomputation is listed, and the command fails.`,
		Args:          cobra.ExactArgs(1),
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			f, err := os.Open(args[0])
			if err != nil {
				return err
			}
			defer func() { _ = f.Close() }()
			recs, err := study.ReadRequests(f)
			if err != nil {
				return err
			}
			if resultsPath == "" {
				resultsPath = filepath.Join(filepath.Dir(args[0]), study.FileResults)
			}
			var prev *study.Results
			slo := study.DefaultSLO()
			if rf, err := os.Open(resultsPath); err == nil {
				prev, err = study.ReadResults(rf)
				_ = rf.Close()
				if err != nil {
					return err
				}
				slo = prev.Config.SLO
			}
			res, diffs := study.Recompute(recs, slo, prev)
			study.WriteTables(stdout, res)
			if prev == nil {
				fmt.Fprintf(stdout, "(no %s: token hit rate, selection and max waiting not available)\n", resultsPath)
				return nil
			}
			if len(diffs) > 0 {
				for _, d := range diffs {
					fmt.Fprintln(stdout, "DIFF", d)
				}
				return fmt.Errorf("kvbench: %d differences between %s and the recomputation", len(diffs), resultsPath)
			}
			fmt.Fprintf(stdout, "recompute: %d requests, %d phases: every field matches %s\n", len(recs), len(res.Runs), resultsPath)
			return nil
		},
	}
	cmd.Flags().StringVar(&resultsPath, "results", "", "results.json to take counter-based fields from (default: next to requests.jsonl)")
	return cmd
}

func newReportCmd(stdout io.Writer) *cobra.Command {
	return &cobra.Command{
		Use:           "report DIR",
		Short:         "Re-render report.md and report.html (and print the tables) from a kvbench output directory",
		Args:          cobra.ExactArgs(1),
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(_ *cobra.Command, args []string) error {
			res, err := study.ReadDir(args[0])
			if err != nil {
				return err
			}
			if err := study.WriteReports(args[0], res); err != nil {
				return err
			}
			study.WriteTables(stdout, res)
			return nil
		},
	}
}
