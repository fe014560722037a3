package des_test

import (
	"context"
	"fmt"

	"github.com/kvmesh/kvmesh/chaos/des"
	"github.com/kvmesh/kvmesh/chaos/study"
)

// Example runs a small study on the discrete-event engine: the same Runner,
// scenarios and statistics as the live engine, in virtual time.
func Example() {
	o := des.DefaultOptions()
	cfg := study.DefaultConfig()
	cfg.Scenarios = []string{study.ScenarioHot50}
	cfg.Strategies = []string{"least-request", "prefix-cache"}
	cfg.Modes = []string{"history"}
	cfg.Rounds = 1
	cfg = des.StudyConfig(cfg, o)
	rn := &study.Runner{Config: cfg, Factory: des.Factory(o)}
	res, err := rn.Run(context.Background())
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, r := range res.Runs {
		fmt.Printf("%s: %d arrivals, %d succeeded\n", r.Strategy, r.Arrivals, r.Succeeded)
	}
	// Output:
	// least-request: 96 arrivals, 96 succeeded
	// prefix-cache: 96 arrivals, 96 succeeded
}
