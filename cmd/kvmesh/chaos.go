package main

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/chaos/suite"
)

// chaosFlags are kvmesh chaos's (and kvmesh chaos run's) flags.
type chaosFlags struct {
	short, long bool
	factor      float64
	outDir      string
	verbose     bool
}

func (f *chaosFlags) register(fs *pflag.FlagSet) {
	fs.BoolVar(&f.short, "short", false, "the short form (the default; the go test form CI runs)")
	fs.BoolVar(&f.long, "long", false, "the long form: more requests and rounds (KVMESH_CHAOS_LONG=1 in go test)")
	fs.Float64Var(&f.factor, "factor", 1, "multiply every request and round count of the chosen form (e.g. 0.5, 3)")
	fs.StringVar(&f.outDir, "out", "chaos-report", "directory for the report: report.md and report.json")
	fs.BoolVarP(&f.verbose, "verbose", "v", false, "show every line the scenarios log on stderr")
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

Progress goes to stderr, the table to stdout, and the report to --out
(report.md, report.json). The exit code is 1 when any invariant failed.`,
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

	list := &cobra.Command{
		Use:   "list",
		Short: "List the scenarios",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "#\tNAME\tGO TEST\tWHAT")
			for _, s := range suite.All() {
				fmt.Fprintf(tw, "%d\t%s\t%s\t%s\n", s.Number, s.Name, s.Test, s.Summary)
			}
			return tw.Flush()
		},
	}
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
	scs, err := suite.Select(names)
	if err != nil {
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
