package kvevents

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// counterValue reads one counter (prometheus' testutil would need a module
// this repository does not carry).
func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	require.NoError(t, c.Write(&m))
	return m.GetCounter().GetValue()
}

// testLogger logs to stderr at debug level when KVEVENTS_TEST_LOG is set.
func testLogger() *slog.Logger {
	if os.Getenv("KVEVENTS_TEST_LOG") == "" {
		return nil
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func TestMain(m *testing.M) {
	// zmq4 v0.17.0's PUB Close never stops the socket's queue-writer
	// goroutine (pubSocket.Close does not close its pubMWriter): one parked
	// goroutine per PUB socket ever created, not ours to stop.
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// record is one Handler call.
type record struct {
	seq    Seq
	reset  ResetReason // 0 for a batch
	hash   EngineHash  // first block hash of the first event
	events int
}

// recorder is a Handler that keeps every call. block, when set, is received
// from before each HandleBatch returns, to simulate a slow consumer.
type recorder struct {
	mu    sync.Mutex
	recs  []record
	block chan struct{}
}

func (r *recorder) HandleBatch(replica string, seq Seq, b *Batch) {
	r.mu.Lock()
	block := r.block
	r.mu.Unlock()
	if block != nil {
		<-block
	}
	rec := record{seq: seq, events: len(b.Events)}
	if len(b.Events) > 0 && b.Events[0].Stored != nil && len(b.Events[0].Stored.BlockHashes) > 0 {
		rec.hash = b.Events[0].Stored.BlockHashes[0]
	}
	r.mu.Lock()
	r.recs = append(r.recs, rec)
	r.mu.Unlock()
}

func (r *recorder) HandleReset(replica string, reason ResetReason) {
	r.mu.Lock()
	r.recs = append(r.recs, record{reset: reason})
	r.mu.Unlock()
}

func (r *recorder) snapshot() []record {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]record(nil), r.recs...)
}

func (r *recorder) batches() int {
	n := 0
	for _, rec := range r.snapshot() {
		if rec.reset == 0 {
			n++
		}
	}
	return n
}

func (r *recorder) lastBatchSeq() (Seq, bool) {
	recs := r.snapshot()
	for i := len(recs) - 1; i >= 0; i-- {
		if recs[i].reset == 0 {
			return recs[i].seq, true
		}
	}
	return 0, false
}

// hashFor gives each published batch a hash derived from its seq so the
// test can check delivered content against what was published.
func hashFor(seq Seq, gen int) EngineHash { return EngineHash(uint64(gen)<<32 | uint64(seq) + 1) }

func batchFor(seq Seq, gen int) Batch {
	return Batch{TS: float64(seq), Events: []Event{{Kind: KindBlockStored, Stored: &BlockStored{
		BlockHashes: []EngineHash{hashFor(seq, gen)}, TokenIDs: seqTokens(int(seq), 4), BlockSize: 4, Medium: "GPU",
	}}}}
}

func testPublisherConfig() PublisherConfig {
	cfg := DefaultPublisherConfig()
	cfg.Endpoint = "tcp://127.0.0.1:0"
	cfg.AlwaysBind = true
	cfg.ReplayEndpoint = "tcp://127.0.0.1:0"
	cfg.BufferSteps = 1000
	cfg.RedialInterval = 50 * time.Millisecond
	return cfg
}

func newPublisher(t *testing.T, cfg PublisherConfig) *Publisher {
	t.Helper()
	p, err := NewPublisher(cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func testSubscriberConfig(endpoint, replay string) SubscriberConfig {
	cfg := DefaultSubscriberConfig()
	cfg.Replica = "r1"
	cfg.Endpoint = endpoint
	cfg.ReplayEndpoint = replay
	cfg.ReconnectMin = 10 * time.Millisecond
	cfg.ReconnectMax = 100 * time.Millisecond
	return cfg
}

func startSubscriber(t *testing.T, cfg SubscriberConfig, h Handler, m *Metrics, hook func(Seq) bool) *Subscriber {
	t.Helper()
	s, err := NewSubscriber(cfg, h, m, testLogger())
	require.NoError(t, err)
	seen := new(atomic.Int64)
	liveSeen.Store(s, seen)
	s.dropLive = func(q Seq) bool {
		seen.Add(1)
		return hook != nil && hook(q)
	}
	require.NoError(t, s.Start(context.Background()))
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// liveSeen maps a Subscriber started by startSubscriber to the number of
// live messages its reader received (delivered or not).
var liveSeen sync.Map

// liveReceived reports whether s has received a live message: proof that
// its subscription reached the publisher, which a batch delivered through
// a catch-up replay is not.
func liveReceived(s *Subscriber) bool {
	v, ok := liveSeen.Load(s)
	return ok && v.(*atomic.Int64).Load() > 0
}

// publishUntil publishes one batch every few ms until cond holds or the
// deadline passes, and returns how many it published. It absorbs the ZMQ
// slow-joiner window: messages sent before the SUB's subscription arrives
// are lost.
func publishUntil(t *testing.T, p *Publisher, gen int, cond func() bool) Seq {
	t.Helper()
	var n Seq
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		require.True(t, time.Now().Before(deadline), "condition not reached after %d batches", n)
		seq, err := p.Publish(batchFor(n, gen))
		require.NoError(t, err)
		require.Equal(t, n, seq)
		n++
		// Pace the loop on a condition with a timeout rather than sleeping
		// blindly: wait up to 10ms for cond.
		waitFor(10*time.Millisecond, cond)
	}
	return n
}

// sendRawUntil encodes b and sends it as seq from a raw PUB socket every
// 10 ms until cond holds (ZMQ's slow joiner loses what is sent before the
// subscription arrives); the test fails if cond does not hold within wait.
func sendRawUntil(t *testing.T, pub zmq4.Socket, seq Seq, b Batch, wait time.Duration, cond func() bool, msgAndArgs ...any) {
	t.Helper()
	payload, err := Encode(&b, EncodingMap)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		require.NoError(t, pub.SendMulti(zmq4.NewMsgFrom([]byte{}, seqBytes(seq), payload)))
		return cond()
	}, wait, 10*time.Millisecond, msgAndArgs...)
}

func waitFor(d time.Duration, cond func() bool) {
	deadline := time.Now().Add(d)
	for !cond() && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
}

// requireContiguous checks that the batches recorded after the last reset
// run from..to-1 exactly once, in order, with the published content.
func requireContiguous(t *testing.T, recs []record, from, to Seq, gen int) {
	t.Helper()
	want := from
	for _, r := range recs {
		require.Zero(t, r.reset, "unexpected reset in %v", recs)
		require.Equal(t, want, r.seq, "records %v", recs)
		require.Equal(t, hashFor(r.seq, gen), r.hash)
		want++
	}
	require.Equal(t, to, want)
}

func TestLiveDeliveryInOrderAllEncodings(t *testing.T) {
	for _, form := range []Encoding{EncodingMap, EncodingArray, EncodingMapEnvelope} {
		t.Run(form.String(), func(t *testing.T) {
			pcfg := testPublisherConfig()
			pcfg.Encoding = form
			p := newPublisher(t, pcfg)
			h := &recorder{}
			m := NewMetrics()
			startSubscriber(t, testSubscriberConfig(p.Addr(), p.ReplayAddr()), h, m, nil)

			n := publishUntil(t, p, 1, func() bool { return h.batches() > 0 })
			for range 100 {
				seq, err := p.Publish(batchFor(n, 1))
				require.NoError(t, err)
				require.Equal(t, n, seq)
				n++
			}
			require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 },
				5*time.Second, 5*time.Millisecond)
			// Batches lost to the slow-joiner window were replayed from 0.
			requireContiguous(t, h.snapshot(), 0, n, 1)
			require.Equal(t, float64(n), counterValue(t, m.Batches.WithLabelValues("r1")))
			require.Equal(t, float64(n), counterValue(t, m.Events.WithLabelValues("r1", "BlockStored")))
			require.Zero(t, counterValue(t, m.Resets.WithLabelValues("r1", "gap_unrecoverable")))
		})
	}
}

func TestPublisherConnectsToBoundSubscriber(t *testing.T) {
	h := &recorder{}
	scfg := testSubscriberConfig("tcp://127.0.0.1:0", "")
	scfg.Bind = true
	// The replay ROUTER always binds on the publisher side; learn its
	// address first by creating the publisher after the SUB listens.
	sub, err := NewSubscriber(scfg, h, nil, nil)
	require.NoError(t, err)
	require.NoError(t, sub.Start(context.Background()))
	t.Cleanup(func() { _ = sub.Close() })
	require.NotEqual(t, "tcp://127.0.0.1:0", sub.Addr())

	pcfg := testPublisherConfig()
	pcfg.Endpoint = sub.Addr() // no wildcard: the PUB connects
	pcfg.AlwaysBind = false
	p := newPublisher(t, pcfg)
	require.Equal(t, sub.Addr(), p.Addr())

	n := publishUntil(t, p, 2, func() bool { return h.batches() > 0 })
	// Batches published before the PUB's connection was up are lost (no
	// replay here); delivery runs contiguously from the first one that
	// arrived. Not the last seen when publishUntil returned: batches it
	// published in the meantime may still be arriving.
	first := h.snapshot()[0].seq
	for range 50 {
		_, err := p.Publish(batchFor(n, 2))
		require.NoError(t, err)
		n++
	}
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 },
		5*time.Second, 5*time.Millisecond)
	requireContiguous(t, h.snapshot(), first, n, 2)
}

// TestConnectingPublisherRedials: the consumer that a connecting PUB
// dials restarts on the same address; the publisher notices and redials, and
// the new consumer catches up through replay.
func TestConnectingPublisherRedials(t *testing.T) {
	h1 := &recorder{}
	scfg := testSubscriberConfig("tcp://127.0.0.1:0", "")
	scfg.Bind = true
	s1, err := NewSubscriber(scfg, h1, nil, nil)
	require.NoError(t, err)
	require.NoError(t, s1.Start(context.Background()))
	t.Cleanup(func() { _ = s1.Close() })

	pcfg := testPublisherConfig()
	pcfg.Endpoint, pcfg.AlwaysBind = s1.Addr(), false
	p := newPublisher(t, pcfg)
	n := publishUntil(t, p, 12, func() bool { return h1.batches() > 0 })
	require.NoError(t, s1.Close())

	h2 := &recorder{}
	scfg.Endpoint, scfg.ReplayEndpoint = s1.Addr(), p.ReplayAddr()
	var s2 *Subscriber
	require.Eventually(t, func() bool {
		s, err := NewSubscriber(scfg, h2, nil, nil)
		require.NoError(t, err)
		if s.Start(context.Background()) != nil {
			return false
		}
		s2 = s
		return true
	}, 5*time.Second, 10*time.Millisecond, "rebinding the consumer's address")
	t.Cleanup(func() { _ = s2.Close() })
	// The restarted consumer may catch up through replay before the
	// publisher's redial reaches it; either way it ends with every seq.
	deadline := time.Now().Add(10 * time.Second)
	for h2.batches() == 0 {
		require.True(t, time.Now().Before(deadline), "publisher never reached the restarted consumer")
		seq, err := p.Publish(batchFor(0, 12))
		require.NoError(t, err)
		n = seq + 1
		waitFor(10*time.Millisecond, func() bool { return h2.batches() > 0 })
	}
	require.Eventually(t, func() bool { s, ok := h2.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	// Everything from seq 0 arrived, the early part through replay.
	want := Seq(0)
	for _, r := range h2.snapshot() {
		require.Zero(t, r.reset)
		require.Equal(t, want, r.seq)
		want++
	}
	require.Equal(t, n, want)
}

func TestGapReplayedBothReplyForms(t *testing.T) {
	for _, form := range []ReplayForm{ReplayWithTopic, ReplayNoTopic} {
		t.Run(form.String(), func(t *testing.T) {
			pcfg := testPublisherConfig()
			pcfg.ReplayForm = form
			pcfg.Topic = "kv@r1"
			p := newPublisher(t, pcfg)
			h := &recorder{}
			m := NewMetrics()
			var dropFrom, dropTo atomic.Int64
			dropFrom.Store(-1)
			scfg := testSubscriberConfig(p.Addr(), p.ReplayAddr())
			scfg.Topic = "kv@"
			sub := startSubscriber(t, scfg, h, m, func(s Seq) bool {
				return int64(s) >= dropFrom.Load() && int64(s) < dropTo.Load()
			})
			n := publishUntil(t, p, 3, func() bool { return liveReceived(sub) })
			require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
			// A batch lost in ZMQ's slow-joiner window may already have
			// counted as a gap (and been replayed): count the one made here.
			gapsBefore := counterValue(t, m.Gaps.WithLabelValues("r1"))
			replayedBefore := counterValue(t, m.Replayed.WithLabelValues("r1"))
			dropFrom.Store(int64(n + 3))
			dropTo.Store(int64(n + 13))
			for range 30 {
				_, err := p.Publish(batchFor(n, 3))
				require.NoError(t, err)
				n++
			}
			require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
			requireContiguous(t, h.snapshot(), 0, n, 3)
			require.Equal(t, gapsBefore+1, counterValue(t, m.Gaps.WithLabelValues("r1")))
			// A replay is counted when it ends, after its batches.
			require.Eventually(t, func() bool { return counterValue(t, m.Replays.WithLabelValues("r1", "complete")) >= 1 },
				5*time.Second, 5*time.Millisecond)
			require.Equal(t, replayedBefore+10, counterValue(t, m.Replayed.WithLabelValues("r1")), "the ten lost batches came from the replay")
		})
	}
}

func TestGapWithoutReplayResets(t *testing.T) {
	p := newPublisher(t, testPublisherConfig())
	h := &recorder{}
	m := NewMetrics()
	var dropFrom, dropTo atomic.Int64
	dropFrom.Store(-1)
	startSubscriber(t, testSubscriberConfig(p.Addr(), ""), h, m, func(s Seq) bool {
		return int64(s) >= dropFrom.Load() && int64(s) < dropTo.Load()
	})
	n := publishUntil(t, p, 4, func() bool { return h.batches() > 0 })
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	before := len(h.snapshot())
	dropFrom.Store(int64(n + 2))
	dropTo.Store(int64(n + 5))
	for range 10 {
		_, err := p.Publish(batchFor(n, 4))
		require.NoError(t, err)
		n++
	}
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	recs := h.snapshot()[before:]
	gapAt := Seq(dropFrom.Load())
	requireContiguous(t, recs[:2], gapAt-2, gapAt, 4)
	require.Equal(t, ResetGapUnrecoverable, recs[2].reset)
	requireContiguous(t, recs[3:], Seq(dropTo.Load()), n, 4)
	require.Equal(t, 1.0, counterValue(t, m.Resets.WithLabelValues("r1", "gap_unrecoverable")))
}

func TestGapBeyondReplayBufferResets(t *testing.T) {
	pcfg := testPublisherConfig()
	pcfg.BufferSteps = 4
	p := newPublisher(t, pcfg)
	h := &recorder{}
	m := NewMetrics()
	var dropFrom, dropTo atomic.Int64
	dropFrom.Store(-1)
	scfg := testSubscriberConfig(p.Addr(), p.ReplayAddr())
	scfg.JoinReplay = false
	startSubscriber(t, scfg, h, m, func(s Seq) bool {
		return int64(s) >= dropFrom.Load() && int64(s) < dropTo.Load()
	})
	n := publishUntil(t, p, 5, func() bool { return h.batches() > 0 })
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	before := len(h.snapshot())
	gapAt := n
	dropFrom.Store(int64(gapAt))
	dropTo.Store(int64(gapAt + 10))
	for range 11 {
		_, err := p.Publish(batchFor(n, 5))
		require.NoError(t, err)
		n++
	}
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	recs := h.snapshot()[before:]
	// The ring holds gapAt+7..gapAt+10 when the replay is served: the
	// subscriber resets, then takes what the buffer still had.
	require.Equal(t, ResetGapUnrecoverable, recs[0].reset, "records %v", recs)
	requireContiguous(t, recs[1:], recs[1].seq, n, 5)
	require.Greater(t, recs[1].seq, gapAt)
	require.Eventually(t, func() bool { return counterValue(t, m.Replays.WithLabelValues("r1", "partial")) == 1 },
		5*time.Second, 5*time.Millisecond, "a replay is counted when it ends, after its batches")
}

func TestRewindAfterPublisherRestart(t *testing.T) {
	p1 := newPublisher(t, testPublisherConfig())
	h := &recorder{}
	m := NewMetrics()
	startSubscriber(t, testSubscriberConfig(p1.Addr(), p1.ReplayAddr()), h, m, nil)
	n := publishUntil(t, p1, 6, func() bool { return h.batches() > 0 })
	for n < 100 {
		_, err := p1.Publish(batchFor(n, 6))
		require.NoError(t, err)
		n++
	}
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	requireContiguous(t, h.snapshot(), 0, n, 6)
	before := len(h.snapshot())
	require.NoError(t, p1.Close())

	// The engine restarts on the same addresses, from seq 0.
	cfg2 := testPublisherConfig()
	cfg2.Endpoint, cfg2.ReplayEndpoint = p1.Addr(), p1.ReplayAddr()
	var p2 *Publisher
	require.Eventually(t, func() bool {
		var err error
		p2, err = NewPublisher(cfg2, nil)
		return err == nil
	}, 5*time.Second, 10*time.Millisecond)
	t.Cleanup(func() { _ = p2.Close() })
	n2 := publishUntil(t, p2, 7, func() bool {
		recs := h.snapshot()
		return len(recs) > before+1
	})
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n2-1 }, 5*time.Second, 5*time.Millisecond)
	recs := h.snapshot()[before:]
	require.Equal(t, ResetRewind, recs[0].reset, "records %v", recs)
	// The new engine's stream from 0, joined through replay.
	requireContiguous(t, recs[1:], 0, n2, 7)
	require.GreaterOrEqual(t, counterValue(t, m.Reconnects.WithLabelValues("r1")), 2.0)
}

func TestOverflowResets(t *testing.T) {
	p := newPublisher(t, testPublisherConfig())
	gate := make(chan struct{})
	h := &recorder{}
	m := NewMetrics()
	scfg := testSubscriberConfig(p.Addr(), "")
	scfg.QueueSize = 2
	startSubscriber(t, scfg, h, m, nil)
	n := publishUntil(t, p, 8, func() bool { return h.batches() > 0 })
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 }, 5*time.Second, 5*time.Millisecond)
	before := len(h.snapshot())

	h.mu.Lock()
	h.block = gate
	h.mu.Unlock()
	// One batch is held in the Handler, two queue, the rest are dropped.
	for range 20 {
		_, err := p.Publish(batchFor(n, 8))
		require.NoError(t, err)
		n++
	}
	waitFor(5*time.Second, func() bool { return counterValue(t, m.Dropped.WithLabelValues("r1")) >= 17 })
	require.GreaterOrEqual(t, counterValue(t, m.Dropped.WithLabelValues("r1")), 17.0, "reconnects %v batches %v malformed %v",
		counterValue(t, m.Reconnects.WithLabelValues("r1")), counterValue(t, m.Batches.WithLabelValues("r1")),
		counterValue(t, m.Malformed.WithLabelValues("r1")))
	close(gate)
	// Publish until one gets through: the first ones may still find the
	// queue full while the writer drains it.
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err := p.Publish(batchFor(n, 8))
		require.NoError(t, err)
		n++
		waitFor(20*time.Millisecond, func() bool { s, ok := h.lastBatchSeq(); return ok && s == n-1 })
		if s, _ := h.lastBatchSeq(); s == n-1 {
			break
		}
		require.True(t, time.Now().Before(deadline), "no batch delivered after the queue drained")
	}
	recs := h.snapshot()[before:]
	resetAt := -1
	for i, r := range recs {
		if r.reset != 0 {
			require.Equal(t, ResetOverflow, r.reset)
			require.Equal(t, -1, resetAt, "one reset only: %v", recs)
			resetAt = i
		}
	}
	require.Positive(t, resetAt, "records %v", recs)
	require.Equal(t, n-1, recs[len(recs)-1].seq)
	require.Equal(t, 1.0, counterValue(t, m.Resets.WithLabelValues("r1", "overflow")))
}

// TestSequenceRulesRawPub drives a Subscriber from a raw zmq4 PUB so every
// sequence number, duplicate and bad payload is chosen by the test.
func TestSequenceRulesRawPub(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub := zmq4.NewPub(ctx)
	defer pub.Close()
	require.NoError(t, pub.Listen("tcp://127.0.0.1:0"))
	h := &recorder{}
	m := NewMetrics()
	startSubscriber(t, testSubscriberConfig("tcp://"+pub.Addr().String(), ""), h, m, nil)

	send := func(seq Seq, payload []byte) {
		require.NoError(t, pub.SendMulti(zmq4.NewMsgFrom([]byte("t"), seqBytes(seq), payload)))
	}
	good := func(seq Seq) []byte {
		b := batchFor(seq, 9)
		p, err := Encode(&b, EncodingMap)
		require.NoError(t, err)
		return p
	}
	// Slow joiner: repeat seq 5 until it arrives; repeats are duplicates.
	require.Eventually(t, func() bool { send(5, good(5)); return h.batches() > 0 }, 5*time.Second, 10*time.Millisecond)
	send(6, good(6))
	send(6, good(6))                                       // duplicate
	send(7, []byte{0x92, 0xcb})                            // truncated, no replay: lost, reset, seq consumed
	send(8, mp{}.arr(2).f64(1).arr(1).arr(1).str("Nope"))  // no known events: nothing lost
	send(9, good(9))                                       // no gap: 7 and 8 were accounted
	send(3, good(3))                                       // rewind
	pub.SendMulti(zmq4.NewMsgFrom([]byte("t"), []byte{1})) //nolint:errcheck // bad seq frame
	send(4, good(4))
	require.Eventually(t, func() bool { s, ok := h.lastBatchSeq(); return ok && s == 4 }, 5*time.Second, 5*time.Millisecond)

	var got []string
	for _, r := range h.snapshot() {
		if r.reset != 0 {
			got = append(got, r.reset.String())
		} else {
			got = append(got, fmt.Sprint(r.seq))
		}
	}
	require.Equal(t, []string{"5", "6", "malformed", "9", "rewind", "3", "4"}, got)
	require.GreaterOrEqual(t, counterValue(t, m.Duplicates.WithLabelValues("r1")), 1.0)
	require.Equal(t, 2.0, counterValue(t, m.Malformed.WithLabelValues("r1")))
	require.Equal(t, 1.0, counterValue(t, m.NoEventBatches.WithLabelValues("r1")))
	require.Equal(t, 1.0, counterValue(t, m.Resets.WithLabelValues("r1", "malformed")))
	require.Equal(t, 1.0, counterValue(t, m.IgnoredEvents.WithLabelValues("r1")))
	require.Zero(t, counterValue(t, m.Gaps.WithLabelValues("r1")))
}

// TestRewindToSameSeqOnNewConnection: an engine that restarts after
// publishing only seq 0 publishes seq 0 again; on a new connection that is a
// restart, not a duplicate.
func TestRewindToSameSeqOnNewConnection(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub1 := zmq4.NewPub(ctx)
	require.NoError(t, pub1.Listen("tcp://127.0.0.1:0"))
	addr := "tcp://" + pub1.Addr().String()
	h := &recorder{}
	startSubscriber(t, testSubscriberConfig(addr, ""), h, nil, nil)
	b := batchFor(0, 13)
	sendRawUntil(t, pub1, 0, b, 5*time.Second, func() bool { return h.batches() > 0 })
	require.NoError(t, pub1.Close())

	pub2 := zmq4.NewPub(ctx)
	defer pub2.Close()
	require.Eventually(t, func() bool { return pub2.Listen(addr) == nil }, 5*time.Second, 10*time.Millisecond)
	sendRawUntil(t, pub2, 0, b, 5*time.Second, func() bool { return h.batches() > 1 })
	recs := h.snapshot()
	require.Equal(t, []record{{seq: 0, hash: hashFor(0, 13), events: 1}, {reset: ResetRewind}, {seq: 0, hash: hashFor(0, 13), events: 1}}, recs[:3])
}

// TestReplayRouterFrames talks to the Publisher's ROUTER with a raw DEALER
// and checks the exact frames of both reply forms.
func TestReplayRouterFrames(t *testing.T) {
	for _, form := range []ReplayForm{ReplayWithTopic, ReplayNoTopic} {
		t.Run(form.String(), func(t *testing.T) {
			pcfg := testPublisherConfig()
			pcfg.ReplayForm = form
			pcfg.Topic = "kv"
			p := newPublisher(t, pcfg)
			var payloads [][]byte
			for i := range Seq(4) {
				b := batchFor(i, 10)
				seq, err := p.Publish(b)
				require.NoError(t, err)
				require.Equal(t, i, seq)
				enc, err := Encode(&b, EncodingMap)
				require.NoError(t, err)
				payloads = append(payloads, enc)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			d := zmq4.NewDealer(ctx)
			defer d.Close()
			require.NoError(t, d.Dial(p.ReplayAddr()))
			start := make([]byte, 8)
			binary.BigEndian.PutUint64(start, 2)
			require.NoError(t, d.SendMulti(zmq4.NewMsgFrom([]byte{}, start)))
			for _, want := range []Seq{2, 3, ReplayEnd} {
				msg, err := d.Recv()
				require.NoError(t, err)
				var wantFrames [][]byte
				payload := []byte{}
				if want != ReplayEnd {
					payload = payloads[want]
				}
				if form == ReplayWithTopic {
					wantFrames = [][]byte{{}, []byte("kv"), seqBytes(want), payload}
				} else {
					wantFrames = [][]byte{{}, seqBytes(want), payload}
				}
				require.Equal(t, wantFrames, msg.Frames)
			}
		})
	}
}

func TestPublisherLifecycle(t *testing.T) {
	p := newPublisher(t, testPublisherConfig())
	require.NoError(t, p.Close())
	require.NoError(t, p.Close())
	_, err := p.Publish(batchFor(0, 0))
	require.ErrorIs(t, err, ErrClosed)

	bad := DefaultPublisherConfig()
	bad.Endpoint = "nowhere"
	_, err = NewPublisher(bad, nil)
	require.ErrorIs(t, err, ErrBadConfig)
	bad = DefaultPublisherConfig()
	bad.ReplayEndpoint, bad.BufferSteps = "tcp://*:0", 0
	require.ErrorIs(t, bad.Validate(), ErrBadConfig)
	require.NoError(t, DefaultPublisherConfig().Validate())
}

func TestSubscriberLifecycle(t *testing.T) {
	h := &recorder{}
	_, err := NewSubscriber(DefaultSubscriberConfig(), h, nil, nil)
	require.ErrorIs(t, err, ErrBadConfig)
	// Nothing listens there: the reader keeps redialling with backoff until
	// Close, which must still return promptly.
	s, err := NewSubscriber(testSubscriberConfig("tcp://127.0.0.1:1", ""), h, nil, nil)
	require.NoError(t, err)
	require.NoError(t, s.Start(context.Background()))
	require.NoError(t, s.Start(context.Background()))
	require.NoError(t, s.Close())
	require.NoError(t, s.Close())
	require.ErrorIs(t, s.Start(context.Background()), ErrClosed)

	// Closing before Start is fine too.
	s2, err := NewSubscriber(testSubscriberConfig("tcp://127.0.0.1:1", ""), h, nil, nil)
	require.NoError(t, err)
	require.NoError(t, s2.Close())
}

func TestParseReplayReply(t *testing.T) {
	seq := seqBytes(7)
	for name, frames := range map[string][][]byte{
		"v0.25 with delimiter":    {{}, seq, []byte("p")},
		"v0.26 with delimiter":    {{}, []byte("topic"), seq, []byte("p")},
		"v0.26 empty topic":       {{}, {}, seq, []byte("p")},
		"undelimited no topic":    {seq, []byte("p")},
		"undelimited with topic":  {[]byte("topic"), seq, []byte("p")},
		"undelimited empty topic": {{}, seq, []byte("p")},
	} {
		got, payload, ok := parseReplayReply(frames)
		require.True(t, ok, name)
		require.Equal(t, Seq(7), got, name)
		require.Equal(t, []byte("p"), payload, name)
	}
	_, _, ok := parseReplayReply([][]byte{{}, []byte("short"), []byte("p")})
	require.False(t, ok)
	_, _, ok = parseReplayReply([][]byte{seq})
	require.False(t, ok)
}

// TestConnectingPublisherKeepsOneConnection: a consumer whose subscription
// is slow to reach a connecting PUB (a loaded gateway) looks like a lost
// one, and the publisher redials. Redialling on the same socket kept the
// first connection too, so once the subscription arrived the consumer got
// every batch once per dial, interleaved: seqs that go backwards, which a
// Subscriber must take for an engine restart (a rewind reset that dropped
// the replica's whole view; seen in node's TestKVEventsSaltAndMedium under
// load). Each redial now starts from a fresh socket.
func TestConnectingPublisherKeepsOneConnection(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sub := zmq4.NewSub(ctx, zmq4.WithLogger(discardStdLogger))
	defer func() { _ = sub.Close() }()
	require.NoError(t, sub.Listen("tcp://127.0.0.1:0"))

	pcfg := testPublisherConfig()
	pcfg.Endpoint, pcfg.AlwaysBind, pcfg.ReplayEndpoint = sockAddr(sub, "tcp://127.0.0.1:0"), false, ""
	pcfg.RedialInterval = 10 * time.Millisecond
	p := newPublisher(t, pcfg)
	// Not subscribed yet: the publisher sees no consumer and redials.
	require.Eventually(t, func() bool { return p.redials.Load() >= 3 }, 10*time.Second, time.Millisecond)
	// zmq4 sends the subscription to every connection it holds and reports
	// the first that fails: one of a replaced socket, closed meanwhile.
	// The live one gets it, or a redial's handshake does.
	_ = sub.SetOption(zmq4.OptionSubscribe, pcfg.Topic)

	var mu sync.Mutex
	var got []Seq
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			msg, err := sub.Recv()
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				continue // a connection of a replaced socket closing
			}
			mu.Lock()
			got = append(got, Seq(binary.BigEndian.Uint64(msg.Frames[1])))
			mu.Unlock()
		}
	}()
	received := func() int { mu.Lock(); defer mu.Unlock(); return len(got) }
	n := publishUntil(t, p, 3, func() bool { return received() > 0 })
	for range 30 {
		_, err := p.Publish(batchFor(n, 3))
		require.NoError(t, err)
		n++
	}
	// Copies over a second connection arrive interleaved with the
	// originals, as before the change they did.
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return got[len(got)-1] == n-1
	}, 5*time.Second, time.Millisecond)
	cancel()
	_ = sub.Close()
	<-done
	for i := 1; i < len(got); i++ {
		require.Equal(t, got[i-1]+1, got[i], "batch %d of %d: every seq once, in order (%v)", i, len(got), got)
	}
}
