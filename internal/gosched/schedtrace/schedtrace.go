// Package schedtrace reads a Go execution trace (runtime/trace, or a
// gateway's /debug/pprof/trace) for what its goroutine wake-ups waited
// for: how long goroutines that were ready to run waited for a P, and,
// for the waits of a millisecond or more, what the Ps ran meanwhile and
// whether a GC was on. The runtime's go_sched_latencies_seconds
// (package gosched) says that goroutines waited; the trace says for
// what. kvbench proxybench --trace summarises a trace per kvmesh target
// with it (issue 21: where a gateway's added tail latency goes).
package schedtrace

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"

	"golang.org/x/exp/trace"
)

// LongWait is the wait from which a wake-up counts as long: a
// millisecond, the order of what a gateway's TTFB p99 adds over nginx's
// at 200 streams (issue 21).
const LongWait = time.Millisecond

// LongRun is the run length from which a goroutine's run counts as long:
// ten times the median run of a gateway's relay goroutines (about 20 µs),
// so a run that keeps a P from the others for as long as ten chunks'
// relays.
const LongRun = 200 * time.Microsecond

// Summary is what Analyze read from a trace.
type Summary struct {
	// Module is the function-name prefix Analyze was given; Write leaves
	// it out of the names it prints.
	Module string `json:"module,omitempty"`
	// Span is the time between the trace's first and last event.
	Span time.Duration `json:"span_ns"`
	// Procs is the number of Ps the trace shows running goroutines.
	Procs int `json:"procs"`
	// Wakeups counts goroutines that went from runnable to running;
	// WaitP50, WaitP99, WaitP999 and WaitMax are percentiles of how long
	// they were runnable first.
	Wakeups  int           `json:"wakeups"`
	WaitP50  time.Duration `json:"wait_p50_ns"`
	WaitP99  time.Duration `json:"wait_p99_ns"`
	WaitP999 time.Duration `json:"wait_p999_ns"`
	WaitMax  time.Duration `json:"wait_max_ns"`
	// LongWaits counts wake-ups that waited LongWait or more. BusyPs is
	// the mean number of Ps running goroutines while they waited: Procs
	// when every P ran another goroutine throughout (the waits queued
	// behind the process's own goroutines, or behind ones whose threads
	// the operating system took off the CPU while they ran: a trace
	// cannot tell these apart), fewer when Ps sat idle while a goroutine
	// was ready (the scheduler was slow to hand it one). InGC counts the
	// long waits that overlapped a GC mark phase or stop-the-world pause.
	LongWaits int     `json:"long_waits"`
	BusyPs    float64 `json:"busy_ps"`
	InGC      int     `json:"long_waits_in_gc"`
	// Runs counts goroutine runs (running to anything else); RunP50 and
	// RunP99 are percentiles of their lengths, LongRunShare the share of
	// all running time spent in runs of LongRun or more.
	Runs         int           `json:"runs"`
	RunP50       time.Duration `json:"run_p50_ns"`
	RunP99       time.Duration `json:"run_p99_ns"`
	LongRunShare float64       `json:"long_run_share"`
	// RanDuringWaits is what the Ps ran while the long waits lasted: the
	// running time that overlapped them, by where each goroutine that
	// ran had last blocked (Where), largest first.
	RanDuringWaits []Share `json:"ran_during_long_waits,omitempty"`
	// Activities sums the runs by what the goroutine did: from where it
	// had last blocked to where it blocked next (in a gateway, relaying a
	// chunk is node.(*rawRelay).run to node.(*rawRelay).run), most
	// running time first.
	Activities []Activity `json:"activities,omitempty"`
}

// Activity is one line of Summary.Activities. To is "(preempted)" for a
// run that ended runnable, "(syscall)" for one that entered a blocking
// system call, "(exited)" for a goroutine's last.
type Activity struct {
	From  string        `json:"from"`
	To    string        `json:"to"`
	Runs  int           `json:"runs"`
	Total time.Duration `json:"total_ns"`
	Share float64       `json:"share"` // of all running time
}

// RunningAtStart names where a goroutine blocked when the trace shows it
// running before it shows it blocked or created: it was running when the
// trace began.
const RunningAtStart = "(running when the trace began)"

// Share is one line of Summary.RanDuringWaits.
type Share struct {
	Where string  `json:"where"`
	Share float64 `json:"share"`
}

// Analyze reads a whole execution trace from r. module, when not empty,
// is a function-name prefix (such as "github.com/kvmesh/kvmesh/") that
// names where a goroutine blocked: the innermost frame of its blocking
// stack with that prefix, else the innermost outside the runtime's and
// the standard library's synchronisation and polling. A goroutine not
// yet seen blocking is named by its starting stack the same way, or
// RunningAtStart.
func Analyze(r io.Reader, module string) (Summary, error) {
	rd, err := trace.NewReader(r)
	if err != nil {
		return Summary{}, fmt.Errorf("execution trace: %w", err)
	}
	a := analysis{
		module:   module,
		runnable: map[trace.GoID]trace.Time{},
		running:  map[trace.GoID]trace.Time{},
		where:    map[trace.GoID]string{},
		procs:    map[trace.ProcID]bool{},
		ranges:   map[string]trace.Time{},
	}
	for {
		ev, err := rd.ReadEvent()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return Summary{}, fmt.Errorf("execution trace: %w", err)
		}
		a.event(ev)
	}
	if !a.seen {
		return Summary{}, errors.New("execution trace: no events")
	}
	return a.summary(), nil
}

// run is one goroutine's run, labelled by where it had last blocked.
type run struct {
	start, end trace.Time
	where      string // where the goroutine had blocked before the run
	to         string // where it blocked after it (Activity.To)
}

// span is a closed interval of trace time.
type span struct{ start, end trace.Time }

type analysis struct {
	module      string
	seen        bool // an event was read
	first, last trace.Time
	runnable    map[trace.GoID]trace.Time // since when each runnable goroutine is
	running     map[trace.GoID]trace.Time // since when each running goroutine runs
	where       map[trace.GoID]string     // where each goroutine last blocked
	procs       map[trace.ProcID]bool
	ranges      map[string]trace.Time // open GC ranges by name
	waits       []time.Duration
	long        []span // the long waits
	runs        []run
	gc          []span
}

func (a *analysis) event(ev trace.Event) {
	t := ev.Time()
	if !a.seen {
		a.seen, a.first = true, t
	}
	a.last = t
	switch ev.Kind() {
	case trace.EventRangeBegin, trace.EventRangeActive:
		if r := ev.Range(); isGC(r.Name) {
			a.ranges[r.Name] = t
		}
	case trace.EventRangeEnd:
		r := ev.Range()
		if s, ok := a.ranges[r.Name]; ok {
			a.gc = append(a.gc, span{s, t})
			delete(a.ranges, r.Name)
		}
	case trace.EventStateTransition:
		st := ev.StateTransition()
		if st.Resource.Kind != trace.ResourceGoroutine {
			return
		}
		a.transition(st.Resource.Goroutine(), st, ev.Proc(), t)
	}
}

func (a *analysis) transition(g trace.GoID, st trace.StateTransition, proc trace.ProcID, t trace.Time) {
	from, to := st.Goroutine()
	if from == trace.GoRunning && to != trace.GoRunning {
		next := runEnd(to)
		if to == trace.GoWaiting {
			next = a.label(st.Stack)
		}
		if start, ok := a.running[g]; ok {
			a.runs = append(a.runs, run{start, t, a.where[g], next})
			delete(a.running, g)
		}
		if to == trace.GoWaiting {
			a.where[g] = next
		}
	}
	switch {
	case from == trace.GoNotExist && to == trace.GoRunnable:
		// A new goroutine is named by the function it starts in until
		// it first blocks.
		a.where[g] = a.label(st.Stack)
	case from != trace.GoRunning && to == trace.GoWaiting && st.Stack != trace.NoStack:
		// A goroutine blocked when the trace began.
		a.where[g] = a.label(st.Stack)
	}
	switch to {
	case trace.GoRunnable:
		// Runnable when the trace began (from undetermined): since when
		// is not known, so its wait is not counted.
		if from != trace.GoUndetermined {
			a.runnable[g] = t
		} else {
			delete(a.runnable, g)
		}
	case trace.GoRunning:
		if s, ok := a.runnable[g]; ok && from == trace.GoRunnable {
			w := t.Sub(s)
			a.waits = append(a.waits, w)
			if w >= LongWait {
				a.long = append(a.long, span{s, t})
			}
		}
		delete(a.runnable, g)
		a.running[g] = t
		a.procs[proc] = true
		if _, ok := a.where[g]; !ok {
			a.where[g] = RunningAtStart
		}
	default:
		delete(a.runnable, g)
	}
}

// runEnd names how a run that did not block ended (Activity.To).
func runEnd(to trace.GoState) string {
	switch to {
	case trace.GoRunnable:
		return "(preempted)"
	case trace.GoSyscall:
		return "(syscall)"
	case trace.GoNotExist:
		return "(exited)"
	}
	return "(" + to.String() + ")"
}

// isGC reports whether a range is a GC phase that holds up goroutines:
// the concurrent mark phase (whose workers and assists take Ps) or a
// stop-the-world pause.
func isGC(name string) bool {
	return name == "GC concurrent mark phase" || strings.HasPrefix(name, "stop-the-world")
}

// label names where a goroutine blocked, from its blocking stack: the
// innermost frame of the module, else the innermost outside the
// plumbing, else the goroutine's own function (the outermost frame: a GC
// worker's, say).
func (a *analysis) label(st trace.Stack) string {
	var outside, outermost string
	for f := range st.Frames() {
		if a.module != "" && strings.HasPrefix(f.Func, a.module) {
			return f.Func
		}
		if outside == "" && !plumbing(f.Func) {
			outside = f.Func
		}
		outermost = f.Func
	}
	switch {
	case outside != "":
		return outside
	case outermost != "":
		return outermost
	}
	return "(no stack)"
}

// plumbing reports whether a function is the runtime's or the standard
// library's parking, polling or locking, which every blocked goroutine
// has on its stack.
func plumbing(fn string) bool {
	for _, p := range []string{"runtime.", "internal/", "syscall.", "sync.", "net.", "os."} {
		if strings.HasPrefix(fn, p) {
			return true
		}
	}
	return false
}

func (a *analysis) summary() Summary {
	s := Summary{Module: a.module, Span: a.last.Sub(a.first), Procs: len(a.procs), Wakeups: len(a.waits), LongWaits: len(a.long)}
	if len(a.waits) > 0 {
		slices.Sort(a.waits)
		s.WaitP50, s.WaitP99, s.WaitP999 = quantile(a.waits, 0.5), quantile(a.waits, 0.99), quantile(a.waits, 0.999)
		s.WaitMax = a.waits[len(a.waits)-1]
	}
	s.Runs = len(a.runs)
	var longest time.Duration // the longest run
	if len(a.runs) > 0 {
		lens := make([]time.Duration, len(a.runs))
		var total, long time.Duration
		acts := map[[2]string]*Activity{}
		for i, r := range a.runs {
			lens[i] = r.end.Sub(r.start)
			total += lens[i]
			if lens[i] >= LongRun {
				long += lens[i]
			}
			k := [2]string{r.where, r.to}
			act := acts[k]
			if act == nil {
				act = &Activity{From: r.where, To: r.to}
				acts[k] = act
			}
			act.Runs++
			act.Total += lens[i]
		}
		slices.Sort(lens)
		s.RunP50, s.RunP99 = quantile(lens, 0.5), quantile(lens, 0.99)
		longest = lens[len(lens)-1]
		if total > 0 {
			s.LongRunShare = float64(long) / float64(total)
		}
		for _, act := range acts {
			if total > 0 {
				act.Share = float64(act.Total) / float64(total)
			}
			s.Activities = append(s.Activities, *act)
		}
		slices.SortFunc(s.Activities, func(x, y Activity) int {
			return cmp.Or(cmp.Compare(y.Total, x.Total), strings.Compare(x.From, y.From), strings.Compare(x.To, y.To))
		})
	}
	if len(a.long) == 0 {
		return s
	}
	// What ran during the long waits: runs and waits sorted by start, so
	// each wait looks only at runs that started at most the longest run
	// before it.
	slices.SortFunc(a.runs, func(x, y run) int { return cmp.Compare(x.start, y.start) })
	slices.SortFunc(a.long, func(x, y span) int { return cmp.Compare(x.start, y.start) })
	by := map[string]time.Duration{}
	var waited, ran time.Duration
	lo := 0
	for _, w := range a.long {
		waited += w.end.Sub(w.start)
		for lo < len(a.runs) && a.runs[lo].start < w.start-trace.Time(longest) {
			lo++
		}
		for _, r := range a.runs[lo:] {
			if r.start >= w.end {
				break
			}
			if o := min(r.end, w.end).Sub(max(r.start, w.start)); o > 0 {
				by[r.where] += o
				ran += o
			}
		}
		for _, g := range a.gc {
			if g.start < w.end && g.end > w.start {
				s.InGC++
				break
			}
		}
	}
	if waited > 0 {
		s.BusyPs = float64(ran) / float64(waited)
	}
	for where, d := range by {
		s.RanDuringWaits = append(s.RanDuringWaits, Share{where, float64(d) / float64(ran)})
	}
	slices.SortFunc(s.RanDuringWaits, func(x, y Share) int {
		return cmp.Or(cmp.Compare(y.Share, x.Share), strings.Compare(x.Where, y.Where))
	})
	return s
}

// quantile returns the q-quantile of sorted xs (nearest rank below).
func quantile(xs []time.Duration, q float64) time.Duration {
	return xs[int(math.Floor(q*float64(len(xs)-1)))]
}

// Write prints s in a few lines, the Activities and RanDuringWaits down
// to top lines each.
func (s Summary) Write(w io.Writer, top int) {
	ms := func(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d)/1e6) }
	name := func(fn string) string {
		if s.Module != "" {
			return strings.TrimPrefix(fn, s.Module)
		}
		return fn
	}
	fmt.Fprintf(w, "  %d goroutine wake-ups in %.2f s; their wait for a P: p50 %s, p99 %s, p99.9 %s, max %s\n",
		s.Wakeups, s.Span.Seconds(), ms(s.WaitP50), ms(s.WaitP99), ms(s.WaitP999), ms(s.WaitMax))
	if s.LongWaits == 0 {
		fmt.Fprintf(w, "  none waited %s or more\n", ms(LongWait))
	} else {
		fmt.Fprintf(w, "  %d waited %s or more: meanwhile %.2f of %d Ps ran goroutines on average; %d of them during a GC\n",
			s.LongWaits, ms(LongWait), s.BusyPs, s.Procs, s.InGC)
	}
	fmt.Fprintf(w, "  %d goroutine runs: p50 %s, p99 %s; runs of %s or more hold %.0f%% of the running time\n",
		s.Runs, ms(s.RunP50), ms(s.RunP99), ms(LongRun), 100*s.LongRunShare)
	if len(s.Activities) > 0 {
		fmt.Fprintf(w, "  running time by what the goroutine did (where it had blocked -> where it blocked next):\n")
		for i, act := range s.Activities {
			if i == top {
				break
			}
			fmt.Fprintf(w, "    %5.1f%%  %6d runs, mean %s  %s -> %s\n", 100*act.Share, act.Runs,
				ms(act.Total/time.Duration(act.Runs)), name(act.From), name(act.To))
		}
	}
	if len(s.RanDuringWaits) > 0 {
		fmt.Fprintf(w, "  ran during the long waits, by where the goroutine last blocked:\n")
		for i, sh := range s.RanDuringWaits {
			if i == top {
				break
			}
			fmt.Fprintf(w, "    %5.1f%%  %s\n", 100*sh.Share, name(sh.Where))
		}
	}
}
