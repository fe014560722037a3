package des

import (
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/chaos/study"
)

// scaleConfig is one phase at scale: a single scenario and strategy with
// n arrivals at rps, for measuring simulation throughput.
func scaleConfig(scenario, strategy, mode string, gateways, n int, rps float64) study.Config {
	c := study.DefaultConfig()
	c.Scenarios = []string{scenario}
	c.Strategies = []string{strategy}
	c.Modes = []string{mode}
	c.Gateways = []int{gateways}
	c.Rounds = 1
	c.Arrivals = n
	c.RPS = rps
	c.InflightCap = 1 << 20
	return c
}

// TestScale runs DES_SCALE arrivals (e.g. 100000) of one cold phase with cost
// in hybrid mode on 64 replicas behind 8 gateways at 51.2 RPS (the seed's
// 1.6 RPS per two replicas) and logs arrivals per second of wall time.
// Run: DES_SCALE=100000 go test -run TestScale -v ./chaos/des
func TestScale(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("DES_SCALE"))
	if n <= 0 {
		t.Skip("set DES_SCALE=<arrivals> to run")
	}
	scenario := os.Getenv("DES_SCENARIO")
	if scenario == "" {
		scenario = study.ScenarioCold
	}
	mode := os.Getenv("DES_MODE")
	if mode == "" {
		mode = "hybrid"
	}
	gws, _ := strconv.Atoi(os.Getenv("DES_GATEWAYS"))
	if gws < 1 {
		gws = 8
	}
	cfg := scaleConfig(scenario, "cost", mode, gws, n, 51.2)
	cfg.Replicas = 64
	start := time.Now()
	res, _ := runStudy(t, cfg, DefaultOptions())
	wall := time.Since(start)
	r := res.Runs[0]
	t.Logf("%d arrivals (%s, cost, %s, 64 replicas, 8 gateways) in %s: %.0f arrivals/s; pass %d, ttft95 %.2fs, hit %.3f",
		n, scenario, mode, wall.Round(time.Millisecond), float64(n)/wall.Seconds(), r.SLOPass, float64(r.TTFTP95), float64(r.TokenHitRate))
	lo, hi := n, 0
	for _, c := range r.PerReplica {
		lo, hi = min(lo, c), max(hi, c)
	}
	t.Logf("per replica %d..%d, max waiting %v, selection %v", lo, hi, r.MaxWaiting, r.Selection)
}
