package sync

import (
	"context"
	"fmt"
	"maps"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/index"
)

// startSmallEngine starts a simulated replica whose KV pool holds only
// blocks, so new prompts evict (BlockRemoved) older ones, and whose replay
// buffer keeps only a few batches (as a long-running engine's covers only
// its recent past).
func startSmallEngine(t testing.TB, blocks int) *sim.Server {
	cfg := sim.LocalConfig()
	cfg.ServedModelName = "m"
	cfg.KVEvents.EnableKVCacheEvents = true
	cfg.Speed = 50
	cfg.NumGPUBlocks = blocks
	cfg.KVEvents.BufferSteps = 4
	s, err := sim.NewServer(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, s.Start(ctx))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = s.Shutdown(ctx)
	})
	return s
}

// engineKeys is the set of index keys of the blocks eng has cached.
func engineKeys(g *gw, eng *sim.Server) map[index.BlockKey]bool {
	h := g.ix.Hasher()
	out := make(map[index.BlockKey]bool)
	for _, b := range eng.CachedBlocks() {
		keys := h.AppendKeys(nil, h.Root("m", "", ""), b.Prefix)
		out[keys[len(keys)-1]] = true
	}
	return out
}

// confirmedKeys is the set of keys g holds confirmed for replica 0.
func confirmedKeys(g *gw) map[index.BlockKey]bool {
	out := make(map[index.BlockKey]bool)
	for _, k := range g.ix.AppendReplicaKeys(nil, 0, index.Confirmed) {
		out[k] = true
	}
	return out
}

// TestKVOutageWithRemovalsConverges: while NATS is down the engine evicts
// blocks; only its owner hears the removals (KV batches are not gossiped),
// so the peers' views become supersets. After the heal every gateway,
// owner included, must hold exactly the engine's cached set: a repair
// never replaces an owned engine's view with a peer's older one, and a
// peer whose view has a gap never passes it off as current. The owner
// also repairs from a stale peer (after a lost decision delta) and keeps
// its exact view.
func TestKVOutageWithRemovalsConverges(t *testing.T) {
	eng := startSmallEngine(t, 40)
	src := []KVSource{{Replica: "r0", Model: "m", Endpoint: eng.KVEventsAddr(), ReplayEndpoint: eng.KVReplayAddr()}}
	gws := startCluster(t, 3, nil, func(c *Config) { c.KVSources = src })
	exact := func(gs ...*gw) func() bool {
		return func() bool {
			for _, g := range gs {
				want := engineKeys(g, eng)
				if len(want) == 0 || !maps.Equal(confirmedKeys(g), want) {
					return false
				}
			}
			return true
		}
	}
	complete(t, eng, 0)
	require.Eventually(t, exact(gws...), converge, 10*time.Millisecond)
	var owner *gw
	require.Eventually(t, func() bool {
		for _, g := range gws {
			if g.c.OwnsKV("r0") {
				owner = g
			}
		}
		return owner != nil
	}, converge, 10*time.Millisecond)

	for _, g := range gws {
		natsDown(t, g)
	}
	require.Eventually(t, func() bool {
		for _, g := range gws {
			if g.c.NATSConnected() {
				return false
			}
		}
		return true
	}, converge, 5*time.Millisecond)
	// Twelve prompts of 12 blocks through a 40-block pool: most of what
	// the peers hold is evicted.
	for i := 1; i <= 12; i++ {
		complete(t, eng, i)
	}
	require.Eventually(t, exact(owner), converge, 10*time.Millisecond, "the owner keeps ingesting")
	for _, g := range gws {
		if g != owner {
			require.False(t, maps.Equal(confirmedKeys(g), confirmedKeys(owner)), "%s missed the outage's batches", g.name)
		}
	}

	// The owner repairs from a stale peer, as anti-entropy does when it
	// lost a decision delta that peer has: the engine it owns must keep its
	// exact view (the engine's replay buffer no longer covers the outage).
	var peer *gw
	for _, g := range gws {
		if g != owner {
			peer = g
		}
	}
	m := memberOf(t, owner, peer.name)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	require.NoError(t, owner.c.restoreFrom(ctx, m, false, true, nil))
	cancel()
	require.True(t, exact(owner)(), "a repair from a peer replaced the owned engine's view")

	for _, g := range gws {
		natsUp(t, g)
	}
	// Batches after the heal (a gap for the peers).
	for i := 13; i <= 14; i++ {
		complete(t, eng, i)
	}
	ok := false
	deadline := time.Now().Add(20 * time.Second)
	for !ok && time.Now().Before(deadline) {
		ok = exact(gws...)()
		if !ok {
			<-time.After(20 * time.Millisecond)
		}
	}
	if !ok {
		for _, g := range gws {
			t.Logf("%s (owner %v): %d confirmed, engine %d", g.name, g == owner, len(confirmedKeys(g)), len(engineKeys(g, eng)))
		}
		t.Fatal("gateways did not converge to the engine's cached set after the heal")
	}
	require.Eventually(t, func() bool { // counted just after the restore
		repairs := 0.0
		for _, g := range gws {
			repairs += metricValue(t, g.reg, "kvmesh_sync_antientropy_repairs_total", map[string]string{"result": "ok"})
		}
		return repairs >= 2
	}, converge, 5*time.Millisecond, fmt.Sprintf("both peers repaired (owner %s)", owner.name))
	// And it stays exact (no later repair undoes it).
	for i := 15; i <= 16; i++ {
		complete(t, eng, i)
	}
	require.Eventually(t, exact(gws...), converge, 10*time.Millisecond)
}
