package des

import (
	"context"
	"math"

	"github.com/kvmesh/kvmesh/chaos/study"
)

// Factory returns a study.EngineFactory that builds a World per cell from
// base, taking the mode, gateway and replica counts from the cell. The
// study's seed does not reach the World: set base.Seed (kvbench passes
// --seed) so that routing tie-breaks vary with it.
func Factory(base Options) study.EngineFactory {
	return func(_ context.Context, cell study.Cell) (study.Engine, error) {
		o := base
		o.Mode = cell.Mode
		o.Gateways = cell.Gateways
		o.Replicas = cell.Replicas
		return New(o)
	}
}

// StudyConfig adapts a study configuration to the DES engine: it names the
// engine "des", records whether gateways are isolated, raises Groups to
// the replica count where the study would otherwise refuse a large replica
// count (every replica needs a prefix group), and raises Candidates so the
// hot-spot initialisation can fill every replica's quota: its first sends
// land on uniformly random replicas, so covering R replicas q times takes
// about q·R·(ln R + 3) candidates (coupon collector, ~95 %), not 2·Groups
// (applied above 4 replicas; the seed's grid keeps its 16).
// Speed is irrelevant in virtual time and left as is.
func StudyConfig(c study.Config, o Options) study.Config {
	c.Engine = "des"
	c.Groups = max(c.Groups, c.Replicas)
	quota := (c.Groups + c.Replicas - 1) / c.Replicas
	cover := int(math.Ceil(float64(quota*c.Replicas) * (math.Log(float64(c.Replicas)) + 3)))
	c.Candidates = max(c.Candidates, 2*c.Groups)
	if c.Replicas > 4 { // up to 4 replicas the seed's 16 candidates suffice
		c.Candidates = max(c.Candidates, cover)
	}
	c.GatewaysIsolated = false
	for _, g := range c.Gateways {
		if g > 1 && o.NoSync {
			c.GatewaysIsolated = true
		}
	}
	return c
}

// Seed load per replica: the seed study ran 1.6 RPS and a client cap of 48
// in flight on two replicas.
const (
	SeedRPSPerReplica         = 0.8
	SeedInflightCapPerReplica = 24
)

// DefaultGrid returns c with the axes kvbench --engine des runs unless
// flags set them: the grid that answers the scale questions (does cost
// still beat least-request and prefix-cache with many replicas, and what
// do isolated gateways cost) in a minute at 100,000 arrivals per phase on
// two cores, instead of the live engine's 64-phase seed grid:
//
//   - Scenarios: hot50 (the hot spot that separates the strategies).
//   - Strategies: least-request, prefix-cache, cost.
//   - Modes: history. Synced gateways share only their routing decisions
//     there, so it is the mode where isolation (--no-sync) costs most; it
//     is also half the simulation work of hybrid, where every gateway
//     applies every engine's KV events (--modes hybrid runs it).
//   - Rounds: 1 (virtual time has no host noise to average out; the
//     counterbalancing of round 2 is still available with --rounds 2).
//   - Sync: synced and isolated (for gateway counts above 1: the
//     --no-sync comparison side by side).
//   - RPS and in-flight cap: the seed's per-replica load
//     (SeedRPSPerReplica and SeedInflightCapPerReplica times c.Replicas;
//     1.6 RPS and 48 on the seed's two replicas, 51.2 and 1,536 on 64).
//
// Every other field of c (replicas, gateways, arrivals, seed, ...) is
// kept. The cells (one per sync setting) are independent and kvbench runs
// them in parallel.
func DefaultGrid(c study.Config) study.Config {
	c.Scenarios = []string{study.ScenarioHot50}
	c.Strategies = []string{"least-request", "prefix-cache", "cost"}
	c.Modes = []string{DefaultGridMode}
	c.Rounds = 1
	c.Sync = []string{study.SyncSynced, study.SyncIsolated}
	c.RPS = SeedRPSPerReplica * float64(c.Replicas)
	c.InflightCap = SeedInflightCapPerReplica * c.Replicas
	return c
}

// DefaultGridMode is DefaultGrid's index mode.
const DefaultGridMode = "history"
