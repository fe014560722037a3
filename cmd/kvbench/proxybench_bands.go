package main

import (
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/chaos/study"
)

// A p99 of a few thousand requests on a shared two-core machine moves by
// milliseconds from one run to the next (the OS schedules the load
// generator, the engines and the proxies on the same cores), while issue
// 21's bounds are 0.2 and 0.5 ms. So beside each compared figure the
// report gives a band: how far the figure moves when the run is made of
// other draws of the same rounds. A resample draws as many rounds as ran,
// with replacement, and takes every target's block of each drawn round
// (blocks of one round ran side by side, so a resample keeps what the
// machine did to all targets at that time together); the band is the 5th
// to 95th percentile of the figure over resamples. A band that straddles
// a bound says the run cannot tell whether the bound holds.

// bandResamples is the number of round resamples per band.
const bandResamples = 400

// blockTimes is what one block measured for one target: its TTFBs and
// inter-chunk gaps.
type blockTimes struct {
	ttfb, gaps []time.Duration
}

// band is one compared figure of a run (all rounds) and its 5th–95th
// percentile over round resamples, in milliseconds.
type band struct {
	Figure string  `json:"figure"`
	Value  float64 `json:"value_ms"`
	Lo     float64 `json:"p5_ms"`
	Hi     float64 `json:"p95_ms"`
}

// proxyBands is the bands of one stream count.
type proxyBands struct {
	Streams   int    `json:"streams"`
	Rounds    int    `json:"rounds"`
	Resamples int    `json:"resamples"`
	Bands     []band `json:"bands"` // none without the targets to compare
}

// bandFigure is one compared figure, computed from the targets' blocks
// of some rounds (see drawn).
type bandFigure struct {
	name  string
	needs []string
	of    func(d *drawn) float64
}

// sortedBlocks is one target's blocks, each sorted.
type sortedBlocks struct {
	ttfb, gaps [][]time.Duration
}

// drawn is a resample: every target's blocks, and how many times each
// round was drawn.
type drawn struct {
	blocks map[string]*sortedBlocks
	times  []int
}

// ttfb and gap return target's p-quantile over the drawn rounds.
func (d *drawn) ttfb(target string, p float64) time.Duration {
	return pooledPct(d.blocks[target].ttfb, d.times, p)
}

func (d *drawn) gap(target string, p float64) time.Duration {
	return pooledPct(d.blocks[target].gaps, d.times, p)
}

// pooledPct is pct of the multiset holding sorted block r times[r] times,
// without building it: pct's two order statistics are found by bisecting
// the value range, counting with a binary search per block.
func pooledPct(blocks [][]time.Duration, times []int, p float64) time.Duration {
	n := 0
	lo, hi := time.Duration(math.MaxInt64), time.Duration(math.MinInt64)
	for r, b := range blocks {
		if times[r] == 0 || len(b) == 0 {
			continue
		}
		n += times[r] * len(b)
		lo, hi = min(lo, b[0]), max(hi, b[len(b)-1])
	}
	if n == 0 {
		return 0
	}
	// kth is the k-th smallest (from 0): the least v with more than k
	// values ≤ v.
	kth := func(k int) time.Duration {
		a, z := lo, hi
		for a < z {
			v := a + (z-a)/2
			c := 0
			for r, b := range blocks {
				if times[r] > 0 {
					i, _ := slices.BinarySearch(b, v+1)
					c += times[r] * i
				}
			}
			if c > k {
				z = v
			} else {
				a = v + 1
			}
		}
		return a
	}
	pos := p * float64(n-1)
	k := int(pos)
	if k+1 >= n {
		return hi
	}
	x, y := kth(k), kth(k+1)
	return x + time.Duration(math.Round((pos-float64(k))*float64(y-x)))
}

// bandFigures are the figures issue 21's acceptance compares: kvmesh's
// added TTFB against nginx's (the direct TTFB cancels out of the
// difference) and kvmesh's and nginx's added inter-chunk gap p99; with
// the Go floor measured, the same against it.
var bandFigures = []bandFigure{
	ttfbDiff(targetKvmesh, targetNginx, .5),
	ttfbDiff(targetKvmesh, targetNginx, .99),
	addedGap(targetKvmesh),
	addedGap(targetNginx),
	// With --go-floor: kvmesh against the least a Go proxy costs.
	ttfbDiff(targetKvmesh, targetGoFloor, .5),
	ttfbDiff(targetKvmesh, targetGoFloor, .99),
	addedGap(targetGoFloor),
	// With --raw-floor: against the least any Go proxy costs.
	ttfbDiff(targetKvmesh, targetRawFloor, .5),
	ttfbDiff(targetKvmesh, targetRawFloor, .99),
	ttfbDiff(targetRawFloor, targetNginx, .99),
	addedGap(targetRawFloor),
}

// ttfbDiff is a's TTFB p-quantile minus b's.
func ttfbDiff(a, b string, p float64) bandFigure {
	return bandFigure{fmt.Sprintf("%s − %s, TTFB p%.0f", a, b, p*100), []string{a, b}, func(d *drawn) float64 {
		return ms(d.ttfb(a, p) - d.ttfb(b, p))
	}}
}

// addedGap is t's inter-chunk gap p99 over direct's.
func addedGap(t string) bandFigure {
	return bandFigure{t + " added gap p99", []string{t, targetDirect}, func(d *drawn) float64 {
		return ms(d.gap(t, .99) - d.gap(targetDirect, .99))
	}}
}

// roundBands computes the bands of one stream count from each target's
// blocks, one per round in round order (byRound), with the given number
// of resamples; the same blocks give the same bands.
func roundBands(streams int, byRound map[string][]blockTimes, resamples int) proxyBands {
	rounds := -1
	for _, blocks := range byRound {
		if rounds < 0 || len(blocks) < rounds {
			rounds = len(blocks)
		}
	}
	out := proxyBands{Streams: streams, Rounds: max(rounds, 0), Resamples: resamples}
	var figs []bandFigure
	for _, f := range bandFigures {
		ok := true
		for _, t := range f.needs {
			ok = ok && len(byRound[t]) > 0
		}
		if ok {
			figs = append(figs, f)
		}
	}
	if rounds < 1 || len(figs) == 0 {
		return out
	}
	d := drawn{blocks: map[string]*sortedBlocks{}, times: make([]int, rounds)}
	for name, blocks := range byRound {
		sb := &sortedBlocks{}
		for _, b := range blocks[:rounds] {
			sb.ttfb = append(sb.ttfb, slices.Sorted(slices.Values(b.ttfb)))
			sb.gaps = append(sb.gaps, slices.Sorted(slices.Values(b.gaps)))
		}
		d.blocks[name] = sb
	}
	for r := range d.times {
		d.times[r] = 1
	}
	for _, f := range figs {
		out.Bands = append(out.Bands, band{Figure: f.name, Value: f.of(&d)})
	}
	rng := rand.New(rand.NewPCG(uint64(streams), uint64(rounds)))
	draws := make([][]float64, len(figs))
	for range resamples {
		clear(d.times)
		for range rounds {
			d.times[rng.IntN(rounds)]++
		}
		for i, f := range figs {
			draws[i] = append(draws[i], f.of(&d))
		}
	}
	for i := range out.Bands {
		out.Bands[i].Lo = study.Percentile(draws[i], 5)
		out.Bands[i].Hi = study.Percentile(draws[i], 95)
	}
	return out
}

func (b proxyBands) write(w io.Writer) {
	if len(b.Bands) == 0 {
		return
	}
	fmt.Fprintf(w, "%d streams, 5th–95th percentile over %d resamples of the %d rounds:", b.Streams, b.Resamples, b.Rounds)
	for i, x := range b.Bands {
		sep := ";"
		if i == 0 {
			sep = ""
		}
		fmt.Fprintf(w, "%s %s %+.2f ms [%+.2f, %+.2f]", sep, x.Figure, x.Value, x.Lo, x.Hi)
	}
	fmt.Fprintln(w)
}
