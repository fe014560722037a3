package sync

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
)

// chain returns n block keys of a distinct prompt p.
func chain(p, n int) []index.BlockKey {
	out := make([]index.BlockKey, n)
	for i := range out {
		out[i] = index.BlockKey(uint64(p)<<20 | uint64(i+1))
	}
	return out
}

// matchOn reports how many leading blocks of keys replica holds in g's
// index in the history and speculative ledgers.
func matchOn(g *gw, keys []index.BlockKey, replica index.ReplicaID, mode index.Mode) int {
	out := make([]int32, 1)
	g.ix.Match(keys, []index.ReplicaID{replica}, mode, time.Now().UnixNano(), out)
	return int(out[0])
}

// decide records a decision on g and publishes it, as node will.
func decide(t testing.TB, g *gw, p int, replica index.ReplicaID, l index.Ledger) []index.BlockKey {
	keys := chain(p, 8)
	now := time.Now().UnixNano()
	require.NoError(t, g.ix.Record(keys, replica, l, now))
	g.c.PublishDecision(testReplicas[replica], l, keys, now)
	return keys
}

func TestDecisionsConverge(t *testing.T) {
	gws := startCluster(t, 3, nil, nil)
	var sent [][]index.BlockKey
	for i := range 60 {
		g := gws[i%3]
		l := index.History
		if i%2 == 1 {
			l = index.Speculative
		}
		sent = append(sent, decide(t, g, i, index.ReplicaID(i%3), l))
	}
	require.Eventually(t, func() bool {
		for _, g := range gws {
			for i, keys := range sent {
				mode := index.ModeHistory
				if i%2 == 1 {
					mode = index.ModeKVEvents
				}
				if matchOn(g, keys, index.ReplicaID(i%3), mode) != len(keys) {
					return false
				}
			}
		}
		return true
	}, converge, 10*time.Millisecond)
	for _, g := range gws {
		// The peers' 40 decisions arrive as deltas, unless slow delivery (a
		// busy machine) let anti-entropy repair the gateway from a
		// snapshot first: those came in the snapshot and their late deltas
		// were duplicates. A repair counts once its restore has returned,
		// which can be after the index converged (a CI run read 36 deltas
		// and no repair yet), so the counters are polled too.
		var applied, repairs float64
		if !assert.Eventually(t, func() bool {
			applied = metricValue(t, g.reg, "kvmesh_sync_deltas_applied_total", map[string]string{"kind": "decisions"})
			repairs = metricValue(t, g.reg, "kvmesh_sync_antientropy_repairs_total", nil)
			return applied == 40 || repairs > 0
		}, converge, 10*time.Millisecond) {
			t.Fatalf("%s: %v decisions applied as deltas and no anti-entropy repair", g.name, applied)
		}
		require.LessOrEqual(t, applied, 40.0, g.name)
		require.Equal(t, 0.0, metricValue(t, g.reg, "kvmesh_sync_messages_malformed_total", nil))
	}
}

func TestPeerLoad(t *testing.T) {
	gws := startCluster(t, 3, nil, nil)
	gws[1].load.set("r0", 3)
	gws[2].load.set("r0", 4)
	gws[2].load.set("r1", 1)
	require.Eventually(t, func() bool {
		return gws[0].c.InFlight("r0") == 7 && gws[0].c.InFlight("r1") == 1 && gws[1].c.InFlight("r0") == 4
	}, converge, 5*time.Millisecond)
	require.Zero(t, gws[0].c.InFlight("nope"))
	// A stopped peer's report leaves the view.
	gws[2].stop(t)
	require.Eventually(t, func() bool { return gws[0].c.InFlight("r0") == 3 && gws[0].c.InFlight("r1") == 0 },
		converge, 5*time.Millisecond)
	allocs := testing.AllocsPerRun(100, func() { _ = gws[0].c.InFlight("r0") })
	require.Zero(t, allocs)
}

func TestMalformedPeerMessagesDroppedAndCounted(t *testing.T) {
	gws := startCluster(t, 2, nil, nil)
	bad := [][]byte{nil, {'K'}, {'K', 'M', 9, 1}, {'K', 'M', 1, 1, 0xff}, []byte("hello")}
	for _, b := range bad {
		require.NoError(t, gws[1].c.bus.conn().Publish(gws[1].c.bus.subj.decisions, b))
	}
	// Bypass the broadcast queue's transmit limits: deliver as gossip.
	gws[0].c.onGossip([]byte{'K', 'M', 1, 2})
	require.Eventually(t, func() bool {
		return metricValue(t, gws[0].reg, "kvmesh_sync_messages_malformed_total", map[string]string{"source": "nats"}) == float64(len(bad)) &&
			metricValue(t, gws[0].reg, "kvmesh_sync_messages_malformed_total", map[string]string{"source": "gossip"}) == 1
	}, converge, 5*time.Millisecond)
	// The cluster still works.
	keys := decide(t, gws[1], 1, 0, index.History)
	require.Eventually(t, func() bool { return matchOn(gws[0], keys, 0, index.ModeHistory) == len(keys) }, converge, 5*time.Millisecond)
}

func TestShutdownIdempotent(t *testing.T) {
	g := newGW(t, "solo", nil, nil)
	ctx := context.Background()
	require.NoError(t, g.c.Shutdown(ctx)) // before Start
	require.ErrorIs(t, g.c.Start(ctx), ErrShutdown)
	g2 := newGW(t, "solo2", nil, nil)
	g2.start(t)
	require.ErrorIs(t, g2.c.Start(ctx), ErrAlreadyStarted)
	require.NoError(t, g2.c.Shutdown(ctx))
	require.NoError(t, g2.c.Shutdown(ctx))
	_, err := g2.c.Join([]string{"127.0.0.1:1"})
	require.ErrorIs(t, err, ErrNotStarted)
}

func TestConfigValidate(t *testing.T) {
	require.ErrorIs(t, DefaultConfig().Validate(), ErrInvalidConfig, "no cluster key and not Insecure")
	insecure := DefaultConfig()
	insecure.Insecure = true
	require.NoError(t, insecure.Validate())
	keyed := LocalConfig("x")
	keyed.Trust = testRing(t, "x", nil)
	require.NoError(t, keyed.Validate())
	for name, mut := range map[string]func(*Config){
		"natscreds": func(c *Config) { c.NATSCredentialsFile = "x.creds" }, // without NATSURL
		"cluster":   func(c *Config) { c.ClusterName = "a.b" },
		"node":      func(c *Config) { c.NodeName = "" },
		"gossip":    func(c *Config) { c.GossipAddr = "nope" },
		"key":       func(c *Config) { c.SecretKey = []byte("short") },
		"profile":   func(c *Config) { c.GossipProfile = "wan" },
		"flush":     func(c *Config) { c.FlushInterval = 0 },
		"loadttl":   func(c *Config) { c.LoadTTL = time.Millisecond },
		"entries":   func(c *Config) { c.FlushEntries = 0 },
		"kvsource":  func(c *Config) { c.KVSources = []KVSource{{Replica: "r"}} },
		"kvdup": func(c *Config) {
			c.KVSources = []KVSource{{Replica: "r", Endpoint: "e"}, {Replica: "r", Endpoint: "e"}}
		},
	} {
		c := DefaultConfig()
		c.Insecure = true
		mut(&c)
		require.ErrorIs(t, c.Validate(), ErrInvalidConfig, name)
	}
}

func TestOwnerRendezvous(t *testing.T) {
	members := []string{"a", "b", "c", "d"}
	counts := map[string]int{}
	moved := 0
	for i := range 1000 {
		r := fmt.Sprintf("engine-%d", i)
		o := Owner(r, members)
		counts[o]++
		require.Equal(t, o, Owner(r, []string{"d", "c", "b", "a"}), "order-independent")
		// Removing a member moves only its engines.
		o2 := Owner(r, []string{"a", "b", "c"})
		if o != "d" {
			require.Equal(t, o, o2)
		} else {
			moved++
		}
	}
	for _, m := range members {
		require.InDelta(t, 250, counts[m], 80, "balance %v", counts)
	}
	require.Equal(t, counts["d"], moved)
	require.Equal(t, "", Owner("x", nil))
}
