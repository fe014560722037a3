package index

import "fmt"

// MaxEngineBlockTokens bounds an engine block (StoredBlocks.BlockTokens).
// It is not the index block bound (MaxBlockTokens, the hasher's stack
// buffer): an engine block spans BlockTokens / index block size index
// blocks, each hashed on its own, so large engine blocks cost nothing
// extra. vLLM's hybrid (attention + Mamba) models use engine blocks of
// hundreds to thousands of tokens (1568 for the seed study's model, 98
// index blocks of 16). The bound only rejects nonsense sizes before
// len(Hashes)*BlockTokens can overflow.
const MaxEngineBlockTokens = 1 << 16

// StoredBlocks is one engine BlockStored event, decoded: engine blocks in
// prompt order with their tokens.
type StoredBlocks struct {
	// Hashes are the engine's block hashes, opaque to the index.
	Hashes []uint64
	// ParentHash is the engine hash of the block before Hashes[0]; HasParent
	// is false when Hashes[0] starts a sequence (the chain starts at the root).
	ParentHash uint64
	HasParent  bool
	// Tokens holds len(Hashes)*BlockTokens token ids, block by block.
	Tokens []uint32
	// BlockTokens is the engine block size in tokens. It must be a positive
	// multiple of the index block size, at most MaxEngineBlockTokens.
	BlockTokens int
	// Root, when HasRoot is set, overrides the replica's root (for example for
	// a LoRA adapter's requests); otherwise SetReplicaRoot's value is used.
	Root    BlockKey
	HasRoot bool
	// Group is the KV-cache group the engine stored the blocks in (vLLM's
	// group_idx; 0 for a model with one group), below MaxGroups. GroupKind
	// and Window (tokens, sliding-window groups only) describe the group;
	// the index learns them per replica from the events, and a replica
	// with more than one group is matched by the hybrid rule (see Match).
	Group     int
	GroupKind GroupKind
	Window    int
	// Tier is where the blocks are: TierGPU (the confirmed ledger) or an
	// offload tier (CPU, disk), kept apart and reported by MatchTiers.
	// Offload events use the same engine hashes, and the same engine map,
	// as GPU ones; their group is ignored.
	Tier Tier
}

func (x *Index) replica(r ReplicaID) *replicaState {
	rs := x.replicas[r]
	if rs == nil {
		rs = &replicaState{}
		x.replicas[r] = rs
	}
	return rs
}

// SetReplicaRoot sets the root key (Hasher.Root of the engine's model, LoRA
// and salt) that ApplyStored chains from for r's parentless blocks.
func (x *Index) SetReplicaRoot(r ReplicaID, root BlockKey) {
	x.mu.Lock()
	rs := x.replica(r)
	rs.root, rs.hasRoot = root, true
	x.mu.Unlock()
}

// ApplyStored records a BlockStored event of replica r in the confirmed
// ledger. The kvmesh keys are computed from the tokens, chained from the
// parent's key (looked up in r's engine map; no parent: the root), so they
// never depend on the engine's hash algorithm. Each engine hash is mapped to
// the index blocks it contains so that ApplyRemoved can remove them all.
// Speculative entries of r for these blocks are promoted (cleared from the
// speculative ledger, counted in Stats.Promoted).
//
// Engine block size must be a positive multiple of the index block size
// and at most MaxEngineBlockTokens (hybrid models' 1568-token blocks are
// fine): otherwise ErrBlockSize, and nothing changes. (Engine blocks smaller than
// index blocks would need partial-token carry state; kvmesh runs the index
// at the engine's block size or a divisor of it instead.) If the parent is
// unknown, the blocks are skipped, counted, and ErrUnknownParent returned,
// except for parent 0 (see ApplyStoredReport).
// ApplyStored keeps nothing of s.
func (x *Index) ApplyStored(r ReplicaID, s StoredBlocks) error {
	_, err := x.ApplyStoredReport(r, s)
	return err
}

// Tolerance names a publisher quirk ApplyStoredReport accepted instead of
// rejecting, so that callers can count it per replica.
type Tolerance uint8

const (
	// TolNone: the event was read as sent.
	TolNone Tolerance = iota
	// TolParentZero: a BlockStored with parent_block_hash 0 where 0 names
	// no block r has stored was taken as a chain start (parentless).
	// llm-d-inference-sim's legacy array format sends 0 instead of nil for
	// a chain's first block. When r does have a block whose engine hash is
	// 0, the parent keeps its meaning.
	TolParentZero
)

// String is the tolerance's metric label ("" for TolNone).
func (t Tolerance) String() string {
	if t == TolParentZero {
		return "parent_zero"
	}
	return ""
}

// ApplyStoredReport is ApplyStored, also reporting the tolerance applied
// (TolNone or TolParentZero, counted in Stats.ParentZeroStarts). This is
// the one place the parent-0 rule lives: every apply path (node, sync,
// des, chaos/truth) goes through it.
func (x *Index) ApplyStoredReport(r ReplicaID, s StoredBlocks) (Tolerance, error) {
	tol := TolNone
	bs := x.h.tokens
	if s.BlockTokens <= 0 || s.BlockTokens > MaxEngineBlockTokens || s.BlockTokens%bs != 0 {
		return tol, fmt.Errorf("%w: engine %d tokens, index %d", ErrBlockSize, s.BlockTokens, bs)
	}
	if len(s.Tokens) != len(s.Hashes)*s.BlockTokens {
		return tol, fmt.Errorf("%w: %d tokens for %d blocks of %d", ErrMalformedStored, len(s.Tokens), len(s.Hashes), s.BlockTokens)
	}
	if len(s.Hashes) == 0 {
		return tol, nil
	}
	per := s.BlockTokens / bs
	x.mu.Lock()
	defer x.mu.Unlock()
	if s.Group < 0 || s.Group >= MaxGroups || s.Tier >= numTiers {
		x.st.skippedGroup++
		return tol, fmt.Errorf("%w: group %d tier %d", ErrGroup, s.Group, s.Tier)
	}
	rs := x.replica(r)
	var k BlockKey
	hasParent := s.HasParent
	if hasParent {
		pk, ok := x.engLookup(r, rs, s.ParentHash)
		switch {
		case ok:
			k = pk
		case s.ParentHash == 0:
			// Parent 0 naming no stored block: a chain start sent as 0.
			hasParent, tol = false, TolParentZero
		default:
			x.st.unknownParent += uint64(len(s.Hashes))
			return tol, fmt.Errorf("%w: replica %d parent %#x (%d blocks skipped)", ErrUnknownParent, r, s.ParentHash, len(s.Hashes))
		}
	}
	switch {
	case hasParent:
	case s.HasRoot:
		k = s.Root
	case rs.hasRoot:
		k = rs.root
	default:
		return TolNone, fmt.Errorf("%w: replica %d", ErrNoRoot, r)
	}
	if tol == TolParentZero {
		x.st.parentZero++
	}
	if s.Tier == TierGPU && (s.Group != 0 || s.GroupKind != GroupFull || rs.ngroups > 0) {
		x.learnGroup(r, rs, &s)
	}
	// Engine blocks are consecutive, so the whole event is one chain.
	x.scratch = x.h.AppendKeys(x.scratch[:0], k, s.Tokens)
	x.touch(x.scratch)
	x.sink ^= x.eng.touch(s.Hashes)
	var prev uint32
	for _, key := range x.scratch {
		idx := x.insert(key, prev)
		switch {
		case s.Tier != TierGPU:
			// An offloaded copy confirms nothing on the GPU.
			x.setSide(idx, r, sideBit(0, s.Tier))
		case s.Group == 0:
			x.set(idx, r, Confirmed)
		default:
			x.setSide(idx, r, sideBit(s.Group, TierGPU))
		}
		if s.Tier == TierGPU && x.has(idx, r, Speculative) {
			x.clear(idx, r, Speculative) // node stays: it is confirmed now
			x.st.promoted++
		}
		if prev != 0 {
			x.nodes[prev].next = idx
		}
		prev = idx
	}
	for i, eh := range s.Hashes {
		keys := x.scratch[i*per : (i+1)*per]
		x.engStore(r, rs, eh, keys[per-1])
		if per > 1 {
			if rs.multi == nil {
				rs.multi = make(map[uint64][]BlockKey)
			}
			rs.multi[eh] = append(rs.multi[eh][:0], keys...)
		} else if rs.multi != nil {
			delete(rs.multi, eh)
		}
	}
	x.enforceCapacity()
	return tol, nil
}

// ApplyRemoved applies a BlockRemoved event of replica r: for each engine
// hash, the confirmed entries of r for the index blocks it maps to are
// removed, and the mapping forgotten. Other replicas are untouched. Hashes r
// never stored are counted in Stats.UnknownRemoved. It returns the number of
// entries removed and keeps nothing of hashes.
func (x *Index) ApplyRemoved(r ReplicaID, hashes []uint64) int {
	return x.ApplyRemovedGroup(r, 0, hashes)
}

// ApplyRemovedGroup is ApplyRemoved for the blocks of KV-cache group g (a
// BlockRemoved with group_idx g): only r's residency in that group goes,
// and an engine hash's mapping is forgotten once r holds its blocks in no
// group. A group outside [0, MaxGroups) is skipped and counted
// (Stats.SkippedGroupEvents).
func (x *Index) ApplyRemovedGroup(r ReplicaID, g int, hashes []uint64) int {
	return x.applyRemoved(r, g, TierGPU, hashes)
}

// ApplyRemovedTier is ApplyRemoved for an offload tier's copies (a
// BlockRemoved with medium CPU or disk): only r's residency in tier t
// goes; the GPU's and the other tier's stay.
func (x *Index) ApplyRemovedTier(r ReplicaID, t Tier, hashes []uint64) int {
	return x.applyRemoved(r, 0, t, hashes)
}

func (x *Index) applyRemoved(r ReplicaID, g int, tier Tier, hashes []uint64) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	if g < 0 || g >= MaxGroups || tier >= numTiers {
		x.st.skippedGroup++
		return 0
	}
	rs := x.replicas[r]
	removed := 0
	for _, eh := range hashes {
		k, ok := x.engLookup(r, rs, eh)
		if !ok {
			x.st.unknownRemoved++
			continue
		}
		var ks []BlockKey
		multi := false
		if rs != nil {
			ks, multi = rs.multi[eh]
		}
		if multi {
			for _, key := range ks {
				removed += x.removeConfirmed(key, r, g, tier)
			}
		} else {
			removed += x.removeConfirmed(k, r, g, tier)
		}
		// k is the engine block's last key: while r still holds it in a
		// group, so does the engine, and the mapping stays.
		if idx := x.probe(k); idx == 0 || !x.has(idx, r, Confirmed) && x.groupsOf(&x.nodes[idx], r) == 0 {
			x.engRemove(r, rs, eh)
			if multi {
				delete(rs.multi, eh)
			}
		}
	}
	return removed
}

func (x *Index) removeConfirmed(k BlockKey, r ReplicaID, g int, tier Tier) int {
	idx := x.probe(k)
	if idx == 0 {
		return 0
	}
	if tier != TierGPU {
		if x.clearGroups(idx, r, sideBit(0, tier)) {
			return 1
		}
		return 0
	}
	if g == 0 {
		if x.clear(idx, r, Confirmed) {
			return 1
		}
		return 0
	}
	if x.clearGroups(idx, r, 1<<g) {
		return 1
	}
	return 0
}

// ClearReplica removes every confirmed and speculative entry of r and its
// engine map (an AllBlocksCleared event, an engine restart or an
// unrecoverable gap). Speculative entries go too: they stand for routing
// decisions the engine has not confirmed yet, and after a reset they would
// keep steering prompts to the emptied engine until their TTL. History
// entries, the root and the publisher flag stay (history mode deliberately
// knows nothing of engine state). It returns the number of entries removed.
// Cost is proportional to the number of blocks.
func (x *Index) ClearReplica(r ReplicaID) int {
	return x.ClearLedgers(r, Speculative, Confirmed)
}

// ClearLedgers removes every entry of r in the given ledgers (with
// Confirmed, its engine map too) and keeps its root and publisher flag.
// ClearReplica is ClearLedgers(r, Speculative, Confirmed); another engine
// taking r's name (a new address) clears all three, since neither what the
// old one confirmed nor where requests went says anything about the new
// one's cache. It returns the number of entries removed.
func (x *Index) ClearLedgers(r ReplicaID, ledgers ...Ledger) int {
	var mask uint8
	for _, l := range ledgers {
		mask |= 1 << l
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if mask&(1<<Confirmed) != 0 {
		x.engClear(r)
	}
	return x.clearAll(r, mask)
}

// DropReplica removes every entry of r in all ledgers and everything the
// index knows about it (root, engine map, publisher flag): the replica left.
// It returns the number of entries removed.
func (x *Index) DropReplica(r ReplicaID) int {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.engClear(r)
	delete(x.replicas, r)
	x.publishers[r/64] &^= 1 << (r % 64)
	if r < inlineReplicas {
		x.hybrid &^= 1 << r
	}
	return x.clearAll(r, 1<<History|1<<Speculative|1<<Confirmed)
}

func (x *Index) clearAll(r ReplicaID, ledgers uint8) int {
	removed := 0
	for i := 1; i < len(x.nodes); i++ {
		idx := uint32(i)
		if x.nodes[idx].flags.Load()&flagLive == 0 {
			continue
		}
		if ledgers&(1<<Confirmed) != 0 && x.clearGroups(idx, r, 0xFFFF) {
			removed++
			if x.nodes[idx].flags.Load()&flagLive == 0 {
				continue
			}
		}
		for l := range numLedgers {
			if ledgers&(1<<l) != 0 && x.nodes[idx].flags.Load()&flagLive != 0 && x.clear(idx, r, l) {
				removed++
			}
		}
	}
	return removed
}

// engEntry is a shared engine-hash mapping: the kvmesh key of the last index
// block of an engine block, and the replicas (ids < 64) it holds for.
// Engines that hash deterministically (vLLM with a fixed PYTHONHASHSEED)
// give a block the same hash everywhere, so replicas holding the same
// blocks share one map entry instead of paying one each.
type engEntry struct {
	key  BlockKey
	reps uint64
}

// engLookup returns r's mapping for engine hash h. A replica's mapping is
// either in its private map (ids >= 64, or a key that differs from the
// shared one) or in the shared map with its bit set, never both.
func (x *Index) engLookup(r ReplicaID, rs *replicaState, h uint64) (BlockKey, bool) {
	if rs != nil && rs.eng != nil {
		if k, ok := rs.eng[h]; ok {
			return k, true
		}
	}
	if r < inlineReplicas {
		if e := x.eng.ptr(h); e != nil && e.reps&(1<<r) != 0 {
			return e.key, true
		}
	}
	return 0, false
}

// engStore sets r's mapping for engine hash h to k.
func (x *Index) engStore(r ReplicaID, rs *replicaState, h uint64, k BlockKey) {
	if r < inlineReplicas {
		b := uint64(1) << r
		e, existed := x.eng.upsert(h)
		if !existed || e.key == k || e.reps == b {
			if rs.eng != nil {
				if _, had := rs.eng[h]; had {
					delete(rs.eng, h)
					x.engCount--
					rs.engSub(h)
				}
			}
			if e.reps&b == 0 {
				x.engCount++
				rs.engAdd(h)
			}
			e.key, e.reps = k, e.reps|b
			return
		}
		// Another replica maps h to a different key: r's mapping goes private.
		if e.reps&b != 0 {
			e.reps &^= b
			x.engCount--
			rs.engSub(h)
		}
	}
	if rs.eng == nil {
		rs.eng = make(map[uint64]BlockKey)
	}
	if _, had := rs.eng[h]; !had {
		x.engCount++
		rs.engAdd(h)
	}
	rs.eng[h] = k
}

// engRemove deletes r's mapping for engine hash h and returns it.
func (x *Index) engRemove(r ReplicaID, rs *replicaState, h uint64) (BlockKey, bool) {
	if rs != nil && rs.eng != nil {
		if k, ok := rs.eng[h]; ok {
			delete(rs.eng, h)
			x.engCount--
			rs.engSub(h)
			return k, true
		}
	}
	if r < inlineReplicas {
		b := uint64(1) << r
		if e := x.eng.ptr(h); e != nil && e.reps&b != 0 {
			k := e.key
			if e.reps &^= b; e.reps == 0 {
				x.eng.del(h)
			}
			x.engCount--
			if rs != nil { // always: engStore made it
				rs.engSub(h)
			}
			return k, true
		}
	}
	return 0, false
}

// engClear deletes every engine mapping of r. It scans the shared map.
func (x *Index) engClear(r ReplicaID) {
	if rs := x.replicas[r]; rs != nil {
		x.engCount -= len(rs.eng)
		rs.eng, rs.multi = nil, nil
		rs.engN, rs.engSum = 0, 0
	}
	if r >= inlineReplicas {
		return
	}
	b := uint64(1) << r
	emptied := 0
	x.eng.each(func(_ uint64, e *engEntry) {
		if e.reps&b != 0 {
			x.engCount--
			if e.reps &^= b; e.reps == 0 {
				emptied++
			}
		}
	})
	if emptied > 0 {
		// Rehash at the same size, dropping the emptied entries.
		x.eng.resize(len(x.eng.slots))
	}
}

// AppendEngineHashes appends every engine hash currently mapped for replica
// r (stored and not yet removed or cleared), in no particular order. With
// AppendReplicaKeys it lets an end-to-end test compare the index with an
// engine's own block table. It takes the read lock; cost is proportional to
// the engine maps' size.
func (x *Index) AppendEngineHashes(dst []uint64, r ReplicaID) []uint64 {
	x.mu.RLock()
	defer x.mu.RUnlock()
	if r < inlineReplicas {
		x.eng.each(func(h uint64, e *engEntry) {
			if e.reps&(1<<r) != 0 {
				dst = append(dst, h)
			}
		})
	}
	if rs := x.replicas[r]; rs != nil {
		for h := range rs.eng {
			dst = append(dst, h)
		}
	}
	return dst
}

// EngineFingerprint summarises the engine block hashes replica r holds
// (group 0, as AppendEngineHashes lists them): their number and an
// order-independent hash of the set. Two gateways that applied the same
// KV-event stream from the same start hold equal fingerprints; a view
// that missed batches holds a different one (with probability 2^-64 of
// a collision at equal counts). Anti-entropy compares it with the
// engine's owner at equal watermarks, after every batch. The figures are
// kept as mappings change, so it costs one read lock and no scan.
func (x *Index) EngineFingerprint(r ReplicaID) (n int, sum uint64) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	if rs := x.replicas[r]; rs != nil {
		return rs.engN, rs.engSum
	}
	return 0, 0
}

// mix64 is splitmix64's finaliser: it spreads engine hashes (which may be
// small integers, as some publishers number blocks) over 64 bits before
// EngineFingerprint sums them.
func mix64(k uint64) uint64 {
	k ^= k >> 30
	k *= 0xbf58476d1ce4e5b9
	k ^= k >> 27
	k *= 0x94d049bb133111eb
	return k ^ k>>31
}

// AppendReplicaKeys appends the key of every block replica r holds in
// ledger l, in no particular order, ignoring TTLs (entries Expire has not
// removed yet are included). It takes the read lock and scans every block.
func (x *Index) AppendReplicaKeys(dst []BlockKey, r ReplicaID, l Ledger) []BlockKey {
	if l >= numLedgers {
		return dst
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	for i := 1; i < len(x.nodes); i++ {
		if x.nodes[i].flags.Load()&flagLive != 0 && x.has(uint32(i), r, l) {
			dst = append(dst, x.nodes[i].key)
		}
	}
	return dst
}
