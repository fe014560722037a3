package kvevents

import (
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/internal/freeport"
)

// publishN publishes seqs 0..n-1 (batchFor: clock = seq) and returns n.
func publishN(t *testing.T, p *Publisher, n Seq, gen int) Seq {
	t.Helper()
	for i := range n {
		seq, err := p.Publish(batchFor(i, gen))
		require.NoError(t, err)
		require.Equal(t, i, seq)
	}
	return n
}

// startResumed starts a subscriber on p's sockets resumed at rp.
func startResumed(t *testing.T, p *Publisher, rp ResumePoint, m *Metrics) (*Subscriber, *recorder) {
	t.Helper()
	cfg := testSubscriberConfig(p.Addr(), p.ReplayAddr())
	cfg.Resume = &rp
	h := &recorder{}
	return startSubscriber(t, cfg, h, m, nil), h
}

// requireResetThen waits until the last delivered seq is to-1, then checks
// that the records are one reset r and then from..to-1 of generation gen.
func requireResetThen(t *testing.T, h *recorder, r ResetReason, from, to Seq, gen int) {
	t.Helper()
	require.Eventually(t, func() bool { q, ok := h.lastBatchSeq(); return ok && q == to-1 }, 5*time.Second, 5*time.Millisecond,
		"records %v", h.snapshot())
	recs := h.snapshot()
	require.Equal(t, record{reset: r}, recs[0], "records %v", recs)
	requireContiguous(t, recs[1:], from, to, gen)
}

// TestResumeDeliversOnlyWhatFollows: a subscriber resumed after seq 5 (the
// view a gateway took over already holds 0..5) is handed 6..9 from the
// engine's buffer, not 0..9, and then the live stream without a reset.
func TestResumeDeliversOnlyWhatFollows(t *testing.T) {
	p := newPublisher(t, testPublisherConfig())
	n := publishN(t, p, 10, 40)
	m := NewMetrics()
	s, h := startResumed(t, p, ResumePoint{Seq: 5, EngineTS: 5}, m)
	require.Eventually(t, func() bool { return h.batches() == 4 }, 5*time.Second, 5*time.Millisecond,
		"records %v", h.snapshot())
	requireContiguous(t, h.snapshot(), 6, 10, 40)
	require.Equal(t, 4.0, counterValue(t, m.Replayed.WithLabelValues("r1")), "only what follows the resumed batch is replayed")

	n = publishMoreUntil(t, p, n, 40, func() bool { return liveReceived(s) && h.batches() > 4 })
	require.Eventually(t, func() bool { q, ok := h.lastBatchSeq(); return ok && q == n-1 }, 5*time.Second, 5*time.Millisecond)
	requireContiguous(t, h.snapshot(), 6, n, 40)
	require.Zero(t, counterValue(t, m.Resets.WithLabelValues("r1", "rewind")))
}

// TestResumeRefusedWhenTheBatchDiffers: the engine holds a batch at the
// resumed seq, but with another clock: it restarted and published as many
// batches again. The view is reset and rebuilt from the buffer's start.
func TestResumeRefusedWhenTheBatchDiffers(t *testing.T) {
	p := newPublisher(t, testPublisherConfig())
	publishN(t, p, 10, 41)
	m := NewMetrics()
	_, h := startResumed(t, p, ResumePoint{Seq: 5, EngineTS: 1e9}, m) // the old engine's clock
	requireResetThen(t, h, ResetRewind, 0, 10, 41)
	require.Equal(t, 1.0, counterValue(t, m.Resets.WithLabelValues("r1", "rewind")))
}

// TestResumeRefusedWhenTheEngineIsBehind: the engine's seqs no longer
// reach the resumed one (it restarted and published fewer batches since).
// The catch-up finds nothing to check, which proves nothing alone (an
// engine's buffer may be empty); the first live batch, not above the
// resumed seq on a new connection, is the rewind (or, once the restarted
// engine reaches seq 7, a catch-up finds another clock there: whichever
// comes first), and the view is rebuilt from the engine's buffer.
func TestResumeRefusedWhenTheEngineIsBehind(t *testing.T) {
	p := newPublisher(t, testPublisherConfig())
	n := publishN(t, p, 4, 42)
	s, h := startResumed(t, p, ResumePoint{Seq: 7, EngineTS: 1e9}, nil) // the old engine's clock
	n = publishMoreUntil(t, p, n, 42, func() bool { return liveReceived(s) && h.batches() > 0 })
	requireResetThen(t, h, ResetRewind, 0, n, 42)
}

// TestResumeAcrossABufferThatMovedOn: the engine's buffer no longer holds
// the batches after the resumed one, so the view cannot be continued: a
// gap reset, then what the buffer still has, as after a long disconnect.
func TestResumeAcrossABufferThatMovedOn(t *testing.T) {
	pc := testPublisherConfig()
	pc.BufferSteps = 5
	p := newPublisher(t, pc)
	publishN(t, p, 20, 43)
	_, h := startResumed(t, p, ResumePoint{Seq: 5, EngineTS: 5}, nil)
	requireResetThen(t, h, ResetGapUnrecoverable, 15, 20, 43)
}

// TestResumedFirstLiveBatchNotAboveIsRewind: live traffic arrives before
// any catch-up could check the resumed batch (the engine's replay port does
// not answer). A new connection carries only new batches, so a first seq
// not above the resumed one means the engine restarted.
func TestResumedFirstLiveBatchNotAboveIsRewind(t *testing.T) {
	pub := zmq4.NewPub(t.Context())
	t.Cleanup(func() { _ = pub.Close() })
	require.NoError(t, pub.Listen("tcp://127.0.0.1:0"))
	dead := net.JoinHostPort("127.0.0.1", strconv.Itoa(freeport.Ports(t, 1)[0]))
	cfg := testSubscriberConfig("tcp://"+pub.Addr().String(), "tcp://"+dead)
	cfg.Resume = &ResumePoint{Seq: 5, EngineTS: 5}
	h := &recorder{}
	startSubscriber(t, cfg, h, nil, nil)
	sendRawUntil(t, pub, 2, batchFor(2, 44), 5*time.Second, func() bool { return h.batches() > 0 })
	recs := h.snapshot()
	require.Equal(t, record{reset: ResetRewind}, recs[0], "records %v", recs)
	require.Equal(t, record{seq: 2, hash: hashFor(2, 44), events: 1}, recs[1])
}

// TestRestartPastTheLastSeqIsRewind: the engine restarted and published
// more batches than before while the subscriber was away, so the first
// seq it hears on the new connection is above the last one it delivered,
// which reads like a gap. The catch-up checks the batch at the last
// delivered seq: the restarted engine's has another clock, so this is a
// rewind, and the view is rebuilt from the new engine's buffer rather than
// continued with batches of another engine.
func TestRestartPastTheLastSeqIsRewind(t *testing.T) {
	p1 := newPublisher(t, testPublisherConfig())
	h := &recorder{}
	m := NewMetrics()
	s := startSubscriber(t, testSubscriberConfig(p1.Addr(), p1.ReplayAddr()), h, m, nil)
	n := publishUntil(t, p1, 50, func() bool { return liveReceived(s) && h.batches() > 0 })
	require.Eventually(t, func() bool { q, ok := h.lastBatchSeq(); return ok && q == n-1 }, 5*time.Second, 5*time.Millisecond)
	pubAddr, replayAddr := p1.Addr(), p1.ReplayAddr()
	require.NoError(t, p1.Close())

	// The restarted engine: its replay port where the old one was, and
	// n+5 batches in its buffer (its clock: 1000 + seq) before the
	// subscriber can hear it.
	pc := testPublisherConfig()
	pc.Endpoint = "tcp://127.0.0.1:0"
	pc.ReplayEndpoint = replayAddr
	var p2 *Publisher
	require.Eventually(t, func() bool {
		var err error
		p2, err = NewPublisher(pc, nil)
		return err == nil
	}, 5*time.Second, 10*time.Millisecond, "rebinding the replay port")
	t.Cleanup(func() { _ = p2.Close() })
	restarted := func(seq Seq) Batch {
		b := batchFor(seq, 51)
		b.TS = 1000 + float64(seq)
		return b
	}
	for i := range n + 5 {
		_, err := p2.Publish(restarted(i))
		require.NoError(t, err)
	}
	// Its live stream, from the old PUB address, goes on at n+5.
	pub := zmq4.NewPub(t.Context())
	t.Cleanup(func() { _ = pub.Close() })
	require.Eventually(t, func() bool { return pub.Listen(pubAddr) == nil }, 5*time.Second, 10*time.Millisecond)
	sendRawUntil(t, pub, n+5, restarted(n+5), 10*time.Second, func() bool {
		q, ok := h.lastBatchSeq()
		return ok && q == n+5
	}, "records %v", h.snapshot())

	recs := h.snapshot()
	requireContiguous(t, recs[:n], 0, n, 50)
	require.Equal(t, record{reset: ResetRewind}, recs[n], "records %v", recs)
	requireContiguous(t, recs[n+1:], 0, n+6, 51)
	require.Equal(t, 1.0, counterValue(t, m.Resets.WithLabelValues("r1", "rewind")))
}
