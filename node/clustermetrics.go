package node

import "github.com/prometheus/client_golang/prometheus"

// registerTrustMetrics registers kvmesh_insecure: 1 for a cluster-mode
// gateway running without a cluster key (--insecure), else 0 (a keyed
// member, or a standalone gateway, which opens no cluster port). An alert
// on it catches a cluster left insecure by accident.
func (n *Node) registerTrustMetrics() {
	v := 0.0
	if n.cl != nil && n.cl.ring == nil {
		v = 1
	}
	n.m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvmesh_insecure",
		Help: "1 when this gateway runs cluster mode without a cluster key (--insecure): its cluster ports accept anyone; else 0.",
	}, func() float64 { return v }))
}
