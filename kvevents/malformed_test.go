package kvevents

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// liveOnlyConfig is the subscriber config of the malformed-batch tests:
// without JoinReplay the writer never runs its connect-time catch-up, whose
// retries (until the first live batch, with backoff) would otherwise race
// the test and may fetch the bad seq from the replay buffer before its live
// copy arrives; the live copy is then a duplicate, dropped undecoded, and
// the malformed path under test never runs (seen under -race on a loaded
// machine: Malformed 0, want 1). The replay endpoint stays set, so a
// malformed live batch is still retried from the engine's buffer.
func liveOnlyConfig(p *Publisher) SubscriberConfig {
	cfg := testSubscriberConfig(p.Addr(), p.ReplayAddr())
	cfg.JoinReplay = false
	return cfg
}

// garbled is what a damaged payload looks like: a truncated msgpack array.
var garbled = []byte{0x92, 0xcb}

// TestMalformedLiveBatchRecoveredByReplay: a batch damaged in transit is
// fetched again from the engine's replay buffer and delivered in order; no
// event is lost, so there is no reset.
func TestMalformedLiveBatchRecoveredByReplay(t *testing.T) {
	p := newPublisher(t, testPublisherConfig())
	h := &recorder{}
	m := NewMetrics()
	var bad atomic.Int64
	bad.Store(-1)
	s, err := NewSubscriber(liveOnlyConfig(p), h, m, nil)
	require.NoError(t, err)
	s.mangle = func(seq Seq, replayed bool, payload []byte) []byte {
		if !replayed && int64(seq) == bad.Load() {
			return garbled
		}
		return payload
	}
	require.NoError(t, s.Start(t.Context()))
	t.Cleanup(func() { _ = s.Close() })

	n := publishUntil(t, p, 20, func() bool { return h.batches() > 0 })
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	first := h.snapshot()[0].seq
	bad.Store(int64(n + 2))
	for range 6 {
		_, err := p.Publish(batchFor(n, 20))
		require.NoError(t, err)
		n++
	}
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	requireContiguous(t, h.snapshot(), first, n, 20)
	require.Equal(t, 1.0, counterValue(t, m.Malformed.WithLabelValues("r1")))
	require.Zero(t, counterValue(t, m.Resets.WithLabelValues("r1", "malformed")))
	require.Eventually(t, func() bool { return counterValue(t, m.Replays.WithLabelValues("r1", "complete")) >= 1 },
		5*time.Second, 5*time.Millisecond, "a replay is counted when it ends, after its batches")
}

// TestMalformedBatchUnrecoverableResets: when the replayed copy does not
// decode either, the batch's events are lost: the replica is reset (never a
// silent drift) and the stream continues after it without a gap.
func TestMalformedBatchUnrecoverableResets(t *testing.T) {
	p := newPublisher(t, testPublisherConfig())
	h := &recorder{}
	m := NewMetrics()
	var bad, garbledLive, garbledReplayed atomic.Int64
	bad.Store(-1)
	s, err := NewSubscriber(liveOnlyConfig(p), h, m, nil)
	require.NoError(t, err)
	s.mangle = func(seq Seq, replayed bool, payload []byte) []byte {
		if int64(seq) == bad.Load() {
			if replayed {
				garbledReplayed.Add(1)
			} else {
				garbledLive.Add(1)
			}
			return garbled
		}
		return payload
	}
	require.NoError(t, s.Start(t.Context()))
	t.Cleanup(func() { _ = s.Close() })

	n := publishUntil(t, p, 21, func() bool { return h.batches() > 0 })
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	before := len(h.snapshot())
	// A batch lost in ZMQ's slow-joiner window may have counted as a gap.
	gapsBefore := counterValue(t, m.Gaps.WithLabelValues("r1"))
	badSeq := n + 2
	bad.Store(int64(badSeq))
	for range 6 {
		_, err := p.Publish(batchFor(n, 21))
		require.NoError(t, err)
		n++
	}
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	recs := h.snapshot()[before:]
	requireContiguous(t, recs[:2], badSeq-2, badSeq, 21)
	require.Equal(t, ResetMalformed, recs[2].reset, "records %v", recs)
	requireContiguous(t, recs[3:], badSeq+1, n, 21)
	// The live copy fails, its replayed copy fails too: both are counted.
	require.Equal(t, int64(1), garbledLive.Load())
	require.Equal(t, int64(1), garbledReplayed.Load())
	require.Equal(t, 2.0, counterValue(t, m.Malformed.WithLabelValues("r1")))
	require.Equal(t, 1.0, counterValue(t, m.Resets.WithLabelValues("r1", "malformed")))
	require.Equal(t, gapsBefore, counterValue(t, m.Gaps.WithLabelValues("r1")), "a malformed batch is not a gap")
}
