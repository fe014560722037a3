package kvevents

import (
	"strings"

	"github.com/kvmesh/kvmesh/index"
)

// StoredForIndex turns a decoded BlockStored into what index.ApplyStored
// takes, keyed the way the gateway keys requests to model, so that a
// consumer cannot get the medium, the root or opaque blocks wrong:
//
//   - ok is false for another medium than the GPU (CPU or disk offload
//     tiers; see GPUMedium): the confirmed ledger tracks the GPU cache.
//   - A parentless event whose first block mixed in a LoRA name or a cache
//     salt gets Root = h.Root(model, lora, salt) (HasRoot); otherwise the
//     replica's root (index.SetReplicaRoot) applies. An event with parent
//     0 gets that Root too: the index takes it as a chain start when 0
//     names no stored block (index.TolParentZero).
//   - The KV-cache group (group_idx) and its kind and sliding window
//     (kv_cache_spec_kind, kv_cache_spec_sliding_window) are passed on,
//     so a hybrid model's groups are kept apart (index.Match).
//   - Only IndexableBlocks are passed on: from the first block with opaque
//     extra keys (multimodal, prompt embeddings) on, keys computed from
//     token ids would not identify what the engine cached. ok is false when
//     no block is left.
//
// The engine hashes are appended to hashes[:0]; sb.Hashes aliases that
// buffer and sb.Tokens aliases st.TokenIDs, so sb is valid until either is
// reused.
func StoredForIndex(h index.Hasher, model string, st *BlockStored, hashes []uint64) (sb index.StoredBlocks, ok bool) {
	if st == nil || !st.OnGPU() {
		return index.StoredBlocks{}, false
	}
	return storedForIndex(h, model, st, hashes, index.TierGPU)
}

// MediumTier maps an event's medium to an index tier: the GPU (see
// GPUMedium), "CPU" or "DISK" in any case; ok is false for another medium.
func MediumTier(medium string) (t index.Tier, ok bool) {
	switch {
	case GPUMedium(medium):
		return index.TierGPU, true
	case strings.EqualFold(medium, "cpu"):
		return index.TierCPU, true
	case strings.EqualFold(medium, "disk"):
		return index.TierDisk, true
	}
	return 0, false
}

func storedForIndex(h index.Hasher, model string, st *BlockStored, hashes []uint64, tier index.Tier) (sb index.StoredBlocks, ok bool) {
	n := st.IndexableBlocks()
	if n == 0 {
		return index.StoredBlocks{}, false
	}
	hashes = hashes[:0]
	for _, eh := range st.BlockHashes[:n] {
		hashes = append(hashes, uint64(eh))
	}
	tokens := st.TokenIDs
	if n < len(st.BlockHashes) && n*st.BlockSize <= len(tokens) {
		tokens = tokens[:n*st.BlockSize]
	}
	sb = index.StoredBlocks{
		Hashes:      hashes,
		ParentHash:  uint64(st.ParentBlockHash),
		HasParent:   st.HasParent,
		Tokens:      tokens,
		BlockTokens: st.BlockSize,
		Group:       st.GroupIdx,
		GroupKind:   index.ParseGroupKind(st.SpecKind),
		Tier:        tier,
	}
	if sb.GroupKind == index.GroupSliding {
		sb.Window = st.SlidingWindow
	}
	if lora, salt := st.RootInputs(); (!st.HasParent || st.ParentBlockHash == 0) && (lora != "" || salt != "") {
		sb.Root, sb.HasRoot = h.Root(model, lora, salt), true
	}
	return sb, true
}

// RemovedForIndex returns the engine hashes of a GPU-tier BlockRemoved,
// appended to hashes[:0], for index.ApplyRemoved; ok is false for another
// medium (an offload tier evicting its copy leaves the GPU copy cached).
func RemovedForIndex(rm *BlockRemoved, hashes []uint64) (out []uint64, ok bool) {
	if rm == nil || !rm.OnGPU() {
		return hashes[:0], false
	}
	out = hashes[:0]
	for _, eh := range rm.BlockHashes {
		out = append(out, uint64(eh))
	}
	return out, true
}

// Normalize turns a decoded engine batch into index input: the one
// normalization every consumer uses (node, a synced cluster's owner, the
// DES), so that what a stored event means for the index is decided here
// and nowhere else. GPU stored events go through StoredForIndex, GPU
// removals through RemovedForIndex; CPU and disk events become the same
// input with their index.Tier set (MediumTier), so the index keeps the
// offload tiers apart from the GPU's confirmed ledger; events of other
// media are dropped, clears are kept. The events are appended to dst[:0], reusing the hash buffers of
// dst's elements, so a caller that applies each batch before the next may
// pass the previous result and allocate nothing in the steady state; a
// caller that keeps a result must pass nil. Results alias b's token slices.
func Normalize(h index.Hasher, model string, b *Batch, dst []index.KVEvent) []index.KVEvent {
	out := dst[:0]
	for i := range b.Events {
		ev := &b.Events[i]
		// next is the element out would grow into, with its old buffers.
		var next index.KVEvent
		if len(out) < cap(out) {
			next = out[:len(out)+1][len(out)]
		}
		switch ev.Kind {
		case KindBlockStored:
			buf := next.Stored.Hashes
			if buf == nil {
				buf = next.Removed
			}
			if ev.Stored == nil {
				continue
			}
			tier, ok := MediumTier(ev.Stored.Medium)
			if !ok {
				continue
			}
			sb, ok := storedForIndex(h, model, ev.Stored, buf, tier)
			if !ok {
				continue
			}
			out = append(out, index.KVEvent{Kind: index.KVStored, Stored: sb})
		case KindBlockRemoved:
			buf := next.Removed
			if buf == nil {
				buf = next.Stored.Hashes
			}
			if ev.Removed == nil {
				continue
			}
			tier, ok := MediumTier(ev.Removed.Medium)
			if !ok {
				continue
			}
			hs := buf[:0]
			for _, eh := range ev.Removed.BlockHashes {
				hs = append(hs, uint64(eh))
			}
			out = append(out, index.KVEvent{Kind: index.KVRemoved, Removed: hs, Group: ev.Removed.GroupIdx, Tier: tier})
		case KindAllBlocksCleared:
			out = append(out, index.KVEvent{Kind: index.KVCleared, Removed: next.Removed[:0], Stored: index.StoredBlocks{Hashes: next.Stored.Hashes[:0]}})
		}
	}
	return out
}
