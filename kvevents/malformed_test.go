package kvevents

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

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
	s, err := NewSubscriber(testSubscriberConfig(p.Addr(), p.ReplayAddr()), h, m, nil)
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
	bad.Store(int64(n + 2))
	for range 6 {
		_, err := p.Publish(batchFor(n, 20))
		require.NoError(t, err)
		n++
	}
	require.Eventually(t, func() bool { s, _ := h.lastBatchSeq(); return s == n-1 }, 5*time.Second, 5*time.Millisecond)
	requireContiguous(t, h.snapshot(), 0, n, 20)
	require.Equal(t, 1.0, counterValue(t, m.Malformed.WithLabelValues("r1")))
	require.Zero(t, counterValue(t, m.Resets.WithLabelValues("r1", "malformed")))
	require.GreaterOrEqual(t, counterValue(t, m.Replays.WithLabelValues("r1", "complete")), 1.0)
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
	s, err := NewSubscriber(testSubscriberConfig(p.Addr(), p.ReplayAddr()), h, m, nil)
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
	require.Eventually(t, func() bool { s, _ := h.lastBatchSeq(); return s == n-1 }, 5*time.Second, 5*time.Millisecond)
	before := len(h.snapshot())
	badSeq := n + 2
	bad.Store(int64(badSeq))
	for range 6 {
		_, err := p.Publish(batchFor(n, 21))
		require.NoError(t, err)
		n++
	}
	require.Eventually(t, func() bool { s, _ := h.lastBatchSeq(); return s == n-1 }, 5*time.Second, 5*time.Millisecond)
	recs := h.snapshot()[before:]
	requireContiguous(t, recs[:2], badSeq-2, badSeq, 21)
	require.Equal(t, ResetMalformed, recs[2].reset, "records %v", recs)
	requireContiguous(t, recs[3:], badSeq+1, n, 21)
	// Normally the live copy fails, its replayed copy fails too, and both
	// are counted (2). On a loaded machine a replay the writer started for
	// another reason can deliver the replayed copy first; the live copy
	// then arrives as a duplicate and is dropped as one, uncounted (CI saw
	// 1). Either way a replayed copy failed before the reset, and no copy
	// is counted twice.
	require.Positive(t, garbledReplayed.Load(), "a replayed copy was tried before the reset")
	malformed := counterValue(t, m.Malformed.WithLabelValues("r1"))
	require.GreaterOrEqual(t, malformed, float64(garbledReplayed.Load()), "every replayed copy counted")
	require.LessOrEqual(t, malformed, float64(garbledLive.Load()+garbledReplayed.Load()), "no copy counted twice")
	require.Equal(t, 1.0, counterValue(t, m.Resets.WithLabelValues("r1", "malformed")))
	require.Zero(t, counterValue(t, m.Gaps.WithLabelValues("r1")))
}
