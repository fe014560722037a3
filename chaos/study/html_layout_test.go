package study

import (
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// textBox is a chart text's approximate extent: the font sizes of the
// .t and .tk classes and an average glyph width of 0.6 em. No browser runs
// here to measure them; the approximation errs on the wide side.
type textBox struct {
	s              string
	x0, x1, y0, y1 float64
	inside, rotate bool
}

var svgText = regexp.MustCompile(`<text x="([0-9.-]+)" y="([0-9.-]+)" class="([^"]+)"([^>]*)>([^<]*)</text>`)

func textBoxes(t *testing.T, svg string) []textBox {
	t.Helper()
	var out []textBox
	for _, m := range svgText.FindAllStringSubmatch(svg, -1) {
		x, _ := strconv.ParseFloat(m[1], 64)
		y, _ := strconv.ParseFloat(m[2], 64)
		size := 10.0
		if strings.Contains(m[3], "t") && !strings.Contains(m[3], "tk") {
			size = 12
		}
		w := 0.6 * size * float64(len([]rune(m[5])))
		x0 := x
		switch {
		case strings.Contains(m[4], `text-anchor="middle"`):
			x0 = x - w/2
		case strings.Contains(m[4], `text-anchor="end"`):
			x0 = x - w
		}
		out = append(out, textBox{s: m[5], x0: x0, x1: x0 + w, y0: y - size*0.8, y1: y + size*0.2,
			inside: strings.Contains(m[3], "in"), rotate: strings.Contains(m[4], "transform")})
	}
	return out
}

func overlap(a, b textBox) bool {
	return a.x0 < b.x1 && b.x0 < a.x1 && a.y0 < b.y1 && b.y0 < a.y1
}

// TestChartTextDoesNotOverlap: in the report's charts no text overlaps
// another (title, legend, bar labels, tick labels), bar labels of full
// bars stay inside the plotted area, and the legend sits in its band
// between the title and the plot instead of over the data.
func TestChartTextDoesNotOverlap(t *testing.T) {
	runs := []Run{
		{Round: 1, Strategy: "prefix-cache", TokenHitRate: 1, PerReplica: map[string]int{"A": 96, "B": 0}},
		{Round: 1, Strategy: "least-request", TokenHitRate: 0.995, PerReplica: map[string]int{"A": 48, "B": 48}},
		{Round: 1, Strategy: "cost", TokenHitRate: 0.5, PerReplica: map[string]int{"A": 50, "B": 46}},
	}
	for name, svg := range map[string]string{"hit rate": hitRateBars(runs), "per replica": replicaBars(runs)} {
		boxes := textBoxes(t, svg)
		if len(boxes) < 5 {
			t.Fatalf("%s: %d texts parsed", name, len(boxes))
		}
		const plotTop = 40
		for i, a := range boxes {
			if a.rotate {
				continue // category labels under the axis, rotated
			}
			for _, b := range boxes[i+1:] {
				if !b.rotate && overlap(a, b) {
					t.Errorf("%s: %q overlaps %q", name, a.s, b.s)
				}
			}
		}
		for _, b := range boxes {
			if b.inside && b.y0 < plotTop {
				t.Errorf("%s: bar label %q rises above the plotted area", name, b.s)
			}
		}
		if name == "per replica" {
			for _, b := range boxes {
				if (b.s == "A" || b.s == "B") && b.y1 > plotTop {
					t.Errorf("%s: legend entry %q lies in the plotted area (y %.0f-%.0f)", name, b.s, b.y0, b.y1)
				}
			}
		}
	}
}
