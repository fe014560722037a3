package des_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/chaos/des"
	"github.com/kvmesh/kvmesh/chaos/study"
)

// offloadStudy runs the cost strategy in kv-events mode on engines whose
// GPU pool holds only a few of the study's prefix documents, with a CPU
// offload tier large enough for all of them, once with cost's tier term
// (CPU-resident prefixes priced as loads) and once without it (CPU rate
// negative: the index's GPU match only, as before tiers were priced).
func offloadStudy(t *testing.T, scenarios []string) (off, on *study.Results, offLoads, onLoads loads) {
	t.Helper()
	o := des.DefaultOptions()
	o.EngineTokens = envInt("KVMESH_OFFLOAD_GPU_TOKENS", 40_000)
	o.OffloadBlocks = envInt("KVMESH_OFFLOAD_BLOCKS", 2_500)
	cfg := study.DefaultConfig()
	cfg.Scenarios = scenarios
	cfg.Strategies = []string{"cost"}
	cfg.Modes = []string{"kv-events"}
	cfg.Rounds = 1
	cfg.Seed = uint64(envInt("KVMESH_OFFLOAD_SEED", int(cfg.Seed)))
	cfg.Replicas = envInt("KVMESH_OFFLOAD_REPLICAS", 4)
	cfg.Groups = envInt("KVMESH_OFFLOAD_GROUPS", 32)
	cfg.Arrivals = envInt("KVMESH_OFFLOAD_ARRIVALS", 192)
	cfg.RPS = float64(cfg.Replicas) * des.SeedRPSPerReplica
	cfg.InflightCap = cfg.Replicas * des.SeedInflightCapPerReplica
	cfg = des.StudyConfig(cfg, o)
	run := func(cpuRate float64) (*study.Results, loads) {
		oo := o
		oo.Route.Cost.CPULoadTokensPerSecond = cpuRate
		var worlds []*des.World
		factory := func(ctx context.Context, cell study.Cell) (study.Engine, error) {
			e, err := des.Factory(oo)(ctx, cell)
			if w, ok := e.(*des.World); ok {
				worlds = append(worlds, w)
			}
			return e, err
		}
		rn := &study.Runner{Config: cfg, Factory: factory}
		res, err := rn.Run(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		var l loads
		for _, w := range worlds {
			for _, s := range w.EngineStats() {
				l.queried += s.PrefixQueries
				l.gpuHit += s.PrefixHits
				l.loaded += s.OffloadLoadedTokens
			}
		}
		return res, l
	}
	off, offLoads = run(-1)
	on, onLoads = run(0)
	return off, on, offLoads, onLoads
}

// loads sums the engines' prompt-token counters over a study: tokens
// looked up, hit on the GPU, loaded from the CPU tier.
type loads struct{ queried, gpuHit, loaded uint64 }

func (l loads) String() string {
	return fmt.Sprintf("%d prompt tokens loaded from CPU tiers (engine admissions; the GPU hit column counts lookups, repeated while a request waits for blocks)", l.loaded)
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// TestCostRoutesToCPUTier is issue 16's acceptance for offload tiers: in
// a cost phase where a prefix evicted from every GPU lives in one
// engine's CPU tier, and recomputing its ~5K tokens elsewhere misses the
// TTFT SLO under load, the tier term sends requests to the CPU holder,
// which loads instead of recomputing: more SLO passes than the same
// workload without the term.
func TestCostRoutesToCPUTier(t *testing.T) {
	if testing.Short() {
		t.Skip("runs two DES studies")
	}
	off, on, offLoads, onLoads := offloadStudy(t, []string{study.ScenarioWarm})
	tab, _ := des.Compare(off, on, "no tier term", "tier term")
	var b strings.Builder
	tab.Markdown(&b)
	t.Logf("\n%s", b.String())
	t.Logf("engines, no tier term: %v", offLoads)
	t.Logf("engines, tier term:    %v", onLoads)
	if onLoads.loaded <= offLoads.loaded {
		t.Errorf("the tier term loaded %d tokens from CPU, no more than the %d without it", onLoads.loaded, offLoads.loaded)
	}
	for i := range on.Runs {
		t.Logf("%v selections: off %v on %v", on.Runs[i].Key(), off.Runs[i].Selection, on.Runs[i].Selection)
		if on.Runs[i].SLOPass <= off.Runs[i].SLOPass {
			t.Errorf("%v: SLO pass %d with the tier term, %d without", on.Runs[i].Key(), on.Runs[i].SLOPass, off.Runs[i].SLOPass)
		}
	}
}
