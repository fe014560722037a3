package kvevents

import "strings"

// EngineHash is an engine's identifier for one KV block. Consumers treat it as
// opaque: vLLM may send it as an unsigned or (in old versions) signed integer,
// or as raw bytes when integer hashes are off. Integers are kept bit-for-bit
// (a negative int64 becomes its two's-complement uint64); byte strings are
// folded to 64 bits with xxh3. kvmesh never derives its own block keys from an
// EngineHash: it only uses one to find the entries a later BlockRemoved means.
type EngineHash uint64

// Seq is a publisher's batch sequence number: 0 for the first batch after the
// engine starts, +1 per batch. A smaller number than the last one seen means
// the engine restarted.
type Seq uint64

// ReplayEnd is the sequence number that ends a replay reply stream; it is sent
// with an empty payload.
const ReplayEnd Seq = 0xFFFFFFFFFFFFFFFF

// Kind names an event type as vLLM spells it on the wire.
type Kind uint8

const (
	KindBlockStored Kind = iota + 1
	KindBlockRemoved
	KindAllBlocksCleared
)

func (k Kind) String() string {
	switch k {
	case KindBlockStored:
		return "BlockStored"
	case KindBlockRemoved:
		return "BlockRemoved"
	case KindAllBlocksCleared:
		return "AllBlocksCleared"
	}
	return "Unknown"
}

// Event is one KV-cache event. Exactly one of the pointer fields of a decoded
// Event is set, as Kind says; the zero Event is invalid.
type Event struct {
	Kind    Kind
	Stored  *BlockStored
	Removed *BlockRemoved
}

// BlockStored reports blocks that became full and cached, in prompt order.
// Fields follow vLLM's BlockStored in wire order; fields vLLM added later are
// zero when an older engine omits them.
type BlockStored struct {
	BlockHashes []EngineHash
	// ParentBlockHash is the hash of the block before BlockHashes[0];
	// HasParent is false when BlockHashes[0] is a sequence's first block.
	ParentBlockHash EngineHash
	HasParent       bool
	// TokenIDs holds len(BlockHashes)*BlockSize tokens, block by block.
	TokenIDs  []uint32
	BlockSize int
	// LoRAID is nil when no adapter is active.
	LoRAID *int64
	// Medium is "GPU", "CPU", ... or "" when the engine did not say.
	Medium   string
	LoRAName string

	// The fields below summarize extra_keys, which newer vLLM sends (one
	// entry per block: the LoRA name, multimodal item keys, the cache salt
	// on a sequence's first block, prompt-embedding hashes) and which the
	// engine mixed into its block hashes.

	// HasExtraKeys is set when the event carried an extra_keys list.
	HasExtraKeys bool
	// CacheSalt is the request's cache_salt, found in the extra keys of a
	// parentless event's first block; "" when there is none or the engine
	// does not send extra_keys.
	CacheSalt string
	// OpaqueFrom, when HasOpaque is set, is the index of the first block
	// whose extra keys hold something kvmesh cannot derive from a prompt's
	// text (multimodal item hashes, prompt-embedding hashes, or keys it
	// cannot classify). Keys computed from token ids alone would claim that
	// block, and every block chained after it, for any prompt with the same
	// placeholder tokens.
	OpaqueFrom int
	HasOpaque  bool

	// GroupIdx is the KV-cache group the blocks were stored in (vLLM's
	// group_idx; 0 when absent). A hybrid-attention model has one group per
	// attention type (full attention, sliding window, ...), each caching
	// and evicting its own copy of blocks with the same hashes.
	GroupIdx int
	// SpecKind is the group's kv_cache_spec_kind ("full_attention",
	// "sliding_window", ...; "" when absent) and SlidingWindow its
	// kv_cache_spec_sliding_window in tokens (0 when absent).
	SpecKind      string
	SlidingWindow int
}

// GPUMedium reports whether an event's medium is the GPU tier, which is the
// cache the confirmed ledger tracks: "GPU" in any case, or "" from engines
// that do not say (older vLLM, GPU only). CPU and disk offload tiers report
// their own stores and removals, which must not touch the GPU ledger.
func GPUMedium(medium string) bool {
	return medium == "" || medium == "GPU" || strings.EqualFold(medium, "gpu")
}

// OnGPU reports whether the stored blocks are in the GPU tier.
func (s *BlockStored) OnGPU() bool { return GPUMedium(s.Medium) }

// OnGPU reports whether the removed blocks were in the GPU tier.
func (r *BlockRemoved) OnGPU() bool { return GPUMedium(r.Medium) }

// RootInputs returns the LoRA name and cache salt the engine mixed into the
// hash of the sequence's first block: for a parentless event, the inputs of
// the root key (index.Hasher.Root(model, lora, salt)), the same the gateway
// computes for the request.
func (s *BlockStored) RootInputs() (lora, salt string) { return s.LoRAName, s.CacheSalt }

// IndexableBlocks is the number of leading blocks whose kvmesh keys follow
// from their token ids (and the root): all of them unless a block carries
// opaque extra keys (see OpaqueFrom).
func (s *BlockStored) IndexableBlocks() int {
	if s.HasOpaque && s.OpaqueFrom < len(s.BlockHashes) {
		return max(s.OpaqueFrom, 0)
	}
	return len(s.BlockHashes)
}

// BlockRemoved reports blocks evicted from Medium.
type BlockRemoved struct {
	BlockHashes []EngineHash
	Medium      string
	// GroupIdx is the KV-cache group the blocks left (0 when absent).
	GroupIdx int
}

// Batch is one published message: the events of one engine step.
type Batch struct {
	// TS is the engine's wall clock in seconds since the Unix epoch.
	TS     float64
	Events []Event
	// DataParallelRank is nil when the engine does not use data parallelism.
	DataParallelRank *int64
}
