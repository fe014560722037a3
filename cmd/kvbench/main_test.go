package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
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
	_, _, err = run(t, "--sync-delay", "10ms")
	require.ErrorIs(t, err, study.ErrInvalidConfig, "DES-only flag on the live engine")
	_, _, err = run(t, "--no-sync", "--sync", "synced")
	require.ErrorIs(t, err, study.ErrInvalidConfig)
	_, _, err = run(t, "--sync", "sometimes")
	require.ErrorIs(t, err, study.ErrInvalidConfig)
	_, _, err = run(t, "--engine", "analog")
	require.ErrorIs(t, err, study.ErrInvalidConfig)
	_, _, err = run(t, "sweep", "--replicas", "2")
	require.ErrorIs(t, err, study.ErrInvalidConfig, "a sweep needs every axis")
	_, _, err = run(t, "--parallel", "2")
	require.ErrorIs(t, err, study.ErrInvalidConfig, "live cells share the host: one at a time")
	_, _, err = run(t, "--engine", "des", "--parallel", "-1")
	require.ErrorIs(t, err, study.ErrInvalidConfig)
}

// TestKvbenchDESDefaultGrid runs --engine des with only the scale flags
// (small): the DES default grid (hot50; least-request, prefix-cache,
// cost; history; one round; synced and isolated; the seed's load per
// replica), explicit flags overriding it, and the same bytes on one and
// on two workers.
func TestKvbenchDESDefaultGrid(t *testing.T) {
	var raws [][]byte
	for _, parallel := range []string{"1", "2"} {
		dir := t.TempDir()
		_, stderr, err := run(t, "--engine", "des", "--replicas", "4", "--gateways", "2", "--arrivals", "40",
			"--parallel", parallel, "--out", dir)
		require.NoError(t, err, stderr)
		assert.Contains(t, stderr, "cells history/g2,history/g2-isolated")
		assert.Contains(t, stderr, "arrivals/s")
		assert.Contains(t, stderr, "40 arrivals per phase at 3.2 RPS")
		res, raw := readResults(t, dir)
		raws = append(raws, raw)
		assert.Equal(t, []string{study.ScenarioHot50}, res.Config.Scenarios)
		assert.Equal(t, []string{"least-request", "prefix-cache", "cost"}, res.Config.Strategies)
		assert.Equal(t, []string{"history"}, res.Config.Modes)
		assert.Equal(t, 1, res.Config.Rounds)
		assert.InDelta(t, 3.2, res.Config.RPS, 1e-9, "0.8 RPS per replica")
		assert.Equal(t, 96, res.Config.InflightCap, "24 per replica")
		require.Len(t, res.Runs, 2*3)
	}
	assert.Equal(t, string(raws[0]), string(raws[1]), "--parallel must not change results.json")

	dir := t.TempDir()
	_, stderr, err := run(t, "--engine", "des", "--replicas", "4", "--gateways", "2", "--arrivals", "24",
		"--modes", "hybrid", "--strategies", "cost", "--rps", "1.6", "--no-sync", "--cpuprofile", filepath.Join(dir, "cpu.prof"), "--out", dir)
	require.NoError(t, err, stderr)
	res, _ := readResults(t, dir)
	assert.Equal(t, []string{"hybrid"}, res.Config.Modes)
	assert.Equal(t, []string{"cost"}, res.Config.Strategies)
	assert.InDelta(t, 1.6, res.Config.RPS, 1e-9)
	assert.True(t, res.Config.GatewaysIsolated)
	require.Len(t, res.Runs, 1)
	st, err := os.Stat(filepath.Join(dir, "cpu.prof"))
	require.NoError(t, err)
	assert.Positive(t, st.Size())
}

func readResults(t *testing.T, dir string) (*study.Results, []byte) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, study.FileResults))
	require.NoError(t, err)
	var res study.Results
	require.NoError(t, json.Unmarshal(raw, &res))
	return &res, raw
}

// TestKvbenchSyncedAndIsolated runs one gateway, two synced gateways and
// two isolated gateways side by side on the live engine.
func TestKvbenchSyncedAndIsolated(t *testing.T) {
	if testing.Short() && raceEnabled {
		t.Skip("two gateway clusters under the race detector; skipped under -race -short")
	}
	dir := t.TempDir()
	stdout, stderr, err := run(t, "--quick", "--profile", "fast", "--speed", "20", "--arrivals", "8", "--rps", "4",
		"--max-tokens", "16", "--scenarios", "hot50", "--strategies", "prefix-cache", "--modes", "hybrid",
		"--gateways", "1,2", "--sync", "synced,isolated", "--out", dir)
	require.NoError(t, err, stderr)
	assert.Contains(t, stdout, "== hot50 — hybrid · 1 gateway ==")
	assert.Contains(t, stdout, "== hot50 — hybrid · 2 gateways, synced (shared index) ==")
	assert.Contains(t, stdout, "== hot50 — hybrid · 2 gateways, isolated (no shared index) ==")
	assert.Contains(t, stderr, "cells hybrid/g1,hybrid/g2,hybrid/g2-isolated")
	assert.Contains(t, stderr, "peers settled in", "synced phases report the wait for the peers")

	res, _ := readResults(t, dir)
	require.Len(t, res.Runs, 3)
	assert.Equal(t, []string{study.SyncSynced, study.SyncIsolated}, res.Config.Sync)
	assert.False(t, res.Config.GatewaysIsolated)
	var got []string
	for _, r := range res.Runs {
		got = append(got, r.Key().PhaseName())
		assert.Equal(t, r.Arrivals, r.Succeeded+r.Failed)
	}
	assert.Equal(t, []string{"r1-hot50-prefix-cache@hybrid/g1", "r1-hot50-prefix-cache@hybrid/g2",
		"r1-hot50-prefix-cache@hybrid/g2-isolated"}, got)

	stdout, _, err = run(t, "recompute", filepath.Join(dir, study.FileRequests))
	require.NoError(t, err)
	assert.Contains(t, stdout, "every field matches")
}

// TestKvbenchDES runs a DES grid through the command twice (byte-identical
// results.json) and a small sweep.
func TestKvbenchDES(t *testing.T) {
	args := []string{"--engine", "des", "--quick", "--arrivals", "24", "--scenarios", "warm,hot50",
		"--gateways", "1,4", "--sync", "synced,isolated", "--sync-delay", "20ms", "--load-delay", "200ms"}
	dirs := []string{t.TempDir(), t.TempDir()}
	var raws [][]byte
	for _, dir := range dirs {
		stdout, stderr, err := run(t, append(args, "--out", dir)...)
		require.NoError(t, err, stderr)
		assert.Contains(t, stdout, "== hot50 — history · 4 gateways, isolated (no shared index) ==")
		assert.Contains(t, stderr, "DES engine, delays sync 20ms load 200ms")
		res, raw := readResults(t, dir)
		raws = append(raws, raw)
		assert.Equal(t, "des", res.Config.Engine)
		require.Len(t, res.Runs, 2*3*3, "2 scenarios × 3 strategies × 3 cells")
		for _, r := range res.Runs {
			assert.Equal(t, 24, r.Arrivals)
			assert.Equal(t, r.Arrivals, r.Succeeded+r.Failed)
		}
	}
	assert.Equal(t, string(raws[0]), string(raws[1]), "same seed, same results.json")

	dir := t.TempDir()
	stdout, stderr, err := run(t, "sweep", "--replicas", "2,4", "--gateways", "1,2", "--rps", "1.6",
		"--scenarios", "hot50", "--strategies", "least-request,cost", "--modes", "hybrid", "--rounds", "1",
		"--arrivals", "16", "--out", dir)
	require.NoError(t, err, stderr)
	assert.Contains(t, stdout, "4 replicas × 2 gateways (synced) @ 1.6 RPS")
	md, err := os.ReadFile(filepath.Join(dir, "sweep.md"))
	require.NoError(t, err)
	assert.Equal(t, 4, strings.Count(string(md), "replicas ×"), "one table per setting")
	_, err = os.Stat(filepath.Join(dir, "r4-g2-rps1.6", study.FileResults))
	require.NoError(t, err)
}

func TestVersionFlag(t *testing.T) {
	var out bytes.Buffer
	cmd := newRootCmd(io.Discard, io.Discard)
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"--version"})
	if err := cmd.ExecuteContext(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out.String(), "kvbench dev (revision ") {
		t.Fatalf("kvbench --version = %q", out.String())
	}
}

// TestKvbenchPrintsEveryError: the commands silence cobra's error
// printing, so execute prints each failure once: a mistyped flag, a bad
// value and an invalid setting each end with status 1 and say why; an
// error the command reported itself is not printed twice.
func TestKvbenchPrintsEveryError(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--bogus"}, "kvbench: unknown flag: --bogus\n"},
		{[]string{"--rps", "abc"}, `kvbench: invalid argument "abc" for "--rps"`},
		{[]string{"--hybrid-sliding-window", "1024"}, "kvbench: "},
		{[]string{"--engine", "des", "--engine-max-num-seqs", "0"}, "kvbench: "},
		{[]string{"sweep", "--replicas", "x"}, `kvbench: invalid argument "x" for "--replicas"`},
	} {
		var out, errb bytes.Buffer
		code := execute(context.Background(), c.args, &out, &errb)
		assert.Equal(t, 1, code, "%v", c.args)
		assert.Contains(t, errb.String(), c.want, "%v", c.args)
		assert.Equal(t, 1, strings.Count(errb.String(), "kvbench: "), "%v printed once: %q", c.args, errb.String())
	}
	var out, errb bytes.Buffer
	require.Zero(t, execute(context.Background(), []string{"--help"}, &out, &errb), errb.String())
	assert.Contains(t, out.String(), "Usage:")
	assert.Empty(t, errb.String())
}
