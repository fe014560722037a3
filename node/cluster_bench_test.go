package node

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/index"
)

// BenchmarkClusterDecisionConvergence measures, on a three-gateway
// loopback cluster (real memberlist, embedded NATS, raft), the time from a
// routing decision on one gateway (the response headers are back) until
// both peers hold it in their history ledgers. Decisions rotate over the
// gateways. Reports p50 and p99 in microseconds.
//
//	go test -run '^$' -bench ClusterDecisionConvergence -benchtime 300x ./node
func BenchmarkClusterDecisionConvergence(b *testing.B) {
	e1, e2 := newFakeEngine(b, "e1"), newFakeEngine(b, "e2")
	e1.chunks.Store(1)
	e2.chunks.Store(1)
	reps := []ReplicaConfig{rc("e1", e1.url()), rc("e2", e2.url())}
	gws := make([]*Node, 3)
	gws[0], _ = startGateway(b, gwConfig("gw-a", b.TempDir(), nil, 3, reps...))
	seed := []string{gws[0].Cluster().GossipAddr()}
	gws[1], _ = startGateway(b, gwConfig("gw-b", b.TempDir(), seed, 3, reps...))
	gws[2], _ = startGateway(b, gwConfig("gw-c", b.TempDir(), seed, 3, reps...))
	waitReady(b, gws...)
	settleCluster(b, gws)

	b.ReportAllocs()
	lat := make([]time.Duration, 0, b.N)
	out := make([]int32, 1)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		g := gws[i%3]
		prompt := fmt.Sprintf("decision %d %s", i, strings.Repeat("abcdefgh", 32))
		resp := post(b, g, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":1}`, prompt),
			map[string]string{HeaderStrategy: "random"})
		start := time.Now()
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("status %d", resp.StatusCode)
		}
		picked := resp.Header.Get(HeaderReplica)
		readAll(b, resp)
		h := g.Index().Hasher()
		keys := h.AppendKeysString(nil, h.Root("m", "", ""), prompt)
		for k := 1; k < 3; k++ {
			peer := gws[(i+k)%3]
			id, _ := peer.ReplicaID(picked)
			deadline := start.Add(5 * time.Second)
			for {
				peer.Index().Match(keys, []index.ReplicaID{id}, index.ModeHistory, time.Now().UnixNano(), out)
				if int(out[0]) == len(keys) {
					break
				}
				if time.Now().After(deadline) {
					b.Fatalf("decision %d not on %s after 5s", i, peer.NodeID())
				}
				time.Sleep(100 * time.Microsecond) // polling the peer's index for the condition
			}
		}
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(lat)
	q := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Microseconds()) }
	b.ReportMetric(q(0.5), "p50-µs")
	b.ReportMetric(q(0.99), "p99-µs")
}
