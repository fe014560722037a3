package index

import "sync"

// MaxGroups bounds the KV-cache groups the index tracks per replica. A
// stored or removed event of a higher group is skipped and counted
// (Stats.SkippedGroupEvents). vLLM hybrid models have a handful of groups.
const MaxGroups = 14

// Tier is where an engine keeps a cached block: its GPU (the confirmed
// ledger) or an offload tier it loads from instead of recomputing.
type Tier uint8

const (
	// TierGPU is the engine's own KV cache: the confirmed ledger.
	TierGPU Tier = iota
	// TierCPU is host memory (vLLM's CPU offloading, LMCache's CPU cache).
	TierCPU
	// TierDisk is local or remote disk (LMCache's disk backends).
	TierDisk
	numTiers
)

func (t Tier) String() string {
	switch t {
	case TierGPU:
		return "gpu"
	case TierCPU:
		return "cpu"
	case TierDisk:
		return "disk"
	}
	return "unknown"
}

// Side-entry bits: groups 1..MaxGroups-1 at their own bit, offload tiers
// above them.
const (
	groupBits = 1<<MaxGroups - 1
	cpuBit    = 1 << MaxGroups
	diskBit   = 1 << (MaxGroups + 1)
)

// sideBit is the side-entry bit of group g (> 0) or of offload tier t.
func sideBit(g int, t Tier) uint16 {
	switch t {
	case TierCPU:
		return cpuBit
	case TierDisk:
		return diskBit
	}
	return 1 << g
}

// GroupKind is the attention type of a KV-cache group, which decides what
// a prefix hit needs from it (see Match).
type GroupKind uint8

const (
	// GroupFull needs every block of the prefix (full attention, MLA, and
	// any kind the index does not know: the conservative reading).
	GroupFull GroupKind = iota
	// GroupSliding needs only the blocks inside its window before the hit
	// point (sliding-window attention).
	GroupSliding
)

// ParseGroupKind maps vLLM's kv_cache_spec_kind to a GroupKind: names
// containing "sliding" are GroupSliding, everything else (including "")
// GroupFull.
func ParseGroupKind(kind string) GroupKind {
	for i := 0; i+7 <= len(kind); i++ {
		if kind[i:i+7] == "sliding" {
			return GroupSliding
		}
	}
	return GroupFull
}

// groupSpec is what the index learned about one group of a replica.
type groupSpec struct {
	known bool
	kind  GroupKind
	// window is the number of index blocks a sliding-window group needs
	// before the hit point (at least 1).
	window int
}

// grpEntry holds replica r's residency in groups 1..MaxGroups-1 (bit g)
// and in the offload tiers (cpuBit, diskBit) of one block; group 0 on the
// GPU lives in the node's confirmed mask.
type grpEntry struct {
	r      ReplicaID
	groups uint16
}

// learnGroup records s's group spec for r and maintains the hybrid mask.
func (x *Index) learnGroup(r ReplicaID, rs *replicaState, s *StoredBlocks) {
	g := s.Group
	sp := groupSpec{known: true, kind: s.GroupKind, window: 1}
	if sp.kind == GroupSliding && s.Window > 1 {
		// vLLM: cdiv(window-1, engine block) engine blocks must be cached
		// contiguously before the hit point; in index blocks, times per.
		per := s.BlockTokens / x.h.tokens
		sp.window = (s.Window - 1 + s.BlockTokens - 1) / s.BlockTokens * per
	}
	if g > 0 && !rs.groups[0].known {
		// An engine that names group g has a group 0; until an event of
		// group 0 says otherwise, it is taken as full attention.
		rs.groups[0] = groupSpec{known: true, kind: GroupFull, window: 1}
		rs.ngroups++
	}
	if rs.groups[g] == sp {
		return
	}
	if !rs.groups[g].known {
		rs.ngroups++
	}
	rs.groups[g] = sp
	// More than one group: match by hybridHit. A model whose only group
	// is a sliding window is matched on its leading run, which is never
	// more than vLLM's hit (blocks freed outside the window end it early).
	if r < inlineReplicas && rs.ngroups > 1 {
		x.hybrid |= 1 << r
	}
}

// setSide adds r's side entry bit (sideBit) for node idx.
func (x *Index) setSide(idx uint32, r ReplicaID, bit uint16) {
	n := &x.nodes[idx]
	es := x.grp[n.key]
	for i := range es {
		if es[i].r == r {
			if es[i].groups&bit == 0 {
				es[i].groups |= bit
				x.grpEntries++
			}
			return
		}
	}
	x.grp[n.key] = append(es, grpEntry{r: r, groups: bit})
	n.flags.Or(flagGrp)
	x.grpEntries++
}

// clearGroups removes r's residency of node idx in the groups of mask and
// reports whether there was any. It frees the node when it becomes empty.
func (x *Index) clearGroups(idx uint32, r ReplicaID, mask uint16) bool {
	n := &x.nodes[idx]
	if n.flags.Load()&flagGrp == 0 {
		return false
	}
	es := x.grp[n.key]
	for i := range es {
		if es[i].r != r {
			continue
		}
		had := es[i].groups & mask
		if had == 0 {
			return false
		}
		x.grpEntries -= popcount16(had)
		if es[i].groups &^= mask; es[i].groups == 0 {
			es[i] = es[len(es)-1]
			es = es[:len(es)-1]
			if len(es) == 0 {
				delete(x.grp, n.key)
				n.flags.And(^flagGrp)
			} else {
				x.grp[n.key] = es
			}
		}
		x.freeIfEmpty(idx)
		return true
	}
	return false
}

// groupsOf returns r's group bits (1..) of node n.
func (x *Index) groupsOf(n *node, r ReplicaID) uint16 {
	if n.flags.Load()&flagGrp == 0 {
		return 0
	}
	for _, e := range x.grp[n.key] {
		if e.r == r {
			return e.groups
		}
	}
	return 0
}

// grpHeld returns the replicas of want (ids < 64) holding node n in some
// group above 0.
func (x *Index) grpHeld(n *node, want uint64) uint64 {
	var held uint64
	for _, e := range x.grp[n.key] {
		if e.r < inlineReplicas && e.groups&groupBits != 0 {
			held |= 1 << e.r
		}
	}
	return held & want
}

// dropGroups removes every group entry of node idx (eviction) and returns
// how many there were. It does not free the node.
func (x *Index) dropGroups(idx uint32) int {
	n := &x.nodes[idx]
	if n.flags.Load()&flagGrp == 0 {
		return 0
	}
	c := 0
	for _, e := range x.grp[n.key] {
		c += popcount16(e.groups)
	}
	delete(x.grp, n.key)
	n.flags.And(^flagGrp)
	x.grpEntries -= c
	return c
}

func popcount16(v uint16) int {
	c := 0
	for ; v != 0; v &= v - 1 {
		c++
	}
	return c
}

// bitsPool holds hybridHit's per-block scratch, so Match stays free of
// allocations in the steady state.
var bitsPool = sync.Pool{New: func() any { s := make([]uint16, 0, 512); return &s }}

// hybridHit applies vLLM's hybrid hit rule to replica r (id < 64, hybrid)
// over keys, every one of which r holds in some group (or speculatively):
// the hit is the longest prefix such that every full-attention group holds
// all its blocks and every sliding-window group holds the window's blocks
// right before the hit point (or, when shorter than the window, the
// prefix from the start). r's speculative entries unexpired at tick t
// count in every group (a routing decision stands for the whole prefix).
// Called with the read lock.
func (x *Index) hybridHit(keys []BlockKey, r ReplicaID, rs *replicaState, t uint32) int {
	bp := bitsPool.Get().(*[]uint16)
	bits := (*bp)[:0]
	b := uint64(1) << r
	var prev uint32
	for _, k := range keys {
		idx := x.find(k, prev)
		if idx == 0 {
			break
		}
		n := &x.nodes[idx]
		var v uint16
		switch {
		case n.masks[Speculative]&b != 0 && alive(t, n.stime, x.specTTL):
			v = 0xFFFF
		default:
			if n.masks[Confirmed]&b != 0 {
				v = 1
			}
			v |= x.groupsOf(n, r)
		}
		bits = append(bits, v)
		prev = idx
	}
	hit := len(bits)
	for g := range MaxGroups {
		if sp := &rs.groups[g]; sp.known && sp.kind == GroupFull {
			for i := range hit {
				if bits[i]&(1<<g) == 0 {
					hit = i
					break
				}
			}
		}
	}
	// Sliding-window groups may shorten the hit, which can change another
	// window group's answer: repeat until no group shortens it (vLLM's
	// fixed point; one pass for one full and one window group).
	for changed := true; changed; {
		changed = false
		for g := range MaxGroups {
			sp := &rs.groups[g]
			if !sp.known || sp.kind != GroupSliding {
				continue
			}
			if e := windowHit(bits[:hit], uint16(1)<<g, sp.window); e < hit {
				hit, changed = e, true
			}
		}
	}
	*bp = bits
	bitsPool.Put(bp)
	return hit
}

// windowHit is a sliding-window group's hit within bits: scanning from the
// end, the end of the first run of w contiguous blocks held in the group;
// without such a run, the run of held blocks at the start.
func windowHit(bits []uint16, g uint16, w int) int {
	run := 0
	for i := len(bits) - 1; i >= 0; i-- {
		if bits[i]&g == 0 {
			run = 0
			continue
		}
		if run++; run >= w {
			return i + run
		}
	}
	return run
}

// MatchTiers is Match (gpu receives what Match's out would) that also
// reports, for each candidate whose events mode trusts, the blocks right
// after its GPU match that its offload tiers hold: the run of following
// blocks held on CPU or disk, of which cpu[j] are on CPU and disk[j] only
// on disk. An engine with an offload connector loads that run instead of
// recomputing it (route prices the load as a transfer). Candidates read
// from history, and replica ids of 64 and above, get 0. gpu, cpu and disk
// must be at least as long as candidates. Like Match it takes the read
// lock once, does not allocate and keeps nothing of its arguments; it
// returns the longest GPU match.
func (x *Index) MatchTiers(keys []BlockKey, candidates []ReplicaID, mode Mode, now int64, gpu, cpu, disk []int32) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	longest := x.matchLocked(keys, candidates, mode, now, gpu)
	cpu, disk = cpu[:len(candidates)], disk[:len(candidates)]
	for j, r := range candidates {
		cpu[j], disk[j] = 0, 0
		if r >= inlineReplicas || !x.trustsEvents(mode, r) {
			continue
		}
		var prev uint32
		for _, k := range keys[gpu[j]:] {
			idx := x.find(k, prev)
			if idx == 0 {
				break
			}
			b := x.groupsOf(&x.nodes[idx], r)
			if b&cpuBit != 0 {
				cpu[j]++
			} else if b&diskBit != 0 {
				disk[j]++
			} else {
				break
			}
			prev = idx
		}
	}
	return longest
}

// AppendReplicaTierKeys appends the key of every block replica r holds in
// offload tier t (TierCPU or TierDisk; nothing for TierGPU, whose keys
// AppendReplicaKeys lists), in no particular order. Like AppendReplicaKeys
// it is for comparing the index with an engine's own tables: it takes the
// read lock and scans every block.
func (x *Index) AppendReplicaTierKeys(dst []BlockKey, r ReplicaID, t Tier) []BlockKey {
	if t == TierGPU || t >= numTiers {
		return dst
	}
	bit := sideBit(0, t)
	x.mu.RLock()
	defer x.mu.RUnlock()
	for i := 1; i < len(x.nodes); i++ {
		n := &x.nodes[i]
		if n.flags.Load()&(flagLive|flagGrp) == flagLive|flagGrp && x.groupsOf(n, r)&bit != 0 {
			dst = append(dst, n.key)
		}
	}
	return dst
}
