package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
)

// exampleWorkload is the workload file the docs ship.
var exampleWorkload = filepath.Join("..", "..", "docs", "examples", "workload.jsonl")

// TestKvbenchWorkload runs the documented example workload through the
// command on the live in-process engine and on the DES engine: one phase
// per strategy with every line of the file as one request, the file's
// summary in results.json and report.md, requests.jsonl recomputing to the
// same tables.
func TestKvbenchWorkload(t *testing.T) {
	w, err := study.LoadWorkload(exampleWorkload)
	require.NoError(t, err)
	require.Equal(t, 14, w.Requests)

	for _, engine := range []string{"live", "des"} {
		dir := t.TempDir()
		stdout, stderr, err := run(t, "--engine", engine, "--workload", exampleWorkload, "--profile", "fast", "--speed", "20",
			"--strategies", "least-request,prefix-cache", "--modes", "history", "--rounds", "1", "--max-tokens", "16",
			"--out", dir)
		require.NoError(t, err, stderr)
		assert.Contains(t, stdout, "== workload — history · 1 gateway ==", engine)

		res, raw := readResults(t, dir)
		validateResults(t, raw)
		require.NotNil(t, res.Config.Workload, engine)
		assert.Equal(t, w.SHA256, res.Config.Workload.SHA256)
		assert.Equal(t, 2, res.Config.Workload.Sessions)
		assert.True(t, res.Config.Workload.Scheduled)
		assert.True(t, res.Config.Workload.Salted)
		assert.Equal(t, []string{study.ScenarioWorkload}, res.Config.Scenarios)
		require.Len(t, res.Runs, 2, engine)
		for _, r := range res.Runs {
			assert.Equal(t, 14, r.Arrivals, engine)
			assert.Equal(t, 14, r.Succeeded, "%s %s", engine, r.Strategy)
		}
		// Every request was served as the file says: per-line max_tokens
		// and a prompt longer than the file's shared system text.
		rf, err := os.Open(filepath.Join(dir, study.FileRequests))
		require.NoError(t, err)
		recs, err := study.ReadRequests(rf)
		_ = rf.Close()
		require.NoError(t, err)
		require.Len(t, recs, 28)
		for _, r := range recs[:14] {
			require.NotNil(t, r.Usage, "%s line %d: sent %t, status %d, error %q", engine, r.Document, r.Sent, r.Status, r.Err)
			want := 16
			if r.Document >= 7 && r.Document <= 9 {
				want = 64 // the code-review lines set max_tokens
			}
			assert.Equal(t, want, r.Usage.CompletionTokens, "%s line %d", engine, r.Document)
			assert.Greater(t, r.Usage.PromptTokens, 40, "%s line %d", engine, r.Document)
		}
		md, err := os.ReadFile(filepath.Join(dir, study.FileReport))
		require.NoError(t, err)
		assert.Contains(t, string(md), "## Workload")
		assert.Contains(t, string(md), w.SHA256)

		out, stderr, err := run(t, "recompute", filepath.Join(dir, study.FileRequests))
		require.NoError(t, err, stderr)
		assert.Contains(t, out, "every field matches", engine)
	}
}

// TestWorkloadFlags: --workload replaces the scenarios and arrivals (so
// they are refused beside it), a bad line fails with its number, and
// --plan describes the file without running it.
func TestWorkloadFlags(t *testing.T) {
	_, _, err := run(t, "--workload", exampleWorkload, "--scenarios", "warm")
	require.ErrorIs(t, err, study.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "--scenarios does not apply to --workload")
	_, _, err = run(t, "--workload", exampleWorkload, "--arrivals", "5")
	require.ErrorIs(t, err, study.ErrInvalidConfig)
	_, _, err = run(t, "--workload-salt=false")
	require.ErrorIs(t, err, study.ErrInvalidConfig)

	bad := filepath.Join(t.TempDir(), "bad.jsonl")
	require.NoError(t, os.WriteFile(bad, []byte("{\"prompt\":\"a\"}\n\n{\"prompt\":\"b\",\"max_token\":3}\n"), 0o644))
	_, _, err = run(t, "--workload", bad, "--quick")
	require.ErrorIs(t, err, study.ErrBadWorkload)
	assert.Contains(t, err.Error(), "bad.jsonl: study: bad workload file: line 3: json: unknown field \"max_token\"")
	_, _, err = run(t, "--workload", filepath.Join(t.TempDir(), "missing.jsonl"))
	require.ErrorIs(t, err, study.ErrBadWorkload)

	dir := filepath.Join(t.TempDir(), "out")
	out, stderr, err := run(t, "--workload", exampleWorkload, "--quick", "--plan", "--out", dir)
	require.NoError(t, err, stderr)
	assert.Contains(t, out, "14 requests, 11 arrival units, 2 sessions; prompts salted per phase")
	assert.Contains(t, out, "plan: 3 phases, 14 scheduled arrivals each on the workload's at_ms schedule: at least 3.5s of arrivals per phase")
	assert.Contains(t, out, "r1-workload-cost@history/g1")
	_, err = os.Stat(dir)
	assert.True(t, os.IsNotExist(err), "--plan runs nothing")
	assert.False(t, strings.Contains(out, "hot50"))
}
