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
//
// --target runs the study against a running deployment instead (package
// chaos/study/target; README "Against a running deployment"):
//
//	kvbench --target http://gw1:8080 --target http://gw2:8080 --engines r1=http://e1:8000,r2=http://e2:8000
//
// Several gateways (--gateways 3) form one cluster sharing the index and
// load reports (node's cluster mode: gossip, embedded NATS, raft, all on
// loopback); --no-sync runs them isolated instead, and --sync
// synced,isolated runs both side by side (issue 6's figure):
//
//	kvbench --gateways 1,3 --sync synced,isolated --modes hybrid,history
//
// --engine des runs the same study on the discrete-event engine (package
// chaos/des) in virtual time, with the propagation delays as flags;
// `kvbench sweep` runs it over replica, gateway and rate settings:
//
//	kvbench --engine des --replicas 64 --gateways 8 --arrivals 100000
//	kvbench sweep --replicas 8,64 --gateways 1,8 --rps 1.6,12.8
//
// Under --engine des the default grid is des.DefaultGrid, not the live
// engine's 64-phase seed grid: the hot50 scenario with least-request,
// prefix-cache and cost, history mode, one round, synced and isolated
// gateways side by side (for gateway counts above 1), at the seed's load
// per replica (0.8 RPS and an in-flight cap of 24 per replica). The first
// command above therefore runs 6 phases of 100,000 scheduled arrivals
// each (--arrivals keeps its meaning: arrivals per phase), at 51.2 RPS
// with a cap of 1,536, on 64 replicas behind 8 gateways, synced and
// isolated: 600,000 arrivals. Every axis flag given explicitly (--scenarios,
// --strategies, --modes, --rounds, --sync/--no-sync, --rps, --inflight-cap)
// replaces its default; --quick replaces the whole default grid. The cells
// (mode × gateways × sync) share nothing and run in parallel on GOMAXPROCS
// workers (--parallel); results are assembled in cell order, so
// results.json does not depend on the number of workers, and the same
// --seed gives byte-identical results.json. The run ends with the number
// of simulated arrivals per second of wall time; --cpuprofile writes a CPU
// profile.
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
	"runtime"
	"runtime/pprof"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvmesh/kvmesh/chaos/des"
	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/chaos/study/live"
	"github.com/kvmesh/kvmesh/internal/buildinfo"
)

// Engines accepted by --engine.
const (
	engineLive = "live"
	engineDES  = "des"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := execute(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// execute runs kvbench with args and returns its exit status. The
// commands silence cobra's own error printing (it would print usage with
// every failed run), so every error is printed here, once: a mistyped
// flag or an invalid setting used to end the command with status 1 and
// no word of why.
func execute(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	root := newRootCmd(stdout, stderr)
	root.SetArgs(args)
	root.SetOut(stdout) // help and usage
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	if err == nil {
		return 0
	}
	if !errors.As(err, new(reportedError)) {
		fmt.Fprintf(stderr, "kvbench: %v\n", err)
	}
	return 1
}

// options are the flags that are not study.Config fields.
type options struct {
	quick    bool
	out      string
	logLevel string
	timeout  time.Duration
	engine   string
	noSync   bool
	// parallel is how many cells run at once (0: GOMAXPROCS under des,
	// 1 live).
	parallel int
	// cpuProfile, if set, receives a CPU profile of the run.
	cpuProfile string
	// des are the discrete-event engine's options (--engine des, sweep).
	des des.Options
	// tgt are the options of a run against a deployment (--target).
	tgt targetOptions
	// workload is a workload file (--workload) replacing the seed's
	// scenarios; workloadSalt prefixes its prompts with a per-phase salt.
	workload     string
	workloadSalt bool
	// tokenizer and promptTokens size the seed's prompts in an engine's
	// tokens (--tokenizer, --prompt-tokens).
	tokenizer    string
	promptTokens int
}

// desFlags are the flags that only the discrete-event engine reads.
var desFlags = []string{"sync-delay", "load-delay", "kv-delay"}

// addStudyFlags registers the study's flags on f; the sweep subcommand
// leaves out the axes it sweeps (replicas, gateways, rps).
func addStudyFlags(f *pflag.FlagSet, cfg *study.Config, opt *options, sweep bool) {
	f.StringSliceVar(&cfg.Scenarios, "scenarios", cfg.Scenarios, "scenarios: cold, warm, hot50, hot90, multiturn (--engine des default: hot50)")
	f.StringSliceVar(&cfg.Strategies, "strategies", cfg.Strategies, "strategies in round-1 order (even rounds reverse): random, least-request, prefix-cache, consistent-hash, cost (--engine des default: least-request,prefix-cache,cost)")
	f.StringSliceVar(&cfg.Modes, "modes", cfg.Modes, "gateway index modes: history, kv-events, hybrid (--engine des default: history)")
	if !sweep {
		f.IntSliceVar(&cfg.Gateways, "gateways", cfg.Gateways, "gateway counts; arrivals round-robin over gateways; more than one form a cluster sharing the index (see --sync, --no-sync)")
		f.StringSliceVar(&cfg.Sync, "sync", nil, "for gateway counts > 1: synced (one cluster, shared index and load), isolated (no sharing), or both (default synced; --engine des: both)")
		f.IntVar(&cfg.Replicas, "replicas", cfg.Replicas, "simulated engine replicas")
		f.Float64Var(&cfg.RPS, "rps", cfg.RPS, "fixed arrival rate per phase (model time; --engine des default: 0.8 × --replicas, the seed's load per replica)")
	}
	f.BoolVar(&opt.noSync, "no-sync", false, "isolated gateways: several gateways share no index and no load (same as --sync isolated)")
	f.IntVar(&cfg.Rounds, "rounds", cfg.Rounds, "rounds; even rounds run the strategies in reverse order (--engine des default: 1)")
	f.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed for salts and arrival sequences (round r uses seed+r-1); also seeds the DES engine")
	f.Float64Var(&cfg.Speed, "speed", cfg.Speed, "simulator time compression (live engine); reported times are model time")
	f.StringVar(&cfg.Profile, "profile", cfg.Profile, "simulator profile: l20-qwen27b-fp8 or fast")
	f.IntVar(&cfg.Arrivals, "arrivals", cfg.Arrivals, "scheduled arrivals per phase")
	f.IntVar(&cfg.InflightCap, "inflight-cap", cfg.InflightCap, "client in-flight cap; arrivals beyond it are unsent and fail (--engine des default: 24 × --replicas)")
	f.IntVar(&cfg.MaxTokens, "max-tokens", cfg.MaxTokens, "completion tokens per measured request")
	f.IntVar(&cfg.Turns, "turns", cfg.Turns, "turns per multiturn session")
	f.BoolVar(&opt.quick, "quick", false, "reduced grid (warm and hot50; least-request, prefix-cache, cost; history; 1 round; 48 arrivals; speed 10): about a minute")
	f.StringVar(&opt.out, "out", "kvbench-out", "output directory")
	f.StringVar(&opt.logLevel, "log-level", "warn", "log level of simulators and gateways (debug, info, warn, error)")
	f.IntVar(&cfg.EngineBlockSize, "engine-block-size", cfg.EngineBlockSize, "simulated engines' KV block size in tokens (1568 = the seed's hybrid-model granularity: history mode only on the live engine; --engine des indexes it at 784-token blocks)")
	f.StringVar(&opt.workload, "workload", "", "JSONL file of your own prompts and multi-turn sessions (optional at_ms arrival schedule; docs/workload.md): replaces the seed's scenarios and documents, one phase per strategy, mode, cell and round")
	f.BoolVar(&opt.workloadSalt, "workload-salt", true, "with --workload: prefix every prompt with a per-phase salt line, so phases share no prefix in the engines' caches or the gateways' indexes (false: prompts go exactly as written)")
	f.DurationVar(&opt.timeout, "timeout", 0, "stop the study after this wall time (0: no limit)")
	f.IntVar(&opt.parallel, "parallel", 0, "cells (mode × gateways × sync) run at once, each on its own engine; results do not depend on it (0: GOMAXPROCS with --engine des; the live engine runs one cell at a time)")
	f.StringVar(&opt.cpuProfile, "cpuprofile", "", "write a CPU profile of the run to this file (go tool pprof)")
	f.DurationVar(&opt.des.SyncDelay, "sync-delay", opt.des.SyncDelay, "DES: how long a routing decision takes to reach the peer gateways' indexes")
	f.DurationVar(&opt.des.LoadDelay, "load-delay", opt.des.LoadDelay, "DES: how stale a gateway's view of its peers' in-flight counts is")
	f.DurationVar(&opt.des.KVDelay, "kv-delay", opt.des.KVDelay, "DES: how long an engine's KV events take to reach the gateways")
	addEngineProfileFlags(f, opt)
}

func newRootCmd(stdout, stderr io.Writer) *cobra.Command {
	cfg := study.DefaultConfig()
	opt := options{des: des.DefaultOptions()}
	root := &cobra.Command{
		Use:   "kvbench",
		Short: "Measure routing strategies and index modes side by side (the seed study, reproduced)",
		Long: `kvbench runs the seed study's scenarios (cold, warm, hot50, hot90, multiturn)
against in-process simulated vLLM replicas and kvmesh gateways on loopback, for
every strategy, index mode, gateway count and round, and writes results.json,
requests.jsonl, phases.json, report.md and report.html into --out.

Several gateways form one cluster sharing the index (--sync synced, the
default) or run isolated (--no-sync, or --sync synced,isolated for both).
Initialisation goes through gateway 0; synced peers are waited for until
their indexes agree before the first arrival.

All reported times are model time (wall time × --speed). --engine des runs
the study on the discrete-event engine in virtual time instead, with its own
default grid sized for scale (hot50; least-request, prefix-cache, cost;
history; 1 round; synced and isolated gateways; 0.8 RPS and 24 in flight per
replica): any axis flag given explicitly replaces its default, --quick the
whole grid. Its cells run in parallel (--parallel); results do not depend on
it.

--target URL (repeatable) runs the same study against gateways you started
(--engines name=URL,... for their engines' metrics and cache resets; index
modes switched through the admin API, token from $KVMESH_ADMIN_TOKEN, and
verified on every gateway); --engines alone runs kvbench's own client-side
random and round-robin baselines straight at the engines. --plan prints the
phases, the expected duration and what will be reset, and sends nothing.`,
		Version:       buildinfo.String("kvbench"),
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, o, err := resolve(cmd, cfg, opt, true)
			if err != nil {
				return err
			}
			opt.des = o
			if err := checkSizingFlags(cmd.Flags(), opt); err != nil {
				return err
			}
			if opt.tgt.on() {
				return runTarget(cmd.Context(), cmd.Flags(), c, opt, stdout, stderr)
			}
			if c, err = sizePrompts(cmd.Context(), c, opt, "", "", stderr); err != nil {
				return reportErr(stderr, err)
			}
			if opt.tgt.plan {
				writePlan(stdout, c, nil)
				return nil
			}
			return runStudy(cmd.Context(), c, opt, stdout, stderr)
		},
	}
	root.SetVersionTemplate("{{.Version}}\n")
	f := root.Flags()
	addStudyFlags(f, &cfg, &opt, false)
	addTargetFlags(f, &opt.tgt)
	f.StringVar(&opt.tokenizer, "tokenizer", "", "size the seed's prompts in the engine's own tokens: hf:<dir> (the model's tokenizer.json), tiktoken, bytes, or engine (POST /tokenize on the first engine of --target/--engines); the body's sentence count is chosen so a prompt is --prompt-tokens long (in process this only resizes the prompts: the simulators keep counting with tiktoken)")
	f.IntVar(&opt.promptTokens, "prompt-tokens", study.SeedPromptTokens, "with --tokenizer: a seed prompt's length in the engine's tokens (default: the seed's prompt in its Qwen3 tokens)")
	f.StringVar(&opt.engine, "engine", engineLive, "engine: live (simulators and gateways on loopback) or des (discrete-event, virtual time)")
	root.AddCommand(newRecomputeCmd(stdout), newReportCmd(stdout), newSweepCmd(stdout, stderr),
		newProxybenchCmd(stdout, stderr), newProxybenchEngineCmd(), newProxybenchGoFloorCmd(), newProxybenchRawFloorCmd())
	return root
}

// overlay copies the named flag's value from flagged into c.
var overlay = map[string]func(c *study.Config, flagged study.Config){
	"scenarios":         func(c *study.Config, f study.Config) { c.Scenarios = f.Scenarios },
	"strategies":        func(c *study.Config, f study.Config) { c.Strategies = f.Strategies },
	"modes":             func(c *study.Config, f study.Config) { c.Modes = f.Modes },
	"gateways":          func(c *study.Config, f study.Config) { c.Gateways = f.Gateways },
	"sync":              func(c *study.Config, f study.Config) { c.Sync = f.Sync },
	"rounds":            func(c *study.Config, f study.Config) { c.Rounds = f.Rounds },
	"replicas":          func(c *study.Config, f study.Config) { c.Replicas = f.Replicas },
	"seed":              func(c *study.Config, f study.Config) { c.Seed = f.Seed },
	"speed":             func(c *study.Config, f study.Config) { c.Speed = f.Speed },
	"profile":           func(c *study.Config, f study.Config) { c.Profile = f.Profile },
	"rps":               func(c *study.Config, f study.Config) { c.RPS = f.RPS },
	"arrivals":          func(c *study.Config, f study.Config) { c.Arrivals = f.Arrivals },
	"inflight-cap":      func(c *study.Config, f study.Config) { c.InflightCap = f.InflightCap },
	"max-tokens":        func(c *study.Config, f study.Config) { c.MaxTokens = f.MaxTokens },
	"turns":             func(c *study.Config, f study.Config) { c.Turns = f.Turns },
	"engine-block-size": func(c *study.Config, f study.Config) { c.EngineBlockSize = f.EngineBlockSize },
}

// keepFlagged lays the explicitly set flags among names over a preset
// grid c: a preset replaces defaults, never what the user typed.
func keepFlagged(fs *pflag.FlagSet, c *study.Config, flagged study.Config, names ...string) {
	for _, name := range names {
		if fs.Changed(name) {
			overlay[name](c, flagged)
		}
	}
}

// resolve applies --quick (or, with grid, the DES engine's default grid)
// under the explicitly set flags, the gateway sync settings and, for the
// DES engine, its options and adaptations.
func resolve(cmd *cobra.Command, flagged study.Config, opt options, grid bool) (study.Config, des.Options, error) {
	c := flagged
	f := cmd.Flags()
	if grid && !opt.quick && opt.engine == engineDES {
		c = des.DefaultGrid(flagged)
		keepFlagged(f, &c, flagged, "scenarios", "strategies", "modes", "rounds", "sync", "rps", "inflight-cap")
	}
	if opt.parallel < 0 {
		return c, opt.des, fmt.Errorf("%w: --parallel %d < 0", study.ErrInvalidConfig, opt.parallel)
	}
	if opt.parallel > 1 && opt.engine != engineDES {
		// Live cells would share the host's cores and inflate each
		// other's model time.
		return c, opt.des, fmt.Errorf("%w: --parallel > 1 needs --engine des", study.ErrInvalidConfig)
	}
	if opt.quick {
		c = study.QuickConfig()
		keepFlagged(f, &c, flagged, "scenarios", "strategies", "modes", "gateways", "sync", "rounds",
			"replicas", "seed", "speed", "profile", "rps", "arrivals", "inflight-cap", "max-tokens", "turns",
			"engine-block-size")
	}
	if err := applyWorkload(f, &c, opt); err != nil {
		return c, opt.des, err
	}
	o := opt.des
	if opt.noSync {
		if f.Changed("sync") {
			return c, o, fmt.Errorf("%w: --no-sync and --sync together", study.ErrInvalidConfig)
		}
		c.Sync = []string{study.SyncIsolated}
	}
	// Every multi-gateway cell isolated: the study-wide flag the DES
	// engine and older readers use.
	c.GatewaysIsolated = len(c.Sync) == 1 && c.Sync[0] == study.SyncIsolated
	if opt.tgt.on() {
		// Validated once the deployment is probed (its replicas, and
		// the client-side strategies without gateways).
		return c, o, nil
	}
	switch opt.engine {
	case engineLive:
		for _, name := range desFlags {
			if f.Changed(name) {
				return c, o, fmt.Errorf("%w: --%s needs --engine des", study.ErrInvalidConfig, name)
			}
		}
		c.Engine = engineLive
	case engineDES:
		o.Profile = c.Profile
		o.EngineBlockSize = c.EngineBlockSize
		o.Seed = c.Seed
		o.NoSync = c.GatewaysIsolated
		c.EngineProfile = engineProfileText(o)
		c = des.StudyConfig(c, o)
		if err := o.Validate(); err != nil {
			return c, o, err
		}
	default:
		return c, o, fmt.Errorf("%w: --engine %q (want %s or %s)", study.ErrInvalidConfig, opt.engine, engineLive, engineDES)
	}
	return c, o, c.Validate()
}

// applyWorkload loads --workload into c: its one scenario, and as many
// arrivals per phase as it has requests. The flags it replaces must not
// be given.
func applyWorkload(f *pflag.FlagSet, c *study.Config, opt options) error {
	if opt.workload == "" {
		if f.Changed("workload-salt") {
			return fmt.Errorf("%w: --workload-salt needs --workload", study.ErrInvalidConfig)
		}
		return nil
	}
	for _, name := range []string{"scenarios", "arrivals", "turns"} {
		if f.Changed(name) {
			return fmt.Errorf("%w: --%s does not apply to --workload (the file decides it)", study.ErrInvalidConfig, name)
		}
	}
	w, err := study.LoadWorkload(opt.workload)
	if err != nil {
		return err
	}
	w.Salted = opt.workloadSalt
	c.Workload = w
	c.Scenarios = []string{study.ScenarioWorkload}
	c.Arrivals = w.Requests
	return nil
}

// checkSizingFlags refuses --prompt-tokens without --tokenizer and
// --tokenizer with --workload (whose prompts go as written).
func checkSizingFlags(f *pflag.FlagSet, opt options) error {
	if f.Changed("prompt-tokens") && opt.tokenizer == "" {
		return fmt.Errorf("%w: --prompt-tokens needs --tokenizer (the tokens of which engine?)", study.ErrInvalidConfig)
	}
	if opt.tokenizer != "" && opt.workload != "" {
		return fmt.Errorf("%w: --tokenizer sizes the seed's prompts; a --workload's prompts go as written", study.ErrInvalidConfig)
	}
	return nil
}

// desFactory builds DES worlds from o, isolating a cell's gateways when
// the cell says so (des.Factory takes isolation from its options).
func desFactory(o des.Options) study.EngineFactory {
	return func(ctx context.Context, cell study.Cell) (study.Engine, error) {
		co := o
		co.NoSync = cell.Isolated
		return des.Factory(co)(ctx, cell)
	}
}

// workers is the number of cells to run at once: --parallel, or by
// default GOMAXPROCS for the DES engine (its cells share nothing and each
// is single-threaded) and 1 for the live engine.
func workers(opt options) int {
	switch {
	case opt.parallel > 0:
		return opt.parallel
	case opt.engine == engineDES:
		return runtime.GOMAXPROCS(0)
	}
	return 1
}

// startProfile starts a CPU profile into path ("" : none); the returned
// function stops it and closes the file.
func startProfile(path string) (func() error, error) {
	if path == "" {
		return func() error { return nil }, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("kvbench: --cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("kvbench: --cpuprofile: %w", err)
	}
	return func() error {
		pprof.StopCPUProfile()
		return f.Close()
	}, nil
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
	return runWith(ctx, cfg, opt, nil, "", log, stdout, stderr)
}

// runWith runs the study on factory (nil: the --engine's) and writes the
// outputs; engine describes the engine in the opening line.
func runWith(ctx context.Context, cfg study.Config, opt options, factory study.EngineFactory, engine string,
	log *slog.Logger, stdout, stderr io.Writer) error {
	switch {
	case factory != nil:
	case opt.engine == engineDES:
		factory = desFactory(opt.des)
		engine = fmt.Sprintf("DES engine, delays sync %v load %v kv %v", opt.des.SyncDelay, opt.des.LoadDelay, opt.des.KVDelay)
	default:
		engine = fmt.Sprintf("live engine, speed %g", cfg.Speed)
		lc := live.DefaultConfig()
		lc.Profile = cfg.Profile
		lc.Speed = cfg.Speed
		lc.EngineBlockSize = cfg.EngineBlockSize
		lc.Logger = log
		factory = live.Factory(lc)
	}
	cells := cfg.Cells()
	names := make([]string, len(cells))
	for i, c := range cells {
		names[i] = c.Name()
	}
	phases := len(cfg.Scenarios) * len(cfg.Strategies) * cfg.Rounds * len(cells)
	nw := min(workers(opt), len(cells))
	fmt.Fprintf(stderr, "kvbench: %d phases (%s × %s × cells %s × %d rounds), %d replicas, %d arrivals per phase at %g RPS, profile %s, %s, %d cell(s) at once, out %s\n",
		phases, strings.Join(cfg.Scenarios, ","), strings.Join(cfg.Strategies, ","), strings.Join(names, ","),
		cfg.Rounds, cfg.Replicas, cfg.Arrivals, cfg.RPS, cfg.Profile, engine, nw, opt.out)
	prog := study.NewProgress(stderr)
	if nw > 1 {
		prog = study.NewLineProgress(stderr) // phases of different cells overlap
	}
	prog = study.WithOverall(prog, phases)
	stopProfile, err := startProfile(opt.cpuProfile)
	if err != nil {
		return reportErr(stderr, err)
	}
	start := time.Now()
	rn := &study.Runner{Config: cfg, Factory: factory, Progress: prog, Logger: log, Workers: nw}
	res, runErr := rn.Run(ctx)
	wall := time.Since(start)
	if err := stopProfile(); err != nil {
		runErr = errors.Join(runErr, err)
	}
	if res == nil {
		return reportErr(stderr, runErr)
	}
	if err := study.WriteFiles(opt.out, res); err != nil {
		return reportErr(stderr, errors.Join(runErr, err))
	}
	fmt.Fprintln(stdout)
	study.WriteTables(stdout, res)
	arrivals := 0
	for _, r := range res.Runs {
		arrivals += r.Arrivals
	}
	fmt.Fprintf(stderr, "kvbench: %d runs, %d scheduled arrivals in %s: %.0f arrivals/s (wall time, initialisation included)\n",
		len(res.Runs), arrivals, wall.Round(time.Millisecond), float64(arrivals)/wall.Seconds())
	fmt.Fprintf(stderr, "kvbench: wrote %s\n",
		strings.Join([]string{
			filepath.Join(opt.out, study.FileResults), study.FileRequests, study.FilePhases, study.FileReport, study.FileHTML,
		}, ", "))
	return reportErr(stderr, runErr)
}

func reportErr(w io.Writer, err error) error {
	if err == nil {
		return nil
	}
	fmt.Fprintf(w, "kvbench: %v\n", err)
	return reportedError{err}
}

// reportedError is an error reportErr printed already (execute does not
// print it again).
type reportedError struct{ error }

func (e reportedError) Unwrap() error { return e.error }

func newSweepCmd(stdout, stderr io.Writer) *cobra.Command {
	cfg := study.DefaultConfig()
	opt := options{des: des.DefaultOptions(), engine: engineDES}
	var axes des.SweepAxes
	cmd := &cobra.Command{
		Use:   "sweep",
		Short: "Run the study on the discrete-event engine for every replica × gateway × rate setting",
		Long: `sweep runs the study (every scenario, strategy, mode and round given) on the
discrete-event engine once per combination of --replicas, --gateways and --rps,
writes each setting's outputs to --out/<setting>/ and one table per setting to
--out/sweep.md and stdout. Gateways are synced unless --no-sync.`,
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, o, err := resolve(cmd, cfg, opt, false)
			if err != nil {
				return err
			}
			axes.Workers = workers(opt)
			if len(axes.Replicas) == 0 || len(axes.Gateways) == 0 || len(axes.RPS) == 0 {
				return fmt.Errorf("%w: sweep needs --replicas, --gateways and --rps", study.ErrInvalidConfig)
			}
			ctx := cmd.Context()
			if opt.timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, opt.timeout)
				defer cancel()
			}
			start := time.Now()
			res, runErr := des.Sweep(ctx, c, o, axes, opt.out, stderr)
			des.WriteSweep(stdout, res, o)
			fmt.Fprintf(stderr, "kvbench sweep: %d settings in %s; wrote %s\n", len(res), time.Since(start).Round(time.Millisecond),
				filepath.Join(opt.out, "sweep.md"))
			return reportErr(stderr, runErr)
		},
	}
	f := cmd.Flags()
	addStudyFlags(f, &cfg, &opt, true)
	f.IntSliceVar(&axes.Replicas, "replicas", nil, "replica counts to sweep")
	f.IntSliceVar(&axes.Gateways, "gateways", nil, "gateway counts to sweep")
	f.Float64SliceVar(&axes.RPS, "rps", nil, "arrival rates to sweep (model time)")
	f.BoolVar(&axes.ScaleInflightCap, "scale-inflight-cap", true, "scale the client in-flight cap with the rate (cap × rps / 1.6), so the cap does not throttle faster settings")
	return cmd
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
