package sync

import (
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestGossipPartitionDuplicateOwnersHarmless partitions one gateway's
// gossip (NATS stays up): each side elects its own owner for the engine,
// both ingest and publish, and every index still equals the engine's cache
// because batches apply once per engine seq. After the heal there is one
// owner again.
func TestGossipPartitionDuplicateOwnersHarmless(t *testing.T) {
	eng := startEngine(t)
	src := []KVSource{{Replica: "r0", Model: "m", Endpoint: eng.KVEventsAddr(), ReplayEndpoint: eng.KVReplayAddr()}}
	net := &MemNetwork{}
	gws := startCluster(t, 3, func(name string) memberlist.Transport { return net.NewTransport(name) },
		func(c *Config) { c.KVSources = src })
	truth := func() bool {
		n := len(eng.CachedBlocks())
		for _, g := range gws {
			if confirmed(g) != n {
				return false
			}
		}
		return n > 0
	}
	for i := range 3 {
		complete(t, eng, i)
	}
	require.Eventually(t, truth, converge, 10*time.Millisecond)
	require.Len(t, ownersOf(gws), 1)

	pubKV := map[string]string{"kind": "kv", "transport": "nats"}
	pubBefore := map[string]float64{}
	for _, g := range gws {
		pubBefore[g.name] = metricValue(t, g.reg, "kvmesh_sync_messages_published_total", pubKV)
	}
	net.Partition("g2", "g0")
	net.Partition("g2", "g1")
	require.Eventually(t, func() bool {
		return len(gws[2].c.Members()) == 1 && len(gws[0].c.Members()) == 2 && len(gws[1].c.Members()) == 2
	}, converge, 10*time.Millisecond)
	require.Eventually(t, func() bool { return len(ownersOf(gws)) == 2 }, converge, 10*time.Millisecond,
		"each side owns the engine")
	for i := 3; i < 8; i++ {
		complete(t, eng, i)
	}
	require.Eventually(t, truth, converge, 10*time.Millisecond)
	// Both owners ingested and published. (The routes of NATS follow the
	// members, so each side hears only its own owner.)
	for _, g := range gws {
		if g.c.OwnsKV("r0") {
			require.Greater(t, metricValue(t, g.reg, "kvmesh_sync_messages_published_total", pubKV), pubBefore[g.name],
				"%s owns the engine on its side and published its batches", g.name)
		}
	}

	net.Heal()
	healed := func() bool {
		for _, g := range gws {
			if len(g.c.Members()) != 3 {
				return false
			}
		}
		return len(ownersOf(gws)) == 1
	}
	if !assert.Eventually(t, healed, converge, 10*time.Millisecond, "one owner after the heal") {
		for _, g := range gws {
			t.Logf("%s sees %d members", g.name, len(g.c.Members()))
		}
		t.Fatalf("owners %v", ownersOf(gws))
	}
	for i := 8; i < 10; i++ {
		complete(t, eng, i)
	}
	require.Eventually(t, truth, converge, 10*time.Millisecond)
}
