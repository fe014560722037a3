package truth_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/chaos/truth"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

func seq(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

// chain builds engine blocks of size bs over tokens, hashes 1, 2, ...
func chain(tokens []uint32, bs int, firstHash uint64) []sim.CachedBlock {
	var out []sim.CachedBlock
	for i := 0; (i+1)*bs <= len(tokens); i++ {
		b := sim.CachedBlock{
			Hash:   kvHash(firstHash + uint64(i)),
			Tokens: tokens[i*bs : (i+1)*bs],
			Prefix: tokens[:(i+1)*bs],
		}
		if i > 0 {
			b.Parent, b.HasParent = kvHash(firstHash+uint64(i-1)), true
		}
		out = append(out, b)
	}
	return out
}

func TestFromBlocksKeysMatchHasher(t *testing.T) {
	h, err := index.NewHasher(7, 4)
	require.NoError(t, err)
	root := h.Root("m", "", "")
	toks := seq(100, 24)
	want := h.AppendKeys(nil, root, toks) // 6 index blocks

	// Engine blocks of 8 = 2 index blocks each; children before parents so
	// both the memoised and the full-prefix paths run.
	blocks := chain(toks, 8, 1)
	blocks[0], blocks[2] = blocks[2], blocks[0]
	tr, err := truth.FromBlocks(blocks, h, root)
	require.NoError(t, err)
	require.Len(t, tr.Keys, len(want))
	for _, k := range want {
		require.Contains(t, tr.Keys, k)
	}
	require.Len(t, tr.Hashes, 3)
	// Inner keys are the first index block of each engine block.
	require.Len(t, tr.Inner, 3)
	for _, i := range []int{0, 2, 4} {
		require.Contains(t, tr.Inner, want[i])
	}

	// A child whose parent is not cached still yields its own keys only.
	tr, err = truth.FromBlocks(chain(toks, 8, 1)[2:], h, root)
	require.NoError(t, err)
	require.Len(t, tr.Keys, 2)
	require.Contains(t, tr.Keys, want[5])
}

func TestFromBlocksRejects(t *testing.T) {
	h, err := index.NewHasher(0, 16)
	require.NoError(t, err)
	_, err = truth.FromBlocks(chain(seq(0, 24), 8, 1), h, 0)
	require.ErrorIs(t, err, truth.ErrBlockSize)

	b := chain(seq(0, 32), 16, 1)
	b[1].Prefix = seq(50, 32)
	_, err = truth.FromBlocks(b, h, 0)
	require.ErrorIs(t, err, truth.ErrMalformedBlock)
}

func TestCompareCountsPrecisionAndRecall(t *testing.T) {
	ix, err := index.New(index.Config{BlockTokens: 4, Capacity: 1000, HistoryTTL: time.Hour, SpeculativeTTL: time.Second})
	require.NoError(t, err)
	h := ix.Hasher()
	root := h.Root("m", "", "")
	const r = index.ReplicaID(3)
	ix.SetReplicaRoot(r, root)
	toks := seq(1, 16)
	blocks := chain(toks, 4, 10)
	hashes := []uint64{10, 11, 12, 13}
	require.NoError(t, ix.ApplyStored(r, index.StoredBlocks{Hashes: hashes, Tokens: toks, BlockTokens: 4}))

	tr, err := truth.FromBlocks(blocks, h, root)
	require.NoError(t, err)
	c := truth.Compare(tr, ix, r)
	require.True(t, c.Exact(), c.String())
	require.Equal(t, 1.0, c.Precision())
	require.Equal(t, 1.0, c.Recall())

	// The engine evicted the last two blocks but the index did not hear it.
	tr, err = truth.FromBlocks(blocks[:2], h, root)
	require.NoError(t, err)
	c = truth.Compare(tr, ix, r)
	require.False(t, c.Exact())
	require.Equal(t, 0.5, c.Precision())
	require.Equal(t, 1.0, c.Recall())
	require.Len(t, c.Extra, 2)

	// The index heard an eviction the engine did not make.
	ix.ApplyRemoved(r, []uint64{13})
	tr, err = truth.FromBlocks(blocks, h, root)
	require.NoError(t, err)
	c = truth.Compare(tr, ix, r)
	require.Equal(t, 1.0, c.Precision())
	require.Equal(t, 0.75, c.Recall())
	require.Equal(t, 1, c.MissingLast)
	require.False(t, truth.IsExactButSharedInner(c))

	// Empty sets on both sides are exact.
	ix.ClearReplica(r)
	c = truth.Compare(truth.Truth{}, ix, r)
	require.True(t, c.Exact())
}

func TestAwait(t *testing.T) {
	n := 0
	c, _, err := truth.Await(context.Background(), time.Millisecond, func() (truth.Comparison, error) {
		n++
		return truth.Comparison{TruthKeys: 1, CommonKeys: min(n, 3) / 3, IndexKeys: 1}, nil
	}, func(c truth.Comparison) bool { return c.CommonKeys == 1 })
	require.NoError(t, err)
	require.Equal(t, 1, c.CommonKeys)

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, _, err = truth.Await(ctx, time.Millisecond, func() (truth.Comparison, error) {
		return truth.Comparison{TruthKeys: 1}, nil
	}, truth.IsExact)
	require.ErrorIs(t, err, truth.ErrTimeout)
	require.ErrorIs(t, err, context.DeadlineExceeded)

	boom := errors.New("boom")
	_, _, err = truth.Await(context.Background(), time.Millisecond, func() (truth.Comparison, error) {
		return truth.Comparison{}, boom
	}, truth.IsExact)
	require.ErrorIs(t, err, boom)
}

func kvHash(v uint64) kvevents.EngineHash { return kvevents.EngineHash(v) }
