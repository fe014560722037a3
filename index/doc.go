// Package index is kvmesh's prefix index: which replica holds which prompt
// blocks, learned from routing decisions (history and speculative ledgers)
// and from the engines' own KV events (confirmed ledger).
//
// The package is pure: it starts no goroutines, opens no sockets and reads
// no clock. Time is an argument, now, in Unix nanoseconds (int64); stored
// timestamps have 10 ms resolution.
//
// # Keys
//
// A Hasher turns tokens (or, in character mode, bytes) into chained 64-bit
// block keys, k_i = xxh3(k_{i-1} || tokens of block i), rooted at
// Hasher.Root(model, lora, salt), which mixes in the cluster seed. Only full
// blocks have keys. Hasher methods are safe for concurrent use and append to
// a caller's slice without allocating otherwise.
//
// Confirmed keys must equal the keys the gateway computes for the same
// request, so a parentless StoredBlocks of a LoRA or salted sequence carries
// Root = Root(model, lora, salt) (HasRoot); kvevents.StoredForIndex does
// that from the event's lora_name and extra_keys. The engine reports the
// salt only through extra_keys (newer vLLM): from an engine without them a
// salted sequence is confirmed under the replica's unsalted root, which no
// salted request computes, so salted prompts then match only through
// speculative and history entries. Blocks whose engine hash mixed in
// multimodal or prompt-embedding keys are not derivable from text and are
// not applied (kvevents.BlockStored.IndexableBlocks).
//
// # Ledgers and modes
//
// Each (block, replica) pair may be held in any of three ledgers (see
// Ledger). Match trusts the ledgers Mode names: ModeHistory the history
// ledger, ModeKVEvents confirmed plus unexpired speculative, ModeHybrid the
// latter for replicas marked with SetPublishesEvents and history for the
// others. TTLs are kept per (block, ledger): a Record of a block in a ledger
// refreshes that ledger's clock for every replica holding the block there;
// a Record that finds the ledger already expired first drops its stale
// entries. Expired entries are invisible to Match at once and removed by
// Expire, which does bounded work per call.
//
// # Capacity
//
// Capacity bounds (block, replica) entries over all ledgers. When a write
// exceeds it, whole blocks (every replica's entries for one key) are evicted
// in CLOCK order, an approximation of LRU (GCLOCK): a new block starts with
// use count 1, a Match or a repeated write raises it to 3, and the clock hand
// decrements it and evicts the block at 0. Evicting a block removes every
// replica's entries for that key.
// Evicted entries are counted in Stats.Evictions.
//
// # Engine hashes
//
// ApplyStored computes keys from an event's tokens, chained from the parent
// engine block's key in that replica's engine map, and maps each engine hash
// to its keys; ApplyRemoved uses the map so a BlockRemoved affects only the
// replica that sent it. An engine block may span several index blocks (any
// multiple of the index block size up to MaxEngineBlockTokens: vLLM hybrid
// models' 1568-token blocks are 98 index blocks of 16); MaxBlockTokens
// bounds only the index block. Mappings are shared between replicas (ids below 64)
// that map an engine hash to the same key, as engines with a fixed hash seed
// do for common blocks, so a block cached on several replicas costs one map
// entry; a replica whose mapping differs keeps it privately. The engine map
// is bounded by the engine's own cache,
// since the engine reports every eviction; index evictions leave it alone.
// If two engine hashes of one replica map to the same key (for example the
// same block on two media), removing either removes the confirmed entry.
//
// # KV-cache groups
//
// A hybrid-attention model keeps one KV-cache group per attention type
// (full attention, sliding window, ...); vLLM strips the group from the
// hashes it reports, so every group stores and removes blocks under the
// same engine hashes, and each group evicts on its own. StoredBlocks.Group
// and ApplyRemovedGroup (KVEvent.Group) keep the groups apart: group 0 is
// the confirmed ledger's mask, groups 1 to MaxGroups-1 live in a per-key
// side map that single-group models never touch, and a removal in one
// group leaves the others (and the engine mapping, until no group holds
// the block). A replica whose events named more than one group is matched
// by vLLM's hybrid rule (see Match): full-attention groups need every
// block of the prefix, sliding-window groups only the blocks of their
// window before the hit point. The rule follows vLLM's v1 KV-cache
// manager: SlidingWindowManager.find_longest_cache_hit as read at
// vllm-project/vllm commit 002f349 (v0.9 era: a right-to-left search for
// cdiv(window-1, block) contiguous cached blocks) and the fixed-point
// HybridKVCacheCoordinator.find_longest_cache_hit of later releases
// (full-attention groups first; for one full and one sliding group it is
// the single pass of the earlier coordinator). EAGLE's dropped last block
// is not modelled. Group
// residency is not part of snapshots: a restored index matches on group 0
// until the replica's events name its groups again.
//
// # Offload tiers
//
// Engines with CPU offloading (vLLM's offloading connector, LMCache)
// report stores and removals of their CPU (and disk) copies under the same
// engine hashes. StoredBlocks.Tier and KVEvent.Tier (ApplyRemovedTier)
// keep them apart from the GPU: an offloaded copy never enters the
// confirmed ledger, so Match, ConfirmedRun and every strategy that reads
// Match (prefix-cache keeps AIBrix's GPU-only meaning) see the GPU alone,
// while MatchTiers also reports, per candidate, the run of blocks after
// the GPU match that CPU or disk hold, for a cost model to price as a load
// instead of a recompute. Offload residency lives in the same per-key side
// map as the groups above 0, and an engine mapping lives while the GPU,
// a group or a tier holds the block.
//
// # Layout
//
// A block is a 48-byte pointer-free node in a flat arena: the key, one
// 64-bit replica mask per ledger for replica ids below 64, the ledgers'
// timestamps, a CLOCK use counter and flag bits, and the index of the most recent
// successor block. An open-addressing table of 64-bit slots (a 32-bit hash
// tag and the node index, so probing does not touch the arena), filled up
// to 7/8, finds a key; a large arena grows by 1/16 at a time. Issue 16's
// workload (3,200 prompts of 313 blocks over 16 replicas, most blocks on
// one replica) costs about 61 bytes per (block, replica) entry in history
// mode (TestMemoryIssue16Target). Writers link consecutive keys, so Match follows the chain from block
// to block and probes the table only when the chain hint misses. Replica ids
// of 64 and above live in a per-key overflow map: supported, but slower.
// The shared engine-hash map is a flat open-addressing table of 24-byte
// slots that grows by 1.5x, so its memory per mapping varies less than a Go
// map's.
//
// # Concurrency and ownership
//
// All Index methods are safe for concurrent use. Match, Stats,
// AppendSnapshot, AppendEngineHashes and AppendReplicaKeys take the read lock
// once per call (Match never per block) and may run in parallel with each
// other; writers (Record, ApplyStored, ApplyRemoved, ClearReplica,
// DropReplica, Expire, SetReplicaRoot, SetPublishesEvents, Restore) take the
// write lock once per call. No method keeps a reference to a slice or map it
// is given, and none blocks other than on the lock. AppendSnapshot holds the
// read lock while it encodes, which blocks writers for a fraction of a
// second per million entries (BenchmarkSnapshot); Restore decodes into a
// fresh structure without the lock and takes the write lock only to swap
// (with KeepReplicaSettings it carries this index's replica roots and
// publisher flags over in that same critical section, so no Match sees a
// peer's settings).
package index
