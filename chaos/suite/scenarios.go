package suite

import (
	"fmt"
	"strings"
)

// Scenario is one entry of the suite.
type Scenario struct {
	// Number is the scenario's number in the suite's list (several
	// entries can share one: their parts).
	Number int
	// Name is the command-line name (kvmesh chaos run NAME).
	Name string
	// Test is the name of the go test that runs it in chaos/scenarios.
	Test string
	// Summary is one line on what it does.
	Summary string
	// Run runs the scenario on r; it reports through r's T.
	Run func(r *R)
}

var all = []Scenario{
	{1, "eviction", "TestEvictionPressure", "KV eviction pressure: precision >= 0.99 within 1 s", evictionPressure},
	{2, "restart", "TestEngineRestartAndReset", "engine restart (sequence rewind) and cache reset: confirmed entries dropped within 1 s", engineRestartAndReset},
	{3, "zmq", "TestZMQBatchFaults", "lost, duplicated and reordered KV-event batches: replayed or reset, the index converges", zmqBatchFaults},
	{3, "zmq-gap", "TestZMQGapBeyondReplay", "a gap larger than the engine's replay buffer: the subscriber resets, the index converges", zmqGapBeyondReplay},
	{4, "gateway-kill", "TestGatewayKillAndRestart", "clustered gateways killed or stopped under load and restarted: no request lost, index within 1 % of peers", gatewayKillAndRestart},
	{4, "shutdown-grace", "TestGatewayShutdownGraceExpired", "a gateway shutdown whose grace runs out: streams end with an error the client sees", gatewayShutdownGraceExpired},
	{5, "scale", "TestScaleOutAndIn", "gateways 3 -> 5 -> 3, an engine added and one removed through the raft config, under load", scaleOutAndIn},
	{6, "partition", "TestPartition", "one gateway cut from gossip, raft and NATS (or NATS only) under load, then healed", partition},
	{7, "nats", "TestNATSOutage", "NATS outage and recovery (external NATS behind a fault proxy)", natsOutage},
	{8, "bad-input", "TestBadInput", "malformed HTTP bodies, raw bytes, garbled KV events, garbage on replay and SUB ports", badInput},
	{8, "bad-input-cluster", "TestBadInputClusterPorts", "junk on the peer-sync, admin gRPC/HTTP, raft and NATS ports of a 3-gateway cluster", badInputClusterPorts},
	{9, "intruder", "TestIntruder", "a process without the cluster key replays and forges cluster traffic: rejected, counted", intruder},
}

// All returns every scenario in the suite's order.
func All() []Scenario { return append([]Scenario(nil), all...) }

// Lookup returns the scenario with that name or test name.
func Lookup(name string) (Scenario, bool) {
	for _, s := range all {
		if s.Name == name || s.Test == name {
			return s, true
		}
	}
	return Scenario{}, false
}

// Select returns the scenarios named, in the suite's order; "all" or no
// name selects every one, a number selects each part with that number.
func Select(names []string) ([]Scenario, error) {
	if len(names) == 0 {
		return All(), nil
	}
	want := map[string]bool{}
	for _, n := range names {
		for p := range strings.SplitSeq(n, ",") {
			if p = strings.TrimSpace(p); p != "" {
				want[p] = true
			}
		}
	}
	if want["all"] {
		return All(), nil
	}
	var out []Scenario
	for _, s := range all {
		if want[s.Name] || want[s.Test] || want[fmt.Sprint(s.Number)] {
			out = append(out, s)
			delete(want, s.Name)
			delete(want, s.Test)
		}
	}
	for _, s := range all {
		delete(want, fmt.Sprint(s.Number))
	}
	for n := range want {
		return nil, fmt.Errorf("%w: %q (kvmesh chaos list)", ErrUnknownScenario, n)
	}
	return out, nil
}
