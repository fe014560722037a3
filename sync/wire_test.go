package sync

import (
	"bytes"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

func sampleMessages(t testing.TB) [][]byte {
	var out [][]byte
	add := func(b []byte, err error) {
		require.NoError(t, err)
		out = append(out, b)
	}
	add(AppendDecisions(nil, &DecisionBatch{Origin: "g0", Seq: 7, SentAt: 1_700_000_000_000_000_000, Entries: []Decision{
		{Replica: "r0", Ledger: index.History, At: 1_700_000_000_000_000_000 - 3_000_000, Keys: []index.BlockKey{1, 2, 3}},
		{Replica: "r1", Ledger: index.Speculative, At: 1_700_000_000_000_000_000, Keys: []index.BlockKey{math.MaxUint64}},
		{Replica: "r0", Ledger: index.Speculative, At: 1_700_000_000_000_000_000, Keys: nil},
	}}))
	add(AppendKV(nil, &KVBatch{Origin: "g1", Replica: "r2", Seq: 42, EngineTS: 1.7e9, SentAt: 5, Events: []index.KVEvent{
		{Kind: index.KVStored, Stored: index.StoredBlocks{Hashes: []uint64{10, 11}, ParentHash: 9, HasParent: true,
			Root: 77, HasRoot: true, BlockTokens: 2, Tokens: []uint32{1, 2, 3, math.MaxUint32}}},
		{Kind: index.KVStored, Stored: index.StoredBlocks{Hashes: []uint64{12}, BlockTokens: 1, Tokens: []uint32{5}}},
		{Kind: index.KVRemoved, Removed: []uint64{10}},
		{Kind: index.KVCleared},
	}}))
	add(AppendKV(nil, &KVBatch{Origin: "g1", Replica: "r2", Seq: 43, Reset: true, Reason: uint8(kvevents.ResetRewind)}))
	add(appendLoad(nil, &loadReport{Origin: "g2", SentAt: -1, Loads: []ReplicaLoad{{Replica: "r0", InFlight: 3}, {Replica: "r1"}}}))
	add(appendQueued(nil, &loadReport{Origin: "g2", SentAt: 4, Loads: []ReplicaLoad{
		{Replica: "r0", QueuedPrefillTokens: 4096}, {Replica: "r1"}}}))
	add(appendDigest(nil, &digest{Origin: "g2", SentAt: 9, Entries: [3]uint64{1, 2, 3},
		Sources: []watermark{{"d/g0", 7}, {"kv/r2", 43}}}))
	return out
}

func TestWireRoundTrip(t *testing.T) {
	for _, b := range sampleMessages(t) {
		m, err := decodeMessage(b)
		require.NoError(t, err)
		require.Equal(t, b, reencode(t, m), "kind %v", m.Kind)
		// Every strict prefix is malformed, never a panic or a shorter message.
		for i := range b {
			_, err := decodeMessage(b[:i])
			require.ErrorIs(t, err, ErrMalformed, "prefix %d of kind %v", i, m.Kind)
		}
		_, err = decodeMessage(append(bytes.Clone(b), 0))
		require.ErrorIs(t, err, ErrMalformed, "trailing byte")
	}
	m, err := decodeMessage(sampleMessages(t)[0])
	require.NoError(t, err)
	require.Equal(t, int64(1_700_000_000_000_000_000-3_000_000), m.Decisions.Entries[0].At)
	require.Equal(t, "r1", m.Decisions.Entries[1].Replica)
}

func reencode(t testing.TB, m message) []byte {
	b, err := encodeMessage(m)
	require.NoError(t, err)
	return b
}

// encodeMessage encodes m with the encoder of its kind.
func encodeMessage(m message) ([]byte, error) {
	switch m.Kind {
	case kindDecisions:
		return AppendDecisions(nil, m.Decisions)
	case kindKV:
		return AppendKV(nil, m.KV)
	case kindLoad:
		return appendLoad(nil, m.Load)
	case kindQueued:
		return appendQueued(nil, m.Load)
	case kindDigest:
		return appendDigest(nil, m.Digest)
	}
	return nil, nil
}

func TestWireRejects(t *testing.T) {
	cases := map[string][]byte{
		"empty":        nil,
		"magic":        {'X', 'M', 1, 1},
		"version":      {'K', 'M', 2, 1},
		"kind":         {'K', 'M', 1, 9},
		"huge count":   append([]byte{'K', 'M', 1, 1, 1, 'g', 1, 0}, 0xff, 0xff, 0xff, 0xff, 0x0f),
		"huge keys":    {'K', 'M', 1, 1, 1, 'g', 1, 0, 1, 1, 'r', 1, 0, 0, 0, 0xff, 0xff, 0x3f},
		"bad ledger":   {'K', 'M', 1, 1, 1, 'g', 1, 0, 1, 1, 'r', 1, 2, 0, 0, 0},
		"name index":   {'K', 'M', 1, 1, 1, 'g', 1, 0, 1, 1, 'r', 1, 0, 1, 0, 0},
		"reset events": {'K', 'M', 1, 2, 1, 'g', 1, 'r', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 3},
	}
	for name, b := range cases {
		_, err := decodeMessage(b)
		require.ErrorIs(t, err, ErrMalformed, name)
	}
	_, err := AppendDecisions(nil, &DecisionBatch{Entries: []Decision{{Ledger: index.Confirmed}}})
	require.ErrorIs(t, err, index.ErrInvalidLedger)
	_, err = AppendKV(nil, &KVBatch{Events: []index.KVEvent{{Kind: index.KVStored, Stored: index.StoredBlocks{Hashes: []uint64{1}, BlockTokens: 2, Tokens: []uint32{1}}}}})
	require.ErrorIs(t, err, index.ErrMalformedStored)
}

// FuzzDecodeDelta: decodeMessage never panics, and whatever it accepts
// re-encodes to the same bytes (the format has one encoding per message).
func FuzzDecodeDelta(f *testing.F) {
	for _, b := range sampleMessages(f) {
		f.Add(b)
	}
	f.Add([]byte{'K', 'M', 1, 1})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeMessage(b)
		if err != nil {
			return
		}
		re := reencodeLoose(m)
		if re == nil {
			return
		}
		m2, err := decodeMessage(re)
		if err != nil {
			t.Fatalf("re-encoded message does not decode: %v", err)
		}
		if !bytes.Equal(reencodeLoose(m2), re) {
			t.Fatalf("encoding is not stable")
		}
	})
}

// reencodeLoose re-encodes m, or returns nil when the encoder refuses what
// the decoder allowed (e.g. a decision with an age clipped at 0).
func reencodeLoose(m message) []byte {
	b, err := encodeMessage(m)
	if err != nil {
		return nil
	}
	return b
}

// TestGossipPiecesFitAPacket: the NATS-outage fallback splits decisions
// with long names and long chains into messages that fit one gossip packet
// and lose no key.
func TestGossipPiecesFitAPacket(t *testing.T) {
	g := newGW(t, string(bytes.Repeat([]byte("n"), 128)), nil, nil)
	var got [][]byte
	long := string(bytes.Repeat([]byte("r"), maxName))
	entries := []Decision{
		{Replica: long, Ledger: index.History, At: 1, Keys: chain(1, 500)},
		{Replica: "r0", Ledger: index.Speculative, At: 2, Keys: chain(2, 3)},
		{Replica: long, Ledger: index.History, At: 3, Keys: chain(3, 90)},
	}
	// Capture what would be broadcast.
	g.c.testBroadcast = func(msg []byte) { got = append(got, append([]byte(nil), msg...)) }
	g.c.gossipDecisions(entries, nil)
	keys := map[string]int{}
	for _, m := range got {
		require.LessOrEqual(t, len(m), broadcastLimit)
		d, err := decodeMessage(m)
		require.NoError(t, err)
		for _, e := range d.Decisions.Entries {
			keys[e.Replica] += len(e.Keys)
		}
	}
	require.Equal(t, 590, keys[long])
	require.Equal(t, 3, keys["r0"])
}
