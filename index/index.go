package index

import (
	"fmt"
	"math/bits"
	"sync"
	"sync/atomic"
)

// inlineReplicas is the number of replica ids (0..63) kept in the per-block
// bitmasks; larger ids go to the overflow map.
const inlineReplicas = 64

const (
	flagLive uint32 = 1 << 0 // node holds at least one entry
	// flagUse is a 2-bit CLOCK use counter (GCLOCK): a new block starts at
	// useNew, Match and repeated writes set it to flagUse (3), the clock
	// hand decrements it and evicts the block at 0.
	flagUse uint32 = 3 << 1
	useNew  uint32 = 1 << 1
	flagOvf uint32 = 1 << 3 // overflow entries exist for this key
	flagGrp uint32 = 1 << 4 // group entries (KV-cache groups above 0) exist for this key
)

// node is one block key with every replica that holds it. 48 bytes, no
// pointers: the node arena is a flat slice the GC does not scan.
type node struct {
	key   BlockKey
	masks [numLedgers]uint64 // bit r: replica r (< 64) holds the block in that ledger
	next  uint32             // hint: node index of the most recently seen successor
	htime uint32             // tick of the last history record of this block
	stime uint32             // tick of the last speculative record of this block
	flags atomic.Uint32      // flagLive|flagUse|flagOvf|flagGrp; atomic because Match sets flagUse under RLock
}

// ovfEntry is an entry for a replica id >= 64: bit l of ledgers set when the
// replica holds the block in ledger l.
type ovfEntry struct {
	r       ReplicaID
	ledgers uint8
}

// replicaState is what the index knows about one replica's engine.
type replicaState struct {
	root    BlockKey
	hasRoot bool
	// eng maps an engine block hash to the kvmesh key of the last index
	// block it contains (the chain parent of the engine's next block), for
	// mappings not kept in the shared map (see engEntry). Nil when empty.
	eng map[uint64]BlockKey
	// multi holds every key of engine blocks that span several index blocks.
	multi map[uint64][]BlockKey
	// groups is what the replica's events said about its KV-cache groups;
	// ngroups counts the known ones (more than one: a hybrid model).
	groups  [MaxGroups]groupSpec
	ngroups int
	// engN and engSum are EngineFingerprint's figures, kept as mappings
	// come and go (engAdd, engSub) so that reading them costs nothing:
	// the number of engine hashes mapped for the replica, shared or
	// private, and the sum of their mix64.
	engN   int
	engSum uint64
}

// engAdd counts engine hash h as mapped for the replica.
func (rs *replicaState) engAdd(h uint64) { rs.engN++; rs.engSum += mix64(h) }

// engSub counts engine hash h as no longer mapped.
func (rs *replicaState) engSub(h uint64) { rs.engN--; rs.engSum -= mix64(h) }

// Index is the prefix index. See the package documentation for the contract.
type Index struct {
	mu      sync.RWMutex
	h       Hasher
	cfg     Config
	histTTL int32
	specTTL int32

	nodes []node   // arena; index 0 is a permanently unused sentinel
	free  []uint32 // free node indices
	table []uint64 // open addressing, linear probing: tag<<32 | node index, 0 = empty
	shift uint     // 64 - log2(len(table))
	live  int      // live nodes

	clockHand  uint32
	expireHand uint32

	ovf        map[BlockKey][]ovfEntry
	publishers [MaxReplicas / 64]uint64
	replicas   map[ReplicaID]*replicaState
	eng        engMap // shared engine-hash mappings, see engEntry
	engCount   int    // (replica, engine hash) mappings in total

	// grp holds confirmed residency in KV-cache groups above 0, per key
	// (flagGrp marks the nodes that have some); group 0 is the confirmed
	// mask. grpEntries counts (block, replica, group) entries there.
	grp        map[BlockKey][]grpEntry
	grpEntries int
	// hybrid marks replicas (ids < 64) with more than one known group,
	// whose matches follow vLLM's hybrid hit rule (hybridHit).
	hybrid uint64

	entries [numLedgers]int
	st      counters
	sink    uint64 // keeps touch's loads from being optimised away
	scratch []BlockKey
}

type counters struct {
	evictions      uint64
	expired        uint64
	promoted       uint64
	unknownParent  uint64
	unknownRemoved uint64
	parentZero     uint64
	skippedGroup   uint64
}

// New returns an empty Index for cfg.
func New(cfg Config) (*Index, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	h, err := NewHasher(cfg.Seed, cfg.BlockTokens)
	if err != nil {
		return nil, err
	}
	x := &Index{h: h, cfg: cfg}
	x.histTTL = ttlTicks(cfg.HistoryTTL)
	x.specTTL = ttlTicks(cfg.SpeculativeTTL)
	x.reset()
	return x, nil
}

func (x *Index) reset() {
	x.nodes = make([]node, 1, 1024)
	x.free = nil
	x.table = make([]uint64, 1024)
	x.shift = 64 - 10
	x.live = 0
	x.clockHand, x.expireHand = 0, 0
	x.ovf = make(map[BlockKey][]ovfEntry)
	x.publishers = [MaxReplicas / 64]uint64{}
	x.replicas = make(map[ReplicaID]*replicaState)
	x.eng = engMap{}
	x.engCount = 0
	x.grp = make(map[BlockKey][]grpEntry)
	x.grpEntries = 0
	x.hybrid = 0
	x.entries = [numLedgers]int{}
}

// Hasher returns the index's Hasher (seed and block size from its Config).
func (x *Index) Hasher() Hasher { return x.h }

// Config returns the configuration the index was built with.
func (x *Index) Config() Config { return x.cfg }

// Table slots hold tag<<32 | node index (0 = empty), where tag is the top 32
// bits of the key's multiplicative hash. Probes compare tags without touching
// the node arena, and a slot's home position is the top bits of its tag, so
// growing and deleting never read nodes either.
func hashKey(k BlockKey) uint64 { return uint64(k) * 0x9E3779B97F4A7C15 }

func (x *Index) home(tag uint32) uint64 { return uint64(tag) >> (x.shift - 32) }

// probe returns the node index of k, or 0.
func (x *Index) probe(k BlockKey) uint32 {
	hk := hashKey(k)
	tag := uint32(hk >> 32)
	m := uint64(len(x.table) - 1)
	for i := hk >> x.shift; ; i = (i + 1) & m {
		e := x.table[i]
		if e == 0 {
			return 0
		}
		if uint32(e>>32) == tag && x.nodes[uint32(e)].key == k {
			return uint32(e)
		}
	}
}

// find returns the node index of k, trying prev's successor hint first.
func (x *Index) find(k BlockKey, prev uint32) uint32 {
	if prev != 0 {
		if nx := x.nodes[prev].next; nx != 0 {
			n := &x.nodes[nx]
			if n.key == k && n.flags.Load()&flagLive != 0 {
				return nx
			}
		}
	}
	return x.probe(k)
}

// insert returns the node index of k, creating a live node if needed, and
// marks it used. It may grow x.nodes: callers must not hold node pointers
// across it.
func (x *Index) insert(k BlockKey, prev uint32) uint32 {
	if prev != 0 {
		if nx := x.nodes[prev].next; nx != 0 {
			if n := &x.nodes[nx]; n.key == k && n.flags.Load()&flagLive != 0 {
				n.flags.Or(flagUse)
				return nx
			}
		}
	}
	// Up to 7/8 full: probes compare the slots' 32-bit tags and never
	// touch the node arena, and Match mostly follows the chain hints
	// instead of probing, so a fuller table costs little and keeps the
	// table at 9 to 18 bytes per block instead of 11 to 21 (issue 16's
	// memory target).
	if (x.live+1)*8 > len(x.table)*7 {
		x.grow()
	}
	// One probe finds either the node or the empty slot it goes into.
	hk := hashKey(k)
	tag := uint32(hk >> 32)
	m := uint64(len(x.table) - 1)
	i := hk >> x.shift
	for ; x.table[i] != 0; i = (i + 1) & m {
		e := x.table[i]
		if uint32(e>>32) == tag && x.nodes[uint32(e)].key == k {
			x.nodes[uint32(e)].flags.Or(flagUse)
			return uint32(e)
		}
	}
	var idx uint32
	if n := len(x.free); n > 0 {
		idx = x.free[n-1]
		x.free = x.free[:n-1]
	} else {
		if len(x.nodes) == cap(x.nodes) {
			x.growNodes()
		}
		x.nodes = append(x.nodes, node{})
		idx = uint32(len(x.nodes) - 1)
	}
	n := &x.nodes[idx]
	n.key = k
	n.masks = [numLedgers]uint64{}
	n.next, n.htime, n.stime = 0, 0, 0
	n.flags.Store(flagLive | useNew)
	x.table[i] = uint64(tag)<<32 | uint64(idx)
	x.live++
	return idx
}

// growNodes makes room for more nodes. A large arena grows by 1/16 of its
// size rather than append's 1.25x, so that its unused tail stays under
// 1/16 of the nodes (about 3 B per block on average instead of about 6,
// and at most 3 B instead of 12; issue 16's memory target). Each growth
// copies the arena under the write lock, as append would, only more
// often: amortised, every node is copied about 16 times over the index's
// life.
func (x *Index) growNodes() {
	n := len(x.nodes)
	add := n / 16
	if n < 1<<16 {
		add = n // small arenas double, as append does
	}
	grown := make([]node, n, n+max(add, 1024))
	copy(grown, x.nodes)
	x.nodes = grown
}

// touch loads the table slots of keys before a writer inserts them. The
// loads are independent, so their cache misses overlap instead of being paid
// one after another inside the insert loop.
func (x *Index) touch(keys []BlockKey) {
	var acc uint64
	for _, k := range keys {
		acc ^= x.table[hashKey(k)>>x.shift]
	}
	x.sink = acc
}

func (x *Index) grow() {
	old := x.table
	x.table = make([]uint64, len(old)*2)
	x.shift--
	m := uint64(len(x.table) - 1)
	for _, e := range old {
		if e == 0 {
			continue
		}
		i := x.home(uint32(e >> 32))
		for x.table[i] != 0 {
			i = (i + 1) & m
		}
		x.table[i] = e
	}
}

// unlink removes node idx from the table (backward-shift deletion) and frees it.
func (x *Index) unlink(idx uint32) {
	n := &x.nodes[idx]
	m := uint64(len(x.table) - 1)
	i := hashKey(n.key) >> x.shift
	for uint32(x.table[i]) != idx {
		i = (i + 1) & m
	}
	for j := (i + 1) & m; ; j = (j + 1) & m {
		e := x.table[j]
		if e == 0 {
			break
		}
		home := x.home(uint32(e >> 32))
		// Move e back into the hole at i unless its home lies cyclically in (i, j].
		if (j-home)&m >= (j-i)&m {
			x.table[i] = e
			i = j
		}
	}
	x.table[i] = 0
	if n.flags.Load()&flagOvf != 0 {
		delete(x.ovf, n.key)
	}
	if n.flags.Load()&flagGrp != 0 {
		x.dropGroups(idx)
	}
	n.key = 0
	n.masks = [numLedgers]uint64{}
	n.next = 0
	n.flags.Store(0)
	x.free = append(x.free, idx)
	x.live--
}

// has reports whether replica r holds node idx in ledger l (ignoring TTLs).
func (x *Index) has(idx uint32, r ReplicaID, l Ledger) bool {
	n := &x.nodes[idx]
	if r < inlineReplicas {
		return n.masks[l]&(1<<r) != 0
	}
	if n.flags.Load()&flagOvf == 0 {
		return false
	}
	for _, e := range x.ovf[n.key] {
		if e.r == r {
			return e.ledgers&(1<<l) != 0
		}
	}
	return false
}

// set adds (idx, r) to ledger l and reports whether it was new.
func (x *Index) set(idx uint32, r ReplicaID, l Ledger) bool {
	n := &x.nodes[idx]
	if r < inlineReplicas {
		b := uint64(1) << r
		if n.masks[l]&b != 0 {
			return false
		}
		n.masks[l] |= b
		x.entries[l]++
		return true
	}
	es := x.ovf[n.key]
	for i := range es {
		if es[i].r == r {
			if es[i].ledgers&(1<<l) != 0 {
				return false
			}
			es[i].ledgers |= 1 << l
			x.entries[l]++
			return true
		}
	}
	x.ovf[n.key] = append(es, ovfEntry{r: r, ledgers: 1 << l})
	n.flags.Or(flagOvf)
	x.entries[l]++
	return true
}

// clear removes (idx, r) from ledger l and reports whether it was there. It
// frees the node when it becomes empty; idx must not be used afterwards then.
func (x *Index) clear(idx uint32, r ReplicaID, l Ledger) bool {
	n := &x.nodes[idx]
	found := false
	if r < inlineReplicas {
		b := uint64(1) << r
		if n.masks[l]&b != 0 {
			n.masks[l] &^= b
			found = true
		}
	} else if n.flags.Load()&flagOvf != 0 {
		es := x.ovf[n.key]
		for i := range es {
			if es[i].r == r && es[i].ledgers&(1<<l) != 0 {
				es[i].ledgers &^= 1 << l
				found = true
				if es[i].ledgers == 0 {
					es[i] = es[len(es)-1]
					es = es[:len(es)-1]
					x.setOvf(n, es)
				}
				break
			}
		}
	}
	if found {
		x.entries[l]--
		x.freeIfEmpty(idx)
	}
	return found
}

func (x *Index) setOvf(n *node, es []ovfEntry) {
	if len(es) == 0 {
		delete(x.ovf, n.key)
		n.flags.And(^flagOvf)
		return
	}
	x.ovf[n.key] = es
}

// clearLedger removes every entry of node idx in ledger l and returns how
// many there were. It does not free the node.
func (x *Index) clearLedger(idx uint32, l Ledger) int {
	n := &x.nodes[idx]
	c := bits.OnesCount64(n.masks[l])
	n.masks[l] = 0
	if n.flags.Load()&flagOvf != 0 {
		es := x.ovf[n.key]
		k := 0
		for _, e := range es {
			if e.ledgers&(1<<l) != 0 {
				c++
				e.ledgers &^= 1 << l
			}
			if e.ledgers != 0 {
				es[k] = e
				k++
			}
		}
		x.setOvf(n, es[:k])
	}
	x.entries[l] -= c
	return c
}

func (x *Index) freeIfEmpty(idx uint32) bool {
	n := &x.nodes[idx]
	if n.masks[0]|n.masks[1]|n.masks[2] != 0 || n.flags.Load()&(flagOvf|flagGrp) != 0 {
		return false
	}
	x.unlink(idx)
	return true
}

// evict removes node idx with all its entries and returns how many.
func (x *Index) evict(idx uint32) int {
	c := 0
	for l := range numLedgers {
		c += x.clearLedger(idx, l)
	}
	c += x.dropGroups(idx)
	x.unlink(idx)
	return c
}

// total counts the entries Capacity bounds: every ledger's plus the
// confirmed entries of KV-cache groups above 0.
func (x *Index) total() int { return x.entries[0] + x.entries[1] + x.entries[2] + x.grpEntries }

// enforceCapacity evicts whole blocks in CLOCK order (see flagUse) until the
// entry count is within Capacity. Each node is passed over at most four
// times per call, enough to bring any use counter to 0.
func (x *Index) enforceCapacity() {
	if x.total() <= x.cfg.Capacity {
		return
	}
	budget := 4 * len(x.nodes)
	for x.total() > x.cfg.Capacity && budget > 0 && x.live > 0 {
		budget--
		x.clockHand++
		if int(x.clockHand) >= len(x.nodes) {
			x.clockHand = 1
		}
		n := &x.nodes[x.clockHand]
		f := n.flags.Load()
		if f&flagLive == 0 {
			continue
		}
		if f&flagUse != 0 {
			n.flags.Store(f - useNew)
			continue
		}
		x.st.evictions += uint64(x.evict(x.clockHand))
	}
}

// SetPublishesEvents marks whether replica r publishes KV events; ModeHybrid
// trusts confirmed and speculative entries for such replicas and history
// entries for the others. Safe for concurrent use.
func (x *Index) SetPublishesEvents(r ReplicaID, publishes bool) {
	x.mu.Lock()
	if publishes {
		x.publishers[r/64] |= 1 << (r % 64)
	} else {
		x.publishers[r/64] &^= 1 << (r % 64)
	}
	x.mu.Unlock()
}

func (x *Index) publishes(r ReplicaID) bool { return x.publishers[r/64]&(1<<(r%64)) != 0 }

// trustsEvents reports whether, in mode, Match reads r's confirmed and
// speculative ledgers (true) or its history ledger (false).
func (x *Index) trustsEvents(mode Mode, r ReplicaID) bool {
	switch mode {
	case ModeKVEvents:
		return true
	case ModeHybrid:
		return x.publishes(r)
	}
	return false
}

// Match computes, for each candidate, the number of leading consecutive
// blocks of keys it holds in the ledgers mode trusts, and returns the
// largest. out[j] receives the count for candidates[j]; out must be at least
// as long as candidates (Match panics otherwise). Expired history and
// speculative entries are ignored even before Expire removes them. The walk
// stops at the first block no candidate holds. Match takes the read lock
// once, does not allocate, keeps nothing of its arguments, and marks the
// blocks it matched as recently used. An unknown mode behaves as ModeHistory.
//
// A replica (id < 64) whose events named more than one KV-cache group (a
// hybrid-attention model) is matched, in the ledgers of its events, by
// vLLM's hybrid hit rule (HybridKVCacheCoordinator with FullAttention and
// SlidingWindow managers; see the package doc for the version): every full-attention group
// must hold every block of the prefix, and each sliding-window group only
// the ceil((window-1)/engine block) engine blocks right before the hit
// point (or the whole prefix when it is shorter than that); the hit is the
// longest prefix all groups accept. Its speculative entries count in every
// group. vLLM's own cap (at most the prompt minus one token) is the
// caller's business, as for single-group replicas. Replica ids of 64 and
// above are matched on group 0 only.
func (x *Index) Match(keys []BlockKey, candidates []ReplicaID, mode Mode, now int64, out []int32) int {
	out = out[:len(candidates)]
	x.mu.RLock()
	if x.hybrid != 0 {
		// Some replica needs the hybrid rule: the general walk (kept
		// apart so this one, the common case, stays as lean as it was).
		longest := x.matchLocked(keys, candidates, mode, now, out)
		x.mu.RUnlock()
		return longest
	}
	var wantH, wantE uint64
	nOver := 0
	for j, r := range candidates {
		out[j] = 0
		if r >= inlineReplicas {
			out[j] = -1 // still matching; resolved below
			nOver++
			continue
		}
		if x.trustsEvents(mode, r) {
			wantE |= 1 << r
		} else {
			wantH |= 1 << r
		}
	}
	t := tickOf(now)
	var depth [inlineReplicas]int32
	live := wantH | wantE
	overLive := nOver
	matched := 0
	var prev uint32
	if live != 0 || overLive != 0 {
		for i, k := range keys {
			idx := x.find(k, prev)
			if idx == 0 {
				break
			}
			n := &x.nodes[idx]
			held := n.masks[Confirmed]
			if alive(t, n.stime, x.specTTL) {
				held |= n.masks[Speculative]
			}
			held &= wantE
			if alive(t, n.htime, x.histTTL) {
				held |= n.masks[History] & wantH
			}
			for d := live &^ held; d != 0; d &= d - 1 {
				depth[bits.TrailingZeros64(d)] = int32(i)
			}
			live &= held
			if overLive > 0 {
				overLive = x.matchOverflow(n, candidates, mode, t, out, i, overLive)
			}
			if live == 0 && overLive == 0 {
				break
			}
			if n.flags.Load()&flagUse != flagUse {
				n.flags.Or(flagUse)
			}
			matched = i + 1
			prev = idx
		}
	}
	x.mu.RUnlock()
	for d := live; d != 0; d &= d - 1 {
		depth[bits.TrailingZeros64(d)] = int32(matched)
	}
	longest := 0
	for j, r := range candidates {
		if r < inlineReplicas {
			out[j] = depth[r]
		} else if out[j] < 0 {
			out[j] = int32(matched)
		}
		if int(out[j]) > longest {
			longest = int(out[j])
		}
	}
	return longest
}

// matchLocked is Match with the read lock held, for every replica kind
// (hybrid replicas included). Match itself runs a copy of this walk
// without the hybrid rows while no replica is hybrid: the rows' extra live
// state in the loop cost about 15% on short matches (partial64 348 ->
// 409 cpu-ns/op).
func (x *Index) matchLocked(keys []BlockKey, candidates []ReplicaID, mode Mode, now int64, out []int32) int {
	out = out[:len(candidates)]
	var wantH, wantE uint64
	nOver := 0
	for j, r := range candidates {
		out[j] = 0
		if r >= inlineReplicas {
			out[j] = -1 // still matching; resolved below
			nOver++
			continue
		}
		if x.trustsEvents(mode, r) {
			wantE |= 1 << r
		} else {
			wantH |= 1 << r
		}
	}
	t := tickOf(now)
	var depth [inlineReplicas]int32
	live := wantH | wantE
	// Hybrid replicas hold a block while any of their groups does; the
	// hybrid rule then trims their run below.
	hyb := wantE & x.hybrid
	// hb holds, block by block, each hybrid candidate's group bits (one
	// row of nh per block) for the hybrid rule after the walk.
	var hb []uint16
	var hbp *[]uint16
	nh := bits.OnesCount64(hyb)
	if hyb != 0 {
		hbp = bitsPool.Get().(*[]uint16)
		hb = (*hbp)[:0]
	}
	overLive := nOver
	matched := 0
	var prev uint32
	if live != 0 || overLive != 0 {
		for i, k := range keys {
			idx := x.find(k, prev)
			if idx == 0 {
				break
			}
			n := &x.nodes[idx]
			held := n.masks[Confirmed]
			specOK := alive(t, n.stime, x.specTTL)
			if specOK {
				held |= n.masks[Speculative]
			}
			if hyb != 0 {
				var any uint64
				hb, any = x.appendHybridRow(hb, n, hyb, nh, specOK)
				held |= any
			}
			held &= wantE
			if alive(t, n.htime, x.histTTL) {
				held |= n.masks[History] & wantH
			}
			for d := live &^ held; d != 0; d &= d - 1 {
				depth[bits.TrailingZeros64(d)] = int32(i)
			}
			live &= held
			if overLive > 0 {
				overLive = x.matchOverflow(n, candidates, mode, t, out, i, overLive)
			}
			if live == 0 && overLive == 0 {
				break
			}
			if n.flags.Load()&flagUse != flagUse {
				n.flags.Or(flagUse)
			}
			matched = i + 1
			prev = idx
		}
	}
	for d := live; d != 0; d &= d - 1 {
		depth[bits.TrailingZeros64(d)] = int32(matched)
	}
	if hyb != 0 {
		x.hybridDepths(hb, hyb, nh, &depth)
		*hbp = hb
		bitsPool.Put(hbp)
	}
	longest := 0
	for j, r := range candidates {
		if r < inlineReplicas {
			out[j] = depth[r]
		} else if out[j] < 0 {
			out[j] = int32(matched)
		}
		if int(out[j]) > longest {
			longest = int(out[j])
		}
	}
	return longest
}

// matchOverflow advances candidates with ids >= 64 (out[j] == -1 while they
// still match) over block i held in node n; it returns how many still match.
func (x *Index) matchOverflow(n *node, candidates []ReplicaID, mode Mode, t uint32, out []int32, i, overLive int) int {
	var es []ovfEntry
	if n.flags.Load()&flagOvf != 0 {
		es = x.ovf[n.key]
	}
	specOK := alive(t, n.stime, x.specTTL)
	histOK := alive(t, n.htime, x.histTTL)
	for j, r := range candidates {
		if r < inlineReplicas || out[j] != -1 {
			continue
		}
		var ledgers uint8
		for _, e := range es {
			if e.r == r {
				ledgers = e.ledgers
				break
			}
		}
		var ok bool
		if x.trustsEvents(mode, r) {
			ok = ledgers&(1<<Confirmed) != 0 || specOK && ledgers&(1<<Speculative) != 0
		} else {
			ok = histOK && ledgers&(1<<History) != 0
		}
		if !ok {
			out[j] = int32(i)
			overLive--
		}
	}
	return overLive
}

// Record notes that replica r probably holds keys (a routing decision) in
// the History or Speculative ledger at time now (Unix nanoseconds), and
// refreshes that ledger's TTL for these blocks. If a block's ledger had
// already expired, its stale entries are dropped first. A now older than
// the block's last record of that ledger (a late peer batch) never moves
// its time back: the later one is kept. Record links the
// keys as a chain so that later Matches of the same prefix follow it.
// It keeps nothing of keys.
func (x *Index) Record(keys []BlockKey, r ReplicaID, l Ledger, now int64) error {
	if l != History && l != Speculative {
		return fmt.Errorf("%w: Record writes history or speculative, not %v", ErrInvalidLedger, l)
	}
	t := tickOf(now)
	x.mu.Lock()
	defer x.mu.Unlock()
	var prev uint32
	for _, k := range keys {
		idx := x.insert(k, prev)
		n := &x.nodes[idx]
		if l == History {
			x.stamp(idx, &n.htime, History, x.histTTL, t)
		} else {
			x.stamp(idx, &n.stime, Speculative, x.specTTL, t)
		}
		x.set(idx, r, l)
		if prev != 0 {
			x.nodes[prev].next = idx
		}
		prev = idx
	}
	x.enforceCapacity()
	return nil
}

// stamp moves ledger l's timestamp *ts of node idx to tick t for a write
// at t. It never moves it back while the ledger holds live entries: a late
// write (a peer's delayed batch, a clock that stepped back) must not
// shorten the TTL a later write set, so the later of the two is kept (the
// late write's replica then shares that TTL: timestamps are per block). A
// ledger whose timestamp expired at t is cleared first and takes t, as
// does one without entries.
func (x *Index) stamp(idx uint32, ts *uint32, l Ledger, ttl int32, t uint32) {
	switch {
	case !x.holdsLedger(idx, l):
		*ts = t
	case !alive(t, *ts, ttl):
		x.clearLedger(idx, l)
		*ts = t
	case int32(t-*ts) > 0:
		*ts = t
	}
}

// holdsLedger reports whether node idx has an entry in ledger l.
func (x *Index) holdsLedger(idx uint32, l Ledger) bool {
	n := &x.nodes[idx]
	if n.masks[l] != 0 {
		return true
	}
	if n.flags.Load()&flagOvf != 0 {
		for _, e := range x.ovf[n.key] {
			if e.ledgers&(1<<l) != 0 {
				return true
			}
		}
	}
	return false
}

// Expire removes history and speculative entries whose TTL has passed at
// now (Unix nanoseconds). It examines at most maxNodes blocks (all if
// maxNodes <= 0), continuing where the previous call stopped, so a caller
// can bound the time it holds the write lock. It returns the number of
// entries removed and of blocks examined.
func (x *Index) Expire(now int64, maxNodes int) (expired, scanned int) {
	t := tickOf(now)
	x.mu.Lock()
	defer x.mu.Unlock()
	limit := len(x.nodes) - 1
	if maxNodes > 0 && maxNodes < limit {
		limit = maxNodes
	}
	for ; scanned < limit; scanned++ {
		x.expireHand++
		if int(x.expireHand) >= len(x.nodes) {
			x.expireHand = 1
		}
		idx := x.expireHand
		n := &x.nodes[idx]
		if n.flags.Load()&flagLive == 0 {
			continue
		}
		if !alive(t, n.htime, x.histTTL) {
			expired += x.clearLedger(idx, History)
		}
		if !alive(t, n.stime, x.specTTL) {
			expired += x.clearLedger(idx, Speculative)
		}
		x.freeIfEmpty(idx)
	}
	x.st.expired += uint64(expired)
	return expired, scanned
}

// Stats is a point-in-time summary of an Index.
type Stats struct {
	// Entries counts (block, replica) entries per ledger, indexed by Ledger.
	Entries [numLedgers]int
	// Blocks is the number of distinct block keys held.
	Blocks int
	// EngineHashes is the number of engine hashes mapped over all replicas.
	EngineHashes int
	// Evictions counts entries removed to respect Capacity.
	Evictions uint64
	// Expired counts entries removed by Expire.
	Expired uint64
	// Promoted counts speculative entries a BlockStored confirmed.
	Promoted uint64
	// UnknownParentBlocks counts stored engine blocks skipped because their
	// parent engine hash was unknown.
	UnknownParentBlocks uint64
	// ParentZeroStarts counts BlockStored events whose parent hash 0 named
	// no stored block and was taken as a chain start (TolParentZero).
	ParentZeroStarts uint64
	// UnknownRemoved counts removed engine hashes the replica's map lacked.
	UnknownRemoved uint64
	// GroupEntries counts confirmed (block, replica, group) entries of
	// KV-cache groups above 0 (hybrid models); Capacity bounds them with
	// the ledgers' entries.
	GroupEntries int
	// SkippedGroupEvents counts stored and removed events of a group
	// outside [0, MaxGroups), which were not applied.
	SkippedGroupEvents uint64
	// ApproxBytes estimates the memory held: arena, table, overflow and
	// engine maps (Go maps estimated at their typical load).
	ApproxBytes int64
}

// TotalEntries is the number of (block, replica) entries over all ledgers.
func (s Stats) TotalEntries() int { return s.Entries[0] + s.Entries[1] + s.Entries[2] }

// Stats returns current counters. Safe for concurrent use.
func (x *Index) Stats() Stats {
	x.mu.RLock()
	defer x.mu.RUnlock()
	s := Stats{
		Entries:             x.entries,
		Blocks:              x.live,
		Evictions:           x.st.evictions,
		Expired:             x.st.expired,
		Promoted:            x.st.promoted,
		UnknownParentBlocks: x.st.unknownParent,
		UnknownRemoved:      x.st.unknownRemoved,
		ParentZeroStarts:    x.st.parentZero,
		GroupEntries:        x.grpEntries,
		SkippedGroupEvents:  x.st.skippedGroup,
	}
	b := int64(cap(x.nodes))*48 + int64(cap(x.table))*8 + int64(cap(x.free))*4
	b += int64(len(x.ovf)) * 64
	b += int64(len(x.grp))*64 + int64(x.grpEntries)*4
	s.EngineHashes = x.engCount
	b += x.eng.bytes()
	for _, rs := range x.replicas {
		b += int64(len(rs.eng)) * 24
		for _, ks := range rs.multi {
			b += 48 + int64(cap(ks))*8
		}
	}
	s.ApproxBytes = b
	return s
}

// ConfirmedRun returns how many leading consecutive blocks of keys replica
// r holds in the Confirmed ledger: what the engine itself reported through
// KV events, with no speculation or history. The gateway's self-check
// (node) compares it with the engine's reported cached tokens, so it judges
// only the engine's own claims. It takes the read lock once, does not
// allocate, keeps nothing of keys and, unlike Match, does not mark blocks
// used (it is an observation, not a routing read).
func (x *Index) ConfirmedRun(keys []BlockKey, r ReplicaID) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	var prev uint32
	for i, k := range keys {
		idx := x.find(k, prev)
		if idx == 0 || !x.has(idx, r, Confirmed) {
			return i
		}
		prev = idx
	}
	return len(keys)
}
