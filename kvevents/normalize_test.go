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
	require.Len(t, got, 3)
	sb, ok := StoredForIndex(h, testModel, b.Events[0].Stored, nil)
	require.True(t, ok)
	require.Equal(t, index.KVEvent{Kind: index.KVStored, Stored: sb}, got[0])
	require.Equal(t, index.KVRemoved, got[1].Kind)
	require.Equal(t, []uint64{32}, got[1].Removed)
	require.Equal(t, index.KVCleared, got[2].Kind)

	var rep index.KVReport
	x.ApplyKV(1, got[:1], &rep)
	require.Empty(t, rep.Errors)
	require.Equal(t, 2, gatewayMatch(t, x, "", "", tokens))
	x.ApplyKV(1, got[1:2], &rep)
	require.Equal(t, 1, gatewayMatch(t, x, "", "", tokens))

	allocs := testing.AllocsPerRun(100, func() { got = Normalize(h, testModel, b, got) })
	require.Zero(t, allocs)
	require.Equal(t, []uint64{31, 32}, got[0].Stored.Hashes)
	require.Equal(t, []uint64{32}, got[1].Removed)
}
