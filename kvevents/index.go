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
