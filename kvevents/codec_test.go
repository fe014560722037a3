package kvevents

import (
	"encoding/binary"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"
)

// mp builds msgpack bytes by hand, field by field, the way Python's msgspec
// emits them (compact ints, float64, str keys), independent of the Encoder.
type mp []byte

func (m mp) arr(n int) mp {
	if n < 16 {
		return append(m, 0x90|byte(n))
	}
	return append(m, 0xdc, byte(n>>8), byte(n))
}

func (m mp) mapn(n int) mp {
	if n < 16 {
		return append(m, 0x80|byte(n))
	}
	return append(m, 0xde, byte(n>>8), byte(n))
}

func (m mp) str(s string) mp {
	switch {
	case len(s) < 32:
		m = append(m, 0xa0|byte(len(s)))
	case len(s) < 256:
		m = append(m, 0xd9, byte(len(s)))
	default:
		m = append(m, 0xda, byte(len(s)>>8), byte(len(s)))
	}
	return append(m, s...)
}

func (m mp) bin(p []byte) mp { return append(append(m, 0xc4, byte(len(p))), p...) }

func (m mp) nil_() mp { return append(m, 0xc0) }

func (m mp) f64(f float64) mp {
	return binary.BigEndian.AppendUint64(append(m, 0xcb), math.Float64bits(f))
}

// uint encodes v in the smallest unsigned form, as msgspec does.
func (m mp) uint(v uint64) mp {
	switch {
	case v < 128:
		return append(m, byte(v))
	case v < 256:
		return append(m, 0xcc, byte(v))
	case v < 1<<16:
		return binary.BigEndian.AppendUint16(append(m, 0xcd), uint16(v))
	case v < 1<<32:
		return binary.BigEndian.AppendUint32(append(m, 0xce), uint32(v))
	}
	return binary.BigEndian.AppendUint64(append(m, 0xcf), v)
}

func (m mp) int(v int64) mp {
	if v >= 0 {
		return m.uint(uint64(v))
	}
	if v >= -32 {
		return append(m, byte(int8(v)))
	}
	return binary.BigEndian.AppendUint64(append(m, 0xd3), uint64(v))
}

func (m mp) tokens(from, n int) mp {
	m = m.arr(n)
	for i := range n {
		m = m.uint(uint64(from + i))
	}
	return m
}

func seqTokens(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

func TestDecodeTaggedArrayOldForm(t *testing.T) {
	// vLLM ~0.9: array batch, tagged-array events, BlockStored before
	// medium/lora_name existed (5 fields), dp rank omitted.
	p := mp{}.arr(2).f64(1732000000.5).arr(3).
		arr(5).str("BlockStored").arr(2).uint(0xFFFFFFFFFFFFFFF0).uint(7).nil_().tokens(100, 8).uint(4).
		arr(3).str("BlockRemoved").arr(1).uint(7).str("GPU").
		arr(1).str("AllBlocksCleared")
	b, err := Decode(p)
	require.NoError(t, err)
	require.Equal(t, 1732000000.5, b.TS)
	require.Nil(t, b.DataParallelRank)
	require.Len(t, b.Events, 3)

	s := b.Events[0]
	require.Equal(t, KindBlockStored, s.Kind)
	require.Nil(t, s.Removed)
	require.Equal(t, []EngineHash{0xFFFFFFFFFFFFFFF0, 7}, s.Stored.BlockHashes)
	require.False(t, s.Stored.HasParent)
	require.Equal(t, seqTokens(100, 8), s.Stored.TokenIDs)
	require.Equal(t, 4, s.Stored.BlockSize)
	require.Nil(t, s.Stored.LoRAID)
	require.Empty(t, s.Stored.Medium)

	r := b.Events[1]
	require.Equal(t, KindBlockRemoved, r.Kind)
	require.Nil(t, r.Stored)
	require.Equal(t, []EngineHash{7}, r.Removed.BlockHashes)
	require.Equal(t, "GPU", r.Removed.Medium)

	require.Equal(t, Event{Kind: KindAllBlocksCleared}, b.Events[2])
}

func TestDecodeTaggedArrayFullWithTrailingExtras(t *testing.T) {
	// All positional fields plus extra_keys and group_idx and one more
	// unknown future field, dp rank present.
	p := mp{}.arr(3).f64(2).arr(1).
		arr(11).str("BlockStored").arr(1).int(-5).uint(99).tokens(0, 4).uint(4).uint(3).str("CPU").str("adapter-a").
		arr(1).arr(2).str("mm-hash").uint(1).uint(2).str("full_attention").
		uint(1)
	b, err := Decode(p)
	require.NoError(t, err)
	require.NotNil(t, b.DataParallelRank)
	require.Equal(t, int64(1), *b.DataParallelRank)
	s := b.Events[0].Stored
	require.Equal(t, []EngineHash{EngineHash(0xFFFFFFFFFFFFFFFB)}, s.BlockHashes, "negative int64 hash kept bit-for-bit")
	require.True(t, s.HasParent)
	require.Equal(t, EngineHash(99), s.ParentBlockHash)
	require.Equal(t, int64(3), *s.LoRAID)
	require.Equal(t, "CPU", s.Medium)
	require.Equal(t, "adapter-a", s.LoRAName)
}

func TestDecodeMapEventsV026(t *testing.T) {
	// v0.26: array batch, map events with "type" first, omit_defaults drops
	// extra_keys/group_idx when unset; here they are set, plus an unknown key
	// and an unknown event type that must be skipped and counted.
	h := []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32}
	p := mp{}.arr(3).f64(10.25).arr(3).
		mapn(11).str("type").str("BlockStored").
		str("block_hashes").arr(2).bin(h).uint(1<<40).
		str("parent_block_hash").uint(12345).
		str("token_ids").tokens(500, 32).
		str("block_size").uint(16).
		str("lora_id").nil_().
		str("medium").str("GPU").
		str("lora_name").nil_().
		str("extra_keys").arr(2).arr(1).str("salt").nil_().
		str("group_idx").uint(0).
		str("kv_cache_spec_kind").mapn(1).str("nested").arr(2).f64(1).nil_().
		mapn(2).str("type").str("BlockTouched").str("block_hashes").arr(1).uint(5).
		mapn(3).str("medium").nil_().str("block_hashes").arr(2).uint(1 << 40).uint(3).str("type").str("BlockRemoved").
		uint(0)
	var b Batch
	ignored, err := NewDecoder().Decode(p, &b)
	require.NoError(t, err)
	require.Equal(t, 1, ignored)
	require.Equal(t, 10.25, b.TS)
	require.Equal(t, int64(0), *b.DataParallelRank)
	require.Len(t, b.Events, 2)
	s := b.Events[0].Stored
	require.Equal(t, []EngineHash{EngineHash(xxh3.Hash(h)), 1 << 40}, s.BlockHashes, "bytes hashes fold with xxh3")
	require.True(t, s.HasParent)
	require.Equal(t, EngineHash(12345), s.ParentBlockHash)
	require.Equal(t, seqTokens(500, 32), s.TokenIDs)
	require.Equal(t, 16, s.BlockSize)
	require.Equal(t, "GPU", s.Medium)
	r := b.Events[1]
	require.Equal(t, KindBlockRemoved, r.Kind, "type may come last in a map event")
	require.Equal(t, []EngineHash{1 << 40, 3}, r.Removed.BlockHashes)
	require.Empty(t, r.Removed.Medium)
}

func TestDecodeMapEnvelope(t *testing.T) {
	// Newest: the batch is a map; keys in any order, unknown keys skipped,
	// data_parallel_rank omitted when None.
	p := mp{}.mapn(3).str("events").arr(1).
		mapn(8).str("type").str("BlockStored").str("block_hashes").arr(1).uint(42).
		str("parent_block_hash").nil_().str("token_ids").tokens(1, 16).str("block_size").uint(16).
		str("lora_id").nil_().str("medium").str("GPU").str("lora_name").nil_().
		str("future").arr(0).
		str("ts").f64(3.5)
	b, err := Decode(p)
	require.NoError(t, err)
	require.Equal(t, 3.5, b.TS)
	require.Nil(t, b.DataParallelRank)
	require.Len(t, b.Events, 1)
	require.Equal(t, []EngineHash{42}, b.Events[0].Stored.BlockHashes)
	require.Equal(t, seqTokens(1, 16), b.Events[0].Stored.TokenIDs)
}

func TestDecodeErrors(t *testing.T) {
	valid := mp{}.arr(2).f64(1).arr(1).arr(1).str("AllBlocksCleared")
	cases := map[string]struct {
		p        []byte
		noEvents bool
	}{
		"empty":                 {p: nil},
		"garbage":               {p: []byte("hello world")},
		"scalar batch":          {p: mp{}.uint(5)},
		"truncated":             {p: valid[:len(valid)-3]},
		"trailing bytes":        {p: append(append(mp{}, valid...), 0x01)},
		"short array batch":     {p: mp{}.arr(1).f64(1)},
		"string ts":             {p: mp{}.arr(2).str("x").arr(0)},
		"nil events":            {p: mp{}.arr(2).f64(1).nil_()},
		"scalar event":          {p: mp{}.arr(2).f64(1).arr(1).uint(3)},
		"tagless array event":   {p: mp{}.arr(2).f64(1).arr(1).arr(0)},
		"typeless map event":    {p: mp{}.arr(2).f64(1).arr(1).mapn(1).str("block_hashes").arr(0)},
		"nil hash":              {p: mp{}.arr(2).f64(1).arr(1).arr(2).str("BlockRemoved").arr(1).nil_()},
		"float hash":            {p: mp{}.arr(2).f64(1).arr(1).arr(2).str("BlockRemoved").arr(1).f64(1)},
		"negative token":        {p: mp{}.arr(2).f64(1).arr(1).arr(4).str("BlockStored").arr(0).nil_().arr(1).int(-1)},
		"huge array claim":      {p: append(mp{}.arr(2).f64(1), 0xdd, 0xff, 0xff, 0xff, 0xff)},
		"huge string claim":     {p: append(mp{}.arr(2).f64(1).arr(1).arr(1), 0xdb, 0xff, 0xff, 0xff, 0xff)},
		"huge skipped bin":      {p: append(mp{}.mapn(2).str("x"), 0xc6, 0xff, 0xff, 0xff, 0xff)},
		"ext value":             {p: append(mp{}.mapn(2).str("x"), 0xd4, 1, 1)},
		"map batch no events":   {p: mp{}.mapn(1).str("ts").f64(1), noEvents: true},
		"empty events":          {p: mp{}.arr(2).f64(1).arr(0), noEvents: true},
		"only unknown types":    {p: mp{}.arr(2).f64(1).arr(2).arr(1).str("Nope").mapn(1).str("type").str("Nah"), noEvents: true},
		"two events fields":     {p: mp{}.mapn(2).str("events").arr(0).str("events").arr(0)},
		"deeply nested unknown": {p: deepNest(100)},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			var b Batch
			_, err := NewDecoder().Decode(tc.p, &b)
			require.Error(t, err)
			if tc.noEvents {
				require.ErrorIs(t, err, ErrNoEvents)
			} else {
				require.ErrorIs(t, err, ErrMalformed)
			}
		})
	}
}

func deepNest(depth int) []byte {
	m := mp{}.mapn(2).str("events").arr(1).arr(1).str("AllBlocksCleared").str("x")
	for range depth {
		m = m.arr(1)
	}
	return m.uint(1)
}

func sampleBatch(blocks, blockSize int) *Batch {
	dp := int64(0)
	lora := int64(7)
	s := &BlockStored{BlockSize: blockSize, Medium: "GPU", ParentBlockHash: 0xDEADBEEF, HasParent: true}
	for i := range blocks {
		s.BlockHashes = append(s.BlockHashes, EngineHash(0x9E3779B97F4A7C15*uint64(i+1)))
	}
	s.TokenIDs = seqTokens(151000, blocks*blockSize)
	s2 := &BlockStored{BlockHashes: []EngineHash{1}, TokenIDs: seqTokens(0, blockSize), BlockSize: blockSize, LoRAID: &lora, LoRAName: "lora-x"}
	return &Batch{
		TS:               1764400000.123,
		DataParallelRank: &dp,
		Events: []Event{
			{Kind: KindBlockStored, Stored: s},
			{Kind: KindBlockRemoved, Removed: &BlockRemoved{BlockHashes: []EngineHash{5, 6, math.MaxUint64}, Medium: "GPU"}},
			{Kind: KindBlockStored, Stored: s2},
			{Kind: KindAllBlocksCleared},
		},
	}
}

func TestRoundTripAllEncodings(t *testing.T) {
	for _, form := range []Encoding{EncodingMap, EncodingArray, EncodingMapEnvelope} {
		t.Run(form.String(), func(t *testing.T) {
			in := sampleBatch(16, 16)
			p, err := Encode(in, form)
			require.NoError(t, err)
			out, err := Decode(p)
			require.NoError(t, err)
			require.Equal(t, in, out)

			in.DataParallelRank = nil
			p, err = Encode(in, form)
			require.NoError(t, err)
			out, err = Decode(p)
			require.NoError(t, err)
			require.Equal(t, in, out)
		})
	}
}

func TestEncodeShapes(t *testing.T) {
	b := &Batch{TS: 1, Events: []Event{{Kind: KindAllBlocksCleared}}}
	p, err := Encode(b, EncodingArray)
	require.NoError(t, err)
	require.Equal(t, []byte(mp{}.arr(2).f64(1).arr(1).arr(1).str("AllBlocksCleared")), p)
	p, err = Encode(b, EncodingMap)
	require.NoError(t, err)
	require.Equal(t, []byte(mp{}.arr(2).f64(1).arr(1).mapn(1).str("type").str("AllBlocksCleared")), p)
	p, err = Encode(b, EncodingMapEnvelope)
	require.NoError(t, err)
	require.Equal(t, []byte(mp{}.mapn(2).str("ts").f64(1).str("events").arr(1).mapn(1).str("type").str("AllBlocksCleared")), p)

	r := &Batch{TS: 1, Events: []Event{{Kind: KindBlockRemoved, Removed: &BlockRemoved{BlockHashes: []EngineHash{300}, Medium: "GPU"}}}}
	p, err = Encode(r, EncodingMap)
	require.NoError(t, err)
	require.Equal(t, []byte(mp{}.arr(2).f64(1).arr(1).mapn(3).str("type").str("BlockRemoved").
		str("block_hashes").arr(1).uint(300).str("medium").str("GPU")), p)

	_, err = Encode(&Batch{Events: []Event{{}}}, EncodingMap)
	require.Error(t, err)
}

func TestDecoderReuse(t *testing.T) {
	d := NewDecoder()
	var b Batch
	big, err := Encode(sampleBatch(16, 16), EncodingMap)
	require.NoError(t, err)
	small := mp{}.arr(2).f64(9).arr(1).arr(2).str("BlockRemoved").arr(1).uint(77)
	_, err = d.Decode(big, &b)
	require.NoError(t, err)
	_, err = d.Decode(small, &b)
	require.NoError(t, err)
	require.Len(t, b.Events, 1)
	require.Nil(t, b.DataParallelRank)
	require.Equal(t, KindBlockRemoved, b.Events[0].Kind)
	require.Nil(t, b.Events[0].Stored, "a reused slot must not keep the other kind's body")
	require.Equal(t, []EngineHash{77}, b.Events[0].Removed.BlockHashes)
	require.Empty(t, b.Events[0].Removed.Medium)
	_, err = d.Decode(big, &b)
	require.NoError(t, err)
	require.Equal(t, sampleBatch(16, 16), &b)
}

func TestParseEncoding(t *testing.T) {
	for _, e := range []Encoding{EncodingMap, EncodingArray, EncodingMapEnvelope} {
		got, err := ParseEncoding(e.String())
		require.NoError(t, err)
		require.Equal(t, e, got)
	}
	_, err := ParseEncoding("json")
	require.ErrorIs(t, err, ErrBadEncoding)
}
