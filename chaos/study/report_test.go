package study_test

import (
	"bytes"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
)

func run(sc string, round int, strat, mode string, pass int, ttft, hit float64, a, b int) study.Run {
	return study.Run{
		Scenario: sc, Round: round, Strategy: strat, Mode: mode, Gateways: 1, Replicas: 2,
		Arrivals: 96, Succeeded: 96, SLOPass: pass, TTFTP95: study.Num(ttft), TPOTP95: 60,
		E2EP95: 9, TokenHitRate: study.Num(hit),
		PerReplica: map[string]int{"A": a, "B": b}, MaxWaiting: map[string]int{"A": 0, "B": 3},
	}
}

func TestBeatCheck(t *testing.T) {
	res := &study.Results{Config: study.DefaultConfig(), Runs: []study.Run{
		run("hot50", 1, "least-request", "hybrid", 94, 1.9, 0.85, 48, 48),
		run("hot50", 1, "prefix-cache", "hybrid", 40, 8.3, 0.93, 27, 69),
		run("hot50", 1, "cost", "hybrid", 95, 1.8, 0.915, 40, 56), // meets: hit 91.5 ≥ 93−2
		run("warm", 1, "least-request", "hybrid", 96, 0.3, 0.93, 48, 48),
		run("warm", 1, "prefix-cache", "hybrid", 96, 0.3, 0.93, 48, 48),
		run("warm", 1, "cost", "hybrid", 95, 0.4, 0.90, 48, 48), // misses all three
		run("cold", 1, "cost", "history", 50, 5, 0.8, 48, 48),   // history: not part of the goal
	}}
	tab, ok := study.BeatCheck(res)
	require.True(t, ok)
	require.Len(t, tab.Rows, 2)
	assert.Equal(t, "meets", tab.Rows[0][5])
	assert.Equal(t, "misses pass, TTFT, hit rate", tab.Rows[1][5])
}

// TestCalibrationLikeForLikeAndMisses: a 48-arrival run is compared with
// the seed's counts scaled to 48, and a TTFT ten times the seed's is
// flagged as a miss with the tolerance.
func TestCalibrationLikeForLikeAndMisses(t *testing.T) {
	res := &study.Results{Config: study.DefaultConfig(), Runs: []study.Run{
		run("warm", 1, "prefix-cache", "history", 47, 3.1, 0.93, 24, 24),
		run("hot50", 1, "least-request", "history", 30, 1.8, 0.85, 24, 24),
	}}
	res.Runs[0].Arrivals, res.Runs[1].Arrivals = 48, 48
	cal, ok := study.CalibrationTable(res)
	require.True(t, ok)
	require.Len(t, cal.Rows, 2)
	byScenario := map[string][]string{}
	for _, r := range cal.Rows {
		byScenario[r[0]] = r
	}
	warm := byScenario["warm / 1"]
	assert.Equal(t, "47 | 48 of 48", warm[5], "the seed's 96 of 96 scaled to 48")
	assert.Equal(t, "24 / 24 | 24 / 24", warm[6])
	assert.Contains(t, warm[7], "MISS TTFT ×9.5")
	hot := byScenario["hot50 / 1"]
	assert.Equal(t, "30 | 48 of 48", hot[5])
	assert.Equal(t, "MISS pass -18", hot[7])
	assert.Contains(t, strings.Join(cal.Notes, " "), "within ×2")
}

func TestCalibrationAndVerdict(t *testing.T) {
	res := &study.Results{Config: study.DefaultConfig(), Runs: []study.Run{
		run("hot50", 1, "least-request", "history", 96, 1.7, 0.85, 48, 48),
		run("hot50", 1, "prefix-cache", "history", 38, 8.3, 0.93, 27, 69),
		run("hot50", 2, "prefix-cache", "history", 37, 8.2, 0.93, 27, 69),
		run("hot50", 2, "least-request", "history", 94, 1.9, 0.85, 47, 49),
		run("hot50", 1, "cost", "kv-events", 96, 1.5, 0.9, 40, 56),
	}}
	res.Runs[0].TPOTP95 = study.Num(math.NaN())
	cal, ok := study.CalibrationTable(res)
	require.True(t, ok)
	require.Len(t, cal.Rows, 4, "history runs only, each next to its seed row")
	assert.Equal(t, []string{"hot50 / 1", "least-request", "1.700 | 1.767", "— | 71.6", "85.0% | 85.4%", "96 | 96 of 96", "48 / 48 | 48 / 48", "ok"}, cal.Rows[0])

	v := study.Verdict(res, "hot50")
	assert.True(t, strings.HasPrefix(v, "**hot50**: best least-request@history/g1 (96+94 = 190/192 pass"), v)
	assert.Contains(t, v, "worst prefix-cache@history/g1 (38+37 = 75/192 pass, worst TTFT P95 8.30 s, busiest replica 72%)")
	assert.Equal(t, "**multiturn**: not measured.", study.Verdict(res, "multiturn"))

	var txt bytes.Buffer
	study.WriteTables(&txt, res)
	assert.Contains(t, txt.String(), "== hot50 — kv-events · 1 gateway ==")
	assert.NotContains(t, txt.String(), "**")
}

func TestCalibrationCheck(t *testing.T) {
	cfg := study.DefaultConfig()
	cfg.Rounds = 1
	res := &study.Results{Config: cfg, Runs: []study.Run{
		run("hot50", 1, "least-request", "history", 95, 1.7, 0.85, 48, 48),
		run("hot50", 1, "prefix-cache", "history", 40, 8.3, 0.93, 27, 69),
		run("warm", 1, "least-request", "history", 96, 0.3, 0.93, 48, 48),
		run("warm", 1, "prefix-cache", "history", 85, 0.3, 0.93, 48, 48),
		run("warm", 1, "cost", "history", 60, 0.3, 0.93, 70, 26),
	}}
	boot := func(name string, a, b int) study.PhaseDetail {
		p := study.PhaseDetail{Name: name, Measured: true, Replicas: []string{"A", "B"}}
		for i := range a + b {
			rep := "A"
			if i >= a {
				rep = "B"
			}
			p.Init.Bootstrap = append(p.Init.Bootstrap, study.Placement{Replica: rep, Complete: true})
		}
		return p
	}
	res.Phases = []study.PhaseDetail{
		boot("r1-warm-prefix-cache@history/g1", 4, 4),
		boot("r1-warm-cost@history/g1", 6, 2),
		{Name: "r1-hot50-least-request@history/g1", Measured: true, LagP95S: 0.5},
		// Both runs of the difference lag: the verdict says so once.
		{Name: "r1-hot50-prefix-cache@history/g1", Measured: true, LagP95S: 0.5},
	}
	tab, ok := study.CalibrationCheck(res)
	require.True(t, ok)
	got := map[string][2]string{}
	for _, r := range tab.Rows {
		got[r[1]] = [2]string{r[2], r[3]}
	}
	assert.Equal(t, [2]string{"69", "met (host lagging: inflated)"}, got["hot50: prefix-cache puts ≥ 65 of 96 on one replica"])
	assert.Equal(t, [2]string{"95", "met (host lagging: inflated)"}, got["hot50: least-request passes ≥ 90"])
	assert.Equal(t, [2]string{"55 fewer (40 vs 95)", "met (host lagging: inflated)"}, got["hot50: prefix-cache passes ≥ 30 fewer than least-request"])
	assert.Equal(t, [2]string{"96 (index unknown)", "met"}, got["warm, balanced index: least-request passes ≥ 90"], "index-blind")
	assert.Equal(t, [2]string{"85 (index 4/4)", "not met"}, got["warm, balanced index: prefix-cache passes ≥ 90"])
	assert.Equal(t, [2]string{"60 (index 6/2)", "n/a: index not balanced"}, got["warm, balanced index: cost passes ≥ 90"])
}

func TestSyncCheck(t *testing.T) {
	gw := func(r study.Run, g int, iso bool) study.Run {
		r.Gateways, r.Isolated = g, iso
		return r
	}
	res := &study.Results{Config: study.DefaultConfig(), Runs: []study.Run{
		run("hot50", 1, "cost", "history", 95, 1.0, 0.986, 42, 54),
		gw(run("hot50", 1, "cost", "history", 93, 1.5, 0.983, 40, 56), 3, false), // −2.1 pass points
		gw(run("hot50", 1, "cost", "history", 91, 2.0, 0.924, 46, 50), 3, true),
		run("warm", 1, "cost", "hybrid", 96, 0.1, 0.996, 48, 48),
		gw(run("warm", 1, "cost", "hybrid", 96, 0.2, 0.997, 48, 48), 3, false),
		gw(run("cold", 1, "cost", "hybrid", 90, 0.2, 0.5, 48, 48), 3, true), // no 1-gateway run
	}}
	tab, ok := study.SyncCheck(res)
	require.True(t, ok)
	require.Len(t, tab.Rows, 2)
	assert.Equal(t, []string{"hot50 / 1", "history", "cost", "3", "99.0% | 96.9% | 94.8%", "98.6% | 98.3% | 92.4%",
		"no (pass -2.1, hit -0.3)"}, tab.Rows[0])
	assert.Equal(t, "100.0% | 100.0% | —", tab.Rows[1][4])
	assert.Equal(t, "yes (pass +0.0, hit +0.1)", tab.Rows[1][6])

	var b bytes.Buffer
	study.WriteTables(&b, res)
	assert.Contains(t, b.String(), "Gateway cluster: N gateways vs 1")

	// Warm: an index-following strategy's verdict names differing layouts.
	res.Runs = append(res.Runs, run("warm", 1, "prefix-cache", "history", 90, 2, 0.99, 36, 60),
		gw(run("warm", 1, "prefix-cache", "history", 59, 7, 0.99, 69, 27), 3, false))
	layout := func(name string, reps ...string) study.PhaseDetail {
		d := study.PhaseDetail{Name: name, Replicas: []string{"A", "B"}}
		for _, r := range reps {
			d.Init.Bootstrap = append(d.Init.Bootstrap, study.Placement{Replica: r})
		}
		return d
	}
	res.Phases = []study.PhaseDetail{
		layout("r1-warm-prefix-cache@history/g1", "A", "B", "B", "A", "B", "B", "A", "B"),
		layout("r1-warm-prefix-cache@history/g3", "A", "A", "A", "A", "A", "B", "A", "B"),
	}
	tab, _ = study.SyncCheck(res)
	require.Len(t, tab.Rows, 3)
	assert.Equal(t, "no (pass -32.3, hit +0.0); warm index 3/5 vs 6/2", tab.Rows[2][6])

	_, ok = study.SyncCheck(&study.Results{Runs: res.Runs[:1]})
	assert.False(t, ok, "one gateway only: nothing to compare")
}

// A cell holding "ours | seed" stays one column in Markdown: every row has
// as many unescaped separators as the header.
func TestTableMarkdownEscapesPipes(t *testing.T) {
	tb := study.Table{
		Header: []string{"scenario", "pass cost | best(LR,PC)", "verdict"},
		Rows:   [][]string{{"cold / 1", "79 | 57", "meets"}},
	}
	var b strings.Builder
	tb.Markdown(&b)
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	require.Len(t, lines, 3)
	require.Equal(t, `| scenario | pass cost \| best(LR,PC) | verdict |`, lines[0])
	require.Equal(t, "|---|---|---|", lines[1])
	require.Equal(t, `| cold / 1 | 79 \| 57 | meets |`, lines[2])
}

// TestPerReplicaSummaryAtScale: with 128 replicas a phase table's cell
// holds min / median / max and the top three, not 128 values; small runs
// keep the full list.
func TestPerReplicaSummaryAtScale(t *testing.T) {
	r := run("hot50", 1, "cost", "history", 90, 1.5, 0.9, 0, 0)
	r.Replicas = 128
	r.PerReplica, r.MaxWaiting = map[string]int{}, map[string]int{}
	for i := range 128 {
		name := fmt.Sprintf("r%03d", i)
		r.PerReplica[name] = i % 10 // 0..9, r009 first of the nines
		r.MaxWaiting[name] = 1
	}
	r.PerReplica["r100"] = 500
	res := &study.Results{Config: study.DefaultConfig(), Runs: []study.Run{r}}
	var md bytes.Buffer
	require.NoError(t, study.WriteMarkdown(&md, res))
	out := md.String()
	assert.Contains(t, out, "requests per replica (min / median / max; top 3)")
	assert.Contains(t, out, "0 / 4 / 500; r100 500, r009 9, r019 9")
	assert.Contains(t, out, "1 / 1 / 1; ")
	assert.NotContains(t, out, "r000 / r001", "no 128-name header")
	assert.Contains(t, out, "128 replicas: per-replica figures are summarized")

	small := &study.Results{Config: study.DefaultConfig(), Runs: []study.Run{run("hot50", 1, "cost", "history", 90, 1.5, 0.9, 40, 56)}}
	md.Reset()
	require.NoError(t, study.WriteMarkdown(&md, small))
	assert.Contains(t, md.String(), "40 / 56")
}

// TestTargetReportSaysWhereAndFlagsClientLag: a target run's report.md
// names the deployment (gateways and versions, engine count, model,
// isolation) and flags a lagging phase as the client's lag, not as
// inflated engine latencies; in process the same lag is the host's.
func TestTargetReportSaysWhereAndFlagsClientLag(t *testing.T) {
	cfg := study.DefaultConfig()
	cfg.Rounds = 1
	res := &study.Results{Config: cfg, Runs: []study.Run{
		run("warm", 1, "least-request", "history", 96, 0.3, 0.93, 48, 48),
		run("warm", 1, "prefix-cache", "history", 90, 0.4, 0.93, 50, 46),
	}, Phases: []study.PhaseDetail{
		{Name: "r1-warm-least-request@history/g1", Measured: true, LagP95S: 0.02},
		{Name: "r1-warm-prefix-cache@history/g1", Measured: true, LagP95S: 0.35},
	}}
	var inProc bytes.Buffer
	require.NoError(t, study.WriteMarkdown(&inProc, res))
	assert.Contains(t, inProc.String(), "**Host did not keep up** in 1 phase(s)")
	assert.NotContains(t, inProc.String(), "## Deployment")

	res.Config.Target = &study.TargetInfo{
		Gateways: []string{"http://gw1:8080"}, GatewayVersions: []string{"v1.2.3"},
		Engines: []string{"e1=http://e1:8000", "e2=http://e2:8000"}, Model: "Qwen/Qwen3-8B",
		Models: []string{"Qwen/Qwen3-8B"}, Clustered: true, Isolation: study.IsolationSalt,
	}
	var md, txt, page bytes.Buffer
	require.NoError(t, study.WriteMarkdown(&md, res))
	study.WriteTables(&txt, res)
	require.NoError(t, study.WriteHTML(&page, res))
	m := md.String()
	assert.Contains(t, m, "## Deployment")
	assert.Contains(t, m, "`http://gw1:8080` (version v1.2.3)")
	assert.Contains(t, m, "- Engines (2): `e1=http://e1:8000`, `e2=http://e2:8000`; model `Qwen/Qwen3-8B`")
	assert.Contains(t, m, "Cache isolation: no engine cache was reset")
	assert.Contains(t, m, "**Client lagged** in 1 phase(s)")
	assert.Contains(t, m, "r1-warm-prefix-cache@history/g1 (lag P95 350 ms)")
	assert.NotContains(t, m, "r1-warm-least-request@history/g1 (lag")
	assert.NotContains(t, m, "Host did not keep up")
	assert.Contains(t, txt.String(), "Client lagged (arrivals sent > 100ms late at P95")
	assert.Contains(t, page.String(), "<b>Client lagged</b>")
}
