package study

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
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
	// Workers is how many cells run at once, each on its own engine from
	// Factory (the factory must then be safe for concurrent use). 0 or 1
	// runs them one after another. Cells share nothing, and the results
	// are assembled in cell order, so they do not depend on Workers; the
	// phases of one cell always run in order on one engine, because a
	// phase starts from the state the previous one left (learned cost
	// rates, index contents, the engine clock). With more than one worker,
	// Progress calls are serialised but interleave between cells (use a
	// line progress, NewLineProgress, rather than bars).
	Workers int
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
	cells := cfg.Cells()
	if rn.Workers <= 1 || len(cells) <= 1 {
		for _, cell := range cells {
			if err := rn.runCell(ctx, log, rn.Progress, cell, res); err != nil {
				return res, err
			}
		}
		return res, nil
	}
	return rn.runParallel(ctx, log, cells, res)
}

// runParallel runs cells on rn.Workers goroutines, each into its own
// Results, and appends them to res in cell order. As the sequential run
// stops at the first failing cell, so does the assembly: the cells after
// the first failure (in cell order) are cancelled or dropped, and that
// failure is returned.
func (rn *Runner) runParallel(ctx context.Context, log *slog.Logger, cells []Cell, res *Results) (*Results, error) {
	type cellRun struct {
		res    Results
		err    error
		ctx    context.Context
		cancel context.CancelFunc
	}
	runs := make([]cellRun, len(cells))
	for i := range runs {
		runs[i].ctx, runs[i].cancel = context.WithCancel(ctx)
	}
	defer func() {
		for i := range runs {
			runs[i].cancel()
		}
	}()
	var prog Progress
	if rn.Progress != nil {
		prog = &syncProgress{p: rn.Progress}
	}
	var (
		mu   sync.Mutex
		next int
		wg   sync.WaitGroup
	)
	for range min(rn.Workers, len(cells)) {
		wg.Go(func() {
			for {
				mu.Lock()
				i := next
				next++
				mu.Unlock()
				if i >= len(cells) {
					return
				}
				r := &runs[i]
				if err := r.ctx.Err(); err != nil {
					r.err = err
					continue
				}
				r.err = rn.runCell(r.ctx, log, prog, cells[i], &r.res)
				if r.err != nil {
					for j := i + 1; j < len(runs); j++ {
						runs[j].cancel()
					}
				}
			}
		})
	}
	wg.Wait()
	for i := range runs {
		r := &runs[i]
		res.Config.HostChecks = append(res.Config.HostChecks, r.res.Config.HostChecks...)
		res.Runs = append(res.Runs, r.res.Runs...)
		res.Phases = append(res.Phases, r.res.Phases...)
		res.Requests = append(res.Requests, r.res.Requests...)
		if r.err != nil {
			return res, r.err
		}
	}
	return res, nil
}

// syncProgress serialises a Progress shared by parallel cells.
type syncProgress struct {
	mu sync.Mutex
	p  Progress
}

func (s *syncProgress) PhaseStart(name string, total int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.p.PhaseStart(name, total)
}

func (s *syncProgress) Step() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.p.Step()
}

func (s *syncProgress) PhaseDone(name string, run *Run, det *PhaseDetail, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.p.PhaseDone(name, run, det, err)
}

func (s *syncProgress) Note(line string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.p.Note(line)
}

// runCell runs one cell's phases in order on a fresh engine, appending to
// res (its Config.HostChecks, Runs, Phases and Requests).
func (rn *Runner) runCell(ctx context.Context, log *slog.Logger, prog Progress, cell Cell, res *Results) error {
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
		if prog != nil {
			prog.Note(HostCheckLine(chk))
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
				run, det, recs, err := RunPhase(ctx, e, cfg, ph, prog)
				res.Phases = append(res.Phases, det)
				res.Requests = append(res.Requests, recs...)
				if run != nil {
					res.Runs = append(res.Runs, *run)
				}
				if prog != nil {
					prog.PhaseDone(ph.Name, run, &det, err)
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
	switch {
	case plan.Workload != nil:
		total = plan.Workload.Requests
	case plan.Turns > 1:
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
