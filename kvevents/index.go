package kvevents

import "github.com/kvmesh/kvmesh/index"

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
// and nowhere else. Stored events go through StoredForIndex, removals
// through RemovedForIndex (events they refuse are dropped), clears are
// kept. The events are appended to dst[:0], reusing the hash buffers of
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
			sb, ok := StoredForIndex(h, model, ev.Stored, buf)
			if !ok {
				continue
			}
			out = append(out, index.KVEvent{Kind: index.KVStored, Stored: sb})
		case KindBlockRemoved:
			buf := next.Removed
			if buf == nil {
				buf = next.Stored.Hashes
			}
			hs, ok := RemovedForIndex(ev.Removed, buf)
			if !ok {
				continue
			}
			out = append(out, index.KVEvent{Kind: index.KVRemoved, Removed: hs, Group: ev.Removed.GroupIdx})
		case KindAllBlocksCleared:
			out = append(out, index.KVEvent{Kind: index.KVCleared, Removed: next.Removed[:0], Stored: index.StoredBlocks{Hashes: next.Stored.Hashes[:0]}})
		}
	}
	return out
}
