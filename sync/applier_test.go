package sync

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

// TestOriginWindowAgainstReference checks the dedupe window against a
// plain set of every seq ever seen, on shuffled, duplicated streams.
func TestOriginWindowAgainstReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 50 {
		var o originState
		seen := map[uint64]bool{}
		n := 200 + rng.IntN(3000)
		for range n {
			// Mostly in order with local reordering and duplicates.
			seq := uint64(1 + rng.IntN(n))
			if rng.IntN(4) > 0 {
				seq = o.base + 1 + uint64(rng.IntN(8))
			}
			before := o.base
			fresh, _ := o.accept(seq)
			if fresh && seq <= before {
				t.Fatalf("round %d: seq %d at or below the watermark %d accepted", round, seq, before)
			}
			if fresh {
				require.False(t, seen[seq], "round %d: seq %d accepted twice", round, seq)
				seen[seq] = true
			} else if seq > before {
				require.True(t, seen[seq], "round %d: new seq %d above the watermark refused", round, seq)
			}
			require.LessOrEqual(t, len(o.above), dedupWindow)
		}
	}
	// A jump beyond the window gives up the seqs in between as lost.
	var o originState
	f, lost := o.accept(1)
	require.True(t, f)
	require.Zero(t, lost)
	f, lost = o.accept(12 + dedupWindow) // keeps 13..12+window: 2..12 are lost
	require.True(t, f)
	require.Equal(t, uint64(11), lost)
	f, _ = o.accept(5)
	require.False(t, f, "given up as lost")
}

// TestKVSequenceRules drives applyKVLocked directly: in-order applies,
// duplicates drop, gaps count, a rewind with a newer engine clock clears.
func TestKVSequenceRules(t *testing.T) {
	g := newGW(t, "x", nil, nil)
	a := g.c.ap
	stored := func(seq uint64, ts float64, hash uint64, tok uint32) *KVBatch {
		return storedBatch(g.ix.Hasher(), seq, ts, hash, tok)
	}
	applied := func() float64 {
		return metricValue(t, g.reg, "kvmesh_sync_deltas_applied_total", map[string]string{"kind": "kv"})
	}
	a.applyLocal(stored(0, 10, 100, 1))
	a.applyLocal(stored(1, 11, 101, 2))
	require.Equal(t, 2, confirmed(g))
	a.applyLocal(stored(1, 11, 101, 2)) // duplicate
	a.applyLocal(stored(0, 10, 100, 1)) // replayed by a new owner
	require.Equal(t, 2.0, applied())
	require.Equal(t, 2.0, metricValue(t, g.reg, "kvmesh_sync_deltas_dropped_total", map[string]string{"reason": "duplicate"}))
	a.applyLocal(stored(5, 12, 102, 3)) // gap: 2..4 lost on the way
	require.Equal(t, 1.0, metricValue(t, g.reg, "kvmesh_sync_sequence_gaps_total", map[string]string{"kind": "kv"}))
	require.True(t, a.takeLoss())
	require.Equal(t, 3, confirmed(g))
	// Engine restarted (seq 0 again, later clock): old state cleared.
	a.applyLocal(stored(0, 20, 200, 4))
	require.Equal(t, 1, confirmed(g))
	// An explicit reset clears and accepts any seq next.
	a.applyLocal(&KVBatch{Origin: "o", Replica: "r1", Reset: true})
	require.Zero(t, confirmed(g))
	a.applyLocal(stored(7, 1, 300, 5))
	require.Equal(t, 1, confirmed(g))
	w := a.watermarksLocked()
	require.Equal(t, uint64(8), w[srcKV+"r1"])
	// Unknown replicas are dropped and counted.
	a.applyLocal(&KVBatch{Origin: "o", Replica: "nope", Seq: 1})
	require.Equal(t, 1.0, metricValue(t, g.reg, "kvmesh_sync_deltas_dropped_total", map[string]string{"reason": "unknown_replica"}))
	_ = index.Confirmed
}

func TestPublishDecisionDoesNotAllocate(t *testing.T) {
	g := newGW(t, "x", nil, nil) // not started: nothing drains pending
	keys := chain(1, 64)
	for range 100 {
		g.c.PublishDecision("r0", index.History, keys, 1)
	}
	g.c.pending.entries, g.c.pending.keys = g.c.pending.entries[:0], g.c.pending.keys[:0]
	allocs := testing.AllocsPerRun(100, func() { g.c.PublishDecision("r0", index.History, keys, 1) })
	require.Zero(t, allocs)
	require.Equal(t, 101, len(g.c.pending.entries))
	// Confirmed decisions are not published (KV events carry those).
	g.c.PublishDecision("r0", index.Confirmed, keys, 1)
	require.Equal(t, 101, len(g.c.pending.entries))
}

// TestKVGapWatermark: after a seq gap the applier keeps applying but
// advertises the pre-gap watermark until a reset or a repair, and
// kvNewerLocked compares (engine clock, seq), so neither a peer that missed
// a reset nor a gapped view counts as newer.
func TestKVGapWatermark(t *testing.T) {
	g := newGW(t, "x", nil, nil)
	a := g.c.ap
	batch := func(seq uint64, ts float64) *KVBatch {
		return &KVBatch{Origin: "o", Replica: "r1", Seq: seq, EngineTS: ts}
	}
	wm := func(seq uint64, ts float64) map[string]uint64 {
		return map[string]uint64{srcKV + "r1": seq + 1, srcKVTS + "r1": math.Float64bits(ts)}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	require.True(t, a.kvNewerLocked(wm(0, 1), "r1"), "nothing known here")
	require.False(t, a.kvNewerLocked(map[string]uint64{srcKV + "r1": 0}, "r1"), "the peer knows nothing either")
	a.applyKVLocked(batch(0, 10))
	a.applyKVLocked(batch(1, 11))
	a.applyKVLocked(batch(5, 15)) // 2..4 lost
	a.applyKVLocked(batch(6, 16))
	require.Equal(t, uint64(2), a.watermarksLocked()[srcKV+"r1"], "pre-gap watermark")
	require.Equal(t, math.Float64bits(11), a.watermarksLocked()[srcKVTS+"r1"])
	a.mu.Unlock()
	for _, w := range a.sources() {
		if w.Source == srcKV+"r1" {
			require.Equal(t, uint64(2), w.Seq, "digest carries the pre-gap watermark")
		}
	}
	a.mu.Lock()
	require.True(t, a.kvNewerLocked(wm(4, 14), "r1"), "a complete view past the gap is newer")
	require.True(t, a.kvNewerLocked(wm(2, 11), "r1"), "same clock, later seq")
	require.False(t, a.kvNewerLocked(wm(1, 11), "r1"))
	require.True(t, a.kvNewerLocked(wm(0, 30), "r1"), "engine restarted: later clock, lower seq")
	a.applyKVLocked(batch(7, 17)) // still gapped: dedupe goes on from 7
	a.applyKVLocked(batch(7, 17))
	require.Equal(t, 1.0, metricValue(t, g.reg, "kvmesh_sync_deltas_dropped_total", map[string]string{"reason": "duplicate"}))
	// A reset empties the view: the gap no longer matters, and a peer that
	// missed the reset (older clock) is not newer.
	a.applyKVLocked(&KVBatch{Origin: "o", Replica: "r1", Reset: true})
	require.False(t, a.kvNewerLocked(wm(7, 17), "r1"), "a peer that missed the reset")
	require.True(t, a.kvNewerLocked(wm(0, 40), "r1"))
	a.applyKVLocked(batch(20, 40))
	require.Equal(t, uint64(21), a.watermarksLocked()[srcKV+"r1"])
	// A selective restore replaces only the sources it took.
	a.kv["r2"] = &kvState{valid: true, seq: 3, engine: 5}
	a.setWatermarksLocked(wm(30, 50), false, map[string]bool{"r1": true})
	require.Equal(t, uint64(31), a.watermarksLocked()[srcKV+"r1"])
	require.Equal(t, uint64(4), a.watermarksLocked()[srcKV+"r2"])
}

// TestLeadUseful: a peer's digest lead on an engine is a reason to repair
// only where a restore would take the peer's view, judged by the engine
// clock the digest carries beside the seq (the digest's own srcKVTS).
func TestLeadUseful(t *testing.T) {
	g := newGW(t, "x", nil, nil)
	a := g.c.ap
	now := time.Now()
	peer := func(seq uint64, ts float64) map[string]uint64 {
		return map[string]uint64{srcKV + "r1": seq + 1, srcKVTS + "r1": math.Float64bits(ts)}
	}
	useful := func(d map[string]uint64) bool { return a.leadUseful(srcKV+"r1", d, now) }
	require.True(t, useful(peer(3, 10)), "nothing known here")
	a.applyLocal(&KVBatch{Origin: "o", Replica: "r1", Seq: 3, EngineTS: 10})
	require.True(t, useful(peer(5, 12)), "later batches of the same stream")
	require.Equal(t, math.Float64bits(10), g.c.mySources()[srcKVTS+"r1"], "the digest carries the clock")

	// A reset emptied this view; a peer that missed it advertises a later
	// seq at the clock of the reset view, which a restore would not take.
	a.applyLocal(&KVBatch{Origin: "o", Replica: "r1", Reset: true})
	require.False(t, useful(peer(5, 10)), "a peer that missed the reset")
	require.True(t, useful(peer(0, 20)), "the engine published since: a later clock")
	require.False(t, useful(peer(5, float64(now.Add(time.Hour).UnixNano())/1e9)), "a clock in the future")
	noClock := map[string]uint64{srcKV + "r1": 6}
	require.True(t, useful(noClock), "a digest without the clock (a previous release) counts its seq")
	require.Zero(t, g.c.mySources()[srcKVTS+"r1"], "no watermark, no clock")
}

// TestKVParentZeroChainStart: an owner republishes a legacy-format
// engine's chain start with parent 0 (llm-d-inference-sim); every gateway
// confirms it through the index's rule and counts the tolerance.
func TestKVParentZeroChainStart(t *testing.T) {
	g := newGW(t, "x", nil, nil)
	m := kvevents.NewMetrics()
	g.c.deps.KVMetrics = m
	a := g.c.ap
	bt := g.ix.Hasher().BlockTokens()
	toks := make([]uint32, 2*bt)
	for i := range toks {
		toks[i] = uint32(7 + i)
	}
	a.applyLocal(&KVBatch{Origin: "o", Replica: "r1", Seq: 1, EngineTS: 1, Events: []index.KVEvent{
		{Kind: index.KVStored, Stored: index.StoredBlocks{Hashes: []uint64{41}, ParentHash: 0, HasParent: true, BlockTokens: bt, Tokens: toks[:bt]}},
		{Kind: index.KVStored, Stored: index.StoredBlocks{Hashes: []uint64{42}, ParentHash: 41, HasParent: true, BlockTokens: bt, Tokens: toks[bt:]}},
	}})
	require.Equal(t, 2, confirmed(g))
	require.Zero(t, metricValue(t, g.reg, "kvmesh_sync_deltas_dropped_total", map[string]string{"reason": "apply_error"}))
	var d dto.Metric
	require.NoError(t, m.Tolerated.WithLabelValues("r1", "parent_zero").Write(&d))
	require.Equal(t, 1.0, d.GetCounter().GetValue())
}

// TestDropGappedRebuildsFromReplay: a view that lost batches on the way
// here (one of them a removal) keeps the removed block; a new owner's
// replay of the engine's buffer alone cannot fix it (its batches are
// duplicates by seq), so dropGapped empties the view first and the
// replay rebuilds it in order, without the removed block.
func TestDropGappedRebuildsFromReplay(t *testing.T) {
	g := newGW(t, "x", nil, nil)
	a := g.c.ap
	stored := func(seq uint64, hash uint64, tok uint32) *KVBatch {
		return storedBatch(g.ix.Hasher(), seq, float64(10+seq), hash, tok)
	}
	removed := &KVBatch{Origin: "o", Replica: "r1", Seq: 2, EngineTS: 12, Events: []index.KVEvent{
		{Kind: index.KVRemoved, Removed: []uint64{100}}}}
	engine := []*KVBatch{stored(0, 100, 1), stored(1, 101, 2), removed, stored(3, 102, 3)}

	require.False(t, a.dropGapped("r1"), "nothing applied: nothing to drop")
	for _, b := range engine {
		if b.Seq != 2 { // lost on the way here
			a.applyLocal(b)
		}
	}
	require.Equal(t, 3, confirmed(g), "the lost removal leaves block 100")
	for _, b := range engine { // the replay alone: duplicates, dropped
		a.applyLocal(b)
	}
	require.Equal(t, 3, confirmed(g))
	_, ok := a.resumePoint("r1")
	require.False(t, ok, "a gapped view is no resume point")

	require.True(t, a.dropGapped("r1"))
	require.Zero(t, confirmed(g))
	for _, b := range engine {
		a.applyLocal(b)
	}
	require.Equal(t, 2, confirmed(g), "rebuilt without the removed block")
	rp, ok := a.resumePoint("r1")
	require.True(t, ok)
	require.Equal(t, kvevents.Seq(3), rp.Seq)
	require.False(t, a.dropGapped("r1"), "a complete view stays")
	require.False(t, a.dropGapped("nope"), "unknown replica")
}

// storedBatch is engine r1's batch seq (engine clock ts) from origin "o":
// one stored block of engine hash hash, every token tok.
func storedBatch(h index.Hasher, seq uint64, ts float64, hash uint64, tok uint32) *KVBatch {
	toks := make([]uint32, h.BlockTokens())
	for i := range toks {
		toks[i] = tok
	}
	return &KVBatch{Origin: "o", Replica: "r1", Seq: seq, EngineTS: ts, Events: []index.KVEvent{
		{Kind: index.KVStored, Stored: index.StoredBlocks{Hashes: []uint64{hash}, BlockTokens: h.BlockTokens(), Tokens: toks}}}}
}
