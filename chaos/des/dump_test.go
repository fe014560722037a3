package des

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
)

// TestDump writes results.json and requests.jsonl of a mixed grid (every
// scenario, four strategies, both modes, 8 replicas behind 3 synced
// gateways, 240 arrivals per phase) into $DES_DUMP, so that a change meant
// to be pure optimisation can be checked byte for byte against the
// previous commit's output: run it on both and diff the directories.
// Run: DES_DUMP=/tmp/before go test -run TestDump -v ./chaos/des
func TestDump(t *testing.T) {
	dir := os.Getenv("DES_DUMP")
	if dir == "" {
		t.Skip("set DES_DUMP=<dir> to run")
	}
	for _, noSync := range []bool{false, true} {
		cfg := study.DefaultConfig()
		cfg.Scenarios = []string{study.ScenarioCold, study.ScenarioWarm, study.ScenarioHot50, study.ScenarioMultiturn}
		cfg.Strategies = []string{"random", "least-request", "prefix-cache", "cost"}
		cfg.Modes = []string{"history", "hybrid"}
		cfg.Gateways = []int{3}
		cfg.Replicas = 8
		cfg.Rounds = 1
		cfg.Arrivals = 240
		cfg.RPS = 6.4
		cfg.Turns = 3
		o := DefaultOptions()
		o.NoSync = noSync
		res, js := runStudy(t, cfg, o)
		var reqs bytes.Buffer
		require.NoError(t, study.WriteRequests(&reqs, res.Requests))
		sub := filepath.Join(dir, map[bool]string{false: "synced", true: "nosync"}[noSync])
		require.NoError(t, os.MkdirAll(sub, 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(sub, study.FileResults), js, 0o644))
		require.NoError(t, os.WriteFile(filepath.Join(sub, "requests.jsonl"), reqs.Bytes(), 0o644))
	}
}
