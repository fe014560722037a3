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
