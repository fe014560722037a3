package main

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/chaos/faultctl"
	"github.com/kvmesh/kvmesh/chaos/suite"
	"github.com/kvmesh/kvmesh/chaos/target"
)

// chaosFlags are kvmesh chaos's (and kvmesh chaos run's) flags.
type chaosFlags struct {
	short, long bool
	factor      float64
	outDir      string
	verbose     bool

	// --target: scenarios against a running deployment (chaos/target).
	target                       []string
	adminToken, model, replica   string
	engineURL, faultproxy, fpTok string
	kvProxy, natsProxy           string
	restartCmd, restartGateway   string
	requests                     int
	converge, outage             time.Duration
}

func (f *chaosFlags) register(fs *pflag.FlagSet) {
	fs.BoolVar(&f.short, "short", false, "the short form (the default; the go test form CI runs)")
	fs.BoolVar(&f.long, "long", false, "the long form: more requests and rounds (KVMESH_CHAOS_LONG=1 in go test)")
	fs.Float64Var(&f.factor, "factor", 1, "multiply every request and round count of the chosen form (e.g. 0.5, 3)")
	fs.StringVar(&f.outDir, "out", "chaos-report", "directory for the report: report.md and report.json")
	fs.BoolVarP(&f.verbose, "verbose", "v", false, "show every line the scenarios log on stderr")
	fs.StringSliceVar(&f.target, "target", nil, "run the target scenarios against these gateways (base URLs) instead of the in-process suite")
	fs.StringVar(&f.adminToken, "admin-token", "", "--target: the gateways' admin token (default $KVMESH_ADMIN_TOKEN)")
	fs.StringVar(&f.model, "model", "", "--target: the model name")
	fs.StringVar(&f.replica, "replica", "", "--target: the replica to fault (kv-events, engine-reset)")
	fs.StringVar(&f.engineURL, "engine-url", "", "--target: that replica's engine URL (engine-reset)")
	fs.StringVar(&f.faultproxy, "faultproxy", "", "--target: kvmesh faultproxy's control URL")
	fs.StringVar(&f.fpTok, "faultproxy-token", "", "--target: its token (default $KVMESH_FAULTPROXY_TOKEN)")
	fs.StringVar(&f.kvProxy, "kv-proxy", "", "--target: the zmq proxy in front of the replica's KV-event port (kv-events)")
	fs.StringVar(&f.natsProxy, "nats-proxy", "", "--target: the tcp proxy in front of the gateways' NATS (nats-outage)")
	fs.StringVar(&f.restartCmd, "restart-cmd", "", "--target: sh -c command that restarts --restart-gateway, $KVMESH_CHAOS_GATEWAY (gateway-restart)")
	fs.StringVar(&f.restartGateway, "restart-gateway", "", "--target: the gateway --restart-cmd restarts (default the last --target)")
	fs.IntVar(&f.requests, "requests", 24, "--target: requests per phase (at most 4x that while nats-outage's or gateway-restart's fault lasts)")
	fs.DurationVar(&f.converge, "converge", 15*time.Second, "--target: how long the views may take to follow the engines after a heal")
	fs.DurationVar(&f.outage, "outage", 3*time.Second, "--target: how long nats-outage keeps NATS down")
}

// targetConfig is the deployment --target describes.
func (f *chaosFlags) targetConfig() *target.Config {
	c := &target.Config{
		Gateways: f.target, AdminToken: f.adminToken, Model: f.model, Replica: f.replica, EngineURL: f.engineURL,
		KVProxy: f.kvProxy, NATSProxy: f.natsProxy, RestartCmd: f.restartCmd, RestartGateway: f.restartGateway,
		Requests: f.requests, Converge: f.converge, Outage: f.outage,
	}
	for i, g := range c.Gateways {
		if !strings.Contains(g, "://") {
			c.Gateways[i] = "http://" + g
		}
	}
	if c.AdminToken == "" {
		c.AdminToken = os.Getenv("KVMESH_ADMIN_TOKEN")
	}
	if f.faultproxy != "" {
		tok := f.fpTok
		if tok == "" {
			tok = os.Getenv("KVMESH_FAULTPROXY_TOKEN")
		}
		base := f.faultproxy
		if !strings.Contains(base, "://") {
			base = "http://" + base
		}
		c.FaultProxy = &faultctl.Client{Base: base, Token: tok}
	}
	return c
}

func (f *chaosFlags) size() (suite.Size, error) {
	if f.short && f.long {
		return suite.Size{}, errors.New("chaos: --short and --long exclude each other")
	}
	if f.factor <= 0 || f.factor > 100 {
		return suite.Size{}, fmt.Errorf("chaos: --factor %g: want (0, 100]", f.factor)
	}
	return suite.Size{Long: f.long, Factor: f.factor}, nil
}

// ErrChaosFailed: kvmesh chaos ran and an invariant failed (exit code 1).
var ErrChaosFailed = errors.New("chaos: an invariant failed")

func newChaosCmd() *cobra.Command {
	f := &chaosFlags{}
	cmd := &cobra.Command{
		Use:   "chaos",
		Short: "Run kvmesh's failure-injection scenarios in process",
		Long: `Run the chaos suite: each scenario starts an in-process cluster (simulated
vLLM engines, gateways, NATS, raft on 127.0.0.1), drives client load, injects
one kind of fault and checks the invariants (no request lost, every gateway's
index within bounds of the engines' true block sets and converged in time).
These are the scenarios go test ./chaos/scenarios runs, through the same code.

	kvmesh chaos list
	kvmesh chaos --short                     # every scenario, short form
	kvmesh chaos run zmq partition --long    # some, long form
	kvmesh chaos run 3 --factor 4            # both parts of scenario 3, 4x the requests
	kvmesh chaos list --target
	kvmesh chaos --target 127.0.0.1:18081,127.0.0.1:18082 --model M --replica r1 \
	    --engine-url http://127.0.0.1:18001 --faultproxy 127.0.0.1:8474 --kv-proxy r1-events

Progress goes to stderr, the table to stdout, and the report to --out
(report.md, report.json). The exit code is 1 when any invariant failed.

With --target the scenarios run against a running deployment instead: kv-events
(through kvmesh faultproxy's zmq relay in front of one engine's event port),
engine-reset, nats-outage (a tcp relay in front of NATS) and gateway-restart
(--restart-cmd); those the flags give no means for are skipped. They check the
invariants through the gateways' /debug/route (admin token), /metrics and
/ready. go doc github.com/kvmesh/kvmesh/chaos/target has the details.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runChaos(cmd, f, nil) },
	}
	f.register(cmd.Flags())

	rf := &chaosFlags{}
	run := &cobra.Command{
		Use:   "run [scenario...]",
		Short: "Run some scenarios (names, numbers or all; kvmesh chaos list)",
		RunE:  func(cmd *cobra.Command, args []string) error { return runChaos(cmd, rf, args) },
	}
	rf.register(run.Flags())

	var listTarget bool
	list := &cobra.Command{
		Use:   "list",
		Short: "List the scenarios (--target: those against a running deployment)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			if listTarget {
				fmt.Fprintln(tw, "NAME\tWHAT")
				for _, s := range target.All() {
					fmt.Fprintf(tw, "%s\t%s\n", s.Name, s.Summary)
				}
				return tw.Flush()
			}
			fmt.Fprintln(tw, "#\tNAME\tGO TEST\tWHAT")
			for _, s := range suite.All() {
				fmt.Fprintf(tw, "%d\t%s\t%s\t%s\n", s.Number, s.Name, s.Test, s.Summary)
			}
			return tw.Flush()
		},
	}
	list.Flags().BoolVar(&listTarget, "target", false, "list the scenarios kvmesh chaos --target runs")
	cmd.AddCommand(list, run)
	return cmd
}

// runChaos runs the scenarios named (all without names), prints the table
// and writes the report; an interrupt stops after the current scenario.
func runChaos(cmd *cobra.Command, f *chaosFlags, names []string) error {
	size, err := f.size()
	if err != nil {
		return err
	}
	var scs []suite.Scenario
	if len(f.target) > 0 {
		var skipped []string
		scs, skipped, err = target.Suite(f.targetConfig(), names)
		if err != nil {
			return err
		}
		for _, s := range skipped {
			fmt.Fprintf(cmd.ErrOrStderr(), "chaos: skipped %s\n", s)
		}
		if len(scs) == 0 {
			return fmt.Errorf("chaos: --target: no scenario applies (kvmesh chaos list --target)")
		}
	} else if scs, err = suite.Select(names); err != nil {
		return err
	}
	if err := os.MkdirAll(f.outDir, 0o755); err != nil {
		return fmt.Errorf("chaos: --out: %w", err)
	}
	ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	started := time.Now()
	results := suite.Run(ctx, scs, suite.Options{Size: size, Progress: cmd.ErrOrStderr(), Verbose: f.verbose})
	rep := suite.NewReport(size, started, results)
	if len(f.target) > 0 {
		rep.Form = "target"
	}

	var table cluster.Report
	for _, r := range results {
		for _, row := range r.Rows {
			table.Add(row)
		}
	}
	fmt.Fprintf(cmd.OutOrStdout(), "chaos suite (%s form)\n%s", rep.Form, table.Table())
	js, err := rep.JSON()
	if err != nil {
		return err
	}
	mdPath, jsPath := filepath.Join(f.outDir, "report.md"), filepath.Join(f.outDir, "report.json")
	if err := os.WriteFile(mdPath, []byte(rep.Markdown()), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(jsPath, append(js, '\n'), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(cmd.ErrOrStderr(), "chaos: report in %s and %s\n", mdPath, jsPath)
	if len(results) < len(scs) {
		return fmt.Errorf("%w: interrupted after %d of %d scenarios", ErrChaosFailed, len(results), len(scs))
	}
	if !rep.Passed {
		var failed []string
		for _, r := range results {
			if !r.Passed {
				failed = append(failed, r.Name)
			}
		}
		return fmt.Errorf("%w: %v", ErrChaosFailed, failed)
	}
	return nil
}
