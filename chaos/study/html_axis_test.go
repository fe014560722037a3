package study

import (
	"math"
	"regexp"
	"strconv"
	"testing"
)

// TestNiceAxisTicks: ticks fall on multiples of 1, 2 or 5 times a power of
// ten (never 1.25 or 3.75), 3 to 5 intervals, and the axis ends at the
// first tick at or above the data.
func TestNiceAxisTicks(t *testing.T) {
	for _, v := range []float64{0.3, 1, 3.1, 4.9, 5, 7.5, 9.7, 12, 48, 96, 100, 3100, 0.0042} {
		end, step := niceAxis(v)
		if end < v || end-step >= v {
			t.Errorf("niceAxis(%v) = %v, %v: the end is not the first tick at or above the data", v, end, step)
		}
		n := math.Round(end / step)
		if n < 2 || n > 5 {
			t.Errorf("niceAxis(%v) = %v, %v: %v intervals", v, end, step, n)
		}
		m := step / math.Pow(10, math.Floor(math.Log10(step)))
		if r := math.Round(m*1e6) / 1e6; r != 1 && r != 2 && r != 5 {
			t.Errorf("niceAxis(%v): step %v is not 1, 2 or 5 times a power of ten", v, step)
		}
	}
	p := newPlot(400, 200, 10, 5, "t", "x", "y")
	for _, m := range regexp.MustCompile(`text-anchor="end">([0-9.]+)</text>`).FindAllStringSubmatch(p.b.String(), -1) {
		v, _ := strconv.ParseFloat(m[1], 64)
		if v != math.Trunc(v) {
			t.Errorf("y tick %s for data up to 5", m[1])
		}
	}
}
