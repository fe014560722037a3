package scenarios

import (
	"testing"

	"github.com/kvmesh/kvmesh/chaos/suite"
)

// One test per suite scenario, in the suite's order of files (the order
// these tests ran in before the scenarios moved to chaos/suite).

func TestBadInput(t *testing.T)                    { run(t) }
func TestBadInputClusterPorts(t *testing.T)        { run(t) }
func TestEvictionPressure(t *testing.T)            { run(t) }
func TestGatewayKillAndRestart(t *testing.T)       { run(t) }
func TestGatewayShutdownGraceExpired(t *testing.T) { run(t) }
func TestIntruder(t *testing.T)                    { run(t) }
func TestNATSOutage(t *testing.T)                  { run(t) }
func TestPartition(t *testing.T)                   { run(t) }
func TestEngineRestartAndReset(t *testing.T)       { run(t) }
func TestScaleOutAndIn(t *testing.T)               { run(t) }
func TestZMQBatchFaults(t *testing.T)              { run(t) }
func TestZMQGapBeyondReplay(t *testing.T)          { run(t) }

// TestEveryScenarioHasATest keeps the list above and the suite's in step:
// a scenario added to the suite without a test here would run only from
// the command.
func TestEveryScenarioHasATest(t *testing.T) {
	tests := map[string]bool{}
	for _, tt := range []string{"TestBadInput", "TestBadInputClusterPorts", "TestEvictionPressure",
		"TestGatewayKillAndRestart", "TestGatewayShutdownGraceExpired", "TestIntruder", "TestNATSOutage",
		"TestPartition", "TestEngineRestartAndReset", "TestScaleOutAndIn", "TestZMQBatchFaults",
		"TestZMQGapBeyondReplay"} {
		tests[tt] = true
	}
	for _, sc := range suite.All() {
		if !tests[sc.Test] {
			t.Errorf("suite scenario %s (%s) has no test in chaos/scenarios", sc.Name, sc.Test)
		}
		delete(tests, sc.Test)
	}
	for tt := range tests {
		t.Errorf("test %s names no suite scenario", tt)
	}
}
