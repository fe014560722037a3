package study

import (
	"fmt"
	"io"
	"math"
	"slices"
	"sort"
	"strings"
	"unicode/utf8"
)

// Table is a rendered-agnostic table: a header and rows of cells.
type Table struct {
	Title  string
	Header []string
	Rows   [][]string
	Notes  []string
}

// Markdown writes t as a GitHub-flavoured Markdown table.
func (t *Table) Markdown(w io.Writer) {
	if t.Title != "" {
		fmt.Fprintf(w, "### %s\n\n", t.Title)
	}
	fmt.Fprintf(w, "| %s |\n", strings.Join(mdCells(t.Header), " | "))
	seps := make([]string, len(t.Header))
	for i := range seps {
		seps[i] = "---"
	}
	fmt.Fprintf(w, "|%s|\n", strings.Join(seps, "|"))
	for _, r := range t.Rows {
		fmt.Fprintf(w, "| %s |\n", strings.Join(mdCells(r), " | "))
	}
	fmt.Fprintln(w)
	for _, n := range t.Notes {
		fmt.Fprintf(w, "%s\n\n", n)
	}
}

// mdCells escapes the pipes inside cells ("ours | seed" pairs), which
// Markdown would otherwise read as column separators.
func mdCells(cells []string) []string {
	out := make([]string, len(cells))
	for i, c := range cells {
		out[i] = strings.ReplaceAll(c, "|", `\|`)
	}
	return out
}

// Text writes t as an aligned plain-text table for a terminal.
func (t *Table) Text(w io.Writer) {
	width := make([]int, len(t.Header))
	for i, h := range t.Header {
		width[i] = utf8.RuneCountInString(h)
	}
	for _, r := range t.Rows {
		for i, c := range r {
			if i < len(width) {
				width[i] = max(width[i], utf8.RuneCountInString(c))
			}
		}
	}
	line := func(cells []string) {
		var b strings.Builder
		for i, c := range cells {
			if i > 0 {
				b.WriteString("  ")
			}
			b.WriteString(c)
			if i < len(cells)-1 {
				b.WriteString(strings.Repeat(" ", width[i]-utf8.RuneCountInString(c)))
			}
		}
		fmt.Fprintln(w, strings.TrimRight(b.String(), " "))
	}
	if t.Title != "" {
		fmt.Fprintf(w, "== %s ==\n", t.Title)
	}
	line(t.Header)
	for _, r := range t.Rows {
		line(r)
	}
	for _, n := range t.Notes {
		fmt.Fprintln(w, n)
	}
	fmt.Fprintln(w)
}

func fnum(v Num, prec int) string {
	f := float64(v)
	if math.IsNaN(f) {
		return "—"
	}
	return fmt.Sprintf("%.*f", prec, f)
}

func fpct(v Num) string {
	f := float64(v)
	if math.IsNaN(f) {
		return "—"
	}
	return fmt.Sprintf("%.1f%%", 100*f)
}

// replicaNames returns the replica names of the runs, sorted.
func replicaNames(runs []Run) []string {
	seen := map[string]bool{}
	for _, r := range runs {
		for n := range r.PerReplica {
			seen[n] = true
		}
		for n := range r.MaxWaiting {
			seen[n] = true
		}
	}
	out := make([]string, 0, len(seen))
	for n := range seen {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func joinCounts(m map[string]int, names []string) string {
	parts := make([]string, len(names))
	for i, n := range names {
		parts[i] = fmt.Sprint(m[n])
	}
	return strings.Join(parts, " / ")
}

func selectionString(m map[string]int) string {
	if m == nil {
		return "—"
	}
	if len(m) == 0 {
		return "none"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s=%d", k, m[k])
	}
	return strings.Join(parts, " ")
}

// CellLabel describes a cell for table titles: one gateway, several
// gateways sharing one index (a synced cluster), or several isolated
// gateways (the --no-sync baseline).
func CellLabel(mode string, gateways int, isolated bool) string {
	if gateways == 1 {
		return mode + " · 1 gateway"
	}
	if isolated {
		return fmt.Sprintf("%s · %d gateways, isolated (no shared index)", mode, gateways)
	}
	return fmt.Sprintf("%s · %d gateways, synced (shared index)", mode, gateways)
}

type cellKey struct {
	mode     string
	gateways int
	isolated bool
}

// isolated reports whether run r measured isolated gateways: its own flag,
// or the whole study's (results written before per-run flags existed).
func isolated(res *Results, r *Run) bool {
	return r.Gateways > 1 && (r.Isolated || res.Config.GatewaysIsolated)
}

func (ck cellKey) has(res *Results, r *Run) bool {
	return ck.matches(res, r.Mode, r.Gateways, r.Isolated)
}

// matches reports whether a run, phase or request of this mode, gateway
// count and isolation flag belongs to the cell.
func (ck cellKey) matches(res *Results, mode string, gateways int, iso bool) bool {
	iso = gateways > 1 && (iso || res.Config.GatewaysIsolated)
	return mode == ck.mode && gateways == ck.gateways && iso == ck.isolated
}

func (ck cellKey) label() string { return CellLabel(ck.mode, ck.gateways, ck.isolated) }

// ScenarioTables returns one table per (scenario, cell), rounds separate,
// rows in the order the runs appear.
func ScenarioTables(res *Results) []Table {
	var out []Table
	for _, sc := range scenariosOf(res) {
		for _, ck := range cellsOf(res) {
			var runs []Run
			for _, r := range res.Runs {
				if r.Scenario == sc && ck.has(res, &r) {
					runs = append(runs, r)
				}
			}
			if len(runs) == 0 {
				continue
			}
			out = append(out, runTable(sc+" — "+ck.label(), runs))
		}
	}
	return out
}

func runTable(title string, runs []Run) Table {
	names := replicaNames(runs)
	rs := slices.Clone(runs)
	slices.SortStableFunc(rs, func(a, b Run) int { return a.Round - b.Round })
	reqHead, waitHead := strings.Join(names, " / ")+" requests", "max waiting "+strings.Join(names, " / ")
	if len(names) > maxListedReplicas {
		reqHead, waitHead = "requests per replica (min / median / max; top 3)", "max waiting per replica (min / median / max; top 3)"
	}
	t := Table{
		Title: title,
		Header: []string{"round", "strategy", "TTFT P95 s", "TPOT P95 ms", "E2E P95 s", "token hit",
			"pass / arrivals", "failed", reqHead, waitHead, "selection"},
	}
	if len(names) > maxListedReplicas {
		t.Notes = append(t.Notes, fmt.Sprintf("%d replicas: per-replica figures are summarized here; "+
			"results.json (per_replica, max_waiting) and report.html keep every replica's.", len(names)))
	}
	for _, r := range rs {
		t.Rows = append(t.Rows, []string{
			fmt.Sprint(r.Round), r.Strategy, fnum(r.TTFTP95, 3), fnum(r.TPOTP95, 1), fnum(r.E2EP95, 2),
			fpct(r.TokenHitRate), fmt.Sprintf("%d / %d", r.SLOPass, r.Arrivals), fmt.Sprint(r.Failed),
			countsCell(r.PerReplica, names), countsCell(r.MaxWaiting, names), selectionString(r.Selection),
		})
	}
	return t
}

// maxListedReplicas is the most replicas whose figures a table cell lists
// one by one; more are summarized (countsCell).
const maxListedReplicas = 8

// countsCell lists m's counts in names' order, or, for more than
// maxListedReplicas names, summarizes them: min / median / max and the
// three largest with their replica.
func countsCell(m map[string]int, names []string) string {
	if len(names) <= maxListedReplicas {
		return joinCounts(m, names)
	}
	vals := make([]int, len(names))
	order := slices.Clone(names)
	for i, n := range names {
		vals[i] = m[n]
	}
	slices.Sort(vals)
	slices.SortStableFunc(order, func(a, b string) int { return m[b] - m[a] })
	med := vals[len(vals)/2]
	if len(vals)%2 == 0 {
		med = (vals[len(vals)/2-1] + vals[len(vals)/2]) / 2
	}
	top := make([]string, 0, 3)
	for _, n := range order[:3] {
		top = append(top, fmt.Sprintf("%s %d", n, m[n]))
	}
	return fmt.Sprintf("%d / %d / %d; %s", vals[0], med, vals[len(vals)-1], strings.Join(top, ", "))
}

func scenariosOf(res *Results) []string {
	var out []string
	for _, r := range res.Runs {
		if !slices.Contains(out, r.Scenario) {
			out = append(out, r.Scenario)
		}
	}
	return out
}

func cellsOf(res *Results) []cellKey {
	var out []cellKey
	for _, r := range res.Runs {
		k := cellKey{r.Mode, r.Gateways, isolated(res, &r)}
		if !slices.Contains(out, k) {
			out = append(out, k)
		}
	}
	return out
}

// Verdict returns the one-line verdict for a scenario: the strategy (and
// cell) with the most SLO passes summed over rounds (lower worst TTFT P95
// breaks ties), the one with the fewest, and how cost fared when it ran.
func Verdict(res *Results, scenario string) string {
	type agg struct {
		label    string
		pass     []int
		arrivals int
		ttft     float64
		maxShare float64
	}
	var aggs []*agg
	find := func(label string) *agg {
		for _, a := range aggs {
			if a.label == label {
				return a
			}
		}
		a := &agg{label: label}
		aggs = append(aggs, a)
		return a
	}
	multiCell := len(cellsOf(res)) > 1
	for _, r := range res.Runs {
		if r.Scenario != scenario {
			continue
		}
		label := r.Strategy
		if multiCell {
			label = r.Strategy + "@" + cellName(r.Mode, r.Gateways, isolated(res, &r))
		}
		a := find(label)
		a.pass = append(a.pass, r.SLOPass)
		a.arrivals += r.Arrivals
		if t := float64(r.TTFTP95); !math.IsNaN(t) && t > a.ttft {
			a.ttft = t
		}
		tot, top := 0, 0
		for _, c := range r.PerReplica {
			tot += c
			top = max(top, c)
		}
		if tot > 0 {
			a.maxShare = max(a.maxShare, float64(top)/float64(tot))
		}
	}
	if len(aggs) == 0 {
		return fmt.Sprintf("**%s**: not measured.", scenario)
	}
	total := func(a *agg) int {
		s := 0
		for _, p := range a.pass {
			s += p
		}
		return s
	}
	slices.SortStableFunc(aggs, func(a, b *agg) int {
		if d := total(b) - total(a); d != 0 {
			return d
		}
		switch {
		case a.ttft < b.ttft:
			return -1
		case a.ttft > b.ttft:
			return 1
		}
		return 0
	})
	desc := func(a *agg) string {
		ps := make([]string, len(a.pass))
		for i, p := range a.pass {
			ps[i] = fmt.Sprint(p)
		}
		return fmt.Sprintf("%s (%s = %d/%d pass, worst TTFT P95 %.2f s, busiest replica %.0f%%)",
			a.label, strings.Join(ps, "+"), total(a), a.arrivals, a.ttft, 100*a.maxShare)
	}
	best, worst := aggs[0], aggs[len(aggs)-1]
	line := fmt.Sprintf("**%s**: best %s", scenario, desc(best))
	if worst != best {
		line += "; worst " + desc(worst)
	}
	return line + "."
}

// CalibrationTable sets the history-mode, one-gateway runs next to the seed's
// published rows, scenario by scenario and round by round. It returns false
// when there is nothing to compare.
func CalibrationTable(res *Results) (Table, bool) {
	t := Table{
		Title: "Calibration: ours vs the seed study (history mode, 1 gateway)",
		Header: []string{"scenario / round", "strategy", "TTFT P95 s ours | seed", "TPOT P95 ms ours | seed",
			"token hit ours | seed", "pass ours | seed", "A / B ours | seed", "calibration"},
		Notes: []string{"Seed study: the AIBrix v0.7.0 prefix-cache routing experiment (2× vLLM serving Qwen3.8-27B-FP8, " +
			"one L20 GPU each, one gateway, 96 arrivals per phase at 1.6 RPS; its published tables are reproduced in " +
			"chaos/study/seed.go, SeedTable). Ours: the simulator profile named in the config, in model time. " +
			"Counts are like for like: the seed's pass and A / B counts are scaled from its 96 arrivals to ours. " +
			"A/B = the first / second replica; in hot scenarios B (the second) holds the hot group, as in the seed.",
			fmt.Sprintf("Calibration flags a miss beyond the tolerance: TTFT and TPOT P95 within ×%.0f of the seed's, "+
				"passes within %.0f%% of the arrivals of the seed's scaled count.", calTimeFactor, 100*calPassShare)},
	}
	for _, sr := range SeedTable {
		for _, r := range res.Runs {
			if r.Mode != "history" || r.Gateways != 1 || r.Scenario != sr.Scenario || r.Round != sr.Round || r.Strategy != sr.Strategy {
				continue
			}
			names := replicaNames([]Run{r})
			scaled := func(n int) int { return (n*r.Arrivals + SeedArrivals/2) / SeedArrivals }
			t.Rows = append(t.Rows, []string{
				fmt.Sprintf("%s / %d", sr.Scenario, sr.Round), sr.Strategy,
				fmt.Sprintf("%s | %.3f", fnum(r.TTFTP95, 3), sr.TTFTP95),
				fmt.Sprintf("%s | %.1f", fnum(r.TPOTP95, 1), sr.TPOTP95),
				fmt.Sprintf("%s | %.1f%%", fpct(r.TokenHitRate), 100*sr.HitRate),
				fmt.Sprintf("%d | %d of %d", r.SLOPass, scaled(sr.SLOPass), r.Arrivals),
				fmt.Sprintf("%s | %d / %d", joinCounts(r.PerReplica, names), scaled(sr.A), scaled(sr.B)),
				calibrationMisses(r, sr, scaled(sr.SLOPass)),
			})
		}
	}
	return t, len(t.Rows) > 0
}

// BeatCheck evaluates issue 5's goal for cost in kv-events or hybrid mode:
// per scenario and round, SLO pass ≥ the best of least-request and
// prefix-cache (same cell), TTFT P95 ≤ least-request's, token hit rate ≥
// prefix-cache's minus 2 points. It returns false when cost did not run in
// those modes next to both baselines.
func BeatCheck(res *Results) (Table, bool) {
	t := Table{
		Title:  "Beat-it check: cost vs least-request and prefix-cache (same mode, gateways, round)",
		Header: []string{"scenario / round", "cell", "pass cost | best(LR,PC)", "TTFT P95 cost | LR", "hit cost | PC−2pt", "verdict"},
	}
	get := func(k PhaseKey) *Run {
		for i := range res.Runs {
			if res.Runs[i].Key() == k {
				return &res.Runs[i]
			}
		}
		return nil
	}
	for _, c := range res.Runs {
		if c.Strategy != "cost" || c.Mode == "history" {
			continue
		}
		k := c.Key()
		k.Strategy = "least-request"
		lr := get(k)
		k.Strategy = "prefix-cache"
		pc := get(k)
		if lr == nil || pc == nil {
			continue
		}
		best := max(lr.SLOPass, pc.SLOPass)
		okPass := c.SLOPass >= best
		okTTFT := float64(c.TTFTP95) <= float64(lr.TTFTP95)
		okHit := float64(c.TokenHitRate) >= float64(pc.TokenHitRate)-0.02
		var miss []string
		if !okPass {
			miss = append(miss, "pass")
		}
		if !okTTFT {
			miss = append(miss, "TTFT")
		}
		if !okHit {
			miss = append(miss, "hit rate")
		}
		v := "meets"
		if len(miss) > 0 {
			v = "misses " + strings.Join(miss, ", ")
		}
		t.Rows = append(t.Rows, []string{
			fmt.Sprintf("%s / %d", c.Scenario, c.Round), cellName(c.Mode, c.Gateways, isolated(res, &c)),
			fmt.Sprintf("%d | %d", c.SLOPass, best),
			fmt.Sprintf("%s | %s", fnum(c.TTFTP95, 3), fnum(lr.TTFTP95, 3)),
			fmt.Sprintf("%s | %s", fpct(c.TokenHitRate), fpct(pc.TokenHitRate-0.02)),
			v,
		})
	}
	return t, len(t.Rows) > 0
}

// SyncTolerance is issue 6's target: several synced gateways keep SLO
// pass (as a share of arrivals) and token hit rate within this many
// percentage points of one gateway.
const SyncTolerance = 2.0

// SyncCheck compares, for each phase of one gateway that has a
// multi-gateway counterpart (same scenario, round, mode and strategy),
// synced and isolated gateways with the single gateway: SLO pass share and
// token hit rate, and whether the synced cell is within SyncTolerance
// points on both. On warm, an index-following strategy inherits the
// bootstrap's index layout, which gateway 0 chooses afresh in every cell:
// the verdict names the two layouts when they differ. ok is false when
// the study has no such pair.
func SyncCheck(res *Results) (Table, bool) {
	t := Table{
		Title: "Gateway cluster: N gateways vs 1 (goal: SLO pass and token hit within 2 points of one gateway)",
		Header: []string{"scenario / round", "mode", "strategy", "gateways", "pass 1 | synced | isolated",
			"token hit 1 | synced | isolated", "synced within 2 points"},
	}
	pct := func(r *Run) float64 { return 100 * float64(r.SLOPass) / float64(max(r.Arrivals, 1)) }
	type key struct {
		PhaseKey
		g int
	}
	cells := map[key][2]*Run{} // [synced, isolated] by (phase of 1 gateway, N)
	var order []key
	for i := range res.Runs {
		r := &res.Runs[i]
		if r.Gateways < 2 {
			continue
		}
		k := r.Key()
		k.Gateways, k.Isolated = 1, false
		kk := key{k, r.Gateways}
		pair, seen := cells[kk]
		if !seen {
			order = append(order, kk)
		}
		pair[btoi(isolated(res, r))] = r
		cells[kk] = pair
	}
	for _, kk := range order {
		var one *Run
		for i := range res.Runs {
			if res.Runs[i].Key() == kk.PhaseKey {
				one = &res.Runs[i]
			}
		}
		if one == nil {
			continue
		}
		pair := cells[kk]
		passes := []string{fmt.Sprintf("%.1f%%", pct(one))}
		hits := []string{fpct(one.TokenHitRate)}
		for _, r := range pair {
			if r == nil {
				passes, hits = append(passes, "—"), append(hits, "—")
				continue
			}
			passes = append(passes, fmt.Sprintf("%.1f%%", pct(r)))
			hits = append(hits, fpct(r.TokenHitRate))
		}
		verdict := "—"
		if s := pair[0]; s != nil {
			dp := pct(s) - pct(one)
			dh := 100 * (float64(s.TokenHitRate) - float64(one.TokenHitRate))
			verdict = "yes"
			if math.Abs(dp) > SyncTolerance || math.Abs(dh) > SyncTolerance || math.IsNaN(dh) {
				verdict = "no"
			}
			verdict += fmt.Sprintf(" (pass %+.1f, hit %+.1f)", dp, dh)
			if kk.Scenario == ScenarioWarm && !indexBlind[kk.Strategy] {
				// The warm bootstrap's layout is whatever gateway 0 chose;
				// an index-following strategy inherits it.
				a, _ := bootstrapLayout(res, one.Key().PhaseName())
				b, _ := bootstrapLayout(res, s.Key().PhaseName())
				if a != b {
					verdict += fmt.Sprintf("; warm index %s vs %s", a, b)
				}
			}
		}
		t.Rows = append(t.Rows, []string{
			fmt.Sprintf("%s / %d", kk.Scenario, kk.Round), kk.Mode, kk.Strategy, fmt.Sprint(kk.g),
			strings.Join(passes, " | "), strings.Join(hits, " | "), verdict,
		})
	}
	return t, len(t.Rows) > 0
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// WriteTables writes every table and verdict as plain text (stdout).
func WriteTables(w io.Writer, res *Results) {
	for _, t := range ScenarioTables(res) {
		t.Text(w)
	}
	for _, sc := range scenariosOf(res) {
		fmt.Fprintln(w, strings.ReplaceAll(Verdict(res, sc), "**", ""))
	}
	fmt.Fprintln(w)
	if t, ok := CalibrationTable(res); ok {
		t.Text(w)
	}
	if t, ok := CalibrationCheck(res); ok {
		t.Text(w)
	}
	if t, ok := BeatCheck(res); ok {
		t.Text(w)
	}
	if t, ok := SyncCheck(res); ok {
		t.Text(w)
	}
	if bad := unmeasured(res); len(bad) > 0 {
		fmt.Fprintf(w, "Not measured (initialisation failed): %s\n", strings.Join(bad, ", "))
	}
	for _, hc := range res.Config.HostChecks {
		fmt.Fprintln(w, HostCheckLine(hc))
	}
	if lag := LaggingPhases(res); len(lag) > 0 {
		head, why := lagText(res)
		fmt.Fprintf(w, "%s (arrivals sent > %v late at P95; %s): %s\n", head, LagTolerance, why, strings.Join(lag, ", "))
	}
}

// lagText names what a phase's schedule lag means: in process the host
// also runs the engines, so their steps stretched too; against a
// deployment only kvbench's client fell behind, and the deployment saw a
// lighter, burstier load than scheduled.
func lagText(res *Results) (head, why string) {
	if res.Config.Target != nil {
		return "Client lagged", "the deployment got a lighter, burstier load than scheduled; its latencies are its own, but not under the scheduled load"
	}
	return "Host did not keep up", "engine steps were stretched too, so latencies are inflated"
}

func unmeasured(res *Results) []string {
	var out []string
	for _, p := range res.Phases {
		if !p.Measured {
			out = append(out, p.Name)
		}
	}
	return out
}

// WriteMarkdown writes report.md.
func WriteMarkdown(w io.Writer, res *Results) error {
	c := res.Config
	fmt.Fprintf(w, "# kvbench report\n\n")
	fmt.Fprintf(w, "Engine `%s`, profile `%s`, %s, speed %g (all times are model time), %g RPS, %d arrivals per phase, "+
		"in-flight cap %d, max_tokens %d, %d replicas, seed %d, %d round(s) (even rounds run the strategies in reverse).\n\n",
		c.Engine, c.Profile, blockSizeText(c), c.Speed, c.RPS, c.Arrivals, c.InflightCap, c.MaxTokens, c.Replicas, c.Seed, c.Rounds)
	writeTarget(w, c.Target)
	writeWorkload(w, c.Workload)
	if ps := c.PromptSizing; ps != nil {
		fmt.Fprintf(w, "**Prompt sizing.** The seed's %d-sentence body is %d tokens of the seed's model (Qwen3) in a probe prompt; this run's "+
			"prompts were sized in the engine's own tokens instead: %s.\n\n", SentenceRepeats, SeedPromptTokens, SizingLine(*ps))
	}
	writeTerms(w)
	fmt.Fprintf(w, "Pass = complete stream (HTTP 200, content, [DONE], exactly max_tokens completion tokens) and "+
		"TTFT ≤ %v, TPOT ≤ %v, E2E ≤ %v, over scheduled arrivals (unsent arrivals count as failures). "+
		"P95 by linear interpolation over successful requests. Token hit = Δvllm:prefix_cache_hits_total / "+
		"Δvllm:prefix_cache_queries_total over the phase, summed over engines. Selection = Δkvmesh_route_decisions_total "+
		"(— when the gateways do not expose it).\n\n", c.SLO.TTFT, c.SLO.TPOT, c.SLO.E2E)
	for _, hc := range c.HostChecks {
		fmt.Fprintf(w, "- %s\n", HostCheckLine(hc))
	}
	if len(c.HostChecks) > 0 {
		fmt.Fprintln(w)
	}
	if lag := LaggingPhases(res); len(lag) > 0 {
		head, why := lagText(res)
		fmt.Fprintf(w, "**%s** in %d phase(s) (arrivals sent more than %v late at P95: %s): %s.\n\n",
			head, len(lag), LagTolerance, why, strings.Join(lag, ", "))
	}
	if slices.ContainsFunc(c.Gateways, func(g int) bool { return g > 1 }) {
		fmt.Fprintf(w, "Arrivals rotate round-robin over the gateways. **Synced** gateways form one cluster sharing the "+
			"index (decision deltas, KV events) and load reports; **isolated** gateways (--no-sync) share nothing. "+
			"Initialisation (warm bootstrap, hot-spot placement) goes through gateway 0; synced peers are waited for "+
			"until their indexes hold the same entries before the first arrival, isolated peers start without it.\n\n")
	}
	fmt.Fprintf(w, "## Verdicts\n\n")
	for _, sc := range scenariosOf(res) {
		fmt.Fprintf(w, "- %s\n", Verdict(res, sc))
	}
	fmt.Fprintln(w)
	if bad := unmeasured(res); len(bad) > 0 {
		fmt.Fprintf(w, "Not measured (initialisation failed, as the seed's rule prescribes): %s. See phases.json.\n\n", strings.Join(bad, ", "))
	}
	fmt.Fprintf(w, "## Tables\n\n")
	for _, t := range ScenarioTables(res) {
		t.Markdown(w)
	}
	if t, ok := CalibrationTable(res); ok {
		fmt.Fprintf(w, "## Calibration\n\n")
		t.Markdown(w)
		if c, ok := CalibrationCheck(res); ok {
			c.Markdown(w)
		}
	}
	if t, ok := BeatCheck(res); ok {
		fmt.Fprintf(w, "## Beating it\n\n")
		t.Markdown(w)
	}
	if t, ok := SyncCheck(res); ok {
		fmt.Fprintf(w, "## Gateway cluster\n\n")
		t.Markdown(w)
	}
	return nil
}

func blockSizeText(c Config) string {
	if c.EngineBlockSize <= 0 {
		return "engine block size not recorded"
	}
	if c.EngineProfile != "" {
		return fmt.Sprintf("engine block size %d tokens, %s", c.EngineBlockSize, c.EngineProfile)
	}
	return fmt.Sprintf("engine block size %d tokens", c.EngineBlockSize)
}

// indexBlind lists the strategies that ignore the prefix index: their warm
// phases do not depend on the bootstrap's index layout.
var indexBlind = map[string]bool{"random": true, "least-request": true, "consistent-hash": true}

// CalibrationCheck evaluates issue 5's calibration criteria on the
// history-mode, one-gateway runs, round by round: on hot50, prefix-cache
// puts ≥ 65 of 96 requests on one replica and passes at least 30 fewer than
// least-request, which passes ≥ 90; on warm with a balanced index (the
// bootstrap placed the groups evenly) every strategy passes ≥ 90. Counts are
// scaled when a phase has other than 96 arrivals.
func CalibrationCheck(res *Results) (Table, bool) {
	t := Table{
		Title:  "Calibration criteria (the seed study's findings, scaled to our arrivals; history mode, 1 gateway)",
		Header: []string{"round", "criterion", "measured", "verdict"},
	}
	find := func(sc string, round int, strat string) *Run {
		for i := range res.Runs {
			r := &res.Runs[i]
			if r.Mode == "history" && r.Gateways == 1 && r.Scenario == sc && r.Round == round && r.Strategy == strat {
				return r
			}
		}
		return nil
	}
	scale := func(n, arrivals int) int { return (n*arrivals + 48) / 96 }
	ok := func(b bool) string {
		if b {
			return "met"
		}
		return "not met"
	}
	lagging := strings.Join(LaggingPhases(res), " ")
	// note marks a verdict once when any of the runs it rests on ran on a
	// host that lagged behind its schedule.
	note := func(v string, runs ...*Run) string {
		for _, r := range runs {
			if strings.Contains(lagging+" ", r.Key().PhaseName()+" ") {
				return v + " (host lagging: inflated)"
			}
		}
		return v
	}
	for round := 1; round <= res.Config.Rounds; round++ {
		pc, lr := find(ScenarioHot50, round, "prefix-cache"), find(ScenarioHot50, round, "least-request")
		if pc != nil {
			top := 0
			for _, c := range pc.PerReplica {
				top = max(top, c)
			}
			t.Rows = append(t.Rows, []string{fmt.Sprint(round), fmt.Sprintf("hot50: prefix-cache puts ≥ %d of %d on one replica", scale(65, pc.Arrivals), pc.Arrivals),
				fmt.Sprint(top), note(ok(top >= scale(65, pc.Arrivals)), pc)})
		}
		if lr != nil {
			t.Rows = append(t.Rows, []string{fmt.Sprint(round), fmt.Sprintf("hot50: least-request passes ≥ %d", scale(90, lr.Arrivals)),
				fmt.Sprint(lr.SLOPass), note(ok(lr.SLOPass >= scale(90, lr.Arrivals)), lr)})
		}
		if pc != nil && lr != nil {
			d := lr.SLOPass - pc.SLOPass
			t.Rows = append(t.Rows, []string{fmt.Sprint(round), fmt.Sprintf("hot50: prefix-cache passes ≥ %d fewer than least-request", scale(30, pc.Arrivals)),
				fmt.Sprintf("%d fewer (%d vs %d)", d, pc.SLOPass, lr.SLOPass), note(ok(d >= scale(30, pc.Arrivals)), lr, pc)})
		}
		for _, r := range res.Runs {
			if r.Mode != "history" || r.Gateways != 1 || r.Scenario != ScenarioWarm || r.Round != round {
				continue
			}
			crit := fmt.Sprintf("warm, balanced index: %s passes ≥ %d", r.Strategy, scale(90, r.Arrivals))
			layout, balanced := bootstrapLayout(res, r.Key().PhaseName())
			if !indexBlind[r.Strategy] && !balanced {
				t.Rows = append(t.Rows, []string{fmt.Sprint(round), crit, fmt.Sprintf("%d (index %s)", r.SLOPass, layout), "n/a: index not balanced"})
				continue
			}
			t.Rows = append(t.Rows, []string{fmt.Sprint(round), crit, fmt.Sprintf("%d (index %s)", r.SLOPass, layout),
				note(ok(r.SLOPass >= scale(90, r.Arrivals)), &r)})
		}
	}
	return t, len(t.Rows) > 0
}

// writeTerms explains, once, the words every table below uses.
func writeTerms(w io.Writer) {
	fmt.Fprint(w, "**Terms.** The *seed study* is the AIBrix v0.7.0 prefix-cache routing experiment this harness reproduces "+
		"(two vLLM replicas, one gateway, 96 arrivals per phase; its table is `SeedTable` in chaos/study/seed.go). "+
		"A *scenario* is a workload over groups of documents: *cold* (nothing cached), *warm* (each document sent once before "+
		"the phase, so it is cached on some replica and known to the index), *hot50* / *hot90* (50 % / 90 % of arrivals go to one "+
		"hot group, placed on one replica first), *multiturn* (sessions that extend their own chat), *workload* (your own prompts and sessions from a --workload file). "+
		"A *strategy* picks the replica: *random*, *least-request*, *prefix-cache* (AIBrix's: longest cached prefix unless load is imbalanced), "+
		"*consistent-hash*, *cost* (kvmesh's estimate of time to first token). The *index mode* is what the gateway believes is cached: "+
		"*history* (its own past decisions), *kv-events* (the engines' KV-cache events), *hybrid* (both). "+
		"A *phase* is one scenario × round × strategy × mode × gateways run, named like `r1-hot50-cost@hybrid/g8` "+
		"(round 1, hot50, cost, hybrid index, 8 gateways; `-isolated` when they share nothing). "+
		"*P95* is the 95th percentile; *TTFT* time to first token, *TPOT* time per output token after it, *E2E* the whole request.\n\n")
}

// SeedArrivals is the seed study's arrivals per phase.
const SeedArrivals = 96

// Calibration tolerances: a P95 time more than calTimeFactor times the
// seed's (or less than 1/calTimeFactor of it), or a pass count further
// than calPassShare of the arrivals from the seed's scaled count, is a
// miss the report names.
const (
	calTimeFactor = 2.0
	calPassShare  = 0.15
)

// calibrationMisses names r's misses against the seed row, or "ok".
func calibrationMisses(r Run, sr SeedRow, seedPass int) string {
	var miss []string
	ratio := func(name string, ours, seed float64, unit string) {
		if math.IsNaN(ours) || seed <= 0 {
			return
		}
		if f := ours / seed; f > calTimeFactor || f < 1/calTimeFactor {
			miss = append(miss, fmt.Sprintf("MISS %s ×%.1f (%.3g vs %.3g %s)", name, f, ours, seed, unit))
		}
	}
	ratio("TTFT", float64(r.TTFTP95), sr.TTFTP95, "s")
	ratio("TPOT", float64(r.TPOTP95), sr.TPOTP95, "ms")
	if d := r.SLOPass - seedPass; math.Abs(float64(d)) > calPassShare*float64(r.Arrivals) {
		miss = append(miss, fmt.Sprintf("MISS pass %+d", d))
	}
	if len(miss) == 0 {
		return "ok"
	}
	return strings.Join(miss, "; ")
}

// bootstrapLayout returns the warm phase's index layout ("4/4") and
// whether it is balanced (every replica within one group of the others).
func bootstrapLayout(res *Results, phase string) (string, bool) {
	for _, p := range res.Phases {
		if p.Name != phase {
			continue
		}
		counts := make([]int, len(p.Replicas))
		for _, b := range p.Init.Bootstrap {
			if i := slices.Index(p.Replicas, b.Replica); i >= 0 {
				counts[i]++
			}
		}
		if len(counts) == 0 {
			return "unknown", false
		}
		parts := make([]string, len(counts))
		lo, hi := counts[0], counts[0]
		for i, c := range counts {
			parts[i] = fmt.Sprint(c)
			lo, hi = min(lo, c), max(hi, c)
		}
		return strings.Join(parts, "/"), hi-lo <= 1
	}
	return "unknown", false
}

// writeWorkload says, for a run of a user's workload (kvbench
// --workload), which traffic was replayed and how.
func writeWorkload(w io.Writer, wl *Workload) {
	if wl == nil {
		return
	}
	fmt.Fprintf(w, "## Workload\n\n")
	fmt.Fprintf(w, "- File `%s` (sha256 `%s`): %d requests in %d arrival units (%d multi-turn sessions); the seed's documents were not used.\n",
		wl.Path, wl.SHA256, wl.Requests, wl.Units, wl.Sessions)
	if wl.Scheduled {
		fmt.Fprintf(w, "- Arrivals at the file's `at_ms` times (model time from each phase's start); a session's later turns follow the previous answer after `think_ms`.\n")
	} else {
		fmt.Fprintf(w, "- Arrivals in file order at the configured RPS (a session takes one slot per turn); a session's later turns follow the previous answer after `think_ms`.\n")
	}
	if wl.Salted {
		fmt.Fprintf(w, "- Every prompt was prefixed with a per-phase salt line (`kvbench <32 hex>`), the same for every request of a phase: phases share no prefix in engine caches or gateway indexes; within a phase the file's prefix sharing is kept.\n")
	} else {
		fmt.Fprintf(w, "- Prompts went exactly as written (--workload-salt=false): phases are isolated only by the engines' cache reset or cache_salt, and the gateways' history indexes still remember earlier phases' prompts.\n")
	}
	fmt.Fprintln(w)
}

// writeTarget says, for a run against a deployment (kvbench --target), what
// was measured where: gateways and their versions, engines, model, how
// phases were isolated and every index-mode switch.
func writeTarget(w io.Writer, t *TargetInfo) {
	if t == nil {
		return
	}
	fmt.Fprintf(w, "## Deployment\n\n")
	fmt.Fprintf(w, "Measured against a running deployment (kvbench --target); nothing was simulated by kvbench and the profile is the deployment's own.\n\n")
	if len(t.Gateways) > 0 {
		cl := "not a cluster (each routes on its own index)"
		switch {
		case t.Clustered:
			cl = "one cluster (shared index, admin API)"
		case t.Clusters > 1:
			cl = fmt.Sprintf("%d separate clusters (each routes on its own cluster's index; modes set through each cluster's admin API)", t.Clusters)
		}
		fmt.Fprintf(w, "- Gateways (%d, %s): ", len(t.Gateways), cl)
		for i, g := range t.Gateways {
			v := "?"
			if i < len(t.GatewayVersions) {
				v = t.GatewayVersions[i]
			}
			if i > 0 {
				fmt.Fprint(w, ", ")
			}
			fmt.Fprintf(w, "`%s` (version %s)", g, v)
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "- Engines (%d): `%s`; model `%s` (/v1/models: %s)\n", len(t.Engines), strings.Join(t.Engines, "`, `"),
		t.Model, strings.Join(t.Models, ", "))
	switch t.Isolation {
	case IsolationReset:
		fmt.Fprintf(w, "- Cache isolation: every engine's prefix cache was reset (POST /reset_prefix_cache) before each phase and hot-spot retry.\n")
	case IsolationSalt:
		fmt.Fprintf(w, "- Cache isolation: no engine cache was reset (an engine refused /reset_prefix_cache, or --isolation cache_salt): each phase and hot-spot retry sent a fresh `cache_salt`; "+
			"earlier phases' blocks stayed in the engines' caches (taking capacity, never matched).\n")
	}
	for _, m := range t.ModeSwitches {
		if m.ConfigVersion == 0 {
			fmt.Fprintf(w, "- Index mode %s: every gateway already routed in it (%d checked).\n", m.Mode, m.Verified)
			continue
		}
		what := "the cluster default index_mode"
		switch m.Scope {
		case "model":
			what = "the model's own index_mode (models.<model>.index_mode)"
		case "mixed":
			what = "the model's own index_mode in some clusters, the default in others"
		}
		versions := fmt.Sprintf("config version %d", m.ConfigVersion)
		if len(m.ConfigVersions) > 1 {
			versions = fmt.Sprintf("%d clusters, config versions %v", len(m.ConfigVersions), m.ConfigVersions)
		}
		fmt.Fprintf(w, "- Index mode %s: set through the admin API as %s (%s); all %d gateways verified routing in it after %.0f ms.\n",
			m.Mode, what, versions, m.Verified, m.WaitMS)
	}
	fmt.Fprintln(w)
}
