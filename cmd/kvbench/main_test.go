package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/chaos/study"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
	)
}

func run(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	var out, errb bytes.Buffer
	cmd := newRootCmd(&out, &errb)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(context.Background())
	return out.String(), errb.String(), err
}

// TestKvbenchEndToEnd runs the command on a tiny grid (fast profile) and
// recomputes its tables from requests.jsonl.
func TestKvbenchEndToEnd(t *testing.T) {
	dir := t.TempDir()
	stdout, stderr, err := run(t, "--quick", "--profile", "fast", "--speed", "20", "--arrivals", "10", "--rps", "4",
		"--max-tokens", "16", "--scenarios", "cold,hot50", "--out", dir)
	require.NoError(t, err, stderr)
	assert.Contains(t, stdout, "== hot50 — history · 1 gateway ==")
	assert.Contains(t, stdout, "hot50: best")
	assert.Contains(t, stderr, "phase r1-cold-least-request@history/g1")

	raw, err := os.ReadFile(filepath.Join(dir, study.FileResults))
	require.NoError(t, err)
	var res study.Results
	require.NoError(t, json.Unmarshal(raw, &res))
	require.Len(t, res.Runs, 2*3, "quick: 3 strategies, here on 2 scenarios")
	for _, r := range res.Runs {
		assert.Equal(t, r.Arrivals, r.Succeeded+r.Failed)
		assert.Equal(t, 10, r.Arrivals)
	}
	assert.Equal(t, "fast", res.Config.Profile, "explicit flags override --quick")
	assert.Equal(t, []string{"least-request", "prefix-cache", "cost"}, res.Config.Strategies, "--quick's strategies")
	for _, f := range []string{study.FileRequests, study.FilePhases, study.FileReport, study.FileHTML} {
		st, err := os.Stat(filepath.Join(dir, f))
		require.NoError(t, err, f)
		assert.Greater(t, st.Size(), int64(100), f)
	}

	stdout, _, err = run(t, "recompute", filepath.Join(dir, study.FileRequests))
	require.NoError(t, err)
	assert.Contains(t, stdout, "every field matches")
	assert.Contains(t, stdout, "== cold — history · 1 gateway ==")

	// report re-renders the reports from the directory.
	require.NoError(t, os.Remove(filepath.Join(dir, study.FileHTML)))
	stdout, _, err = run(t, "report", dir)
	require.NoError(t, err)
	assert.Contains(t, stdout, "== hot50 — history · 1 gateway ==")
	h, err := os.ReadFile(filepath.Join(dir, study.FileHTML))
	require.NoError(t, err)
	assert.Contains(t, string(h), "TTFT timeline")

	// A tampered results.json is caught.
	res.Runs[0].SLOPass++
	b, _ := json.Marshal(&res)
	bad := filepath.Join(t.TempDir(), "results.json")
	require.NoError(t, os.WriteFile(bad, b, 0o644))
	stdout, _, err = run(t, "recompute", "--results", bad, filepath.Join(dir, study.FileRequests))
	require.Error(t, err)
	assert.Contains(t, stdout, "DIFF")
}

func TestFlagValidation(t *testing.T) {
	_, _, err := run(t, "--strategies", "fastest")
	require.ErrorIs(t, err, study.ErrInvalidConfig)
	_, _, err = run(t, "--scenarios", "lukewarm")
	require.ErrorIs(t, err, study.ErrUnknownScenario)
	_, _, err = run(t, "--quick", "--log-level", "loud", "--profile", "fast")
	require.Error(t, err)
	assert.True(t, strings.Contains(err.Error(), "log-level"))
}
