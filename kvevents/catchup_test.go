package kvevents

import (
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
)

// TestLateJoinIdleEngineCatchesUp: the engine published batches before the
// subscriber connected and then went idle. No later seq will ever reveal
// the gap, so the subscriber must replay on connect; live batches after
// that continue the stream without duplicates.
func TestLateJoinIdleEngineCatchesUp(t *testing.T) {
	p := newPublisher(t, testPublisherConfig())
	const early = 5
	for i := range Seq(early) {
		seq, err := p.Publish(batchFor(i, 30))
		require.NoError(t, err)
		require.Equal(t, i, seq)
	}
	h := &recorder{}
	m := NewMetrics()
	startSubscriber(t, testSubscriberConfig(p.Addr(), p.ReplayAddr()), h, m, nil)
	require.Eventually(t, func() bool { return h.batches() == early }, 5*time.Second, 5*time.Millisecond,
		"records %v", h.snapshot())
	requireContiguous(t, h.snapshot(), 0, early, 30)
	// The counter is bumped after the last replayed batch is handled.
	require.Eventually(t, func() bool { return counterValue(t, m.Replays.WithLabelValues("r1", "complete")) == 1 },
		5*time.Second, 5*time.Millisecond)
	require.Equal(t, float64(early), counterValue(t, m.Replayed.WithLabelValues("r1")), "every batch so far came from the replay")
	require.Equal(t, float64(early), counterValue(t, m.Batches.WithLabelValues("r1")))

	// Live traffic resumes; whatever the replay and the live stream both
	// carried is delivered once.
	n := publishMoreUntil(t, p, early, 30, func() bool { return h.batches() > early })
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	requireContiguous(t, h.snapshot(), 0, n, 30)
	require.Zero(t, counterValue(t, m.Resets.WithLabelValues("r1", "rewind")))
}

// publishMoreUntil is publishUntil for a publisher that already published
// seqs below next; it returns the next seq.
func publishMoreUntil(t *testing.T, p *Publisher, next Seq, gen int, cond func() bool) Seq {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		require.True(t, time.Now().Before(deadline), "condition not reached at seq %d", next)
		seq, err := p.Publish(batchFor(next, gen))
		require.NoError(t, err)
		require.Equal(t, next, seq)
		next++
		waitFor(10*time.Millisecond, cond)
	}
	return next
}

// TestRestartAfterCatchUpOnlyIsRewind: the subscriber learned seqs 0..4
// only through the catch-up (the engine was idle), then the engine
// restarts and publishes seq 0 on the new connection: a rewind, not a
// duplicate of the replayed seq 0.
func TestRestartAfterCatchUpOnlyIsRewind(t *testing.T) {
	p := newPublisher(t, testPublisherConfig())
	for i := range Seq(5) {
		_, err := p.Publish(batchFor(i, 32))
		require.NoError(t, err)
	}
	h := &recorder{}
	m := NewMetrics()
	startSubscriber(t, testSubscriberConfig(p.Addr(), p.ReplayAddr()), h, m, nil)
	require.Eventually(t, func() bool { return h.batches() == 5 }, 5*time.Second, 5*time.Millisecond)
	addr := p.Addr()
	require.NoError(t, p.Close())

	// The restarted engine, on the same address, without replay.
	pub := zmq4.NewPub(t.Context())
	t.Cleanup(func() { _ = pub.Close() })
	require.Eventually(t, func() bool { return pub.Listen(addr) == nil }, 5*time.Second, 10*time.Millisecond)
	sendRawUntil(t, pub, 0, batchFor(0, 33), 5*time.Second, func() bool { return h.batches() > 5 })
	recs := h.snapshot()
	requireContiguous(t, recs[:5], 0, 5, 32)
	require.Equal(t, record{reset: ResetRewind}, recs[5], "records %v", recs)
	require.Equal(t, record{seq: 0, hash: hashFor(0, 33), events: 1}, recs[6])
}
