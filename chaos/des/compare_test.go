package des

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
)

func TestCompareFindsDifferences(t *testing.T) {
	mk := func(pass int, a, b int) study.Run {
		return study.Run{Scenario: "hot50", Round: 1, Strategy: "cost", Mode: "history", Gateways: 1,
			SLOPass: pass, PerReplica: map[string]int{"A": a, "B": b}}
	}
	other := study.Run{Scenario: "warm", Round: 1, Strategy: "cost", Mode: "history", Gateways: 1, PerReplica: map[string]int{}}
	live := &study.Results{Runs: []study.Run{mk(90, 40, 56), other}}
	sim := &study.Results{Runs: []study.Run{mk(84, 46, 50)}}
	tb, diffs := Compare(live, sim, "live", "des")
	require.Len(t, tb.Rows, 1)
	require.Len(t, diffs, 2)
	require.Equal(t, 6, diffs[0].MaxReplicaDelta)
	require.Equal(t, -6, diffs[0].SLOPassDelta)
	require.False(t, diffs[0].Within(5))
	require.True(t, diffs[0].Within(6))
	require.Equal(t, "des", diffs[1].Missing)
}

// TestFidelity runs the grid of a live results.json ($DES_FIDELITY) on the
// DES engine and writes the comparison next to it (fidelity.md).
// Run: DES_FIDELITY=kvbench-out/results.json go test -run TestFidelity -v ./chaos/des
func TestFidelity(t *testing.T) {
	path := os.Getenv("DES_FIDELITY")
	if path == "" {
		t.Skip("set DES_FIDELITY=<live results.json> to run")
	}
	f, err := os.Open(path)
	require.NoError(t, err)
	live, err := study.ReadResults(f)
	f.Close()
	require.NoError(t, err)
	cfg := live.Config
	cfg.HostChecks = nil
	res, _ := runStudy(t, cfg, DefaultOptions())
	tb, diffs := Compare(live, res, "live", "des")
	out, err := os.Create(path + ".fidelity.md")
	require.NoError(t, err)
	defer out.Close()
	tb.Markdown(out)
	tb.Text(os.Stdout)
	bad := 0
	for _, d := range diffs {
		if !d.Within(5) {
			bad++
		}
	}
	t.Logf("%d of %d phases outside ±5 requests", bad, len(diffs))
}
