package schedtrace

import (
	"bytes"
	"runtime"
	"runtime/trace"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// hog holds the only P: each round it wakes the receiver on ch and keeps
// running for spin before it blocks, so the receiver waits about spin
// for the P, however busy the machine (a descheduled thread only makes
// the wait longer: the runtime cannot hand the P over before hog blocks,
// or sysmon preempts it after 10 ms). It blocks once first, so that the
// trace knows where it blocks from the first round on.
func hog(ch chan<- struct{}, rounds int, spin time.Duration) {
	time.Sleep(time.Millisecond)
	for range rounds {
		ch <- struct{}{}
		for start := time.Now(); time.Since(start) < spin; {
		}
		time.Sleep(50 * time.Microsecond)
	}
}

const hogName = "github.com/kvmesh/kvmesh/internal/gosched/schedtrace.hog"

// TestAnalyzeNamesWhatHeldTheP traces a receiver held up by a goroutine
// that keeps the only P and checks that the summary counts the long
// waits and names the hog as what ran during them.
//
// Only the test's own goroutines are ranked. On a busy machine a
// goroutine's thread can be off the CPU for tens of milliseconds while
// the trace shows it running, and the receiver's waits are then charged
// to it: the test goroutine before hog first blocks (35 ms in ci1301,
// five CI runs at once: RunningAtStart), or one of the runtime's own
// (the trace's advancer, 177 ms, beside 6 busy loops and 7 other test
// processes on 2 cores).
func TestAnalyzeNamesWhatHeldTheP(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	const rounds, spin = 20, 2 * time.Millisecond
	ch := make(chan struct{})
	done := make(chan struct{})
	ready := make(chan struct{})
	go func() {
		// With one P this goroutine runs on from close(ready) until it
		// blocks on ch: it is parked before the trace begins.
		close(ready)
		for range ch {
		}
		close(done)
	}()
	<-ready
	var buf bytes.Buffer
	require.NoError(t, trace.Start(&buf))
	hog(ch, rounds, spin)
	close(ch)
	<-done
	trace.Stop()

	s, err := Analyze(&buf, "github.com/kvmesh/kvmesh/")
	require.NoError(t, err)
	var out strings.Builder
	s.Write(&out, 4)
	t.Logf("\n%s", out.String())

	assert.Equal(t, 1, s.Procs, "GOMAXPROCS 1")
	assert.GreaterOrEqual(t, s.LongWaits, rounds/2, "the receiver waited for the P in most rounds")
	assert.GreaterOrEqual(t, s.WaitMax, spin, "a wait lasted the hog's spin")
	assert.Greater(t, s.Wakeups, s.LongWaits)
	var named []Share // the test's goroutines
	var namedSum float64
	for _, sh := range s.RanDuringWaits {
		if sh.Where != RunningAtStart && !strings.HasPrefix(sh.Where, "runtime") {
			named = append(named, sh)
			namedSum += sh.Share
		}
	}
	require.NotEmpty(t, named)
	assert.Equal(t, hogName, named[0].Where)
	// The thread can also be off the CPU between the hog's block and the
	// receiver's start, when the P runs nothing (4 test processes beside
	// 3 busy loops on 2 cores: down to 0.57 of the waits): most of each
	// wait is still the hog's.
	assert.Greater(t, named[0].Share/namedSum, 0.6, "the hog ran through the waits")
	assert.Greater(t, s.BusyPs, 0.3, "the one P was busy while the receiver waited")
	assert.LessOrEqual(t, s.BusyPs, 1.0)
	assert.Greater(t, s.LongRunShare, 0.5, "the hog's spins are most of the running time")
	assert.LessOrEqual(t, s.InGC, s.LongWaits)
	// The hog's spins run from one sleep to the next (or, when a busy
	// machine stretches one past 10 ms, to sysmon's preemption), and its
	// runs add up to at least the time it spun. Which activity is the
	// largest a busy machine decides: beside 6 busy loops and 7 other
	// test processes, a goroutine whose thread was off the CPU showed
	// one run of 134 ms.
	i := slices.IndexFunc(s.Activities, func(a Activity) bool { return a.From == hogName && a.To == hogName })
	require.GreaterOrEqual(t, i, 0, "the hog's spins are an activity")
	assert.GreaterOrEqual(t, s.Activities[i].Runs, rounds/2)
	var hogged time.Duration
	for _, a := range s.Activities {
		if a.From == hogName {
			hogged += a.Total
		}
	}
	assert.GreaterOrEqual(t, hogged, rounds*spin, "the hog's runs hold its spins")
	assert.Contains(t, out.String(), "internal/gosched/schedtrace.hog -> internal/gosched/schedtrace.hog", "names are printed without the module")
	assert.NotContains(t, out.String(), "(not seen blocking)")
}

func TestAnalyzeRejectsWhatIsNoTrace(t *testing.T) {
	_, err := Analyze(strings.NewReader("not a trace"), "")
	require.Error(t, err)
	_, err = Analyze(strings.NewReader(""), "")
	require.Error(t, err)
}
