package faultproxy_test

import (
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/faultproxy"
	"github.com/kvmesh/kvmesh/kvevents"
)

// recorder keeps the sequence numbers and resets a Subscriber delivers.
type recorder struct {
	mu     sync.Mutex
	seqs   []kvevents.Seq
	resets []kvevents.ResetReason
}

func (r *recorder) HandleBatch(_ string, seq kvevents.Seq, _ *kvevents.Batch) {
	r.mu.Lock()
	r.seqs = append(r.seqs, seq)
	r.mu.Unlock()
}

func (r *recorder) HandleReset(_ string, why kvevents.ResetReason) {
	r.mu.Lock()
	r.resets = append(r.resets, why)
	r.mu.Unlock()
}

func (r *recorder) snapshot() ([]kvevents.Seq, []kvevents.ResetReason) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]kvevents.Seq(nil), r.seqs...), append([]kvevents.ResetReason(nil), r.resets...)
}

func batch(i int) kvevents.Batch {
	return kvevents.Batch{TS: float64(i), Events: []kvevents.Event{{Kind: kvevents.KindBlockRemoved,
		Removed: &kvevents.BlockRemoved{BlockHashes: []kvevents.EngineHash{kvevents.EngineHash(i)}}}}}
}

// relayRig is publisher → relay → subscriber, with replay straight to the
// publisher.
type relayRig struct {
	pub   *kvevents.Publisher
	relay *faultproxy.Relay
	rec   *recorder
	next  int
}

func newRelayRig(t *testing.T) *relayRig {
	pc := kvevents.DefaultPublisherConfig()
	pc.Endpoint, pc.AlwaysBind = "tcp://127.0.0.1:0", true
	pc.ReplayEndpoint = "tcp://127.0.0.1:0"
	pub, err := kvevents.NewPublisher(pc, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })

	rc := faultproxy.DefaultRelayConfig()
	rc.Upstream = pub.Addr()
	relay, err := faultproxy.NewRelay(rc)
	require.NoError(t, err)
	require.NoError(t, relay.Start())
	t.Cleanup(func() { require.NoError(t, relay.Close()) })

	rec := &recorder{}
	sc := kvevents.DefaultSubscriberConfig()
	sc.Replica = "r"
	sc.Endpoint = relay.Addr()
	sc.ReplayEndpoint = pub.ReplayAddr()
	// No join replay: the subscriber then delivers only what came live
	// through both hops, so the setup below returns once the relay is
	// subscribed upstream and the subscriber to the relay. With it, the
	// connect-time catch-up (straight to the publisher, retried until the
	// first live batch) could deliver the setup's batches while the relay
	// was still joining, and later fetch the test's batches from the
	// replay buffer before their faulted live copies arrived: no swap or
	// garble was then seen (flaky under load). Gap replays stay on.
	sc.JoinReplay = false
	sub, err := kvevents.NewSubscriber(sc, rec, nil, nil)
	require.NoError(t, err)
	require.NoError(t, sub.Start(t.Context()))
	t.Cleanup(func() { require.NoError(t, sub.Close()) })

	rig := &relayRig{pub: pub, relay: relay, rec: rec}
	// PUB/SUB drops what is sent before both hops are subscribed: publish
	// until something arrives.
	require.Eventually(t, func() bool {
		rig.publish(t, 1)
		s, _ := rec.snapshot()
		return len(s) > 0
	}, 10*time.Second, 10*time.Millisecond)
	return rig
}

func (r *relayRig) publish(t *testing.T, n int) {
	for range n {
		_, err := r.pub.Publish(batch(r.next))
		require.NoError(t, err)
		r.next++
	}
}

// awaitContiguous waits until the subscriber delivered every seq from its
// first one through the last published, in order, exactly once.
func (r *relayRig) awaitContiguous(t *testing.T) []kvevents.ResetReason {
	t.Helper()
	last := kvevents.Seq(r.next - 1)
	require.Eventually(t, func() bool {
		s, _ := r.rec.snapshot()
		return len(s) > 0 && s[len(s)-1] == last
	}, 10*time.Second, 5*time.Millisecond)
	s, resets := r.rec.snapshot()
	for i := 1; i < len(s); i++ {
		if len(resets) == 0 {
			require.Equal(t, s[i-1]+1, s[i], "delivery in order without holes: %v", s)
		}
	}
	return resets
}

func TestRelayForwardsAndDropsAreReplayed(t *testing.T) {
	rig := newRelayRig(t)
	// The last batch is always forwarded: a batch dropped at the end would
	// show as a gap only when a later one arrives. How many batches the
	// rig's setup published depends on the machine's speed, so the last
	// seq's residue mod 5 does too.
	last := uint64(rig.next + 60 - 1)
	rig.relay.SetFault(func(seq, _ uint64) faultproxy.Action {
		switch {
		case seq == last:
			return faultproxy.Forward
		case seq%5 == 0:
			return faultproxy.Drop
		case seq%7 == 0:
			return faultproxy.Duplicate
		}
		return faultproxy.Forward
	})
	rig.publish(t, 60)
	resets := rig.awaitContiguous(t)
	require.Empty(t, resets, "every dropped batch was replayed")
	st := rig.relay.Stats()
	require.Positive(t, st.Dropped)
	require.Positive(t, st.Duplicated)
}

func TestRelaySwapIsHeardAsARewind(t *testing.T) {
	rig := newRelayRig(t)
	first := uint64(rig.next)
	rig.relay.SetFault(func(seq, _ uint64) faultproxy.Action {
		if seq == first+3 {
			return faultproxy.Swap
		}
		return faultproxy.Forward
	})
	rig.publish(t, 10)
	resets := rig.awaitContiguous(t)
	// The subscriber sees first+4 before first+3: a gap it replays, then
	// first+3 live, below the last live seq, which is its rule for an
	// engine restart. TCP never reorders a ZMQ stream, so this costs a
	// resync, not correctness.
	require.Equal(t, []kvevents.ResetReason{kvevents.ResetRewind}, resets)
	st := rig.relay.Stats()
	require.Equal(t, uint64(1), st.Swapped)
	require.Equal(t, st.Received, st.Forwarded)
}

func TestRelayGarbledBatchIsReplayed(t *testing.T) {
	rig := newRelayRig(t)
	bad := uint64(rig.next + 4)
	rig.relay.SetFault(func(seq, _ uint64) faultproxy.Action {
		if seq == bad {
			return faultproxy.Garble
		}
		return faultproxy.Forward
	})
	rig.publish(t, 10)
	last := kvevents.Seq(rig.next - 1)
	require.Eventually(t, func() bool {
		s, _ := rig.rec.snapshot()
		return s[len(s)-1] == last
	}, 10*time.Second, 5*time.Millisecond)
	seqs, resets := rig.rec.snapshot()
	require.Empty(t, resets)
	// The subscriber replays a seq whose payload does not decode: the
	// engine's buffer holds an intact copy.
	require.Contains(t, seqs, kvevents.Seq(bad), "the garbled batch is recovered by replay")
	require.Contains(t, seqs, kvevents.Seq(bad+1))
	require.Equal(t, uint64(1), rig.relay.Stats().Garbled)
}
