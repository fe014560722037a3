package kvevents

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
)

// TestNormalize: one batch becomes the index input StoredForIndex and
// RemovedForIndex give, other tiers dropped and clears kept, and a reused
// result allocates nothing once its buffers have grown.
func TestNormalize(t *testing.T) {
	x := testIndex(t)
	h := x.Hasher()
	tokens := seqTokens(0, 8)
	b := &Batch{Events: []Event{
		{Kind: KindBlockStored, Stored: &BlockStored{BlockHashes: []EngineHash{31, 32}, TokenIDs: tokens, BlockSize: 4, Medium: "GPU"}},
		{Kind: KindBlockStored, Stored: &BlockStored{BlockHashes: []EngineHash{41}, TokenIDs: tokens[:4], BlockSize: 4, Medium: "CPU"}},
		{Kind: KindBlockRemoved, Removed: &BlockRemoved{BlockHashes: []EngineHash{31}, Medium: "CPU"}},
		{Kind: KindBlockRemoved, Removed: &BlockRemoved{BlockHashes: []EngineHash{32}}},
		{Kind: KindAllBlocksCleared},
	}}
	got := Normalize(h, testModel, b, nil)
	require.Len(t, got, 5)
	sb, ok := StoredForIndex(h, testModel, b.Events[0].Stored, nil)
	require.True(t, ok)
	require.Equal(t, index.KVEvent{Kind: index.KVStored, Stored: sb}, got[0])
	require.Equal(t, index.TierCPU, got[1].Stored.Tier, "a CPU store is kept, as the CPU tier")
	require.Equal(t, []uint64{41}, got[1].Stored.Hashes)
	require.Equal(t, index.KVRemoved, got[2].Kind)
	require.Equal(t, index.TierCPU, got[2].Tier)
	require.Equal(t, []uint64{31}, got[2].Removed)
	require.Equal(t, index.KVRemoved, got[3].Kind)
	require.Equal(t, index.TierGPU, got[3].Tier)
	require.Equal(t, []uint64{32}, got[3].Removed)
	require.Equal(t, index.KVCleared, got[4].Kind)

	var rep index.KVReport
	x.ApplyKV(1, got[:3], &rep)
	require.Empty(t, rep.Errors)
	require.Equal(t, 2, gatewayMatch(t, x, "", "", tokens), "CPU-tier events leave the GPU match alone")
	x.ApplyKV(1, got[3:4], &rep)
	require.Equal(t, 1, gatewayMatch(t, x, "", "", tokens))

	allocs := testing.AllocsPerRun(100, func() { got = Normalize(h, testModel, b, got) })
	require.Zero(t, allocs)
	require.Equal(t, []uint64{31, 32}, got[0].Stored.Hashes)
	require.Equal(t, []uint64{32}, got[3].Removed)
}

// TestDecodeGroups: group_idx, kv_cache_spec_kind and
// kv_cache_spec_sliding_window are read in both the tagged-array and the
// map form, for stores and removals, and Normalize passes them on.
func TestDecodeGroups(t *testing.T) {
	arrStored := mp{}.arr(12).str("BlockStored").arr(1).uint(7).nil_().tokens(0, 4).uint(4).nil_().
		str("GPU").nil_().nil_().uint(1).str("sliding_window").uint(4096)
	arrRemoved := mp{}.arr(4).str("BlockRemoved").arr(1).uint(7).str("GPU").uint(1)
	mapStored := mp{}.mapn(8).str("type").str("BlockStored").str("block_hashes").arr(1).uint(8).
		str("parent_block_hash").nil_().str("token_ids").tokens(0, 4).str("block_size").uint(4).
		str("group_idx").uint(2).str("kv_cache_spec_kind").str("full_attention").
		str("kv_cache_spec_sliding_window").nil_()
	mapRemoved := mp{}.mapn(3).str("type").str("BlockRemoved").str("block_hashes").arr(1).uint(8).str("group_idx").uint(2)
	p := append(mp{}.arr(2).f64(1).arr(4), arrStored...)
	p = append(p, arrRemoved...)
	p = append(p, mapStored...)
	p = append(p, mapRemoved...)
	b, err := Decode(p)
	require.NoError(t, err)
	require.Len(t, b.Events, 4)
	s := b.Events[0].Stored
	require.Equal(t, 1, s.GroupIdx)
	require.Equal(t, "sliding_window", s.SpecKind)
	require.Equal(t, 4096, s.SlidingWindow)
	require.Equal(t, 1, b.Events[1].Removed.GroupIdx)
	require.Equal(t, 2, b.Events[2].Stored.GroupIdx)
	require.Equal(t, "full_attention", b.Events[2].Stored.SpecKind)
	require.Equal(t, 2, b.Events[3].Removed.GroupIdx)

	x := testIndex(t)
	got := Normalize(x.Hasher(), testModel, b, nil)
	require.Len(t, got, 4)
	require.Equal(t, 1, got[0].Stored.Group)
	require.Equal(t, index.GroupSliding, got[0].Stored.GroupKind)
	require.Equal(t, 4096, got[0].Stored.Window)
	require.Equal(t, 1, got[1].Group)
	require.Equal(t, 2, got[2].Stored.Group)
	require.Equal(t, index.GroupFull, got[2].Stored.GroupKind)
	require.Zero(t, got[2].Stored.Window)
	require.Equal(t, 2, got[3].Group)
}

// TestEncodeGroupsRoundTrip: the encoder writes the group fields in every
// form, and the decoder reads back what it wrote.
func TestEncodeGroupsRoundTrip(t *testing.T) {
	for _, form := range []Encoding{EncodingArray, EncodingMap, EncodingMapEnvelope} {
		for _, salt := range []string{"", "s"} {
			in := &Batch{TS: 2, Events: []Event{
				{Kind: KindBlockStored, Stored: &BlockStored{BlockHashes: []EngineHash{1}, TokenIDs: seqTokens(0, 4), BlockSize: 4,
					Medium: "GPU", CacheSalt: salt, GroupIdx: 1, SpecKind: "sliding_window", SlidingWindow: 128}},
				{Kind: KindBlockStored, Stored: &BlockStored{BlockHashes: []EngineHash{2}, TokenIDs: seqTokens(4, 4), BlockSize: 4,
					Medium: "GPU", SpecKind: "full_attention"}},
				{Kind: KindBlockRemoved, Removed: &BlockRemoved{BlockHashes: []EngineHash{1}, Medium: "GPU", GroupIdx: 1}},
				{Kind: KindBlockRemoved, Removed: &BlockRemoved{BlockHashes: []EngineHash{2}, Medium: "GPU"}},
			}}
			p, err := Encode(in, form)
			require.NoError(t, err)
			b, err := Decode(p)
			require.NoError(t, err, "form %v salt %q", form, salt)
			require.Len(t, b.Events, 4)
			s := b.Events[0].Stored
			require.Equal(t, 1, s.GroupIdx)
			require.Equal(t, "sliding_window", s.SpecKind)
			require.Equal(t, 128, s.SlidingWindow)
			require.Equal(t, salt, s.CacheSalt)
			require.Equal(t, "full_attention", b.Events[1].Stored.SpecKind)
			require.Zero(t, b.Events[1].Stored.GroupIdx)
			require.Equal(t, 1, b.Events[2].Removed.GroupIdx)
			require.Zero(t, b.Events[3].Removed.GroupIdx)
		}
	}
}
