package index

import (
	"math/bits"
	"sync"
)

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

// bitsPool holds Match's per-block group bits of hybrid candidates, so
// Match stays free of allocations in the steady state.
var bitsPool = sync.Pool{New: func() any { s := make([]uint16, 0, 1024); return &s }}

// appendHybridRow appends node n's row of group bits for the hybrid
// candidates in hyb (nh of them, in id order): bit 0 the confirmed mask
// (group 0), bits 1.. the side map's groups, every group for an unexpired
// speculative entry (a routing decision stands for the whole prefix in
// every group). Offload tiers are left out. It also returns the hybrid
// candidates holding n in some group. Called with the read lock.
func (x *Index) appendHybridRow(hb []uint16, n *node, hyb uint64, nh int, specOK bool) ([]uint16, uint64) {
	base := len(hb)
	for range nh {
		hb = append(hb, 0)
	}
	row := hb[base:]
	var any uint64
	s := 0
	for h := hyb; h != 0; h &= h - 1 {
		b := h & -h
		switch {
		case specOK && n.masks[Speculative]&b != 0:
			row[s] = groupBits
		case n.masks[Confirmed]&b != 0:
			row[s] = 1
		}
		if row[s] != 0 {
			any |= b
		}
		s++
	}
	if n.flags.Load()&flagGrp != 0 {
		for _, e := range x.grp[n.key] {
			b := uint64(1) << e.r
			if e.r >= inlineReplicas || hyb&b == 0 || e.groups&groupBits == 0 {
				continue
			}
			row[bits.OnesCount64(hyb&(b-1))] |= e.groups & groupBits
			any |= b
		}
	}
	return hb, any
}

// hybridDepths applies vLLM's hybrid hit rule to each hybrid candidate r
// in hyb whose run depth[r] is not 0, over the rows appendHybridRow
// collected (nh per block), and lowers depth[r] to the hit: the longest
// prefix such that every full-attention group holds all its blocks and
// every sliding-window group holds the window's blocks right before the
// hit point (or, when shorter than the window, the prefix from the
// start). Called with the read lock.
func (x *Index) hybridDepths(hb []uint16, hyb uint64, nh int, depth *[inlineReplicas]int32) {
	s := -1
	for h := hyb; h != 0; h &= h - 1 {
		s++
		r := ReplicaID(bits.TrailingZeros64(h))
		d := int(depth[r])
		rs := x.replicas[r]
		if d == 0 || rs == nil {
			continue
		}
		hit := d
		for g := range MaxGroups {
			if sp := &rs.groups[g]; sp.known && sp.kind == GroupFull {
				for i := range hit {
					if hb[i*nh+s]&(1<<g) == 0 {
						hit = i
						break
					}
				}
			}
		}
		// Sliding-window groups may shorten the hit, which can change
		// another window group's answer: repeat until no group shortens
		// it (vLLM's fixed point; one pass for one full and one window
		// group).
		for changed := true; changed; {
			changed = false
			for g := range MaxGroups {
				sp := &rs.groups[g]
				if !sp.known || sp.kind != GroupSliding {
					continue
				}
				if e := windowHit(hb[s:], nh, hit, uint16(1)<<g, sp.window); e < hit {
					hit, changed = e, true
				}
			}
		}
		depth[r] = int32(hit)
	}
}

// windowHit is a sliding-window group's hit within the first n blocks
// (bit g of col[i*stride] set: block i held in the group): scanning from
// the end, the end of the first run of w contiguous held blocks; without
// such a run, the run of held blocks at the start.
func windowHit(col []uint16, stride, n int, g uint16, w int) int {
	run := 0
	for i := n - 1; i >= 0; i-- {
		if col[i*stride]&g == 0 {
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
