package suite

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/cluster"
)

// The command's harness fails a scenario as go test would: a failed
// require ends it there, cleanups still run (last in, first out, after the
// Context is cancelled), temporary directories go, a panic is a failure.
func TestRunFailsAScenarioAsTestingWould(t *testing.T) {
	var order []string
	var dir string
	var ctxErr error
	sc := Scenario{Number: 99, Name: "fails", Run: func(r *R) {
		dir = r.TempDir()
		r.Cleanup(func() { order = append(order, "first registered"); ctxErr = r.Context().Err() })
		r.Cleanup(func() { order = append(order, "second registered") })
		r.Row(cluster.Row{Scenario: "99 fails", Load: cluster.LoadResult{Sent: 3, OK: 3}})
		require.Equal(r, 1, 2, "an invariant")
		order = append(order, "after the failed require")
	}}
	res := RunOne(context.Background(), sc, Options{})
	require.False(t, res.Passed)
	require.Len(t, res.Failures, 1)
	require.Contains(t, res.Failures[0], "an invariant")
	require.Equal(t, []string{"second registered", "first registered"}, order)
	require.ErrorIs(t, ctxErr, context.Canceled)
	_, err := os.Stat(dir)
	require.ErrorIs(t, err, os.ErrNotExist, "TempDir removed")
	require.Len(t, res.Rows, 1, "rows recorded before the failure are kept")

	res = RunOne(context.Background(), Scenario{Name: "panics", Run: func(*R) { panic("boom") }}, Options{})
	require.False(t, res.Passed)
	require.Contains(t, res.Failures[0], "panic: boom")

	res = RunOne(context.Background(), Scenario{Name: "lost", Run: func(r *R) {
		r.Row(cluster.Row{Scenario: "lost", Load: cluster.LoadResult{Sent: 2, OK: 1, Lost: 1}})
	}}, Options{})
	require.False(t, res.Passed, "a lost request fails the scenario")

	rep := NewReport(Size{}, time.Now(), []Result{res})
	require.False(t, rep.Passed)
	require.Contains(t, rep.Markdown(), "| lost | **FAIL** | 2 | 1 | 0 | 1 |")
}

// A real scenario through Run, at half size: the row the test package
// records, with the counts scaled.
func TestRunEvictionThroughTheCommandHarness(t *testing.T) {
	sc, ok := Lookup("eviction")
	require.True(t, ok)
	var progress strings.Builder
	rs := Run(t.Context(), []Scenario{sc}, Options{Size: Size{Factor: 0.5}, Progress: &progress})
	require.Len(t, rs, 1)
	require.True(t, rs[0].Passed, "%v", rs[0].Failures)
	require.Len(t, rs[0].Rows, 1)
	row := rs[0].Rows[0]
	require.Equal(t, "1 eviction-pressure", row.Scenario)
	require.Equal(t, 120, row.Load.Sent, "the short form's 240 requests, halved")
	require.Contains(t, progress.String(), "[1/1] eviction ok")

	rep := NewReport(Size{Factor: 0.5}, time.Now(), rs)
	js, err := rep.JSON()
	require.NoError(t, err)
	var back struct {
		Passed  bool
		Results []struct {
			Name string
			Rows []struct {
				Scenario string
				Sent     int
				Lost     int
			}
		}
	}
	require.NoError(t, json.Unmarshal(js, &back))
	require.True(t, back.Passed)
	require.Equal(t, "1 eviction-pressure", back.Results[0].Rows[0].Scenario)
	require.Equal(t, 120, back.Results[0].Rows[0].Sent)
	require.Contains(t, rep.Markdown(), "| 1 eviction-pressure | ok | 120 | 120 | 0 | 0 |")
}

func TestSelect(t *testing.T) {
	all, err := Select(nil)
	require.NoError(t, err)
	require.Len(t, all, len(All()))
	three, err := Select([]string{"3"})
	require.NoError(t, err)
	require.Equal(t, []string{"zmq", "zmq-gap"}, names(three))
	some, err := Select([]string{"partition,eviction", "TestIntruder"})
	require.NoError(t, err)
	require.Equal(t, []string{"eviction", "partition", "intruder"}, names(some), "the suite's order")
	_, err = Select([]string{"eviction", "nope"})
	require.ErrorIs(t, err, ErrUnknownScenario)
}

func names(scs []Scenario) []string {
	out := make([]string, 0, len(scs))
	for _, s := range scs {
		out = append(out, s.Name)
	}
	return out
}
