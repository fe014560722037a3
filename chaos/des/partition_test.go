package des

import (
	"fmt"
	"math/bits"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/route"
)

// TestColdSplits measures how much of the cold scenario's beat-it rows
// the arrival sequence decides (issue 18). On the seed grid's two
// replicas, each of cold's eight groups arrives cold once and, under
// prefix-cache and cost alike, mostly stays on the replica that first
// computed it. A phase's pass count is then close to that of pure
// affinity with the same split of the groups, four and four, against the
// same sequence: for seed 102's round 2, pinned routing with the split
// cost made passes 79, as cost did, and with prefix-cache's split 85, as
// prefix-cache did.
//
// For each seed in $DES_PARTITIONS (comma-separated) it runs the seed grid
// as TestSeedGridBeatIt does, then cold alone, hybrid mode, once for each
// of the 70 ways to put four of the eight groups (in the order they first
// arrive) on replica A and four on B, with pinned routing in place of
// random. It logs, per seed and round, the 70 splits' pass counts and how
// many of them cost's and prefix-cache's phases beat. It asserts nothing
// about them: it is the measurement behind the closing notes' claim that
// a cold row misses when prefix-cache's first arrivals happened to form a
// split that suits the sequence, which no router can know when the groups
// arrive.
// Run: DES_PARTITIONS=102,7,42 go test -run TestColdSplits -v ./chaos/des
func TestColdSplits(t *testing.T) {
	seeds := envSeeds(t, "DES_PARTITIONS")
	tb := study.Table{
		Title: "Cold on two replicas: the 70 four-and-four splits of the groups under pinned routing, against cost and prefix-cache (hybrid, one gateway)",
		Header: []string{"seed", "round", "splits: min / median / max passes",
			"cost: passes (splits below, tied)", "prefix-cache: passes (splits below, tied)"},
	}
	for _, seed := range seeds {
		grid, cfg, o := seedGrid(t, seed)

		cfg.Scenarios = []string{study.ScenarioCold}
		cfg.Strategies = []string{route.NameRandom}
		cfg.Modes = []string{"hybrid"}
		splits := make([][]int, cfg.Rounds) // per round, passes per split
		for mask := uint(0); mask < 1<<coldGroups; mask++ {
			if bits.OnesCount(mask) != coldGroups/2 {
				continue
			}
			p := &pinned{mask: mask}
			o.substitute = map[string]route.Strategy{route.NameRandom: p}
			res, _ := runStudy(t, cfg, o)
			require.Equal(t, coldGroups*cfg.Rounds, p.fresh, "seed %d: every phase places %d groups", seed, coldGroups)
			for _, r := range res.Runs {
				splits[r.Round-1] = append(splits[r.Round-1], r.SLOPass)
			}
		}
		for round, passes := range splits {
			slices.Sort(passes)
			cost := coldPasses(t, grid, route.NameCost, round+1)
			pc := coldPasses(t, grid, route.NamePrefixCache, round+1)
			tb.Rows = append(tb.Rows, []string{strconv.FormatUint(seed, 10), strconv.Itoa(round + 1),
				fmt.Sprintf("%d / %d / %d", passes[0], passes[len(passes)/2], passes[len(passes)-1]),
				rankAmong(cost, passes), rankAmong(pc, passes)})
			t.Logf("seed %d round %d: splits %v", seed, round+1, passes)
		}
	}
	var out strings.Builder
	tb.Markdown(&out)
	t.Logf("\n%s", out.String())
}

// coldGroups is the seed grid's number of groups (study.Config.Groups).
const coldGroups = 8

// pinned is pure prefix affinity with a prescribed first placement, on two
// replicas: a prompt some replica holds goes to the one holding the most
// of it; the k-th prompt none holds (counting from 0, across phases) goes
// to replica bit k mod coldGroups of mask. In a cold phase those are
// the groups' first arrivals, in order.
type pinned struct {
	mask  uint
	fresh int // prompts placed that no replica held
}

func (p *pinned) Name() string { return "pinned" }

func (p *pinned) Pick(_ *route.Request, cands []route.Candidate, _ *route.Rand, _ *route.Explanation) route.Decision {
	best := -1
	for i := range cands {
		if cands[i].Matched > 0 && (best < 0 || cands[i].Matched > cands[best].Matched) {
			best = i
		}
	}
	if best < 0 {
		best = int(p.mask>>(p.fresh%coldGroups)) & 1
		p.fresh++
	}
	return route.Decision{Index: best}
}

// coldPasses is strategy's SLO pass count in the cold hybrid phase of
// round in res.
func coldPasses(t *testing.T, res *study.Results, strategy string, round int) int {
	t.Helper()
	for _, r := range res.Runs {
		if r.Scenario == study.ScenarioCold && r.Mode == "hybrid" && r.Strategy == strategy && r.Round == round {
			return r.SLOPass
		}
	}
	t.Fatalf("no cold hybrid phase of %s in round %d", strategy, round)
	return 0
}

// rankAmong renders passes with how many of the sorted splits pass fewer
// and how many as many.
func rankAmong(passes int, splits []int) string {
	below, tied := 0, 0
	for _, s := range splits {
		switch {
		case s < passes:
			below++
		case s == passes:
			tied++
		}
	}
	return fmt.Sprintf("%d (%d, %d)", passes, below, tied)
}
