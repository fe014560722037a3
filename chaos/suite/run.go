package suite

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/chaos/cluster"
)

// Options configure Run.
type Options struct {
	Size Size
	// Progress receives one line per scenario start and end, and every
	// line a scenario logs when Verbose; nil discards them.
	Progress io.Writer
	Verbose  bool
}

// Result is one scenario's outcome.
type Result struct {
	Number   int           `json:"number"`
	Name     string        `json:"name"`
	Test     string        `json:"test"`
	Passed   bool          `json:"passed"`
	Failures []string      `json:"failures,omitempty"`
	Elapsed  time.Duration `json:"elapsed_ns"`
	Rows     []cluster.Row `json:"-"`
}

// jsonRow is a row in the JSON report: the figures without the
// per-request results.
type jsonRow struct {
	Scenario       string         `json:"scenario"`
	Sent           int            `json:"sent"`
	OK             int            `json:"ok"`
	Failed         int            `json:"failed"`
	Lost           int            `json:"lost"`
	Reasons        map[string]int `json:"reasons,omitempty"`
	Precision      float64        `json:"precision"`
	Recall         float64        `json:"recall"`
	ConvergeMS     float64        `json:"converge_ms"`
	ConfigVersions string         `json:"config_versions,omitempty"`
	Note           string         `json:"note,omitempty"`
}

// MarshalJSON writes the result with its rows' figures.
func (r Result) MarshalJSON() ([]byte, error) {
	type plain Result
	rows := make([]jsonRow, 0, len(r.Rows))
	for _, x := range r.Rows {
		rows = append(rows, jsonRow{Scenario: x.Scenario, Sent: x.Load.Sent, OK: x.Load.OK, Failed: x.Load.Failed,
			Lost: x.Load.Lost, Reasons: x.Load.Reasons, Precision: x.Precision, Recall: x.Recall,
			ConvergeMS: float64(x.Converge) / float64(time.Millisecond), ConfigVersions: x.ConfigVersions, Note: x.Note})
	}
	return json.Marshal(struct {
		plain
		Rows []jsonRow `json:"rows"`
	}{plain(r), rows})
}

// Run runs each scenario in turn, in process, and returns their results.
// A scenario fails as a go test would: an invariant's require fails, it
// panics, or a cleanup (the cluster's shutdown) fails. Scenarios run one at
// a time, as in the test package. ctx cancels the scenarios' Context (those
// that watch it stop early and fail) and skips the ones not yet started.
func Run(ctx context.Context, scs []Scenario, o Options) []Result {
	out := make([]Result, 0, len(scs))
	for i, sc := range scs {
		if ctx.Err() != nil {
			break
		}
		if sc.Number > 0 {
			progress(o.Progress, "chaos: [%d/%d] %s (scenario %d) ...", i+1, len(scs), sc.Name, sc.Number)
		} else {
			progress(o.Progress, "chaos: [%d/%d] %s ...", i+1, len(scs), sc.Name)
		}
		res := RunOne(ctx, sc, o)
		status := "ok"
		if !res.Passed {
			status = "FAIL"
		}
		progress(o.Progress, "chaos: [%d/%d] %s %s in %v", i+1, len(scs), sc.Name, status, res.Elapsed.Round(time.Millisecond))
		for _, r := range res.Rows {
			progress(o.Progress, "chaos:   %s", r.Line())
		}
		for _, f := range res.Failures {
			progress(o.Progress, "chaos:   failure: %s", f)
		}
		out = append(out, res)
	}
	return out
}

// RunOne runs one scenario on a T of its own (see T).
func RunOne(ctx context.Context, sc Scenario, o Options) Result {
	var rep cluster.Report
	t := newRunT(ctx, sc.Name, o)
	start := time.Now()
	t.run(func() { sc.Run(NewR(t, o.Size, &rep)) })
	t.finish()
	return Result{
		Number: sc.Number, Name: sc.Name, Test: sc.Test,
		Passed: !t.Failed(), Failures: t.failures(), Elapsed: time.Since(start), Rows: rep.Rows(),
	}
}

// Failed reports whether any result failed.
func Failed(rs []Result) bool {
	for _, r := range rs {
		if !r.Passed {
			return true
		}
	}
	return false
}

func progress(w io.Writer, format string, args ...any) {
	if w != nil {
		fmt.Fprintf(w, format+"\n", args...)
	}
}

// runT implements T outside the testing package: FailNow ends the calling
// goroutine with runtime.Goexit, as testing does, and run notices it.
type runT struct {
	name    string
	o       Options
	ctx     context.Context
	cancel  context.CancelFunc
	mu      sync.Mutex
	failed  bool
	msgs    []string
	cleanup []func()
	dirs    []string
}

func newRunT(ctx context.Context, name string, o Options) *runT {
	c, cancel := context.WithCancel(ctx)
	return &runT{name: name, o: o, ctx: c, cancel: cancel}
}

// run calls f on a goroutine of its own and waits for it to return, to
// call Goexit or to panic (a panic is a failure with its stack).
func (t *runT) run(f func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer func() {
			if v := recover(); v != nil {
				buf := make([]byte, 16<<10)
				buf = buf[:runtime.Stack(buf, false)]
				t.Errorf("panic: %v\n%s", v, buf)
			}
		}()
		f()
	}()
	<-done
}

// finish cancels the Context, runs the cleanups last-in first-out (each
// may fail the scenario) and removes the temporary directories.
func (t *runT) finish() {
	t.cancel()
	for {
		t.mu.Lock()
		n := len(t.cleanup)
		if n == 0 {
			t.mu.Unlock()
			break
		}
		f := t.cleanup[n-1]
		t.cleanup = t.cleanup[:n-1]
		t.mu.Unlock()
		t.run(f)
	}
	for _, d := range t.dirs {
		_ = os.RemoveAll(d)
	}
}

func (t *runT) failures() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]string(nil), t.msgs...)
}

func (t *runT) Helper()      {}
func (t *runT) Name() string { return t.name }

func (t *runT) Log(args ...any) { t.logLine(strings.TrimSuffix(fmt.Sprintln(args...), "\n")) }

func (t *runT) Logf(format string, args ...any) { t.logLine(fmt.Sprintf(format, args...)) }

func (t *runT) logLine(s string) {
	if t.o.Verbose {
		progress(t.o.Progress, "chaos:   %s: %s", t.name, s)
	}
}

func (t *runT) Errorf(format string, args ...any) {
	msg := strings.TrimSpace(fmt.Sprintf(format, args...))
	t.mu.Lock()
	t.failed = true
	t.msgs = append(t.msgs, msg)
	t.mu.Unlock()
	t.logLine("error: " + msg)
}

func (t *runT) Fatalf(format string, args ...any) {
	t.Errorf(format, args...)
	t.FailNow()
}

func (t *runT) FailNow() {
	t.mu.Lock()
	t.failed = true
	t.mu.Unlock()
	runtime.Goexit()
}

func (t *runT) Failed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.failed
}

func (t *runT) Cleanup(f func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.cleanup = append(t.cleanup, f)
}

// TempDir makes a directory removed after the cleanups; it fails the
// scenario if it cannot.
func (t *runT) TempDir() string {
	d, err := os.MkdirTemp("", "kvmesh-chaos-"+strings.NewReplacer("/", "_", " ", "_").Replace(t.name)+"-")
	if err != nil {
		t.Fatalf("TempDir: %v", err)
	}
	t.mu.Lock()
	t.dirs = append(t.dirs, d)
	t.mu.Unlock()
	return d
}

func (t *runT) Context() context.Context { return t.ctx }
