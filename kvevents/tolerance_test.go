package kvevents

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
)

// publishFrom publishes one batch every few ms from seq next on until cond
// holds (absorbing the slow-joiner window) and returns the next seq.
func publishFrom(t *testing.T, p *Publisher, next Seq, gen int, cond func() bool) Seq {
	t.Helper()
	return publishMoreUntil(t, p, next, gen, cond)
}

// TestReplayFromOneJoinIsComplete: a publisher numbering from 1
// (llm-d-inference-sim) published before the subscriber joined. The join
// replay from 0 gets seq 1 first: nothing is missing, so it is a complete
// replay and a replay_from_one tolerance, not a partial or failed one.
func TestReplayFromOneJoinIsComplete(t *testing.T) {
	pcfg := testPublisherConfig()
	pcfg.FirstSeq = 1
	p := newPublisher(t, pcfg)
	const early = 5
	for i := Seq(1); i <= early; i++ {
		seq, err := p.Publish(batchFor(i, 40))
		require.NoError(t, err)
		require.Equal(t, i, seq)
	}
	h := &recorder{}
	m := NewMetrics()
	startSubscriber(t, testSubscriberConfig(p.Addr(), p.ReplayAddr()), h, m, nil)
	require.Eventually(t, func() bool { return h.batches() == early }, 5*time.Second, 5*time.Millisecond,
		"records %v", h.snapshot())
	requireContiguous(t, h.snapshot(), 1, early+1, 40)
	require.Eventually(t, func() bool { return counterValue(t, m.Replays.WithLabelValues("r1", "complete")) == 1 },
		5*time.Second, 5*time.Millisecond)
	n := publishFrom(t, p, early+1, 40, func() bool { return h.batches() > early })
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	requireContiguous(t, h.snapshot(), 1, n, 40)
	requireFromOneTolerated(t, m)
}

// TestReplayFromOneLiveJoin: the subscriber is up before the publisher
// (numbering from 1) publishes; whether seq 1 arrives live (join replay
// from 0 up to 1 finds nothing before it) or is lost to the slow joiner
// (a catch-up from 0 brings it), no replay is failed or partial.
func TestReplayFromOneLiveJoin(t *testing.T) {
	pcfg := testPublisherConfig()
	pcfg.FirstSeq = 1
	p := newPublisher(t, pcfg)
	h := &recorder{}
	m := NewMetrics()
	startSubscriber(t, testSubscriberConfig(p.Addr(), p.ReplayAddr()), h, m, nil)
	n := publishFrom(t, p, 1, 41, func() bool { return h.batches() > 0 })
	for range 20 {
		_, err := p.Publish(batchFor(n, 41))
		require.NoError(t, err)
		n++
	}
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	requireContiguous(t, h.snapshot(), 1, n, 41)
	requireFromOneTolerated(t, m)
}

func requireFromOneTolerated(t *testing.T, m *Metrics) {
	t.Helper()
	require.Eventually(t, func() bool {
		return counterValue(t, m.Tolerated.WithLabelValues("r1", TolReplayFromOne)) == 1
	}, 5*time.Second, 5*time.Millisecond)
	require.Zero(t, counterValue(t, m.Replays.WithLabelValues("r1", "failed")))
	require.Zero(t, counterValue(t, m.Replays.WithLabelValues("r1", "partial")))
	for _, r := range []string{"rewind", "gap_unrecoverable", "malformed", "overflow"} {
		require.Zero(t, counterValue(t, m.Resets.WithLabelValues("r1", r)), r)
	}
}

// TestReplayFromOneKeepsRealGaps: a publisher numbering from 1 whose ring
// no longer holds its first batches: the join replay starts at seq 4, which
// is a real loss (partial), not a tolerance.
func TestReplayFromOneKeepsRealGaps(t *testing.T) {
	pcfg := testPublisherConfig()
	pcfg.FirstSeq = 1
	pcfg.BufferSteps = 3
	p := newPublisher(t, pcfg)
	for i := Seq(1); i <= 6; i++ {
		_, err := p.Publish(batchFor(i, 42))
		require.NoError(t, err)
	}
	h := &recorder{}
	m := NewMetrics()
	startSubscriber(t, testSubscriberConfig(p.Addr(), p.ReplayAddr()), h, m, nil)
	require.Eventually(t, func() bool { return h.batches() == 3 }, 5*time.Second, 5*time.Millisecond,
		"records %v", h.snapshot())
	requireContiguous(t, h.snapshot(), 4, 7, 42)
	require.Eventually(t, func() bool { return counterValue(t, m.Replays.WithLabelValues("r1", "partial")) == 1 },
		5*time.Second, 5*time.Millisecond)
	require.Zero(t, counterValue(t, m.Tolerated.WithLabelValues("r1", TolReplayFromOne)))
	require.Zero(t, counterValue(t, m.Replays.WithLabelValues("r1", "complete")))
}

// indexHandler applies batches to replica 1 of an index the way the
// gateway does (StoredForIndex, ApplyStoredReport) and counts tolerances.
type indexHandler struct {
	mu  sync.Mutex
	x   *index.Index
	m   *Metrics
	n   int
	err []error
}

func (h *indexHandler) HandleBatch(replica string, _ Seq, b *Batch) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.n++
	for i := range b.Events {
		sb, ok := StoredForIndex(h.x.Hasher(), testModel, b.Events[i].Stored, nil)
		if !ok {
			continue
		}
		tol, err := h.x.ApplyStoredReport(1, sb)
		if err != nil {
			h.err = append(h.err, err)
		}
		if tol != index.TolNone {
			h.m.Tolerated.WithLabelValues(replica, tol.String()).Inc()
		}
	}
}

func (h *indexHandler) HandleReset(string, ResetReason) {}

func (h *indexHandler) batches() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.n
}

// TestLegacyArrayParentZeroConfirmed: a publisher in the legacy array
// encoding (llm-d-inference-sim's default) sends a chain's first block with
// parent_block_hash 0 over ZMQ, then a child chained by hash. The chain is
// confirmed and matches the gateway's keys; the tolerance is counted.
func TestLegacyArrayParentZeroConfirmed(t *testing.T) {
	pcfg := testPublisherConfig()
	pcfg.Encoding = EncodingArray
	pcfg.FirstSeq = 1
	p := newPublisher(t, pcfg)
	x := testIndex(t)
	m := NewMetrics()
	h := &indexHandler{x: x, m: m}
	startSubscriber(t, testSubscriberConfig(p.Addr(), p.ReplayAddr()), h, m, nil)

	tokens := seqTokens(500, 12)
	start := Batch{TS: 1, Events: []Event{{Kind: KindBlockStored, Stored: &BlockStored{
		BlockHashes: []EngineHash{71, 72}, ParentBlockHash: 0, HasParent: true,
		TokenIDs: tokens[:8], BlockSize: 4, Medium: "GPU",
	}}}}
	child := Batch{TS: 2, Events: []Event{{Kind: KindBlockStored, Stored: &BlockStored{
		BlockHashes: []EngineHash{73}, ParentBlockHash: 72, HasParent: true,
		TokenIDs: tokens[8:], BlockSize: 4, Medium: "GPU",
	}}}}
	// The wire form really carries 0, not nil.
	raw, err := Encode(&start, EncodingArray)
	require.NoError(t, err)
	dec, err := Decode(raw)
	require.NoError(t, err)
	require.True(t, dec.Events[0].Stored.HasParent)
	require.Zero(t, dec.Events[0].Stored.ParentBlockHash)

	_, err = p.Publish(start)
	require.NoError(t, err)
	_, err = p.Publish(child)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return h.batches() == 2 }, 5*time.Second, 5*time.Millisecond)
	require.Empty(t, h.err)
	require.Equal(t, 3, gatewayMatch(t, x, "", "", tokens))
	require.Equal(t, float64(1), counterValue(t, m.Tolerated.WithLabelValues("r1", TolParentZero)))
	require.Equal(t, uint64(1), x.Stats().ParentZeroStarts)
	require.Zero(t, x.Stats().UnknownParentBlocks)
}
