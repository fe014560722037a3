package sync

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

// startEngine starts a simulated vLLM replica serving model "m" with KV
// events on loopback.
func startEngine(t testing.TB) *sim.Server { return startEngineWith(t, nil) }

// startEngineWith is startEngine with tune applied to the engine's config.
func startEngineWith(t testing.TB, tune func(*sim.Config)) *sim.Server {
	cfg := sim.LocalConfig()
	cfg.ServedModelName = "m"
	cfg.KVEvents.EnableKVCacheEvents = true
	cfg.Speed = 50
	if tune != nil {
		tune(&cfg)
	}
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

// complete sends one completion of a distinct 200-byte prompt (12 full
// blocks with the byte tokenizer).
func complete(t testing.TB, s *sim.Server, n int) {
	require.NoError(t, post(s, n))
}

// post is complete's request; it returns what went wrong.
func post(s *sim.Server, n int) error {
	prompt := fmt.Sprintf("%06d %s", n, bytes.Repeat([]byte("kvmesh shares one index. "), 8))
	body, _ := json.Marshal(map[string]any{"model": "m", "prompt": prompt, "max_tokens": 2})
	resp, err := http.Post(s.URL()+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("completion %d: %s", n, resp.Status)
	}
	return nil
}

func confirmed(g *gw) int { return g.ix.Stats().Entries[index.Confirmed] }

// owners returns the gateways currently running the engine's subscriber.
func ownersOf(gws []*gw) []string {
	var out []string
	for _, g := range gws {
		if g.c.OwnsKV("r0") {
			out = append(out, g.name)
		}
	}
	return out
}

func TestKVOwnershipAndHandover(t *testing.T) {
	t.Run("graceful", func(t *testing.T) { testHandover(t, false) })
	t.Run("crash", func(t *testing.T) { testHandover(t, true) })
}

func testHandover(t *testing.T, crash bool) {
	eng := startEngine(t)
	src := []KVSource{{Replica: "r0", Model: "m", Endpoint: eng.KVEventsAddr(), ReplayEndpoint: eng.KVReplayAddr()}}
	gws := startCluster(t, 3, nil, func(c *Config) { c.KVSources = src })

	want := Owner("r0", []string{"g0", "g1", "g2"})
	for _, g := range gws {
		require.Equal(t, want, g.c.KVOwner("r0"))
	}
	require.Equal(t, "", gws[0].c.KVOwner("r1"), "not a KV source")
	require.Eventually(t, func() bool {
		o := ownersOf(gws)
		return len(o) == 1 && o[0] == want
	}, converge, 10*time.Millisecond, "exactly one owner, the rendezvous winner")

	converged := func(live []*gw) func() bool {
		return func() bool {
			n := len(eng.CachedBlocks())
			for _, g := range live {
				if confirmed(g) != n {
					return false
				}
			}
			return n > 0
		}
	}
	// The owner may have subscribed just after the first batches: they are
	// replayed (JoinReplay), so everything converges.
	moves := func() (n float64) {
		for _, g := range gws {
			n += metricValue(t, g.reg, "kvmesh_sync_kv_owner_changes_total", nil)
		}
		return n
	}
	movesBefore := moves()
	for i := range 5 {
		complete(t, eng, i)
	}
	require.Eventually(t, converged(gws), converge, 10*time.Millisecond)
	// With one owner throughout, no peer sees a batch missing. On a busy
	// machine memberlist may suspect a live gateway for a moment and move
	// ownership there and back; the two owners' batches then interleave
	// and peers count gaps, which repair closes (the views converged
	// above). A CI run at load 17 counted one such gap.
	if moved := moves() - movesBefore; moved > 0 {
		t.Logf("ownership moved %v times while the first batches flowed: sequence gaps are not checked", moved)
	} else {
		for _, g := range gws {
			if metricValue(t, g.reg, "kvmesh_sync_sequence_gaps_total", nil) != 0 {
				logCounters(t, gws)
				t.Fatalf("%s counted a sequence gap with one owner throughout (run with KVMESH_SYNC_LOG=1 for the gap's seqs)", g.name)
			}
		}
	}

	// Stop the owner: ownership moves to exactly one of the others, which
	// ingests the next events for everyone. It resumes from its own view
	// (kvevents.SubscriberConfig.Resume): the engine replays only what
	// follows it, so no gateway, the new owner included, is handed a batch
	// it already applied.
	dup := map[string]string{"kind": "kv", "reason": "duplicate"}
	dupBefore := map[string]float64{}
	for _, g := range gws {
		dupBefore[g.name] = metricValue(t, g.reg, "kvmesh_sync_deltas_dropped_total", dup)
	}
	var rest []*gw
	for _, g := range gws {
		if g.name == want {
			if crash {
				g.c.kill() // peers detect the failure
			} else {
				g.stop(t)
			}
		} else {
			rest = append(rest, g)
		}
	}
	next := Owner("r0", []string{rest[0].name, rest[1].name})
	require.Eventually(t, func() bool {
		o := ownersOf(rest)
		return len(o) == 1 && o[0] == next
	}, converge, 10*time.Millisecond)
	for i := 5; i < 10; i++ {
		complete(t, eng, i)
	}
	require.Eventually(t, converged(rest), converge, 10*time.Millisecond)
	for _, g := range rest {
		require.Equal(t, dupBefore[g.name], metricValue(t, g.reg, "kvmesh_sync_deltas_dropped_total", dup),
			"%s: KV batches it already had, handed to it again after the handover", g.name)
	}
	// Every cached block's prefix matches on every gateway.
	h := rest[0].ix.Hasher()
	for _, b := range eng.CachedBlocks() {
		keys := h.AppendKeys(nil, h.Root("m", "", ""), b.Prefix)
		for _, g := range rest {
			require.Equal(t, len(keys), matchOn(g, keys, 0, index.ModeKVEvents), g.name)
		}
	}
}

// TestKVOutageRepairedFromOwner: while NATS is down the owner keeps
// ingesting (its own index stays exact) but peers miss the batches; when
// NATS returns they see the owner ahead in its digest (or a seq gap) and
// pull its snapshot.
func TestKVOutageRepairedFromOwner(t *testing.T) {
	eng := startEngine(t)
	src := []KVSource{{Replica: "r0", Model: "m", Endpoint: eng.KVEventsAddr(), ReplayEndpoint: eng.KVReplayAddr()}}
	gws := startCluster(t, 3, nil, func(c *Config) { c.KVSources = src })
	truth := func(gs []*gw) func() bool {
		return func() bool {
			n := len(eng.CachedBlocks())
			for _, g := range gs {
				if confirmed(g) != n {
					return false
				}
			}
			return n > 0
		}
	}
	complete(t, eng, 0)
	require.Eventually(t, truth(gws), converge, 10*time.Millisecond)
	var owner *gw
	require.Eventually(t, func() bool {
		for _, g := range gws {
			if g.c.OwnsKV("r0") {
				owner = g
			}
		}
		return owner != nil
	}, converge, 10*time.Millisecond)

	ownerChanges := func() (n float64) {
		for _, g := range gws {
			n += metricValue(t, g.reg, "kvmesh_sync_kv_owner_changes_total", nil)
		}
		return n
	}
	changesBefore := ownerChanges()
	for _, g := range gws {
		natsDown(t, g)
	}
	require.Eventually(t, func() bool { return !owner.c.NATSConnected() }, converge, 5*time.Millisecond)
	for i := 1; i < 4; i++ {
		complete(t, eng, i)
	}
	require.Eventually(t, truth([]*gw{owner}), converge, 10*time.Millisecond, "the owner keeps ingesting")
	for _, g := range gws {
		natsUp(t, g)
	}
	require.Eventually(t, truth(gws), converge, 20*time.Millisecond, "peers repaired")
	// Both peers repair by snapshot, unless memberlist declared the
	// owner dead meanwhile (a false death under load: ci1023, five CI
	// runs at once): the peer that took the engine over then replayed
	// the batches from the engine itself, and only the other one needed
	// the snapshot.
	want := 2.0
	if moved := ownerChanges() - changesBefore; moved > 0 {
		t.Logf("KV ownership changed %v times during the outage: one peer ingested the engine itself", moved)
		want = 1
	}
	require.Eventually(t, func() bool { // counted just after the restore
		repairs := 0.0
		for _, g := range gws {
			repairs += metricValue(t, g.reg, "kvmesh_sync_antientropy_repairs_total", map[string]string{"result": "ok"})
		}
		return repairs >= want
	}, converge, 5*time.Millisecond, "the peers repaired by snapshot")
}

// TestKVLostStreamStartRepaired: a peer that knows nothing of an engine
// yet and misses the owner's first batches (its NATS was down) takes the
// next batch as the start of the stream, so its watermark equals the
// owner's while its view lacks the earlier blocks. Watermarks alone never
// show that; the owner's digest fingerprint does, and the peer repairs.
func TestKVLostStreamStartRepaired(t *testing.T) {
	// The loop below sends up to 500 completions of 12 blocks and more
	// until the peer is back. Were the first ones evicted meanwhile (the
	// local pool holds 1,024 blocks), the peer's view would come out whole
	// without a repair, as in ci1292 and ci1388 on a busy machine: room
	// for every block keeps the premise.
	eng := startEngineWith(t, func(c *sim.Config) { c.NumGPUBlocks = 8192 })
	src := []KVSource{{Replica: "r0", Model: "m", Endpoint: eng.KVEventsAddr(), ReplayEndpoint: eng.KVReplayAddr()}}
	gws := startCluster(t, 2, nil, func(c *Config) { c.KVSources = src })
	var owner, peer *gw
	require.Eventually(t, func() bool {
		owner, peer = nil, nil
		for _, g := range gws {
			if g.c.OwnsKV("r0") {
				owner = g
			} else {
				peer = g
			}
		}
		return owner != nil && peer != nil
	}, converge, 10*time.Millisecond)

	natsDown(t, peer)
	require.Eventually(t, func() bool { return !peer.c.NATSConnected() }, converge, 5*time.Millisecond)
	for i := range 3 {
		complete(t, eng, i)
	}
	require.Eventually(t, func() bool { return confirmed(owner) == len(eng.CachedBlocks()) }, converge, 10*time.Millisecond,
		"the owner ingests while the peer is cut off")
	natsUp(t, peer)
	// Until the peer applies a batch of the live stream (its NATS route back),
	// keep the engine publishing.
	for i := 3; confirmed(peer) == 0; i++ {
		require.Less(t, i, 500, "the peer never received a live batch")
		complete(t, eng, i)
	}
	require.Eventually(t, func() bool {
		n := len(eng.CachedBlocks())
		return confirmed(owner) == n && confirmed(peer) == n
	}, converge, 20*time.Millisecond, "the peer's view of r0 repaired: owner %d, peer %d, engine %d",
		confirmed(owner), confirmed(peer), len(eng.CachedBlocks()))
	// ci1292 and ci1388 failed here, the peer's view whole without a
	// repair: the engine had evicted the blocks the peer missed (see the
	// pool above; reproduced with the default pool and 100 completions
	// more before the loop). Say what each side sent and took.
	require.Positive(t, metricValue(t, peer.reg, "kvmesh_sync_kv_diverged_total", nil),
		"the owner's fingerprint showed the peer its view differs (owner published %v KV batches; "+
			"peer applied %v, refused %v, gaps %v, repairs %v; its log says where it took up the stream)",
		metricValue(t, owner.reg, "kvmesh_sync_messages_published_total", map[string]string{"kind": "kv"}),
		metricValue(t, peer.reg, "kvmesh_sync_deltas_applied_total", map[string]string{"kind": "kv"}),
		metricValue(t, peer.reg, "kvmesh_sync_kv_rejected_total", nil),
		metricValue(t, peer.reg, "kvmesh_sync_sequence_gaps_total", map[string]string{"kind": "kv"}),
		metricValue(t, peer.reg, "kvmesh_sync_antientropy_repairs_total", nil))
}

// confirmedOn counts g's confirmed blocks of replica id.
func confirmedOn(g *gw, id index.ReplicaID) int {
	return len(g.ix.AppendReplicaKeys(nil, id, index.Confirmed))
}

// startOwnedEngine starts an engine publishing KV events as replica r1
// (its source src) and n gateways ingesting it, and waits until exactly
// one owns it.
func startOwnedEngine(t testing.TB, n int) (*sim.Server, KVSource, []*gw) {
	t.Helper()
	e := startEngine(t)
	src := KVSource{Replica: "r1", Model: "m", Endpoint: e.KVEventsAddr(), ReplayEndpoint: e.KVReplayAddr()}
	gws := startCluster(t, n, nil, func(c *Config) { c.KVSources = []KVSource{src} })
	require.Eventually(t, func() bool { return len(ownersOfReplica(gws, "r1")) == 1 }, converge, 10*time.Millisecond,
		"one gateway owns r1")
	return e, src, gws
}

// waitSameView waits until every gateway holds e's blocks (as replica r1)
// at the same seq.
func waitSameView(t testing.TB, e *sim.Server, gws []*gw) {
	t.Helper()
	require.Eventually(t, func() bool {
		n := len(e.CachedBlocks())
		seq, ok := gws[0].c.KVApplied("r1")
		for _, g := range gws {
			s, k := g.c.KVApplied("r1")
			if confirmedOn(g, 1) != n || k != ok || s != seq {
				return false
			}
		}
		return n > 0 && ok
	}, converge, 10*time.Millisecond, "every gateway holds the engine's blocks at the same seq")
}

// splitOwner returns the gateway that owns replica's KV source (the
// first, per ownersOfReplica) and the others, in gws's order.
func splitOwner(gws []*gw, replica string) (owner *gw, others []*gw) {
	name := ownersOfReplica(gws, replica)[0]
	for _, g := range gws {
		if g.name == name {
			owner = g
		} else {
			others = append(others, g)
		}
	}
	return owner, others
}

// ownersOfReplica returns the gateways running replica's subscriber.
func ownersOfReplica(gws []*gw, replica string) []string {
	var out []string
	for _, g := range gws {
		if g.c.OwnsKV(replica) {
			out = append(out, g.name)
		}
	}
	return out
}

// TestSetKVSources changes the KV sources of a running cluster, as a
// config reload or engine discovery does when replicas come and go: an
// added engine gets exactly one owner and every gateway its blocks; a
// removed one is ingested by no gateway any more; an engine listed under
// the same name at new endpoints is subscribed afresh.
func TestSetKVSources(t *testing.T) {
	e0, e1 := startEngine(t), startEngine(t)
	src0 := KVSource{Replica: "r0", Model: "m", Endpoint: e0.KVEventsAddr(), ReplayEndpoint: e0.KVReplayAddr()}
	src1 := KVSource{Replica: "r1", Model: "m", Endpoint: e1.KVEventsAddr(), ReplayEndpoint: e1.KVReplayAddr()}
	gws := startCluster(t, 3, nil, func(c *Config) { c.KVSources = []KVSource{src0} })
	setAll := func(srcs ...KVSource) {
		for _, g := range gws {
			require.NoError(t, g.c.SetKVSources(srcs))
		}
	}
	holdAll := func(id index.ReplicaID, want func() int) func() bool {
		return func() bool {
			n := want()
			for _, g := range gws {
				if confirmedOn(g, id) != n {
					return false
				}
			}
			return n > 0
		}
	}
	require.Eventually(t, func() bool { return len(ownersOfReplica(gws, "r0")) == 1 }, converge, 10*time.Millisecond)
	complete(t, e0, 0)
	require.Eventually(t, holdAll(0, func() int { return len(e0.CachedBlocks()) }), converge, 10*time.Millisecond)

	// Added: one owner, and every gateway holds its blocks.
	setAll(src0, src1)
	require.Eventually(t, func() bool { return len(ownersOfReplica(gws, "r1")) == 1 }, converge, 10*time.Millisecond,
		"the added engine has exactly one owner")
	require.Equal(t, Owner("r1", []string{"g0", "g1", "g2"}), ownersOfReplica(gws, "r1")[0])
	for i := range 3 {
		complete(t, e1, 10+i)
	}
	require.Eventually(t, holdAll(1, func() int { return len(e1.CachedBlocks()) }), converge, 10*time.Millisecond)

	// Removed: no gateway ingests it, and its stream is forgotten.
	setAll(src1)
	require.Eventually(t, func() bool { return len(ownersOfReplica(gws, "r0")) == 0 }, converge, 10*time.Millisecond,
		"no gateway subscribes to a removed engine")
	held := make([]int, len(gws))
	for i, g := range gws {
		_, ok := g.c.KVApplied("r0")
		require.False(t, ok, "%s still tracks the removed engine's stream", g.name)
		held[i] = confirmedOn(g, 0)
	}
	complete(t, e0, 1) // the removed engine publishes more
	complete(t, e1, 13)
	require.Eventually(t, holdAll(1, func() int { return len(e1.CachedBlocks()) }), converge, 10*time.Millisecond,
		"the engine that stays still flows")
	for i, g := range gws {
		require.Equal(t, held[i], confirmedOn(g, 0), "%s applied a removed engine's batch", g.name)
	}
	// Polled: under load memberlist may declare a live gateway dead for a
	// moment, and r1 then has two owners until the suspicion clears (ci1001
	// read 2 here, five CI runs at once).
	require.Eventually(t, func() bool {
		owned := 0.0
		for _, g := range gws {
			owned += metricValue(t, g.reg, "kvmesh_sync_kv_owned_sources", nil)
		}
		return owned == 1
	}, converge, 10*time.Millisecond, "kvmesh_sync_kv_owned_sources over the cluster: r1 alone")

	// Same name, new endpoints: another engine, subscribed afresh. The
	// old engine's blocks are not the new one's: the owner's reset clears
	// them on every gateway, and then every gateway holds the new engine's
	// blocks alone.
	require.Positive(t, confirmedOn(gws[0], 1))
	e2 := startEngine(t)
	setAll(KVSource{Replica: "r1", Model: "m", Endpoint: e2.KVEventsAddr(), ReplayEndpoint: e2.KVReplayAddr()})
	require.Eventually(t, func() bool { return len(ownersOfReplica(gws, "r1")) == 1 }, converge, 10*time.Millisecond)
	require.Eventually(t, func() bool {
		for _, g := range gws {
			if confirmedOn(g, 1) != 0 {
				return false
			}
		}
		return true
	}, converge, 10*time.Millisecond, "every gateway forgets the replaced engine's blocks")
	complete(t, e2, 20)
	require.Eventually(t, holdAll(1, func() int { return len(e2.CachedBlocks()) }), converge, 10*time.Millisecond,
		"every gateway holds the new engine's blocks, and only those")
	// The owner that reset the old engine's blocks counted it; the others
	// applied its reset and count nothing.
	resets := 0.0
	for _, g := range gws {
		resets += metricValue(t, g.reg, "kvmesh_kvevents_resets_total",
			map[string]string{"replica": "r1", "reason": "source_changed"})
	}
	require.GreaterOrEqual(t, resets, 1.0, "kvmesh_kvevents_resets_total{reason=source_changed} over the cluster")
}

// TestRepointedSourceResetOnTakeover: the gateway that owns a KV source
// leaves before it applies the config change that points the source at
// another engine. The gateway that takes the source over resets the old
// engine's blocks on every remaining gateway before it subscribes to the
// new one, so none of them keeps blocks that no event will ever remove.
func TestRepointedSourceResetOnTakeover(t *testing.T) {
	e1, e2 := startEngine(t), startEngine(t)
	src := func(e *sim.Server) KVSource {
		return KVSource{Replica: "r1", Model: "m", Endpoint: e.KVEventsAddr(), ReplayEndpoint: e.KVReplayAddr()}
	}
	gws := startCluster(t, 3, nil, func(c *Config) { c.KVSources = []KVSource{src(e1)} })
	require.Eventually(t, func() bool { return len(ownersOfReplica(gws, "r1")) == 1 }, converge, 10*time.Millisecond)
	hold := func(gws []*gw, want func() int) func() bool {
		return func() bool {
			n := want()
			for _, g := range gws {
				if confirmedOn(g, 1) != n {
					return false
				}
			}
			return true
		}
	}
	complete(t, e1, 0)
	require.Eventually(t, hold(gws, func() int { return len(e1.CachedBlocks()) }), converge, 10*time.Millisecond)
	require.Positive(t, confirmedOn(gws[0], 1))

	old, rest := splitOwner(gws, "r1")
	for _, g := range rest {
		require.NoError(t, g.c.SetKVSources([]KVSource{src(e2)}))
	}
	old.stop(t) // left with the old source: it never resets r1
	require.Eventually(t, func() bool { return len(ownersOfReplica(rest, "r1")) == 1 }, converge, 10*time.Millisecond,
		"a remaining gateway takes the source over")
	require.Eventually(t, hold(rest, func() int { return 0 }), converge, 10*time.Millisecond,
		"the new owner resets the old engine's blocks everywhere")
	complete(t, e2, 20)
	require.Eventually(t, hold(rest, func() int { return len(e2.CachedBlocks()) }), converge, 10*time.Millisecond,
		"every remaining gateway holds the new engine's blocks alone")
}

// TestTransientOwnersResetRepairedFromOwner: a gateway applied a reset
// from a gateway that owned a KV source for a moment only (memberlist took
// the real owner for dead, the taker-over reset the source, and the owner
// was back before the taker-over's subscriber delivered a batch). The real
// owner never applied that reset and still holds the engine's blocks at
// the seq the emptied gateway had before it. With the engine idle, no
// batch repairs the emptied view and no watermark is ahead of it, so the
// owner's fingerprint must: the emptied gateway takes the owner's view.
// (ci1034: TestSetKVSources waited 30 s for one gateway that held none of
// the new engine's blocks after a re-point.)
func TestTransientOwnersResetRepairedFromOwner(t *testing.T) {
	e, _, gws := startOwnedEngine(t, 3)
	hold := func() bool {
		n := len(e.CachedBlocks())
		for _, g := range gws {
			if confirmedOn(g, 1) != n {
				return false
			}
		}
		return n > 0
	}
	complete(t, e, 0)
	require.Eventually(t, hold, converge, 10*time.Millisecond)

	_, others := splitOwner(gws, "r1")
	emptied, transient := others[0], others[1]
	// The reset as emptied applied it: accepted from transient, which it
	// took for the owner then.
	emptied.c.ap.applyLocal(&KVBatch{Origin: transient.c.origin, Replica: "r1", SentAt: time.Now().UnixNano(),
		Reset: true, Reason: uint8(kvevents.ResetSourceChanged)})
	require.Zero(t, confirmedOn(emptied, 1))
	require.Eventually(t, hold, converge, 10*time.Millisecond,
		"the emptied gateway takes the owner's view back while the engine is idle")
	require.Positive(t, metricValue(t, emptied.reg, "kvmesh_sync_kv_diverged_total", nil))
}

// TestEmptiedTakeKeepsEngineClock: a gateway that applied the owner's
// reset and then took the owner's emptied view by force (a fingerprint the
// owner took just before the reset arrived just after it: ci1071) must
// still refuse the view of a gateway that missed the reset. A taken view
// with no watermark used to leave no engine clock, and any peer's view
// then counted as newer.
func TestEmptiedTakeKeepsEngineClock(t *testing.T) {
	e, src, gws := startOwnedEngine(t, 3)
	complete(t, e, 0)
	waitSameView(t, e, gws)
	o, others := splitOwner(gws, "r1")
	applied, missed := others[0], others[1]
	natsDown(t, missed)
	(&ownerHandler{c: o.c, src: src}).HandleReset("r1", kvevents.ResetRewind)
	require.Eventually(t, func() bool { return confirmedOn(applied, 1) == 0 }, converge, 10*time.Millisecond)
	restore := func(from *gw, force map[string]bool) error {
		ctx, cancel := context.WithTimeout(context.Background(), converge)
		defer cancel()
		return applied.c.restoreFrom(ctx, memberOf(t, applied, from.name), false, false, force)
	}
	require.NoError(t, restore(o, map[string]bool{"r1": true}), "the forced repair")
	require.Zero(t, confirmedOn(applied, 1))
	natsUp(t, missed)
	require.Positive(t, confirmedOn(missed, 1), "the gateway that missed the reset keeps its view")

	// Its digests are no lead (TestMissedResetIsNoLead), so the applied
	// gateway does not pull its snapshot; a repair from it for any other
	// reason must still not take its view.
	require.NoError(t, restore(missed, nil))
	require.Zero(t, confirmedOn(applied, 1), "took a view from before the reset that emptied its own")
}

// TestMissedResetIsNoLead: a gateway whose NATS was down while an engine's
// owner reset it keeps the reset blocks and advertises its old watermark
// until the engine publishes again. A gateway that applied the reset must
// not take that watermark for a lead: a restore would take nothing from
// it (the same engine clock), and it used to pull the stale gateway's
// snapshot every repair interval for as long as the engine stayed idle
// (2 pulls in five digest rounds, with three gateways and a simulator
// engine). The peer's digests are injected and driftPeer is called
// directly, so neither digest timing nor ownership moving under load
// bears on the result; the peer is a real cluster member.
func TestMissedResetIsNoLead(t *testing.T) {
	gws := startCluster(t, 2, nil, func(c *Config) { c.DigestInterval = time.Hour })
	g, peer := gws[0], gws[1]
	// g applied the engine's batches up to seq 4 (engine clock 10), then
	// the owner's reset.
	g.c.ap.applyLocal(&KVBatch{Origin: "o", Replica: "r1", Seq: 4, EngineTS: 10})
	g.c.ap.applyLocal(&KVBatch{Origin: "o", Replica: "r1", Reset: true})
	lead := func(d map[string]uint64) (string, string) {
		src := make([]watermark, 0, len(d))
		for k, v := range d {
			src = append(src, watermark{Source: k, Seq: v})
		}
		g.c.storeDigest(&digest{Origin: peer.c.origin, SentAt: time.Now().UnixNano(), Sources: src})
		g.c.driftPeer(g.c.mySources()) // a lead is repaired once it held for an interval
		p, reason, _ := g.c.driftPeer(g.c.mySources())
		return p, reason
	}
	clock := func(ts float64) uint64 { return math.Float64bits(ts) }
	isLead := func(d map[string]uint64) func() bool {
		return func() bool { p, _ := lead(d); return p == peer.name }
	}
	require.Eventually(t, isLead(map[string]uint64{srcKV + "r1": 2, srcKVTS + "r1": clock(20)}), converge, 10*time.Millisecond,
		"a peer whose view is newer (the engine published since) is a lead")
	require.Eventually(t, isLead(map[string]uint64{srcKV + "r1": 5}), converge, 10*time.Millisecond,
		"a digest without the clock (a previous release) is judged by its seq")
	memberOf(t, g, peer.name)
	p, reason := lead(map[string]uint64{srcKV + "r1": 5, srcKVTS + "r1": clock(10)})
	require.Empty(t, p, "the view the reset emptied, at its clock, taken for a lead: %s", reason)
}

// TestPastFingerprintCompared: an owner's fingerprint is compared with the
// view this gateway had at the owner's seq, not only with its current one.
// Under a steady stream of batches a peer has moved past the owner's seq
// by the time the digest lands; before, a view that lost blocks' removals
// went uncompared for as long as the engine stayed busy (ci1112: 170 stale
// blocks for the 20 s TestScaleOutAndIn kept its engine publishing).
func TestPastFingerprintCompared(t *testing.T) {
	e, _, gws := startOwnedEngine(t, 2)
	o, others := splitOwner(gws, "r1")
	peer := others[0]
	same := func() bool {
		a, ok1 := o.c.KVApplied("r1")
		b, ok2 := peer.c.KVApplied("r1")
		return ok1 && ok2 && a == b && a >= 3
	}
	// A few batches, then the peer catches up while the engine is quiet.
	// Producing until the two views met raced the propagation on a busy
	// host: 200 requests went by and no check saw them equal (ci1240).
	for i := 0; ; i++ {
		require.Less(t, i, 50, "the owner applied no batches")
		complete(t, e, i)
		if a, ok := o.c.KVApplied("r1"); ok && a >= 3 {
			break
		}
	}
	require.Eventually(t, same, converge, 10*time.Millisecond, "the peer never caught up with the owner")
	seq, _ := peer.c.KVApplied("r1")
	at := seq - 1 // a watermark both applied on the way: seq-2 + 1
	mine, ok := peer.c.ap.kvCheckOf("r1", at)
	require.True(t, ok, "the peer kept its fingerprint after batch %d", at-1)
	theirs, ok := o.c.ap.kvCheckOf("r1", at)
	require.True(t, ok, "the owner kept its fingerprint after batch %d", at-1)
	require.Equal(t, theirs, mine, "both applied the same batches")

	digest := func(chk kvCheck) map[string]uint64 {
		return map[string]uint64{srcKVAt + "r1": chk.at, srcKVN + "r1": uint64(chk.n), srcKVSum + "r1": chk.sum}
	}
	peer.c.checkKV(o.name, digest(theirs))
	require.Zero(t, metricValue(t, peer.reg, "kvmesh_sync_kv_diverged_total", nil), "equal past views")
	theirs.sum++
	peer.c.checkKV(o.name, digest(theirs))
	require.Equal(t, 1.0, metricValue(t, peer.reg, "kvmesh_sync_kv_diverged_total", nil),
		"a past view that differs from the owner's at its seq")
	peer.c.dmu.Lock()
	marked := peer.c.diverged["r1"]
	peer.c.dmu.Unlock()
	require.Equal(t, o.name, marked, "repaired from the owner")
}

// TestStaleBlocksRepairedUnderSteadyTraffic: a peer whose view holds
// blocks the engine no longer has, with every batch applied in sequence
// (a removal lost some other way), is repaired while the engine keeps
// publishing.
func TestStaleBlocksRepairedUnderSteadyTraffic(t *testing.T) {
	e, _, gws := startOwnedEngine(t, 2)
	_, others := splitOwner(gws, "r1")
	peer := others[0]
	for i := 0; confirmedOn(peer, 1) == 0; i++ {
		require.Less(t, i, 200, "the peer never applied a batch")
		complete(t, e, i)
	}
	// Blocks no engine stored: what a lost BlockRemoved leaves behind.
	stale := []uint64{1 << 60, 1<<60 + 1}
	toks := make([]uint32, 2*16)
	for i := range toks {
		toks[i] = uint32(7000 + i)
	}
	require.NoError(t, peer.ix.ApplyStored(1, index.StoredBlocks{Hashes: stale, Tokens: toks, BlockTokens: 16}))
	holdsStale := func() bool { return slices.Contains(peer.ix.AppendEngineHashes(nil, 1), stale[0]) }
	require.True(t, holdsStale())

	// Steady traffic from four clients until the stale blocks are gone
	// (bounded in count and time): the repair must not wait for the engine
	// to go idle.
	var sent atomic.Int64
	var wg sync.WaitGroup
	stop := make(chan struct{})
	until := time.Now().Add(converge + 5*time.Second)
	for w := range 4 {
		wg.Go(func() {
			for i := 0; i < 100000 && time.Now().Before(until); i++ {
				select {
				case <-stop:
					return
				default:
				}
				if post(e, 10000*(w+1)+i) == nil { // no require off the test goroutine
					sent.Add(1)
				}
			}
		})
	}
	repaired := assert.Eventually(t, func() bool { return !holdsStale() }, converge, 10*time.Millisecond,
		"the stale blocks outlive steady traffic")
	close(stop)
	wg.Wait()
	t.Logf("%d requests sent", sent.Load())
	require.True(t, repaired)
	require.Positive(t, metricValue(t, peer.reg, "kvmesh_sync_kv_diverged_total", nil))
}
