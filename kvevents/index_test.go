package kvevents

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
)

const testModel = "qwen"

func testIndex(t *testing.T) *index.Index {
	t.Helper()
	cfg := index.DefaultConfig()
	cfg.BlockTokens = 4
	x, err := index.New(cfg)
	require.NoError(t, err)
	x.SetReplicaRoot(1, x.Hasher().Root(testModel, "", ""))
	return x
}

// gatewayMatch is what the request path computes: keys rooted at
// (model, lora, salt), matched against replica 1's confirmed entries.
func gatewayMatch(t *testing.T, x *index.Index, lora, salt string, tokens []uint32) int {
	t.Helper()
	h := x.Hasher()
	keys := h.AppendKeys(nil, h.Root(testModel, lora, salt), tokens)
	out := make([]int32, 1)
	x.Match(keys, []index.ReplicaID{1}, index.ModeKVEvents, 0, out)
	return int(out[0])
}

// storedEvent is a vLLM map-form BlockStored; extra is the extra_keys
// value already encoded (nil: field absent).
func storedEvent(hashes []uint64, parent int64, tokens mp, lora string, extra mp) mp {
	n := 8
	if extra != nil {
		n++
	}
	m := mp{}.mapn(n).str("type").str("BlockStored").str("block_hashes").arr(len(hashes))
	for _, h := range hashes {
		m = m.uint(h)
	}
	m = m.str("parent_block_hash")
	if parent < 0 {
		m = m.nil_()
	} else {
		m = m.uint(uint64(parent))
	}
	m = append(m.str("token_ids"), tokens...)
	m = m.str("block_size").uint(4).str("lora_id")
	if lora != "" {
		m = m.uint(3)
	} else {
		m = m.nil_()
	}
	m = m.str("medium").str("GPU").str("lora_name")
	if lora != "" {
		m = m.str(lora)
	} else {
		m = m.nil_()
	}
	if extra != nil {
		m = append(m.str("extra_keys"), extra...)
	}
	return m
}

func decodeOne(t *testing.T, ev mp) *BlockStored {
	t.Helper()
	b, err := Decode(append(mp{}.arr(2).f64(1).arr(1), ev...))
	require.NoError(t, err)
	require.Len(t, b.Events, 1)
	return b.Events[0].Stored
}

func applyStored(t *testing.T, x *index.Index, st *BlockStored) {
	t.Helper()
	sb, ok := StoredForIndex(x.Hasher(), testModel, st, nil)
	require.True(t, ok)
	require.NoError(t, x.ApplyStored(1, sb))
}

// TestSaltedLoRAEventMatchesGatewayKeys: vLLM puts the LoRA name in every
// block's extra keys and the cache salt in the first block's; the index's
// confirmed keys must be the gateway's keys for that (model, lora, salt).
func TestSaltedLoRAEventMatchesGatewayKeys(t *testing.T) {
	tokens := seqTokens(100, 12)
	for _, tc := range []struct {
		name, lora, salt string
		extra            mp
	}{
		{"salt", "", "s3cret", mp{}.arr(2).arr(1).str("s3cret").nil_()},
		{"lora", "adapter-a", "", mp{}.arr(2).arr(1).str("adapter-a").arr(1).str("adapter-a")},
		{"lora+salt", "adapter-a", "s3cret", mp{}.arr(2).arr(2).str("adapter-a").str("s3cret").arr(1).str("adapter-a")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			x := testIndex(t)
			// Two events: a sequence's first two blocks, then its third
			// chained from the second.
			st := decodeOne(t, storedEvent([]uint64{11, 12}, -1, mp{}.tokens(100, 8), tc.lora, tc.extra))
			require.True(t, st.HasExtraKeys)
			require.False(t, st.HasOpaque)
			require.Equal(t, tc.salt, st.CacheSalt)
			applyStored(t, x, st)
			var more mp
			if tc.lora != "" {
				more = mp{}.arr(1).arr(1).str(tc.lora)
			}
			st = decodeOne(t, storedEvent([]uint64{13}, 12, mp{}.tokens(108, 4), tc.lora, more))
			require.Empty(t, st.CacheSalt, "only a sequence's first block is salted")
			require.False(t, st.HasOpaque)
			applyStored(t, x, st)

			require.Equal(t, 3, gatewayMatch(t, x, tc.lora, tc.salt, tokens))
			require.Zero(t, gatewayMatch(t, x, "", "", tokens), "an unsalted prompt does not match salted blocks")
		})
	}
}

// TestEncodedSaltRoundTrips: the Encoder (the simulator's publisher) writes
// extra_keys as vLLM does, so a salted simulator request is confirmed under
// the gateway's key.
func TestEncodedSaltRoundTrips(t *testing.T) {
	for _, form := range []Encoding{EncodingMap, EncodingArray, EncodingMapEnvelope} {
		b := Batch{TS: 1, Events: []Event{{Kind: KindBlockStored, Stored: &BlockStored{
			BlockHashes: []EngineHash{1, 2}, TokenIDs: seqTokens(0, 8), BlockSize: 4,
			Medium: "GPU", LoRAName: "ad", CacheSalt: "salty",
		}}}}
		p, err := Encode(&b, form)
		require.NoError(t, err)
		got, err := Decode(p)
		require.NoError(t, err)
		st := got.Events[0].Stored
		require.Equal(t, "salty", st.CacheSalt, form.String())
		require.True(t, st.HasExtraKeys)
		require.False(t, st.HasOpaque)
		x := testIndex(t)
		applyStored(t, x, st)
		require.Equal(t, 2, gatewayMatch(t, x, "ad", "salty", seqTokens(0, 8)))
	}
}

// TestOpaqueExtraKeysStopTheChain: a block whose extra keys hold a
// multimodal (id, offset) tuple or a prompt-embedding hash is not keyed
// from its tokens; neither is anything chained after it.
func TestOpaqueExtraKeysStopTheChain(t *testing.T) {
	for _, tc := range []struct {
		name  string
		extra mp
		want  int
	}{
		{"mm-tuple-block1", mp{}.arr(3).nil_().arr(1).arr(2).str("img-1").uint(0).nil_(), 1},
		{"embeds-block0", mp{}.arr(3).arr(1).bin([]byte{1, 2, 3}).nil_().nil_(), 0},
		{"old-mm-string-block2", mp{}.arr(3).nil_().nil_().arr(1).str("img-hash"), 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := decodeOne(t, storedEvent([]uint64{21, 22, 23}, -1, mp{}.tokens(0, 12), "", tc.extra))
			require.True(t, st.HasOpaque)
			require.Equal(t, tc.want, st.IndexableBlocks())
			x := testIndex(t)
			sb, ok := StoredForIndex(x.Hasher(), testModel, st, nil)
			if tc.want == 0 {
				require.False(t, ok)
				return
			}
			require.True(t, ok)
			require.Len(t, sb.Hashes, tc.want)
			require.Len(t, sb.Tokens, tc.want*4)
			require.NoError(t, x.ApplyStored(1, sb))
			require.Equal(t, tc.want, gatewayMatch(t, x, "", "", seqTokens(0, 12)))
		})
	}
}

// TestOffloadTierDoesNotTouchGPULedger: with CPU offloading the engine
// reports stores and removals for medium "CPU" too; a CPU-tier removal of a
// block the GPU still holds must leave the confirmed entry.
func TestOffloadTierDoesNotTouchGPULedger(t *testing.T) {
	x := testIndex(t)
	tokens := seqTokens(0, 8)
	gpu := &BlockStored{BlockHashes: []EngineHash{31, 32}, TokenIDs: tokens, BlockSize: 4, Medium: "GPU"}
	applyStored(t, x, gpu)
	cpu := *gpu
	cpu.Medium = "CPU"
	_, ok := StoredForIndex(x.Hasher(), testModel, &cpu, nil)
	require.False(t, ok, "a CPU-tier store is not a GPU confirmation")

	hs, ok := RemovedForIndex(&BlockRemoved{BlockHashes: []EngineHash{31, 32}, Medium: "CPU"}, nil)
	require.False(t, ok)
	require.Empty(t, hs)
	require.Equal(t, 2, gatewayMatch(t, x, "", "", tokens))

	hs, ok = RemovedForIndex(&BlockRemoved{BlockHashes: []EngineHash{32}, Medium: "GPU"}, nil)
	require.True(t, ok)
	x.ApplyRemoved(1, hs)
	require.Equal(t, 1, gatewayMatch(t, x, "", "", tokens))

	for _, m := range []string{"", "GPU", "gpu"} {
		require.True(t, GPUMedium(m), m)
	}
	for _, m := range []string{"CPU", "DISK", "cpu"} {
		require.False(t, GPUMedium(m), m)
	}
}
