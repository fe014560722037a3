// Package gosched reads what kvmesh's tools watch of a Go process's
// runtime in its Prometheus /metrics text: the GC cycle count and the
// scheduling latency histogram (go_sched_latencies_seconds, which a
// gateway exports: how long goroutines that were ready to run waited for
// a thread), and summarises the histogram as the shares of wake-ups that
// waited longer than about 1 ms and 10 ms. kvbench proxybench reports
// them per block, kvmesh doctor per gateway.
package gosched

import (
	"bufio"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
)

// Runtime is what Parse read.
type Runtime struct {
	// GCs is go_gc_duration_seconds_count, −1 when the text has none.
	GCs int64
	// Sched is go_sched_latencies_seconds, empty when the text has none.
	Sched Histogram
}

// Histogram is a cumulative histogram: upper bound (seconds; +Inf
// included) → the number of observations at or below it.
type Histogram map[float64]float64

// Parse reads r, a Prometheus text exposition. It fails on a line of
// either series it cannot read, not on other series.
func Parse(r io.Reader) (Runtime, error) {
	rt := Runtime{GCs: -1, Sched: Histogram{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if v, ok := strings.CutPrefix(line, "go_gc_duration_seconds_count "); ok {
			n, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				return rt, fmt.Errorf("gosched: %q: %w", line, err)
			}
			rt.GCs = int64(n)
		}
		if rest, ok := strings.CutPrefix(line, `go_sched_latencies_seconds_bucket{le="`); ok {
			le, count, ok := strings.Cut(rest, `"} `)
			if !ok {
				return rt, fmt.Errorf("gosched: %q: not a bucket", line)
			}
			bound, err := strconv.ParseFloat(le, 64) // "+Inf" parses
			if err != nil {
				return rt, fmt.Errorf("gosched: %q: %w", line, err)
			}
			n, err := strconv.ParseFloat(strings.TrimSpace(count), 64)
			if err != nil {
				return rt, fmt.Errorf("gosched: %q: %w", line, err)
			}
			rt.Sched[bound] = n
		}
	}
	return rt, sc.Err()
}

// Sub returns what h counted since prev (h minus prev per bound); nil
// when either is empty.
func (h Histogram) Sub(prev Histogram) Histogram {
	if len(h) == 0 || len(prev) == 0 {
		return nil
	}
	d := make(Histogram, len(h))
	for le, n := range h {
		d[le] = n - prev[le]
	}
	return d
}

// Waits summarises a scheduling latency histogram.
type Waits struct {
	// Wakeups is the number of wake-ups counted (the runtime samples
	// about one in eight of them).
	Wakeups float64
	// Over1 and Over10 are the shares of Wakeups that waited longer than
	// Bound1 and Bound10, the histogram's bounds nearest 1 ms and 10 ms
	// (the Go collector's buckets are about a factor of ten apart: 0.92
	// and 10.5 ms).
	Over1, Bound1, Over10, Bound10 float64
}

// Waits returns h's summary; zero for a histogram with no wake-ups.
func (h Histogram) Waits() Waits {
	w := Waits{Wakeups: h[math.Inf(1)]}
	if w.Wakeups <= 0 {
		return Waits{}
	}
	bounds := slices.Sorted(maps.Keys(h))
	pick := func(target float64) float64 {
		b := 0.0
		for _, le := range bounds {
			if le <= target*1.5 {
				b = le
			}
		}
		return b
	}
	w.Bound1, w.Bound10 = pick(1e-3), pick(1e-2)
	w.Over1, w.Over10 = 1-h[w.Bound1]/w.Wakeups, 1-h[w.Bound10]/w.Wakeups
	return w
}
