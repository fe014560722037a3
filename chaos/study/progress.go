package study

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// NewProgress returns a Progress that draws a bar per phase on w when w is
// a terminal and writes one plain line per phase otherwise.
func NewProgress(w io.Writer) Progress {
	if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		return &barProgress{w: w}
	}
	return &lineProgress{w: w}
}

type barProgress struct {
	w     io.Writer
	bar   *progressbar.ProgressBar
	start time.Time
}

func (p *barProgress) PhaseStart(name string, total int) {
	p.start = time.Now()
	p.bar = progressbar.NewOptions(total,
		progressbar.OptionSetWriter(p.w),
		progressbar.OptionSetDescription(fmt.Sprintf("%-44s", name)),
		progressbar.OptionSetWidth(30),
		progressbar.OptionShowCount(),
		progressbar.OptionThrottle(100*time.Millisecond),
		progressbar.OptionSetElapsedTime(true),
		progressbar.OptionSetPredictTime(false),
	)
}

func (p *barProgress) Step() {
	if p.bar != nil {
		_ = p.bar.Add(1)
	}
}

func (p *barProgress) PhaseDone(name string, run *Run, det *PhaseDetail, err error) {
	if p.bar != nil {
		_ = p.bar.Finish()
		p.bar = nil
	}
	fmt.Fprintln(p.w)
	fmt.Fprintln(p.w, phaseLine(name, run, det, err, time.Since(p.start)))
}

func (p *barProgress) Note(line string) { fmt.Fprintln(p.w, line) }

// NewLineProgress returns a Progress that writes one plain line when a
// phase starts and one when it is done, never a bar. Phases may overlap
// (Runner.Workers > 1): each phase's wall time is measured from its own
// start.
func NewLineProgress(w io.Writer) Progress { return &lineProgress{w: w} }

type lineProgress struct {
	w      io.Writer
	starts map[string]time.Time // by phase name, while running
}

func (p *lineProgress) PhaseStart(name string, total int) {
	if p.starts == nil {
		p.starts = map[string]time.Time{}
	}
	p.starts[name] = time.Now()
	fmt.Fprintf(p.w, "phase %s: %d arrivals\n", name, total)
}

func (p *lineProgress) Step() {}

func (p *lineProgress) PhaseDone(name string, run *Run, det *PhaseDetail, err error) {
	var wall time.Duration
	if t, ok := p.starts[name]; ok {
		wall = time.Since(t)
		delete(p.starts, name)
	}
	fmt.Fprintln(p.w, phaseLine(name, run, det, err, wall))
}

func phaseLine(name string, run *Run, det *PhaseDetail, err error, wall time.Duration) string {
	if run == nil {
		return fmt.Sprintf("phase %s: not measured: %v", name, err)
	}
	lag := ""
	if det != nil && float64(det.LagP95S) > LagTolerance.Seconds() {
		lag = fmt.Sprintf(" HOST LAGGING: arrivals %.0f ms late at P95, latencies inflated;", 1000*float64(det.LagP95S))
	}
	if det != nil && det.SettleMS > 0 {
		lag += fmt.Sprintf(" peers settled in %.0f ms;", det.SettleMS)
	}
	return fmt.Sprintf("phase %s: pass %d/%d, failed %d, TTFT P95 %s s, TPOT P95 %s ms, hit %s, per replica %v;%s (wall %s)",
		name, run.SLOPass, run.Arrivals, run.Failed, fnum(run.TTFTP95, 3), fnum(run.TPOTP95, 1),
		fpct(run.TokenHitRate), run.PerReplica, lag, wall.Round(100*time.Millisecond))
}

func (p *lineProgress) Note(line string) { fmt.Fprintln(p.w, line) }

// WithOverall wraps p with one overall line after every phase: phases done
// of total, the wall time so far and an ETA at the mean wall time per
// phase so far.
func WithOverall(p Progress, total int) Progress {
	return &overallProgress{Progress: p, total: total, start: time.Now()}
}

type overallProgress struct {
	Progress
	total, done int
	start       time.Time
}

func (o *overallProgress) PhaseDone(name string, run *Run, det *PhaseDetail, err error) {
	o.Progress.PhaseDone(name, run, det, err)
	o.done++
	o.Progress.Note(OverallLine(o.done, o.total, time.Since(o.start)))
}

// OverallLine is the overall progress line: "overall: 3/8 phases done,
// 1m30s elapsed, ETA 2m30s".
func OverallLine(done, total int, elapsed time.Duration) string {
	eta := "?"
	if done > 0 {
		eta = (elapsed / time.Duration(done) * time.Duration(max(total-done, 0))).Round(time.Second).String()
	}
	return fmt.Sprintf("overall: %d/%d phases done, %s elapsed, ETA %s", done, total, elapsed.Round(time.Second), eta)
}
