package sync

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	gosync "sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

// loadV1Golden is a kind-3 load report exactly as the release before
// queued prefill encoded it: origin "g2", sentAt -1, r0 with 3 in flight,
// r1 with 0.
var loadV1Golden = []byte{'K', 'M', 1, 3, 2, 'g', '2', 0x01, 2, 2, 'r', '0', 3, 2, 'r', '1', 0}

// decodeLoadV1 is a frozen copy of the previous release's decoding of a
// load report (decodeMessage's header checks, then decodeLoad, then the
// trailing-bytes check), written out here so that a change to the live
// decoder cannot hide a break of what deployed gateways accept.
func decodeLoadV1(data []byte) (map[string]int, error) {
	errBad := errors.New("malformed")
	if len(data) < 4 || data[0] != 'K' || data[1] != 'M' || data[2] != 1 || data[3] != 3 {
		return nil, errBad
	}
	b := data[4:]
	uv := func() (uint64, bool) {
		v, n := binary.Uvarint(b)
		if n <= 0 {
			return 0, false
		}
		b = b[n:]
		return v, true
	}
	str := func() (string, bool) {
		n, ok := uv()
		if !ok || n > 255 || n > uint64(len(b)) {
			return "", false
		}
		s := string(b[:n])
		b = b[n:]
		return s, true
	}
	if _, ok := str(); !ok {
		return nil, errBad
	}
	if _, n := binary.Varint(b); n <= 0 {
		return nil, errBad
	} else {
		b = b[n:]
	}
	n, ok := uv()
	if !ok || n > 1<<16 || n*2 > uint64(len(b)) {
		return nil, errBad
	}
	out := make(map[string]int)
	for range n {
		r, ok := str()
		if !ok {
			return nil, errBad
		}
		v, ok := uv()
		if !ok || v > math.MaxInt32 {
			return nil, errBad
		}
		out[r] += int(v)
	}
	if len(b) != 0 {
		return nil, errBad
	}
	return out, nil
}

// TestLoadWireCompatible: kind 3 is byte for byte the previous release's
// format whatever the queued prefill, so old gateways keep decoding this
// release's in-flight reports; old reports decode here with no queued
// prefill; and kind 5, which an old decoder rejects, is a separate message.
func TestLoadWireCompatible(t *testing.T) {
	// Old → new.
	m, err := decodeMessage(loadV1Golden)
	require.NoError(t, err)
	require.Equal(t, kindLoad, m.Kind)
	require.Equal(t, &loadReport{Origin: "g2", SentAt: -1, Loads: []ReplicaLoad{
		{Replica: "r0", InFlight: 3}, {Replica: "r1"}}}, m.Load)

	// New → old: the queued prefill does not change kind 3's bytes.
	r := &loadReport{Origin: "g2", SentAt: -1, Loads: []ReplicaLoad{
		{Replica: "r0", InFlight: 3, QueuedPrefillTokens: 9000}, {Replica: "r1", QueuedPrefillTokens: 17}}}
	b, err := appendLoad(nil, r)
	require.NoError(t, err)
	require.Equal(t, loadV1Golden, b)
	old, err := decodeLoadV1(b)
	require.NoError(t, err)
	require.Equal(t, map[string]int{"r0": 3, "r1": 0}, old)

	// Kind 5 carries the queued prefill, and only it.
	q, err := appendQueued(nil, r)
	require.NoError(t, err)
	require.Equal(t, []byte{'K', 'M', 1, 5, 2, 'g', '2', 0x01, 2, 2, 'r', '0', 0xa8, 0x46, 2, 'r', '1', 17}, q)
	m, err = decodeMessage(q)
	require.NoError(t, err)
	require.Equal(t, kindQueued, m.Kind)
	require.Equal(t, &loadReport{Origin: "g2", SentAt: -1, Loads: []ReplicaLoad{
		{Replica: "r0", QueuedPrefillTokens: 9000}, {Replica: "r1", QueuedPrefillTokens: 17}}}, m.Load)
	// An old gateway would drop it: that is why it never goes to load.*.
	_, err = decodeLoadV1(q)
	require.Error(t, err)

	// Out-of-range figures are clamped, never encoded undecodable.
	b, err = appendQueued(nil, &loadReport{Origin: "g", Loads: []ReplicaLoad{
		{Replica: "a", QueuedPrefillTokens: -5}, {Replica: "b", QueuedPrefillTokens: math.MaxInt64}}})
	require.NoError(t, err)
	m, err = decodeMessage(b)
	require.NoError(t, err)
	require.Equal(t, 0, m.Load.Loads[0].QueuedPrefillTokens)
	require.Equal(t, math.MaxInt32, m.Load.Loads[1].QueuedPrefillTokens)
}

// TestPeerQueuedPrefill: over the embedded NATS, peers' queued prefill adds
// up per replica, leaves InFlight alone, clears as soon as a peer has none,
// and stops counting when the peer leaves; meanwhile every message on the
// subject previous releases subscribe to stays decodable by them.
func TestPeerQueuedPrefill(t *testing.T) {
	// Reports must not expire while the test reads them: on a loaded
	// machine a peer's next report can come later than the default
	// LoadTTL (1 s), and its in-flight count then drops to 0 for a while
	// (a CI failure under five parallel runs). With a minute's TTL only a
	// report or a departure changes a figure, which is what the test
	// checks; TestPeerQueuedPrefillExpires checks expiry.
	gws := startCluster(t, 3, nil, func(c *Config) { c.LoadTTL = time.Minute })

	// An "old gateway": the previous release's subscription and decoder.
	var oldSeen, oldBad atomic.Int64
	var oldMu gosync.Mutex
	var oldErr error
	sub, err := gws[0].c.bus.conn().Subscribe(gws[0].c.bus.subj.loadAll, func(msg *nats.Msg) {
		if _, err := decodeLoadV1(msg.Data); err != nil {
			oldBad.Add(1)
			oldMu.Lock()
			oldErr = err
			oldMu.Unlock()
			return
		}
		oldSeen.Add(1)
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })

	gws[1].load.set("r0", 2)
	gws[1].load.setQueued("r0", 1500)
	gws[2].load.setQueued("r0", 700)
	gws[2].load.setQueued("r1", 64)
	// In-flight counts and queued prefill travel in separate messages on
	// separate subjects, each delivered by its own subscription: either
	// may arrive first (a CI run read the queued figures before the
	// in-flight one), so both are waited for.
	require.Eventually(t, func() bool {
		return gws[0].c.QueuedPrefill("r0") == 2200 && gws[0].c.QueuedPrefill("r1") == 64 &&
			gws[1].c.QueuedPrefill("r0") == 700 && gws[2].c.QueuedPrefill("r0") == 1500 &&
			gws[0].c.InFlight("r0") == 2
	}, converge, 5*time.Millisecond)
	require.Equal(t, 2, gws[0].c.InFlight("r0"), "queued prefill is not in-flight")
	require.Zero(t, gws[0].c.QueuedPrefill("r2"))
	require.Zero(t, gws[0].c.QueuedPrefill("nope"))
	require.Zero(t, gws[1].c.QueuedPrefill("r2"), "a gateway does not count its own")

	// A peer whose prefill ended says so (one all-zero report), well before
	// LoadTTL would expire its last one.
	cleared := time.Now()
	gws[1].load.setQueued("r0", 0)
	require.Eventually(t, func() bool { return gws[0].c.QueuedPrefill("r0") == 700 },
		5*time.Second, time.Millisecond)
	require.Less(t, time.Since(cleared), gws[0].c.cfg.LoadTTL, "cleared by a report, not by expiry")
	require.Equal(t, 2, gws[0].c.InFlight("r0"))

	// A peer that leaves stops counting.
	gws[2].stop(t)
	require.Eventually(t, func() bool { return gws[0].c.QueuedPrefill("r0") == 0 && gws[0].c.QueuedPrefill("r1") == 0 },
		converge, 5*time.Millisecond)

	require.Zero(t, testing.AllocsPerRun(100, func() { _ = gws[0].c.QueuedPrefill("r0") }))
	require.Positive(t, oldSeen.Load())
	oldMu.Lock()
	defer oldMu.Unlock()
	require.Zero(t, oldBad.Load(), "an old gateway would drop a load report: %v", oldErr)
}

// TestPeerQueuedPrefillExpires: a report not refreshed within the TTL stops
// counting (a peer that went silent without leaving), and a refresh counts
// again.
func TestPeerQueuedPrefillExpires(t *testing.T) {
	p := newPeerLoad(time.Second, queuedPrefillOf)
	t0 := time.Unix(1_700_000_000, 0)
	view := func() map[string]int { return *p.view.Load() }
	p.report(&loadReport{Origin: "a#1", Loads: []ReplicaLoad{{Replica: "r0", InFlight: 9, QueuedPrefillTokens: 100}}}, t0)
	p.report(&loadReport{Origin: "b#1", Loads: []ReplicaLoad{{Replica: "r0", QueuedPrefillTokens: 20}}}, t0.Add(800*time.Millisecond))
	require.Equal(t, map[string]int{"r0": 120}, view())
	require.Equal(t, 1, p.expire(t0.Add(1500*time.Millisecond)))
	require.Equal(t, map[string]int{"r0": 20}, view())
	require.Equal(t, 0, p.expire(t0.Add(2*time.Second)))
	require.Empty(t, view())
	p.report(&loadReport{Origin: "b#2", Loads: []ReplicaLoad{{Replica: "r0", QueuedPrefillTokens: 5}}}, t0.Add(3*time.Second))
	require.Equal(t, map[string]int{"r0": 5}, view())
	p.forget("b", t0.Add(3*time.Second))
	require.Empty(t, view())
}

// TestPeerLoadDropsReportsOfDepartedNode: a report a node sent before it
// left but that arrives after its departure was handled does not count
// (it would for a whole TTL), until the node joins again or the TTL has
// passed.
func TestPeerLoadDropsReportsOfDepartedNode(t *testing.T) {
	p := newPeerLoad(time.Minute, inFlightOf)
	t0 := time.Unix(1_700_000_000, 0)
	view := func() map[string]int { return *p.view.Load() }
	late := &loadReport{Origin: "a#1", Loads: []ReplicaLoad{{Replica: "r0", InFlight: 4}}}
	p.report(late, t0)
	p.report(&loadReport{Origin: "b#1", Loads: []ReplicaLoad{{Replica: "r0", InFlight: 1}}}, t0)
	require.Equal(t, map[string]int{"r0": 5}, view())

	p.forget("a", t0.Add(time.Second))
	require.Equal(t, map[string]int{"r0": 1}, view())
	p.report(late, t0.Add(2*time.Second))
	require.Equal(t, map[string]int{"r0": 1}, view(), "delivered after the leave")
	p.report(&loadReport{Origin: "a#2", Loads: []ReplicaLoad{{Replica: "r0", InFlight: 2}}}, t0.Add(3*time.Second))
	require.Equal(t, map[string]int{"r0": 1}, view(), "a new incarnation counts once it has joined")

	p.rejoin("a")
	p.report(&loadReport{Origin: "a#2", Loads: []ReplicaLoad{{Replica: "r0", InFlight: 2}}}, t0.Add(4*time.Second))
	require.Equal(t, map[string]int{"r0": 3}, view())

	p.forget("b", t0.Add(5*time.Second))
	p.report(&loadReport{Origin: "b#1", Loads: []ReplicaLoad{{Replica: "r0", InFlight: 7}}}, t0.Add(5*time.Second+time.Minute+time.Millisecond))
	require.Equal(t, map[string]int{"r0": 7}, view(), "past the TTL a report counts again (the older ones expired)")
}

// BenchmarkPeerLoadRead is the routing hot path's read of peers' load: one
// lookup per candidate replica, no lock, no allocation.
func BenchmarkPeerLoadRead(b *testing.B) {
	c := &Cluster{peers: newPeerLoad(time.Hour, inFlightOf), queued: newPeerLoad(time.Hour, queuedPrefillOf)}
	now := time.Now()
	for g := range 8 {
		r := &loadReport{Origin: string(rune('a'+g)) + "#1"}
		for i := range 64 {
			r.Loads = append(r.Loads, ReplicaLoad{Replica: "replica-" + string(rune('A'+i)), InFlight: i, QueuedPrefillTokens: 100 * i})
		}
		c.peers.report(r, now)
		c.queued.report(r, now)
	}
	b.Run("InFlight", func(b *testing.B) {
		b.ReportAllocs()
		s := 0
		for b.Loop() {
			s += c.InFlight("replica-Q")
		}
		_ = s
	})
	b.Run("QueuedPrefill", func(b *testing.B) {
		b.ReportAllocs()
		s := 0
		for b.Loop() {
			s += c.QueuedPrefill("replica-Q")
		}
		_ = s
	})
}

// BenchmarkPeerLoadReceive is what one peer's load report costs its
// receiver: decoding a report of 64 replicas and rebuilding the peers'
// view over 8 peers' reports. A gateway receives one per peer every
// LoadInterval (7 peers every 25 ms: 280 a second).
func BenchmarkPeerLoadReceive(b *testing.B) {
	p := newPeerLoad(time.Hour, inFlightOf)
	now := time.Now()
	var msgs [][]byte
	for g := range 8 {
		r := &loadReport{Origin: string(rune('a'+g)) + "#1", SentAt: now.UnixNano()}
		for i := range 64 {
			r.Loads = append(r.Loads, ReplicaLoad{Replica: fmt.Sprintf("replica-%02d", i), InFlight: i % 9})
		}
		msg, err := appendLoad(nil, r)
		require.NoError(b, err)
		msgs = append(msgs, msg)
		p.report(r, now)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		m, err := decodeMessage(msgs[i%len(msgs)])
		if err != nil || m.Kind != kindLoad {
			b.Fatalf("decode: %v (kind %v)", err, m.Kind)
		}
		p.report(m.Load, now)
		i++
	}
}
