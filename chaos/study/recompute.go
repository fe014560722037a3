package study

import (
	"fmt"
	"math"
)

// Recompute rebuilds the per-phase rows from requests.jsonl records alone:
// arrivals, successes, SLO passes, P95s and per-replica counts. The fields
// that come from engine and gateway counters (token hit rate, selection,
// max waiting) are not in the per-request records; they are taken from
// prev (the results.json written alongside) when given, and left missing
// otherwise. The second result lists every field where the recomputed
// value differs from prev.
func Recompute(recs []RequestRecord, slo SLO, prev *Results) (*Results, []string) {
	out := &Results{Requests: recs}
	if prev != nil {
		out.Config = prev.Config
		out.Phases = prev.Phases
	}
	order := []PhaseKey{}
	byKey := map[PhaseKey][]RequestRecord{}
	for _, r := range recs {
		k := r.Key()
		if _, ok := byKey[k]; !ok {
			order = append(order, k)
		}
		byKey[k] = append(byKey[k], r)
	}
	var diffs []string
	for _, k := range order {
		rs := byKey[k]
		sum := Summarize(rs, slo)
		run := Run{
			Scenario: k.Scenario, Round: k.Round, Strategy: k.Strategy, Mode: k.Mode, Gateways: k.Gateways,
			Isolated: k.Isolated,
			Arrivals: sum.Arrivals, Succeeded: sum.Succeeded, Failed: sum.Failed, SLOPass: sum.SLOPass,
			TTFTP95: Num(sum.TTFTP95), TPOTP95: Num(sum.TPOTP95), E2EP95: Num(sum.E2EP95),
			TokenHitRate: Num(math.NaN()), PerReplica: sum.PerReplica,
		}
		var old *Run
		if prev != nil {
			for i := range prev.Runs {
				if prev.Runs[i].Key() == k {
					old = &prev.Runs[i]
				}
			}
		}
		if old != nil {
			run.Replicas = old.Replicas
			run.TokenHitRate = old.TokenHitRate
			run.Selection = old.Selection
			run.MaxWaiting = old.MaxWaiting
			for n := range old.PerReplica {
				if _, ok := run.PerReplica[n]; !ok {
					run.PerReplica[n] = 0
				}
			}
			diffs = append(diffs, compareRuns(k, old, &run)...)
		}
		out.Runs = append(out.Runs, run)
	}
	return out, diffs
}

func compareRuns(k PhaseKey, a, b *Run) []string {
	var d []string
	name := k.PhaseName()
	ints := []struct {
		f    string
		x, y int
	}{
		{"arrivals", a.Arrivals, b.Arrivals}, {"succeeded", a.Succeeded, b.Succeeded},
		{"failed", a.Failed, b.Failed}, {"slo_pass", a.SLOPass, b.SLOPass},
	}
	for _, c := range ints {
		if c.x != c.y {
			d = append(d, fmt.Sprintf("%s %s: results.json %d, recomputed %d", name, c.f, c.x, c.y))
		}
	}
	nums := []struct {
		f    string
		x, y Num
	}{{"ttft_p95_s", a.TTFTP95, b.TTFTP95}, {"tpot_p95_ms", a.TPOTP95, b.TPOTP95}, {"e2e_p95_s", a.E2EP95, b.E2EP95}}
	for _, c := range nums {
		x, y := float64(c.x), float64(c.y)
		if math.IsNaN(x) != math.IsNaN(y) || (!math.IsNaN(x) && math.Abs(x-y) > 1e-6*math.Max(1, math.Abs(x))) {
			d = append(d, fmt.Sprintf("%s %s: results.json %v, recomputed %v", name, c.f, x, y))
		}
	}
	for n, c := range a.PerReplica {
		if b.PerReplica[n] != c {
			d = append(d, fmt.Sprintf("%s per_replica[%s]: results.json %d, recomputed %d", name, n, c, b.PerReplica[n]))
		}
	}
	return d
}
