package des

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/chaos/study"
)

// SweepAxes are the settings a sweep visits: every combination of replica
// count, gateway count and arrival rate, in that nesting order.
type SweepAxes struct {
	Replicas []int
	Gateways []int
	RPS      []float64
	// ScaleInflightCap multiplies the study's in-flight cap by RPS/base
	// RPS, so that the client cap does not throttle a faster setting.
	ScaleInflightCap bool
	// Workers is how many cells of a setting run at once
	// (study.Runner.Workers); results do not depend on it.
	Workers int
}

// Setting is one point of a sweep.
type Setting struct {
	Replicas int
	Gateways int
	RPS      float64
}

// Name is the setting's directory name, e.g. "r64-g8-rps51.2".
func (s Setting) Name() string { return fmt.Sprintf("r%d-g%d-rps%g", s.Replicas, s.Gateways, s.RPS) }

// SweepResult is one setting's study.
type SweepResult struct {
	Setting Setting
	Results *study.Results
	// Wall is how long the setting took to simulate.
	Wall time.Duration
}

// Sweep runs base (every scenario, strategy, mode and round it names) once
// per setting of axes on DES engines built from o. Each setting's study
// gets the setting's replica count, a single gateway count and the rate;
// StudyConfig adapts the rest. When dir is not empty, each setting's
// outputs go to dir/<setting name>/ (study.WriteFiles) and one table per
// setting to dir/sweep.md. progress, if not nil, gets a line per setting.
// A failing setting stops the sweep; the results so far are returned with
// the error.
func Sweep(ctx context.Context, base study.Config, o Options, axes SweepAxes, dir string, progress io.Writer) ([]SweepResult, error) {
	if len(axes.Replicas) == 0 || len(axes.Gateways) == 0 || len(axes.RPS) == 0 {
		return nil, fmt.Errorf("%w: sweep needs at least one replica count, gateway count and rate", ErrInvalidOptions)
	}
	var out []SweepResult
	for _, r := range axes.Replicas {
		for _, g := range axes.Gateways {
			for _, rps := range axes.RPS {
				s := Setting{Replicas: r, Gateways: g, RPS: rps}
				c := base
				c.Replicas, c.Gateways, c.RPS = r, []int{g}, rps
				if axes.ScaleInflightCap && base.RPS > 0 {
					c.InflightCap = max(1, int(float64(base.InflightCap)*rps/base.RPS+0.5))
				}
				c = StudyConfig(c, o)
				start := time.Now()
				rn := &study.Runner{Config: c, Factory: Factory(o), Workers: axes.Workers}
				res, err := rn.Run(ctx)
				sr := SweepResult{Setting: s, Results: res, Wall: time.Since(start)}
				if res != nil {
					out = append(out, sr)
				}
				if err != nil {
					return out, fmt.Errorf("des: sweep %s: %w", s.Name(), err)
				}
				if progress != nil {
					fmt.Fprintf(progress, "sweep %s: %d runs in %s\n", s.Name(), len(res.Runs), sr.Wall.Round(time.Millisecond))
				}
				if dir != "" {
					if err := study.WriteFiles(filepath.Join(dir, s.Name()), res); err != nil {
						return out, err
					}
				}
			}
		}
	}
	if dir != "" {
		f, err := os.Create(filepath.Join(dir, "sweep.md"))
		if err != nil {
			return out, err
		}
		WriteSweep(f, out, o)
		if err := f.Close(); err != nil {
			return out, err
		}
	}
	return out, nil
}

// SweepTable returns one setting's compact table: a row per run with pass
// count, P95s, token hit rate, the spread of requests over replicas and
// the selection counts.
func SweepTable(sr SweepResult, o Options) study.Table {
	s := sr.Setting
	sync := "synced"
	switch {
	case s.Gateways == 1:
		sync = "one gateway"
	case o.NoSync:
		sync = "isolated (--no-sync)"
	}
	t := study.Table{
		Title: fmt.Sprintf("%d replicas × %d gateways (%s) @ %g RPS", s.Replicas, s.Gateways, sync, s.RPS),
		Header: []string{"scenario", "round", "mode", "strategy", "pass / arrivals", "failed", "TTFT P95 s",
			"TPOT P95 ms", "token hit", "requests per replica min–max", "selection"},
	}
	for _, r := range sr.Results.Runs {
		lo, hi := -1, 0
		for _, c := range r.PerReplica {
			if lo < 0 || c < lo {
				lo = c
			}
			hi = max(hi, c)
		}
		t.Rows = append(t.Rows, []string{
			r.Scenario, fmt.Sprint(r.Round), r.Mode, r.Strategy, fmt.Sprintf("%d / %d", r.SLOPass, r.Arrivals),
			fmt.Sprint(r.Failed), fmtNum(r.TTFTP95, 3), fmtNum(r.TPOTP95, 1), fmtPct(r.TokenHitRate),
			fmt.Sprintf("%d–%d", max(lo, 0), hi), selections(r.Selection),
		})
	}
	t.Notes = append(t.Notes, fmt.Sprintf("Delays: sync %v, load %v, KV events %v; simulated in %s.",
		o.SyncDelay, o.LoadDelay, o.KVDelay, sr.Wall.Round(time.Millisecond)))
	return t
}

// WriteSweep writes a Markdown document with one table per setting.
func WriteSweep(w io.Writer, res []SweepResult, o Options) {
	fmt.Fprintf(w, "# kvbench sweep (discrete-event engine)\n\n")
	for _, sr := range res {
		t := SweepTable(sr, o)
		t.Markdown(w)
	}
}

func fmtNum(v study.Num, prec int) string {
	f := float64(v)
	if f != f {
		return "—"
	}
	return fmt.Sprintf("%.*f", prec, f)
}

func fmtPct(v study.Num) string {
	f := float64(v)
	if f != f {
		return "—"
	}
	return fmt.Sprintf("%.1f%%", 100*f)
}

// selections renders selection counts in label order.
func selections(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	return strings.Join(parts, ", ")
}
