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

// TestKvbenchEngineProfiles runs a small seed-like grid on the DES at the
// seed's 1568-token block, plain, hybrid and with an offload tier, on a
// GPU pool small enough to evict: the report names each profile, and the
// profiles change what the engines hit; a running set of one makes
// requests wait.
func TestKvbenchEngineProfiles(t *testing.T) {
	base := []string{"--engine", "des", "--scenarios", "warm", "--strategies", "least-request,cost",
		"--modes", "kv-events", "--rounds", "1", "--replicas", "2", "--gateways", "1", "--rps", "1.6",
		"--inflight-cap", "48", "--arrivals", "48", "--engine-block-size", "1568", "--engine-kv-tokens", "40000"}
	hit := map[string]float64{}
	waiting := map[string]int{}
	for _, p := range []struct {
		name, header string
		args         []string
	}{
		{"plain", "GPU KV pool of 40000 tokens, indexed at 784-token blocks", nil},
		{"hybrid", "hybrid attention (full + 1024-token sliding window, window pool 20000 tokens)", []string{"--hybrid-sliding-window", "1024", "--hybrid-window-tokens", "20000"}},
		{"offload", "CPU offload tier of 128 blocks", []string{"--kv-offload-blocks", "128"}},
		{"one-seq", "running sets of 1 sequences", []string{"--engine-max-num-seqs", "1"}},
	} {
		dir := t.TempDir()
		_, stderr, err := run(t, append(append(append([]string{}, base...), p.args...), "--out", dir)...)
		require.NoError(t, err, "%s: %s", p.name, stderr)
		res, _ := readResults(t, dir)
		assert.Contains(t, res.Config.EngineProfile, p.header, p.name)
		md, err := os.ReadFile(filepath.Join(dir, study.FileReport))
		require.NoError(t, err)
		assert.True(t, strings.Contains(string(md), p.header), "%s: the report names the profile", p.name)
		for _, r := range res.Runs {
			assert.Equal(t, r.Arrivals, r.Succeeded+r.Failed)
			hit[p.name] += float64(r.TokenHitRate)
			for _, w := range r.MaxWaiting {
				waiting[p.name] += w
			}
		}
	}
	t.Logf("summed token hit rates: %v", hit)
	assert.Less(t, hit["hybrid"], hit["plain"], "a small sliding-window pool cuts hits")
	assert.NotEqual(t, hit["offload"], hit["plain"], "the offload tier changes what engines take from cache")
	t.Logf("summed max waiting: %v", waiting)
	assert.Greater(t, waiting["one-seq"], waiting["plain"], "one running slot per engine queues requests")

	_, _, err := run(t, "--hybrid-sliding-window", "1024")
	require.ErrorIs(t, err, study.ErrInvalidConfig, "DES-only flag on the live engine")
	_, _, err = run(t, "--engine", "des", "--hybrid-sliding-window", "1024", "--kv-offload-blocks", "8")
	require.Error(t, err, "a window group with an offload tier is not modelled")
}
