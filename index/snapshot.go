package index

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"slices"
	"sort"
	"strconv"

	"github.com/zeebo/xxh3"
)

// Snapshot format, version 1. Integers are unsigned varints unless noted;
// u32/u64 are fixed-size little-endian.
//
//	magic "KVMI", version byte 1
//	hasher:     seed u64, block size in tokens
//	watermarks: count, then per source: name length, name bytes, value
//	replicas:   count, then per replica: name length, name bytes, flags byte
//	            (bit 0 publishes events, bit 1 has root), root u64,
//	            engine-map count, then per engine hash: hash u64, key count
//	            (>= 1), keys u64...
//	blocks:     count, then per block: key u64, history tick u32,
//	            speculative tick u32, successor (ordinal+1, 0 = none), then
//	            per ledger (history, speculative, confirmed): count, replica
//	            ordinals
//	checksum:   u64, xxh3 of every preceding byte
//
// Replicas travel by name: ReplicaIDs are process-local.
const (
	snapshotMagic   = "KVMI"
	snapshotVersion = 1
)

// AppendSnapshot appends a snapshot of the whole index to dst, with the
// caller's per-source watermarks (carried opaquely, returned by Restore).
// name gives each replica's cluster-wide name; replicas it reports false for
// are left out. A nil name uses the decimal ReplicaID (tests only). It holds
// the read lock while encoding and keeps nothing of its arguments.
func (x *Index) AppendSnapshot(dst []byte, watermarks map[string]uint64, name func(ReplicaID) (string, bool)) []byte {
	if name == nil {
		name = func(r ReplicaID) (string, bool) { return strconv.Itoa(int(r)), true }
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	// Reserve roughly the final size (varints make it an estimate) so the
	// encoding does not copy a growing buffer while holding the lock.
	dst = slices.Grow(dst, 64+x.live*22+x.total()*2+x.engCount*18)
	start := len(dst)
	dst = append(dst, snapshotMagic...)
	dst = append(dst, snapshotVersion)
	dst = binary.LittleEndian.AppendUint64(dst, x.h.seed)
	dst = binary.AppendUvarint(dst, uint64(x.h.tokens))

	srcs := make([]string, 0, len(watermarks))
	for s := range watermarks {
		srcs = append(srcs, s)
	}
	sort.Strings(srcs)
	dst = binary.AppendUvarint(dst, uint64(len(srcs)))
	for _, s := range srcs {
		dst = appendString(dst, s)
		dst = binary.AppendUvarint(dst, watermarks[s])
	}

	// Replica table: every replica with state, a publisher flag or an entry.
	ids := make(map[ReplicaID]bool)
	for r := range x.replicas {
		ids[r] = true
	}
	for w, m := range x.publishers {
		for ; m != 0; m &= m - 1 {
			ids[ReplicaID(w*64+bits.TrailingZeros64(m))] = true
		}
	}
	var inline uint64
	for i := 1; i < len(x.nodes); i++ {
		n := &x.nodes[i]
		inline |= n.masks[0] | n.masks[1] | n.masks[2]
	}
	for ; inline != 0; inline &= inline - 1 {
		ids[ReplicaID(bits.TrailingZeros64(inline))] = true
	}
	for _, es := range x.ovf {
		for _, e := range es {
			ids[e.r] = true
		}
	}
	order := make([]ReplicaID, 0, len(ids))
	names := make([]string, 0, len(ids))
	for r := range ids {
		order = append(order, r)
	}
	sort.Slice(order, func(i, j int) bool { return order[i] < order[j] })
	// ord maps a ReplicaID to its position in the snapshot's replica table,
	// or -1 when left out; a flat slice, since it is read once per entry.
	ord := make([]int32, MaxReplicas)
	for i := range ord {
		ord[i] = -1
	}
	kept := order[:0]
	for _, r := range order {
		if s, ok := name(r); ok {
			ord[r] = int32(len(kept))
			kept = append(kept, r)
			names = append(names, s)
		}
	}
	// Engine mappings per kept replica, in one pass over the shared map.
	type mapping struct {
		h uint64
		k BlockKey
	}
	engOf := make([][]mapping, len(kept))
	x.eng.each(func(h uint64, e *engEntry) {
		for m := e.reps; m != 0; m &= m - 1 {
			if o := ord[bits.TrailingZeros64(m)]; o >= 0 {
				engOf[o] = append(engOf[o], mapping{h, e.key})
			}
		}
	})
	for o, r := range kept {
		if rs := x.replicas[r]; rs != nil {
			for h, k := range rs.eng {
				engOf[o] = append(engOf[o], mapping{h, k})
			}
		}
	}

	dst = binary.AppendUvarint(dst, uint64(len(kept)))
	for i, r := range kept {
		dst = appendString(dst, names[i])
		var flags byte
		if x.publishes(r) {
			flags |= 1
		}
		rs := x.replicas[r]
		var root BlockKey
		if rs != nil && rs.hasRoot {
			flags |= 2
			root = rs.root
		}
		dst = append(dst, flags)
		dst = binary.LittleEndian.AppendUint64(dst, uint64(root))
		var multi map[uint64][]BlockKey
		if rs != nil {
			multi = rs.multi
		}
		dst = binary.AppendUvarint(dst, uint64(len(engOf[i])))
		for _, m := range engOf[i] {
			eh, k := m.h, m.k
			dst = binary.LittleEndian.AppendUint64(dst, eh)
			if ks, ok := multi[eh]; ok {
				dst = binary.AppendUvarint(dst, uint64(len(ks)))
				for _, k := range ks {
					dst = binary.LittleEndian.AppendUint64(dst, uint64(k))
				}
				continue
			}
			dst = binary.AppendUvarint(dst, 1)
			dst = binary.LittleEndian.AppendUint64(dst, uint64(k))
		}
	}

	// Blocks in arena order, which keeps chains together.
	ordinal := make([]uint32, len(x.nodes))
	nb := uint32(0)
	for i := 1; i < len(x.nodes); i++ {
		if x.nodes[i].flags.Load()&flagLive != 0 {
			nb++
			ordinal[i] = nb
		}
	}
	dst = binary.AppendUvarint(dst, uint64(nb))
	var reps []uint64
	for i := 1; i < len(x.nodes); i++ {
		n := &x.nodes[i]
		if n.flags.Load()&flagLive == 0 {
			continue
		}
		dst = binary.LittleEndian.AppendUint64(dst, uint64(n.key))
		dst = binary.LittleEndian.AppendUint32(dst, n.htime)
		dst = binary.LittleEndian.AppendUint32(dst, n.stime)
		var succ uint32
		if nx := n.next; nx != 0 && x.nodes[nx].flags.Load()&flagLive != 0 {
			succ = ordinal[nx]
		}
		dst = binary.AppendUvarint(dst, uint64(succ))
		for l := range numLedgers {
			reps = reps[:0]
			for m := n.masks[l]; m != 0; m &= m - 1 {
				if o := ord[bits.TrailingZeros64(m)]; o >= 0 {
					reps = append(reps, uint64(o))
				}
			}
			if n.flags.Load()&flagOvf != 0 {
				for _, e := range x.ovf[n.key] {
					if o := ord[e.r]; o >= 0 && e.ledgers&(1<<l) != 0 {
						reps = append(reps, uint64(o))
					}
				}
			}
			dst = binary.AppendUvarint(dst, uint64(len(reps)))
			for _, o := range reps {
				dst = binary.AppendUvarint(dst, o)
			}
		}
	}
	return binary.LittleEndian.AppendUint64(dst, xxh3.Hash(dst[start:]))
}

func appendString(dst []byte, s string) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

// decoder reads a snapshot; the first error sticks and every read after it
// returns zero values, so decoding code needs no per-read checks.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: truncated or invalid %s", ErrBadSnapshot, what)
	}
	d.b = nil
}

func (d *decoder) uvarint(what string) uint64 {
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail(what)
		return 0
	}
	d.b = d.b[n:]
	return v
}

// count reads a count of items each at least minSize bytes long, rejecting
// counts the remaining input cannot hold (so garbage cannot force huge
// allocations).
func (d *decoder) count(what string, minSize int) int {
	v := d.uvarint(what)
	if d.err != nil || v > uint64(len(d.b)/minSize) {
		d.fail(what)
		return 0
	}
	return int(v)
}

func (d *decoder) u64(what string) uint64 {
	if len(d.b) < 8 {
		d.fail(what)
		return 0
	}
	v := binary.LittleEndian.Uint64(d.b)
	d.b = d.b[8:]
	return v
}

func (d *decoder) u32(what string) uint32 {
	if len(d.b) < 4 {
		d.fail(what)
		return 0
	}
	v := binary.LittleEndian.Uint32(d.b)
	d.b = d.b[4:]
	return v
}

func (d *decoder) byte1(what string) byte {
	if len(d.b) < 1 {
		d.fail(what)
		return 0
	}
	v := d.b[0]
	d.b = d.b[1:]
	return v
}

func (d *decoder) str(what string) string {
	n := d.count(what, 1)
	if d.err != nil {
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}

// Restore replaces the index's contents with a snapshot made by
// AppendSnapshot (by this or another gateway with the same Config.Seed and
// BlockTokens; a snapshot made with others is rejected, since its keys would
// mean nothing here) and returns its watermarks. resolve maps replica names to
// local ReplicaIDs; entries of replicas it reports false for are dropped. A
// nil resolve parses decimal ReplicaIDs (tests only). On any error, wrapped
// in ErrBadSnapshot, the index is unchanged. Restore never panics on
// malformed input and keeps nothing of data.
//
// By default the snapshot's replica roots and publisher flags replace this
// index's; with KeepReplicaSettings they are this index's own, read at the
// swap under the write lock, so no Match sees the peer's.
func (x *Index) Restore(data []byte, resolve func(string) (ReplicaID, bool), opts ...RestoreOption) (map[string]uint64, error) {
	var opt restoreOptions
	for _, f := range opts {
		f(&opt)
	}
	if resolve == nil {
		resolve = func(s string) (ReplicaID, bool) {
			v, err := strconv.ParseUint(s, 10, 16)
			return ReplicaID(v), err == nil
		}
	}
	if len(data) < len(snapshotMagic)+1+8 || string(data[:4]) != snapshotMagic {
		return nil, fmt.Errorf("%w: not a snapshot", ErrBadSnapshot)
	}
	if data[4] != snapshotVersion {
		return nil, fmt.Errorf("%w: version %d (want %d)", ErrBadSnapshot, data[4], snapshotVersion)
	}
	body := data[:len(data)-8]
	if xxh3.Hash(body) != binary.LittleEndian.Uint64(data[len(data)-8:]) {
		return nil, fmt.Errorf("%w: checksum mismatch", ErrBadSnapshot)
	}
	d := &decoder{b: body[5:]}
	seed, bs := d.u64("seed"), d.uvarint("block size")
	if d.err == nil && (seed != x.h.seed || bs != uint64(x.h.tokens)) {
		return nil, fmt.Errorf("%w: made with seed %d and %d-token blocks, this index uses seed %d and %d",
			ErrBadSnapshot, seed, bs, x.h.seed, x.h.tokens)
	}

	nw := d.count("watermark count", 2)
	wm := make(map[string]uint64, nw)
	for range nw {
		s := d.str("watermark name")
		wm[s] = d.uvarint("watermark value")
	}

	y, err := New(x.cfg)
	if err != nil {
		return nil, err
	}
	nr := d.count("replica count", 10)
	local := make([]ReplicaID, nr)
	known := make([]bool, nr)
	seen := make(map[string]bool, nr)
	for i := range nr {
		s := d.str("replica name")
		flags := d.byte1("replica flags")
		root := BlockKey(d.u64("replica root"))
		if d.err == nil && seen[s] {
			d.fail("replica table (duplicate name)")
		}
		seen[s] = true
		r, ok := resolve(s)
		local[i], known[i] = r, ok
		if ok {
			if flags&1 != 0 {
				y.publishers[r/64] |= 1 << (r % 64)
			}
			if flags&2 != 0 {
				rs := y.replica(r)
				rs.root, rs.hasRoot = root, true
			}
		}
		ne := d.count("engine map count", 17)
		for range ne {
			eh := d.u64("engine hash")
			nk := d.count("engine key count", 8)
			if d.err == nil && nk == 0 {
				d.fail("engine key count")
			}
			var last BlockKey
			var ks []BlockKey
			for range nk {
				last = BlockKey(d.u64("engine key"))
				if nk > 1 && ok {
					ks = append(ks, last)
				}
			}
			if ok && d.err == nil && (opt.take == nil || opt.take(r, Confirmed)) {
				rs := y.replica(r)
				y.engStore(r, rs, eh, last)
				if nk > 1 {
					if rs.multi == nil {
						rs.multi = make(map[uint64][]BlockKey)
					}
					rs.multi[eh] = ks
				}
			}
		}
	}

	nb := d.count("block count", 20)
	idxOf := make([]uint32, nb+1)
	succ := make([]uint32, nb+1)
	for b := 1; b <= nb && d.err == nil; b++ {
		key := BlockKey(d.u64("block key"))
		ht := d.u32("history tick")
		stime := d.u32("speculative tick")
		s := d.uvarint("successor")
		if s > uint64(nb) {
			d.fail("successor")
		}
		succ[b] = uint32(s)
		if d.err == nil && y.probe(key) != 0 {
			d.fail("block table (duplicate key)")
		}
		idx := uint32(0)
		for l := range numLedgers {
			c := d.count("ledger count", 1)
			for range c {
				o := d.uvarint("replica ordinal")
				if o >= uint64(nr) {
					d.fail("replica ordinal")
					break
				}
				if !known[o] || opt.take != nil && !opt.take(local[o], Ledger(l)) {
					continue
				}
				if idx == 0 {
					idx = y.insert(key, 0)
					y.nodes[idx].htime, y.nodes[idx].stime = ht, stime
				}
				y.set(idx, local[o], l)
			}
		}
		idxOf[b] = idx
	}
	if d.err == nil && len(d.b) != 0 {
		d.fail("trailing bytes")
	}
	if d.err != nil {
		return nil, d.err
	}
	for b := 1; b <= nb; b++ {
		if idxOf[b] != 0 && succ[b] != 0 {
			y.nodes[idxOf[b]].next = idxOf[succ[b]]
		}
	}
	if opt.take == nil {
		y.enforceCapacity()
	}

	x.mu.Lock()
	defer x.mu.Unlock()
	if opt.take != nil {
		y.keepUnselected(x, opt.take)
		y.enforceCapacity()
	}
	if opt.keepReplicaSettings {
		y.publishers = x.publishers
		for r, rs := range y.replicas {
			rs.root, rs.hasRoot = BlockKey(0), false
			if old := x.replicas[r]; old != nil {
				rs.root, rs.hasRoot = old.root, old.hasRoot
			}
		}
		for r, old := range x.replicas {
			if old.hasRoot && y.replicas[r] == nil {
				y.replicas[r] = &replicaState{root: old.root, hasRoot: true}
			}
		}
	}
	x.nodes, x.free, x.table, x.shift, x.live = y.nodes, y.free, y.table, y.shift, y.live
	x.clockHand, x.expireHand = 0, 0
	x.ovf, x.publishers, x.replicas, x.entries = y.ovf, y.publishers, y.replicas, y.entries
	x.eng, x.engCount = y.eng, y.engCount
	// Snapshots carry group 0 only: group residency and specs start over,
	// so restored replicas match on group 0 until their events say more.
	x.grp, x.grpEntries, x.hybrid = y.grp, 0, 0
	x.st.evictions += y.st.evictions
	return wm, nil
}

// RestoreOption adjusts Restore.
type RestoreOption func(*restoreOptions)

type restoreOptions struct {
	keepReplicaSettings bool
	take                func(ReplicaID, Ledger) bool
}

// RestoreOnly makes Restore selective: an entry (replica r, ledger l) comes
// from the snapshot only when take(r, l) reports true; for every other
// (replica, ledger) pair this index's own entries stay exactly as they are
// at the swap, and the snapshot's are ignored. A replica's engine-hash
// mappings follow its Confirmed ledger (taken from the snapshot with it,
// else kept). A block holding entries from both sides keeps each ledger's
// later timestamp. take is called while decoding and, for this index's
// entries, under the write lock; it must be fast and must not call the
// Index. The merge of kept entries runs under the write lock and costs
// time proportional to this index's blocks and engine mappings.
//
// Anti-entropy uses it so that a repair replaces only the sources a peer
// has a newer view of: a peer's older view of a source (for example an
// engine this gateway owns, whose removals the peer missed) never
// overwrites a newer local one.
func RestoreOnly(take func(r ReplicaID, l Ledger) bool) RestoreOption {
	return func(o *restoreOptions) { o.take = take }
}

// keepUnselected copies into y (a decoded snapshot) every entry and engine
// mapping of x that take does not select. Both indexes must be private to
// the caller or locked.
func (y *Index) keepUnselected(x *Index, take func(ReplicaID, Ledger) bool) {
	at := make([]uint32, len(x.nodes)) // x node -> y node, 0 = none
	for i := 1; i < len(x.nodes); i++ {
		n := &x.nodes[i]
		if n.flags.Load()&flagLive == 0 {
			continue
		}
		var kept [numLedgers]bool
		idx := uint32(0)
		for l := range numLedgers {
			for m := n.masks[l]; m != 0; m &= m - 1 {
				r := ReplicaID(bits.TrailingZeros64(m))
				if take(r, l) {
					continue
				}
				if idx == 0 {
					idx = y.insert(n.key, 0)
				}
				y.set(idx, r, l)
				kept[l] = true
			}
			if n.flags.Load()&flagOvf == 0 {
				continue
			}
			for _, e := range x.ovf[n.key] {
				if e.ledgers&(1<<l) == 0 || take(e.r, l) {
					continue
				}
				if idx == 0 {
					idx = y.insert(n.key, 0)
				}
				y.set(idx, e.r, l)
				kept[l] = true
			}
		}
		if idx == 0 {
			continue
		}
		at[i] = idx
		yn := &y.nodes[idx]
		if kept[History] {
			yn.htime = max(yn.htime, n.htime)
		}
		if kept[Speculative] {
			yn.stime = max(yn.stime, n.stime)
		}
	}
	// Chain hints of the kept blocks.
	for i := 1; i < len(x.nodes); i++ {
		if at[i] == 0 || y.nodes[at[i]].next != 0 {
			continue
		}
		if nx := x.nodes[i].next; nx != 0 && x.nodes[nx].flags.Load()&flagLive != 0 {
			y.nodes[at[i]].next = y.probe(x.nodes[nx].key)
		}
	}
	// Engine mappings of replicas whose confirmed entries stay.
	x.eng.each(func(h uint64, e *engEntry) {
		for m := e.reps; m != 0; m &= m - 1 {
			if r := ReplicaID(bits.TrailingZeros64(m)); !take(r, Confirmed) {
				y.engStore(r, y.keptReplica(x, r), h, e.key)
			}
		}
	})
	for r, rs := range x.replicas {
		if take(r, Confirmed) || len(rs.eng) == 0 && len(rs.multi) == 0 {
			continue
		}
		ys := y.keptReplica(x, r)
		for h, k := range rs.eng {
			y.engStore(r, ys, h, k)
		}
		if len(rs.multi) > 0 {
			ys.multi = make(map[uint64][]BlockKey, len(rs.multi))
			for h, ks := range rs.multi {
				ys.multi[h] = slices.Clone(ks)
			}
		}
	}
}

// keptReplica returns y's state for r, created with x's root when the
// snapshot did not carry one.
func (y *Index) keptReplica(x *Index, r ReplicaID) *replicaState {
	ys := y.replica(r)
	if old := x.replicas[r]; old != nil && !ys.hasRoot && old.hasRoot {
		ys.root, ys.hasRoot = old.root, true
	}
	return ys
}

// KeepReplicaSettings makes Restore keep this index's per-replica settings
// (SetReplicaRoot, SetPublishesEvents) instead of the snapshot's: a
// gateway's own configuration says which replicas publish KV events and
// what their roots are, and a peer's snapshot may predate a change of it.
func KeepReplicaSettings() RestoreOption {
	return func(o *restoreOptions) { o.keepReplicaSettings = true }
}

// SnapshotWatermarks returns the watermarks of a snapshot made by
// AppendSnapshot without decoding its entries, so a caller can decide what
// to take from it (RestoreOnly) before calling Restore. It checks the
// header and checksum; errors wrap ErrBadSnapshot.
func SnapshotWatermarks(data []byte) (map[string]uint64, error) {
	if len(data) < len(snapshotMagic)+1+8 || string(data[:4]) != snapshotMagic {
		return nil, fmt.Errorf("%w: not a snapshot", ErrBadSnapshot)
	}
	if data[4] != snapshotVersion {
		return nil, fmt.Errorf("%w: version %d (want %d)", ErrBadSnapshot, data[4], snapshotVersion)
	}
	body := data[:len(data)-8]
	if xxh3.Hash(body) != binary.LittleEndian.Uint64(data[len(data)-8:]) {
		return nil, fmt.Errorf("%w: checksum mismatch", ErrBadSnapshot)
	}
	d := &decoder{b: body[5:]}
	d.u64("seed")
	d.uvarint("block size")
	nw := d.count("watermark count", 2)
	wm := make(map[string]uint64, nw)
	for range nw {
		s := d.str("watermark name")
		wm[s] = d.uvarint("watermark value")
	}
	if d.err != nil {
		return nil, d.err
	}
	return wm, nil
}
