package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/chaos/study/httpenv"
	studytarget "github.com/kvmesh/kvmesh/chaos/study/target"
	"github.com/kvmesh/kvmesh/sync/config"
)

// engineTarget is the Config.Engine of a run against a deployment.
const engineTarget = "target"

// targetOptions are the flags of a run against a running deployment.
type targetOptions struct {
	gateways  []string
	engines   string
	adminAddr string
	model     string
	isolation string
	modeScope string
	plan      bool
}

func addTargetFlags(f *pflag.FlagSet, t *targetOptions) {
	f.StringArrayVar(&t.gateways, "target", nil, "run against a running gateway at this URL (repeatable: arrivals round-robin over the gateways); nothing is started")
	f.StringVar(&t.engines, "engines", "", "the deployment's engines as name=URL,... (names as the gateways' x-kvmesh-replica header spells them): their /metrics feed the per-replica figures and their /reset_prefix_cache isolates phases (default with --target: the gateway's /debug/replicas)")
	f.StringVar(&t.adminAddr, "admin-addr", "", "a gateway's admin gRPC address for index-mode switches (token from $"+config.TokenEnv+"; default: the first --target's HTTP admin API)")
	f.StringVar(&t.model, "model", "", "model to request (default: the first id of /v1/models)")
	f.StringVar(&t.isolation, "isolation", studytarget.IsolationAuto, "how phases are kept apart on the engines' caches: auto (reset when every engine allows it, else cache_salt), reset or cache_salt")
	f.StringVar(&t.modeScope, "mode-scope", studytarget.ScopeAuto, "what an index-mode switch writes in each cluster's config: auto (the model's own models.<model>.index_mode when the cluster sets one, else the cluster default), cluster (the default; refused when the model overrides it) or model (always the model's own entry, other models untouched)")
	f.BoolVar(&t.plan, "plan", false, "print the phases, their arrivals, the expected duration and what will be reset, and exit without sending a request")
}

// on reports whether the run targets a deployment.
func (t *targetOptions) on() bool { return len(t.gateways) > 0 || t.engines != "" }

// parseEngines parses name=URL,name=URL.
func parseEngines(s string) ([]httpenv.Endpoint, error) {
	var out []httpenv.Endpoint
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, url, ok := strings.Cut(part, "=")
		if !ok || name == "" || !strings.HasPrefix(url, "http") {
			return nil, fmt.Errorf("%w: --engines entry %q is not name=http://host:port", study.ErrInvalidConfig, part)
		}
		out = append(out, httpenv.Endpoint{Name: name, URL: url})
	}
	return out, nil
}

// resolveTarget fits the study to the deployment: one gateway count (the
// number of --target URLs), speed 1 unless given, no gateways' sync axis
// beyond what the deployment is.
func resolveTarget(f *pflag.FlagSet, c study.Config, t targetOptions) (study.Config, studytarget.Config, error) {
	tc := studytarget.DefaultConfig()
	tc.Gateways = t.gateways
	tc.AdminAddr = t.adminAddr
	tc.AdminToken = os.Getenv(config.TokenEnv)
	tc.Model = t.model
	tc.Isolation = t.isolation
	tc.ModeScope = t.modeScope
	var err error
	if tc.Engines, err = parseEngines(t.engines); err != nil {
		return c, tc, err
	}
	tc.Seed = c.Seed
	if len(t.gateways) == 0 {
		// Straight at the engines: kvbench's own baselines, no index.
		if f.Changed("modes") {
			return c, tc, fmt.Errorf("%w: --modes needs gateways (--target); --engines alone runs mode %s", study.ErrInvalidConfig, study.ModeNone)
		}
		c.Modes = []string{study.ModeNone}
		if !f.Changed("strategies") {
			c.Strategies = study.ClientStrategies
		}
	}
	for _, name := range []string{"engine", "gateways", "sync", "no-sync", "replicas", "profile", "engine-block-size", "parallel"} {
		if f.Changed(name) {
			return c, tc, fmt.Errorf("%w: --%s does not apply to --target (the deployment decides it)", study.ErrInvalidConfig, name)
		}
	}
	if !f.Changed("speed") {
		c.Speed = 1 // real engines run in real time
	}
	tc.Speed = c.Speed
	c.Engine = engineTarget
	c.Gateways = []int{max(len(t.gateways), 1)}
	c.Profile = "deployment"
	c.EngineBlockSize = 0
	return c, tc, tc.Validate()
}

// targetStudy probes the deployment and fills in what it decides (replica
// count, sync setting, the Target description).
func targetStudy(ctx context.Context, c study.Config, tc studytarget.Config, plan bool) (study.Config, *studytarget.Deployment, error) {
	d, err := studytarget.Probe(ctx, tc, plan)
	if err != nil {
		return c, nil, err
	}
	c.Replicas = len(d.Engines())
	c.Sync = []string{study.SyncSynced}
	if !d.Info().Clustered && len(tc.Gateways) > 1 {
		c.Sync = []string{study.SyncIsolated}
	}
	c.GatewaysIsolated = c.Sync[0] == study.SyncIsolated
	if c.Groups < c.Replicas {
		c.Groups = c.Replicas
		c.Candidates = max(c.Candidates, 2*c.Groups)
	}
	c.Target = d.Info()
	return c, d, c.Validate()
}

// writePlan prints what a run would do, without sending anything.
func writePlan(w io.Writer, c study.Config, d *studytarget.Deployment) {
	cells := c.Cells()
	phases := 0
	var perPhase []string
	for _, cell := range cells {
		for round := 1; round <= c.Rounds; round++ {
			for _, sc := range c.Scenarios {
				for _, st := range c.RoundStrategies(round) {
					k := study.PhaseKey{Scenario: sc, Round: round, Strategy: st, Mode: cell.Mode, Gateways: cell.Gateways, Isolated: cell.Isolated}
					arr := c.Arrivals
					if sc == study.ScenarioMultiturn {
						arr = c.Arrivals * c.Turns
					}
					perPhase = append(perPhase, fmt.Sprintf("  %-44s %d arrivals", k.PhaseName(), arr))
					phases++
				}
			}
		}
	}
	model := time.Duration(float64(c.Arrivals) / c.RPS * float64(time.Second))
	rate := fmt.Sprintf("at %g RPS", c.RPS)
	if wl := c.Workload; wl != nil {
		model = wl.Span(c.RPS)
		if wl.Scheduled {
			rate = "on the workload's at_ms schedule"
		}
		salt := "salted per phase"
		if !wl.Salted {
			salt = "sent as written"
		}
		fmt.Fprintf(w, "plan: workload %s (sha256 %.12s): %d requests, %d arrival units, %d sessions; prompts %s\n",
			wl.Path, wl.SHA256, wl.Requests, wl.Units, wl.Sessions, salt)
	}
	if c.PromptSizing != nil {
		fmt.Fprintf(w, "plan: %s\n", study.SizingLine(*c.PromptSizing))
	}
	wall := time.Duration(float64(model) / c.Speed)
	fmt.Fprintf(w, "plan: %d phases, %d scheduled arrivals each %s: at least %v of arrivals per phase (model time), %v wall at speed %g; %v wall in all, plus initialisation and draining\n",
		phases, c.Arrivals, rate, model.Round(time.Millisecond), wall.Round(time.Millisecond), c.Speed,
		(wall * time.Duration(phases)).Round(time.Second))
	for _, l := range perPhase {
		fmt.Fprintln(w, l)
	}
	if d == nil {
		fmt.Fprintf(w, "plan: each cell starts %d simulated engines and %v gateway(s) in process; nothing outside is touched\n", c.Replicas, c.Gateways)
		return
	}
	t := d.Info()
	fmt.Fprintf(w, "plan: model %s; gateways %s (versions %s, %s); engines %s\n", t.Model, strings.Join(t.Gateways, " "),
		strings.Join(t.GatewayVersions, " "), clusterText(t), strings.Join(t.Engines, " "))
	switch t.Isolation {
	case study.IsolationReset:
		fmt.Fprintf(w, "plan: before every phase (and hot-spot retry) POST /reset_prefix_cache on every engine: %s\n", strings.Join(t.Engines, " "))
	default:
		fmt.Fprintf(w, "plan: no engine cache is reset: every phase gets a fresh cache_salt\n")
	}
	modes := d.Modes()
	if len(t.Gateways) == 0 {
		fmt.Fprintf(w, "plan: no gateway: kvbench picks the replica per request itself (%s)\n", strings.Join(c.Strategies, ", "))
		return
	}
	for _, cell := range cells {
		if allEqual(modes, cell.Mode) {
			fmt.Fprintf(w, "plan: cell %s: the gateways already route in %s\n", cell.Name(), cell.Mode)
			continue
		}
		fmt.Fprintf(w, "plan: cell %s switches index_mode %s -> %s through the admin API of %d cluster(s) (--mode-scope %s) and waits until every gateway routes in it\n",
			cell.Name(), strings.Join(modes, ","), cell.Mode, t.Clusters, d.ModeScope())
		modes = []string{cell.Mode}
	}
}

// clusterText says how the gateways are clustered.
func clusterText(t *study.TargetInfo) string {
	switch {
	case t.Clustered:
		return "one cluster"
	case t.Clusters > 1:
		return fmt.Sprintf("%d separate clusters", t.Clusters)
	case t.Clusters == 1:
		return "one cluster and gateways without the admin API"
	}
	return "not a cluster"
}

func allEqual(xs []string, v string) bool {
	for _, x := range xs {
		if x != v {
			return false
		}
	}
	return len(xs) > 0
}

// runTarget runs the study against the deployment named by --target and
// --engines (or prints its plan).
func runTarget(ctx context.Context, f *pflag.FlagSet, c study.Config, opt options, stdout, stderr io.Writer) error {
	c, tc, err := resolveTarget(f, c, opt.tgt)
	if err != nil {
		return reportErr(stderr, err)
	}
	log, err := logger(opt.logLevel, stderr)
	if err != nil {
		return err
	}
	if opt.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, opt.timeout)
		defer cancel()
	}
	c, d, err := targetStudy(ctx, c, tc, opt.tgt.plan)
	if d != nil {
		defer d.Close()
	}
	if err != nil {
		return reportErr(stderr, err)
	}
	if c, err = sizePrompts(ctx, c, opt, d.Engines()[0].URL, d.Info().Model, stderr); err != nil {
		return reportErr(stderr, err)
	}
	if opt.tgt.plan {
		writePlan(stdout, c, d)
		return nil
	}
	t := d.Info()
	engine := fmt.Sprintf("target: %d gateway(s) %s, %d engines, model %s, isolation %s, speed %g",
		len(t.Gateways), strings.Join(t.Gateways, " "), len(t.Engines), t.Model, t.Isolation, c.Speed)
	return runWith(ctx, c, opt, studytarget.Factory(d), engine, log, stdout, stderr)
}
