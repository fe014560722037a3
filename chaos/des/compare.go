package des

import (
	"fmt"
	"slices"

	"github.com/kvmesh/kvmesh/chaos/study"
)

// Difference is one phase's disagreement between two studies of the same
// grid (typically live and DES).
type Difference struct {
	Key study.PhaseKey
	// MaxReplicaDelta is the largest per-replica request-count difference.
	MaxReplicaDelta int
	// SLOPassDelta is b's SLO pass count minus a's.
	SLOPassDelta int
	// Missing names the side that lacks the phase ("a" or "b"), if any.
	Missing string
}

// Within reports whether d is within the fidelity bounds: per-replica
// counts and SLO pass each within tol requests.
func (d Difference) Within(tol int) bool {
	return d.Missing == "" && d.MaxReplicaDelta <= tol && abs(d.SLOPassDelta) <= tol
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

// Compare matches the runs of a and b by phase key and returns a table
// with both sides' per-replica counts, SLO pass, TTFT P95 and token hit
// rate, and the differences, in a's run order (then b's extra phases).
func Compare(a, b *study.Results, nameA, nameB string) (study.Table, []Difference) {
	byKey := map[study.PhaseKey]*study.Run{}
	for i := range b.Runs {
		byKey[b.Runs[i].Key()] = &b.Runs[i]
	}
	t := study.Table{
		Title: fmt.Sprintf("%s vs %s", nameA, nameB),
		Header: []string{"phase", nameA + " per replica", nameB + " per replica", "max Δ replica",
			nameA + " pass", nameB + " pass", "Δ pass", nameA + " TTFT P95 s", nameB + " TTFT P95 s",
			nameA + " hit", nameB + " hit"},
	}
	var diffs []Difference
	seen := map[study.PhaseKey]bool{}
	for i := range a.Runs {
		ra := &a.Runs[i]
		k := ra.Key()
		seen[k] = true
		rb := byKey[k]
		if rb == nil {
			diffs = append(diffs, Difference{Key: k, Missing: nameB})
			continue
		}
		names := replicaUnion(ra.PerReplica, rb.PerReplica)
		d := Difference{Key: k, SLOPassDelta: rb.SLOPass - ra.SLOPass}
		for _, n := range names {
			d.MaxReplicaDelta = max(d.MaxReplicaDelta, abs(rb.PerReplica[n]-ra.PerReplica[n]))
		}
		diffs = append(diffs, d)
		t.Rows = append(t.Rows, []string{
			k.PhaseName(), counts(ra.PerReplica, names), counts(rb.PerReplica, names), fmt.Sprint(d.MaxReplicaDelta),
			fmt.Sprint(ra.SLOPass), fmt.Sprint(rb.SLOPass), fmt.Sprintf("%+d", d.SLOPassDelta),
			fmtNum(ra.TTFTP95, 2), fmtNum(rb.TTFTP95, 2), fmtPct(ra.TokenHitRate), fmtPct(rb.TokenHitRate),
		})
	}
	for i := range b.Runs {
		if k := b.Runs[i].Key(); !seen[k] {
			diffs = append(diffs, Difference{Key: k, Missing: nameA})
		}
	}
	return t, diffs
}

func replicaUnion(a, b map[string]int) []string {
	var names []string
	for n := range a {
		names = append(names, n)
	}
	for n := range b {
		if _, ok := a[n]; !ok {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	return names
}

func counts(m map[string]int, names []string) string {
	s := ""
	for i, n := range names {
		if i > 0 {
			s += "/"
		}
		s += fmt.Sprint(m[n])
	}
	return s
}
