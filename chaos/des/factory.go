package des

import (
	"context"

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
// engine "des", records whether gateways are isolated, and raises Groups
// to the replica count and Candidates to twice Groups where the study
// would otherwise refuse a large replica count (every replica needs a
// prefix group). Speed is irrelevant in virtual time and left as is.
func StudyConfig(c study.Config, o Options) study.Config {
	c.Engine = "des"
	c.Groups = max(c.Groups, c.Replicas)
	c.Candidates = max(c.Candidates, 2*c.Groups)
	c.GatewaysIsolated = false
	for _, g := range c.Gateways {
		if g > 1 && o.NoSync {
			c.GatewaysIsolated = true
		}
	}
	return c
}
