package cluster

import (
	"github.com/prometheus/client_golang/prometheus"
)

// CounterSum adds up the counter (or gauge) name over every series of g
// whose labels include all of match. Absent metrics sum to 0.
func CounterSum(g prometheus.Gatherer, name string, match map[string]string) float64 {
	mfs, err := g.Gather()
	if err != nil {
		return 0
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for k, v := range match {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == k && lp.GetValue() == v {
						found = true
						break
					}
				}
				if !found {
					continue series
				}
			}
			switch {
			case m.GetCounter() != nil:
				sum += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				sum += m.GetGauge().GetValue()
			}
		}
	}
	return sum
}

// GatewayCounter sums a counter over every gateway.
func (c *Cluster) GatewayCounter(name string, match map[string]string) float64 {
	var sum float64
	for _, g := range c.Gateways() {
		sum += CounterSum(g.Node.Registry(), name, match)
	}
	return sum
}
