package study

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"time"
)

// Progress receives the runner's progress. Calls come from one goroutine.
type Progress interface {
	// PhaseStart announces a phase with total scheduled arrivals.
	PhaseStart(name string, total int)
	// Step reports one arrival finished (completed, failed or unsent).
	Step()
	// PhaseDone reports the phase's row (nil if it was not measured) or
	// the error that stopped it.
	PhaseDone(name string, run *Run, det *PhaseDetail, err error)
	// Note reports anything else worth a line (e.g. a host check).
	Note(line string)
}

// HostCheckLine describes a host check in one line.
func HostCheckLine(c HostCheck) string {
	verdict := "ok"
	if !c.OK {
		verdict = fmt.Sprintf("TOO SLOW (> ×%.2f): every latency is inflated; lower --speed or unload the host", HostCheckTolerance)
	}
	return fmt.Sprintf("host check %s: probe TPOT %.1f ms measured vs %.1f ms modelled (×%.2f): %s",
		c.Cell, c.MeasuredTPOTms, c.ModelledTPOTms, c.Ratio, verdict)
}

// Runner runs a study grid: for each cell (mode × gateways) a fresh engine;
// in it, for each round, each scenario, each strategy (reversed in even
// rounds) one phase.
type Runner struct {
	// Config is the study; it must be valid.
	Config Config
	// Factory builds an engine per cell.
	Factory EngineFactory
	// Progress, if not nil, is told about each phase.
	Progress Progress
	// Logger, if not nil, receives structured progress lines.
	Logger *slog.Logger
}

// Run executes the grid. A phase whose initialisation fails is recorded in
// Phases (Measured false) and skipped, as the seed did; an engine failure or
// ctx's end stops the run and returns what was measured so far together
// with the error.
func (rn *Runner) Run(ctx context.Context) (*Results, error) {
	cfg := rn.Config
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := rn.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	res := &Results{Config: cfg}
	for _, cell := range cfg.Cells() {
		if err := rn.runCell(ctx, log, cell, res); err != nil {
			return res, err
		}
	}
	return res, nil
}

func (rn *Runner) runCell(ctx context.Context, log *slog.Logger, cell Cell, res *Results) error {
	cfg := &rn.Config
	e, err := rn.Factory(ctx, cell)
	if err != nil {
		return fmt.Errorf("%w: start engine for %s: %v", ErrEngine, cell.Name(), err)
	}
	defer func() { _ = e.Close() }()
	if hc, ok := e.(HostChecker); ok {
		chk, err := hc.HostCheck(ctx)
		if err != nil {
			return fmt.Errorf("%w: host check for %s: %w", ErrEngine, cell.Name(), err)
		}
		chk.Cell = cell.Name()
		res.Config.HostChecks = append(res.Config.HostChecks, chk)
		if !chk.OK {
			log.Warn("host too slow for this speed: latencies are inflated", "cell", chk.Cell,
				"modelled_tpot_ms", chk.ModelledTPOTms, "measured_tpot_ms", chk.MeasuredTPOTms)
		}
		if rn.Progress != nil {
			rn.Progress.Note(HostCheckLine(chk))
		}
	}
	for round := 1; round <= cfg.Rounds; round++ {
		for _, sc := range cfg.Scenarios {
			for _, strat := range cfg.RoundStrategies(round) {
				key := PhaseKey{Scenario: sc, Round: round, Strategy: strat, Mode: cell.Mode, Gateways: cell.Gateways,
					Isolated: cell.Isolated}
				ph := &Phase{
					Name:     key.PhaseName(),
					Scenario: sc,
					Round:    round,
					Strategy: strat,
					Cell:     cell,
					Seed:     cfg.Seed + uint64(round-1),
				}
				start := time.Now()
				run, det, recs, err := RunPhase(ctx, e, cfg, ph, rn.Progress)
				res.Phases = append(res.Phases, det)
				res.Requests = append(res.Requests, recs...)
				if run != nil {
					res.Runs = append(res.Runs, *run)
				}
				if rn.Progress != nil {
					rn.Progress.PhaseDone(ph.Name, run, &det, err)
				}
				if err != nil && !errors.Is(err, ErrInitFailed) {
					return err
				}
				if err != nil {
					log.Warn("phase not measured", "phase", ph.Name, "err", err)
					continue
				}
				log.Info("phase done", "phase", ph.Name, "wall", time.Since(start).Round(time.Millisecond),
					"slo_pass", run.SLOPass, "arrivals", run.Arrivals, "ttft_p95_s", float64(run.TTFTP95))
			}
		}
	}
	return nil
}

// RunPhase runs one phase on e: wait for idle engines, establish the
// scenario's initial state, snapshot counters, drive the arrivals, wait for
// idle again, snapshot counters, and summarise. The returned detail is
// always filled; run is nil when the phase was not measured.
func RunPhase(ctx context.Context, e Engine, cfg *Config, ph *Phase, prog Progress) (*Run, PhaseDetail, []RequestRecord, error) {
	det := PhaseDetail{
		Name: ph.Name, Scenario: ph.Scenario, Round: ph.Round, Strategy: ph.Strategy,
		Mode: ph.Cell.Mode, Gateways: ph.Cell.Gateways, Isolated: ph.Cell.Isolated, Replicas: e.Replicas(),
	}
	fail := func(err error) (*Run, PhaseDetail, []RequestRecord, error) {
		det.Error = err.Error()
		return nil, det, nil, err
	}
	if err := e.WaitIdle(ctx); err != nil {
		return fail(err)
	}
	plan, err := prepare(ctx, e, cfg, ph)
	if plan != nil {
		det.Init = plan.Init
	}
	if err != nil {
		return fail(err)
	}
	if err := e.WaitIdle(ctx); err != nil {
		return fail(err)
	}
	if s, ok := e.(Settler); ok && ph.Cell.Gateways > 1 && !ph.Cell.Isolated {
		t0 := time.Now()
		if err := s.Settle(ctx); err != nil {
			return fail(fmt.Errorf("%w: gateways did not converge after initialisation: %w", ErrEngine, err))
		}
		det.SettleMS = float64(time.Since(t0).Microseconds()) / 1000
	}
	before, err := e.Counters(ctx)
	if err != nil {
		return fail(err)
	}
	total := len(plan.Sequence)
	if plan.Turns > 1 {
		total = plan.Sessions * plan.Turns
	}
	step := func() {}
	if prog != nil {
		prog.PhaseStart(ph.Name, total)
		step = prog.Step
	}
	d, err := drive(ctx, e, cfg, ph, plan, step)
	if err != nil {
		det.Error = err.Error()
		return nil, det, d.recs, err
	}
	if err := e.WaitIdle(ctx); err != nil {
		return fail(err)
	}
	after, err := e.Counters(ctx)
	if err != nil {
		return fail(err)
	}
	names := e.Replicas()
	sum := Summarize(d.recs, cfg.SLO)
	run := &Run{
		Scenario:     ph.Scenario,
		Round:        ph.Round,
		Strategy:     ph.Strategy,
		Mode:         ph.Cell.Mode,
		Gateways:     ph.Cell.Gateways,
		Isolated:     ph.Cell.Isolated,
		Replicas:     len(names),
		Arrivals:     sum.Arrivals,
		Succeeded:    sum.Succeeded,
		Failed:       sum.Failed,
		SLOPass:      sum.SLOPass,
		TTFTP95:      Num(sum.TTFTP95),
		TPOTP95:      Num(sum.TPOTP95),
		E2EP95:       Num(sum.E2EP95),
		TokenHitRate: Num(HitRate(before, after)),
		PerReplica:   map[string]int{},
		Selection:    SelectionDelta(before, after),
		MaxWaiting:   MaxWaiting(names, d.obs),
	}
	for _, n := range names {
		run.PerReplica[n] = sum.PerReplica[n]
	}
	for n, c := range sum.PerReplica {
		run.PerReplica[n] = c // a replica the engine did not list still shows
	}
	det.Measured = true
	det.StartS = secs(d.t0)
	det.EndS = secs(d.lastDone)
	det.Unsent = sum.Unsent
	det.LagP95S, det.LagMaxS = scheduleLag(d.recs)
	det.Samples = d.obs
	for _, r := range d.recs {
		if r.Usage != nil {
			det.PromptTokens += r.Usage.PromptTokens
			det.CompletionTokens += r.Usage.CompletionTokens
		}
	}
	det.OutputTokensPerS = Num(math.NaN())
	if span := d.lastDone - d.t0; span > 0 {
		det.OutputTokensPerS = Num(float64(det.CompletionTokens) / span.Seconds())
	}
	for i := range names {
		det.QueriesDelta = append(det.QueriesDelta, at(after.Queries, i)-at(before.Queries, i))
		det.HitsDelta = append(det.HitsDelta, at(after.Hits, i)-at(before.Hits, i))
		det.SuccessDelta = append(det.SuccessDelta, at(after.Success, i)-at(before.Success, i))
	}
	return run, det, d.recs, nil
}

func at(xs []float64, i int) float64 {
	if i < len(xs) {
		return xs[i]
	}
	return math.NaN()
}

// LagTolerance is the schedule lag (P95, model time) above which a phase
// is flagged as measured on a host that did not keep up.
const LagTolerance = 100 * time.Millisecond

// scheduleLag returns the P95 and maximum of Start − Scheduled over the
// sent first-turn arrivals (later turns are scheduled on completion).
func scheduleLag(recs []RequestRecord) (Num, Num) {
	var lags []float64
	for _, r := range recs {
		if r.Sent && r.Turn <= 1 {
			lags = append(lags, r.Start-r.Scheduled)
		}
	}
	if len(lags) == 0 {
		return Num(math.NaN()), Num(math.NaN())
	}
	return Num(Percentile(lags, 95)), Num(Percentile(lags, 100))
}

// LaggingPhases lists the measured phases whose schedule lag P95 exceeded
// LagTolerance, with their lag.
func LaggingPhases(res *Results) []string {
	var out []string
	for _, p := range res.Phases {
		if p.Measured && float64(p.LagP95S) > LagTolerance.Seconds() {
			out = append(out, fmt.Sprintf("%s (lag P95 %.0f ms)", p.Name, 1000*float64(p.LagP95S)))
		}
	}
	return out
}
