package sync

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
)

// BenchmarkDeltaPropagation measures routing-decision propagation from one
// gateway to two peers on loopback (embedded NATS, real memberlist) at
// 2,000 decisions/s: each iteration publishes 200 decisions of 64 keys
// paced over 100 ms; lag is decision time at the origin to application in
// the peer's index. Run: go test -run '^$' -bench DeltaPropagation -benchtime 20x ./sync
func BenchmarkDeltaPropagation(b *testing.B) {
	const rate, perIter, nkeys = 2000, 200, 64
	var mu sync.Mutex
	var lags []float64
	hook := func(batch *DecisionBatch, at int64) {
		mu.Lock()
		for _, e := range batch.Entries {
			lags = append(lags, float64(at-e.At)/1e6)
		}
		mu.Unlock()
	}
	gws := make([]*gw, 3)
	for i := range gws {
		gws[i] = newGW(b, fmt.Sprintf("g%d", i), nil, func(c *Config) {
			if i > 0 {
				c.Join = []string{gws[0].c.GossipAddr()}
			}
		})
		gws[i].c.onApplied = hook
		gws[i].start(b)
		defer gws[i].stop(b)
	}
	waitMembers(b, gws, 3)
	keys := make([]index.BlockKey, nkeys)
	interval := time.Second / rate
	b.ReportAllocs()
	b.ResetTimer()
	p := 0
	for range b.N {
		start := time.Now()
		for j := range perIter {
			// Pace against the schedule, not per tick, so that a late
			// wake-up does not lower the rate.
			if d := time.Until(start.Add(time.Duration(j) * interval)); d > 0 {
				time.Sleep(d)
			}
			p++
			for k := range keys {
				keys[k] = index.BlockKey(uint64(p)<<20 | uint64(k))
			}
			gws[0].c.PublishDecision("r0", index.History, keys, time.Now().UnixNano())
		}
	}
	want := 2 * b.N * perIter
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		mu.Lock()
		n := len(lags)
		mu.Unlock()
		if n >= want {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	b.StopTimer()
	mu.Lock()
	defer mu.Unlock()
	require.Len(b, lags, want, "every decision reaches both peers")
	slices.Sort(lags)
	q := func(f float64) float64 { return lags[int(math.Ceil(f*float64(len(lags))))-1] }
	b.ReportMetric(q(0.5), "p50-ms")
	b.ReportMetric(q(0.99), "p99-ms")
	b.ReportMetric(lags[len(lags)-1], "max-ms")
}

// BenchmarkSnapshotBootstrap measures a gateway pulling and restoring a
// 1,000,000-entry index from a peer over the gRPC peer service on
// loopback. Run: go test -run '^$' -bench SnapshotBootstrap -benchtime 3x ./sync
func BenchmarkSnapshotBootstrap(b *testing.B) {
	const entries = 1_000_000
	gws := startCluster(b, 2, nil, nil)
	src := gws[0].ix
	now := time.Now().UnixNano()
	keys := make([]index.BlockKey, 16)
	// 62,500 prompts of 16 blocks on 3 replicas (history and speculative):
	// 1,000,000 (block, replica) entries.
	for p := 0; src.Stats().TotalEntries() < entries; p++ {
		for k := range keys {
			keys[k] = index.BlockKey(uint64(p)<<20 | uint64(k+1))
		}
		n := min(len(keys), entries-src.Stats().TotalEntries())
		require.NoError(b, src.Record(keys[:n], index.ReplicaID(p%3), index.Ledger(p%2), now))
	}
	require.Equal(b, entries, src.Stats().TotalEntries())
	peer, ok := gws[1].c.ms.member("g0")
	require.True(b, ok)
	b.ReportAllocs()
	b.ResetTimer()
	var bytes float64
	for range b.N {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		require.NoError(b, gws[1].c.restoreFrom(ctx, peer, true, true, nil))
		cancel()
	}
	b.StopTimer()
	require.Equal(b, entries, gws[1].ix.Stats().TotalEntries())
	bytes = metricValue(b, gws[1].reg, "kvmesh_sync_snapshot_received_bytes_total", nil) / float64(b.N)
	b.ReportMetric(bytes/1e6, "MB/op")
	b.ReportMetric(bytes/entries, "B/entry")
}

// BenchmarkKVCheck: the per-batch trust check a peer's KV batch passes
// before it is applied (owner table lookup, seq and clock bounds).
func BenchmarkKVCheck(b *testing.B) {
	srcs := []KVSource{{Replica: "r0", Model: "m", Endpoint: "tcp://127.0.0.1:9"}}
	g := newGW(b, "g0", nil, func(c *Config) { c.KVSources = srcs })
	g.c.kvOwn.update([]Member{{Name: "g0"}, {Name: "g1"}}, time.Now())
	owner := Owner("r0", []string{"g0", "g1"})
	now := time.Now()
	g.c.ap.kv["r0"] = &kvState{valid: true, seq: 100, engine: float64(now.Unix()), at: now}
	batch := &KVBatch{Origin: owner + "#1", Replica: "r0", Seq: 101, EngineTS: float64(now.Unix())}
	b.ReportAllocs()
	for b.Loop() {
		if r := g.c.ap.checkKVLocked(batch, now); r != "" {
			b.Fatal(r)
		}
	}
}
