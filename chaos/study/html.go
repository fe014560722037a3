package study

import (
	"fmt"
	"html"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
)

// The HTML report is self-contained: inline CSS and inline SVG charts drawn
// here, no scripts and no external resources, so it renders offline.

var strategyColor = map[string]string{
	"random":          "#7f7f7f",
	"least-request":   "#1f77b4",
	"prefix-cache":    "#ff7f0e",
	"consistent-hash": "#9467bd",
	"cost":            "#2ca02c",
}

var replicaPalette = []string{"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"}

func colorOf(strategy string) string {
	if c, ok := strategyColor[strategy]; ok {
		return c
	}
	return "#444"
}

// plot is a minimal SVG chart with linear axes.
type plot struct {
	b                      strings.Builder
	w, h                   float64
	left, right, top, bot  float64
	xmin, xmax, ymin, ymax float64
	xstep, ystep           float64 // tick spacing: 1, 2 or 5 times a power of ten
}

func newPlot(w, h, xmax, ymax float64, title, xlabel, ylabel string) *plot {
	return newPlotCat(w, h, xmax, ymax, title, xlabel, ylabel, nil)
}

// newPlotCat is newPlot with a categorical x axis when cats is not nil:
// category i spans [i, i+1) and is labelled under the axis.
func newPlotCat(w, h, xmax, ymax float64, title, xlabel, ylabel string, cats []string) *plot {
	// The top margin holds the title (baseline 15) and, below it, the
	// legend's band (baseline 30): neither overlaps the plotted area.
	p := &plot{w: w, h: h, left: 48, right: 12, top: 40, bot: 36}
	p.xmax, p.xstep = niceAxis(xmax)
	p.ymax, p.ystep = niceAxis(ymax)
	if cats != nil {
		p.xmax = math.Max(float64(len(cats)), 1)
		p.bot = 64
	}
	fmt.Fprintf(&p.b, `<svg xmlns="http://www.w3.org/2000/svg" width="%.0f" height="%.0f" viewBox="0 0 %.0f %.0f" role="img">`, w, h, w, h)
	fmt.Fprintf(&p.b, `<title>%s</title>`, html.EscapeString(title))
	fmt.Fprintf(&p.b, `<text x="%.0f" y="15" class="t">%s</text>`, p.left, html.EscapeString(title))
	// Axes and ticks.
	fmt.Fprintf(&p.b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" class="ax"/>`, p.left, h-p.bot, w-p.right, h-p.bot)
	fmt.Fprintf(&p.b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" class="ax"/>`, p.left, p.top, p.left, h-p.bot)
	for i, c := range cats {
		cx, cy := p.x(float64(i)+0.5), h-p.bot+10
		fmt.Fprintf(&p.b, `<text x="%.1f" y="%.1f" class="tk" text-anchor="end" transform="rotate(-35 %.1f %.1f)">%s</text>`, cx, cy, cx, cy, html.EscapeString(c))
	}
	// Ticks on multiples of a 1/2/5 step, the axis ending on the first
	// tick at or above the data (niceAxis): no 1.25 or 3.75, and no axis
	// running far past the data.
	if cats == nil {
		for i := 0; float64(i)*p.xstep <= p.xmax*(1+1e-9); i++ {
			xv := float64(i) * p.xstep
			fmt.Fprintf(&p.b, `<text x="%.1f" y="%.1f" class="tk" text-anchor="middle">%s</text>`, p.x(xv), h-p.bot+13, tick(xv))
		}
	}
	for i := 0; float64(i)*p.ystep <= p.ymax*(1+1e-9); i++ {
		yv := float64(i) * p.ystep
		fmt.Fprintf(&p.b, `<text x="%.1f" y="%.1f" class="tk" text-anchor="end">%s</text>`, p.left-4, p.y(yv)+3, tick(yv))
		if i > 0 {
			fmt.Fprintf(&p.b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" class="gr"/>`, p.left, p.y(yv), w-p.right, p.y(yv))
		}
	}
	fmt.Fprintf(&p.b, `<text x="%.1f" y="%.1f" class="tk" text-anchor="middle">%s</text>`, (p.left+w-p.right)/2, h-4, html.EscapeString(xlabel))
	fmt.Fprintf(&p.b, `<text x="10" y="%.1f" class="tk" text-anchor="middle" transform="rotate(-90 10 %.1f)">%s</text>`, (p.top+h-p.bot)/2, (p.top+h-p.bot)/2, html.EscapeString(ylabel))
	return p
}

// niceAxis returns an axis end at or above v and its tick step: the step
// is 1, 2 or 5 times a power of ten giving 3 to 5 intervals, and the end
// the first multiple of the step at or above v.
func niceAxis(v float64) (end, step float64) {
	if !(v > 0) || math.IsInf(v, 0) {
		return 1, 0.25
	}
	raw := v / 4
	e := math.Pow(10, math.Floor(math.Log10(raw)))
	step = 10 * e
	for _, m := range []float64{1, 2, 5} {
		if m*e >= raw {
			step = m * e
			break
		}
	}
	return math.Ceil(v/step-1e-9) * step, step
}

func tick(v float64) string {
	if v == math.Trunc(v) {
		return fmt.Sprintf("%.0f", v)
	}
	return strconv.FormatFloat(v, 'g', 3, 64)
}

func (p *plot) x(v float64) float64 {
	return p.left + (v-p.xmin)/(p.xmax-p.xmin)*(p.w-p.left-p.right)
}

func (p *plot) y(v float64) float64 {
	v = math.Min(v, p.ymax)
	return p.h - p.bot - (v-p.ymin)/(p.ymax-p.ymin)*(p.h-p.top-p.bot)
}

func (p *plot) hline(v float64, class, label string) {
	fmt.Fprintf(&p.b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" class="%s"/>`, p.left, p.y(v), p.w-p.right, p.y(v), class)
	if label != "" {
		fmt.Fprintf(&p.b, `<text x="%.1f" y="%.1f" class="tk" text-anchor="end">%s</text>`, p.w-p.right-2, p.y(v)-3, html.EscapeString(label))
	}
}

func (p *plot) dot(x, y float64, color string) {
	fmt.Fprintf(&p.b, `<circle cx="%.1f" cy="%.1f" r="2.2" fill="%s" fill-opacity="0.75"/>`, p.x(x), p.y(y), color)
}

func (p *plot) cross(x, y float64, color string) {
	cx, cy := p.x(x), p.y(y)
	fmt.Fprintf(&p.b, `<path d="M%.1f %.1fl5 5m0 -5l-5 5" stroke="%s" stroke-width="1.4"/>`, cx-2.5, cy-2.5, color)
}

func (p *plot) line(xs, ys []float64, color string, dashed bool) {
	if len(xs) == 0 {
		return
	}
	var pts strings.Builder
	for i := range xs {
		fmt.Fprintf(&pts, "%.1f,%.1f ", p.x(xs[i]), p.y(ys[i]))
	}
	dash := ""
	if dashed {
		dash = ` stroke-dasharray="4 3"`
	}
	fmt.Fprintf(&p.b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="1.5"%s/>`, strings.TrimSpace(pts.String()), color, dash)
}

func (p *plot) rect(x0, x1, y float64, color, tip string) {
	fmt.Fprintf(&p.b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s</title></rect>`,
		p.x(x0), p.y(y), p.x(x1)-p.x(x0), p.y(0)-p.y(y), color, html.EscapeString(tip))
}

// label writes s over the bar ending at y, or inside its top when there is
// no room above it within the plotted area (so it never meets the legend
// or the title).
func (p *plot) label(x, y float64, s string) {
	ly, class := p.y(y)-3, "tk"
	if ly-10 < p.top {
		ly, class = p.y(y)+11, "tk in"
	}
	fmt.Fprintf(&p.b, `<text x="%.1f" y="%.1f" class="%s" text-anchor="middle">%s</text>`, p.x(x), ly, class, html.EscapeString(s))
}

func (p *plot) legend(items [][2]string, dashedFrom int) {
	x := p.left + 8
	for i, it := range items {
		dash := ""
		if dashedFrom >= 0 && i >= dashedFrom {
			dash = ` stroke-dasharray="4 3"`
		}
		fmt.Fprintf(&p.b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="3"%s/>`, x, p.top-13, x+14, p.top-13, it[1], dash)
		fmt.Fprintf(&p.b, `<text x="%.1f" y="%.1f" class="tk">%s</text>`, x+17, p.top-10, html.EscapeString(it[0]))
		x += 24 + 6.2*float64(len(it[0]))
	}
}

func (p *plot) String() string { return p.b.String() + "</svg>" }

const htmlStyle = `body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
table{border-collapse:collapse;margin:8px 0 20px;font-size:12px}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}th{background:#f3f3f3}
td:nth-child(2),th:nth-child(2){text-align:left}
.charts{display:flex;flex-wrap:wrap;gap:8px}
svg{background:#fff;border:1px solid #ddd}
.t{font-size:12px;font-weight:600}.tk{font-size:10px;fill:#444}.in{fill:#fff}
.ax{stroke:#333;stroke-width:1}.gr{stroke:#eee;stroke-width:1}.slo{stroke:#d62728;stroke-dasharray:5 3;stroke-width:1}
code{background:#f3f3f3;padding:1px 3px}`

func htmlTable(w io.Writer, t Table) {
	if t.Title != "" {
		fmt.Fprintf(w, "<h3>%s</h3>\n", html.EscapeString(t.Title))
	}
	fmt.Fprintf(w, "<table><tr>")
	for _, h := range t.Header {
		fmt.Fprintf(w, "<th>%s</th>", html.EscapeString(h))
	}
	fmt.Fprintf(w, "</tr>\n")
	for _, r := range t.Rows {
		fmt.Fprintf(w, "<tr>")
		for _, c := range r {
			fmt.Fprintf(w, "<td>%s</td>", html.EscapeString(c))
		}
		fmt.Fprintf(w, "</tr>\n")
	}
	fmt.Fprintf(w, "</table>\n")
	for _, n := range t.Notes {
		fmt.Fprintf(w, "<p>%s</p>\n", html.EscapeString(n))
	}
}

// WriteHTML writes report.html: the tables and verdicts, a TTFT timeline
// per scenario, cell and round (one colour per strategy), per-replica
// running/waiting over time per phase, and token hit rate and per-replica
// request counts per phase.
func WriteHTML(w io.Writer, res *Results) error {
	fmt.Fprintf(w, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>kvbench report</title><style>%s</style></head><body>\n", htmlStyle)
	fmt.Fprintf(w, "<h1>kvbench report</h1>\n")
	c := res.Config
	fmt.Fprintf(w, "<p>Engine <code>%s</code>, profile <code>%s</code>, %s, speed %g (all times model time), %g RPS, %d arrivals per phase, in-flight cap %d, %d replicas, seed %d. SLO: TTFT ≤ %v, TPOT ≤ %v, E2E ≤ %v.</p>\n",
		html.EscapeString(c.Engine), html.EscapeString(c.Profile), blockSizeText(c), c.Speed, c.RPS, c.Arrivals, c.InflightCap, c.Replicas, c.Seed, c.SLO.TTFT, c.SLO.TPOT, c.SLO.E2E)
	fmt.Fprintf(w, "<h2>Verdicts</h2><ul>\n")
	for _, sc := range scenariosOf(res) {
		v := html.EscapeString(Verdict(res, sc))
		v = strings.Replace(strings.Replace(v, "**", "<b>", 1), "**", "</b>", 1)
		fmt.Fprintf(w, "<li>%s</li>\n", v)
	}
	fmt.Fprintf(w, "</ul>\n")
	for _, hc := range c.HostChecks {
		fmt.Fprintf(w, "<p>%s</p>\n", html.EscapeString(HostCheckLine(hc)))
	}
	if lag := LaggingPhases(res); len(lag) > 0 {
		head, why := lagText(res)
		fmt.Fprintf(w, "<p><b>%s</b> (arrivals sent more than %v late at P95: %s): %s.</p>\n",
			head, LagTolerance, html.EscapeString(why), html.EscapeString(strings.Join(lag, ", ")))
	}
	for _, sc := range scenariosOf(res) {
		fmt.Fprintf(w, "<h2>%s</h2>\n", html.EscapeString(sc))
		for _, ck := range cellsOf(res) {
			runs := filterRuns(res, sc, ck)
			if len(runs) == 0 {
				continue
			}
			htmlTable(w, runTable(sc+" — "+ck.label(), runs))
			fmt.Fprintf(w, "<div class=\"charts\">\n")
			for _, round := range roundsOf(runs) {
				fmt.Fprint(w, ttftTimeline(res, sc, ck, round))
			}
			fmt.Fprint(w, hitRateBars(runs))
			fmt.Fprint(w, replicaBars(runs))
			fmt.Fprintf(w, "</div>\n<div class=\"charts\">\n")
			for _, ph := range res.Phases {
				if ph.Scenario == sc && ck.matches(res, ph.Mode, ph.Gateways, ph.Isolated) && ph.Measured {
					fmt.Fprint(w, queueChart(ph))
				}
			}
			fmt.Fprintf(w, "</div>\n")
		}
	}
	if t, ok := CalibrationTable(res); ok {
		fmt.Fprintf(w, "<h2>Calibration</h2>\n")
		htmlTable(w, t)
		if c, ok := CalibrationCheck(res); ok {
			htmlTable(w, c)
		}
	}
	if t, ok := BeatCheck(res); ok {
		fmt.Fprintf(w, "<h2>Beating it</h2>\n")
		htmlTable(w, t)
	}
	if t, ok := SyncCheck(res); ok {
		fmt.Fprintf(w, "<h2>Gateway cluster</h2>\n")
		htmlTable(w, t)
	}
	_, err := fmt.Fprintf(w, "</body></html>\n")
	return err
}

func filterRuns(res *Results, sc string, ck cellKey) []Run {
	var out []Run
	for _, r := range res.Runs {
		if r.Scenario == sc && ck.has(res, &r) {
			out = append(out, r)
		}
	}
	return out
}

func roundsOf(runs []Run) []int {
	var out []int
	for _, r := range runs {
		if !slices.Contains(out, r.Round) {
			out = append(out, r.Round)
		}
	}
	slices.Sort(out)
	return out
}

// ttftTimeline plots TTFT against scheduled arrival time for every strategy
// of one scenario, cell and round; failed or unsent arrivals are crosses at
// the top.
func ttftTimeline(res *Results, sc string, ck cellKey, round int) string {
	var recs []RequestRecord
	var strategies []string
	xmax, ymax := 1.0, res.Config.SLO.TTFT.Seconds()*1.5
	for _, r := range res.Requests {
		if r.Scenario == sc && ck.matches(res, r.Mode, r.Gateways, r.Isolated) && r.Round == round {
			recs = append(recs, r)
			if !slices.Contains(strategies, r.Strategy) {
				strategies = append(strategies, r.Strategy)
			}
			xmax = math.Max(xmax, r.Scheduled)
			if r.Complete {
				ymax = math.Max(ymax, r.TTFT)
			}
		}
	}
	p := newPlot(460, 260, xmax, ymax, fmt.Sprintf("TTFT timeline — %s, round %d", sc, round), "arrival time (s)", "TTFT (s)")
	p.hline(res.Config.SLO.TTFT.Seconds(), "slo", "SLO")
	for _, r := range recs {
		if r.Complete {
			p.dot(r.Scheduled, r.TTFT, colorOf(r.Strategy))
		} else {
			p.cross(r.Scheduled, p.ymax, colorOf(r.Strategy))
		}
	}
	var items [][2]string
	for _, s := range strategies {
		items = append(items, [2]string{s, colorOf(s)})
	}
	p.legend(items, -1)
	return p.String()
}

// queueChart plots running (solid) and waiting (dashed) requests per replica
// over one phase.
func queueChart(ph PhaseDetail) string {
	xmax, ymax := 1.0, 4.0
	for _, o := range ph.Samples {
		xmax = math.Max(xmax, o.At.Seconds())
		for i := range o.Running {
			ymax = math.Max(ymax, float64(o.Running[i]))
			if i < len(o.Waiting) {
				ymax = math.Max(ymax, float64(o.Waiting[i]))
			}
		}
	}
	p := newPlot(380, 200, xmax, ymax, fmt.Sprintf("r%d %s — run (solid) / wait (dashed)", ph.Round, ph.Strategy), "time (s)", "requests")
	var items [][2]string
	for i, n := range ph.Replicas {
		col := replicaPalette[i%len(replicaPalette)]
		var xs, run, wait, wxs []float64
		for _, o := range ph.Samples {
			if i < len(o.Running) && o.Running[i] >= 0 {
				xs = append(xs, o.At.Seconds())
				run = append(run, float64(o.Running[i]))
			}
			if i < len(o.Waiting) && o.Waiting[i] >= 0 {
				wxs = append(wxs, o.At.Seconds())
				wait = append(wait, float64(o.Waiting[i]))
			}
		}
		p.line(xs, run, col, false)
		p.line(wxs, wait, col, true)
		items = append(items, [2]string{n, col})
	}
	p.legend(items, -1)
	return p.String()
}

func runLabels(runs []Run) []string {
	out := make([]string, len(runs))
	for i, r := range runs {
		out[i] = fmt.Sprintf("r%d %s", r.Round, r.Strategy)
	}
	return out
}

// hitRateBars plots the token hit rate of every run of one scenario and cell.
func hitRateBars(runs []Run) string {
	p := newPlotCat(360, 260, float64(len(runs)), 100, "token hit rate (%)", "", "%", runLabels(runs))
	for i, r := range runs {
		v := float64(r.TokenHitRate)
		if math.IsNaN(v) {
			continue
		}
		p.rect(float64(i)+0.15, float64(i)+0.85, 100*v, colorOf(r.Strategy), fmt.Sprintf("r%d %s: %.1f%%", r.Round, r.Strategy, 100*v))
		p.label(float64(i)+0.5, 100*v, fmt.Sprintf("%.0f", 100*v))
	}
	return p.String()
}

// replicaBars plots requests per replica for every run of one scenario and
// cell, side by side.
func replicaBars(runs []Run) string {
	names := replicaNames(runs)
	ymax := 1.0
	for _, r := range runs {
		for _, c := range r.PerReplica {
			ymax = math.Max(ymax, float64(c))
		}
	}
	p := newPlotCat(360, 260, float64(len(runs)), ymax, "requests per replica", "", "requests", runLabels(runs))
	k := float64(max(len(names), 1))
	for i, r := range runs {
		for j, n := range names {
			x0 := float64(i) + 0.1 + 0.8*float64(j)/k
			p.rect(x0, x0+0.8/k, float64(r.PerReplica[n]), replicaPalette[j%len(replicaPalette)],
				fmt.Sprintf("r%d %s %s: %d", r.Round, r.Strategy, n, r.PerReplica[n]))
		}
	}
	var items [][2]string
	for j, n := range names {
		items = append(items, [2]string{n, replicaPalette[j%len(replicaPalette)]})
	}
	p.legend(items, -1)
	return p.String()
}
