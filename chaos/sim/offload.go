package sim

import "github.com/kvmesh/kvmesh/kvevents"

// MediumCPU is the medium the simulator reports for its offload tier.
const MediumCPU = "CPU"

// offloadStore is the engine's CPU offload tier (vLLM's offloading
// connector with a CPU backend, or LMCache's CPU cache): a block the GPU
// pool evicts is kept here, in LRU order, up to capacity blocks, and a
// request whose prompt continues past its GPU hit with blocks held here
// loads them instead of recomputing them. It records BlockStored and
// BlockRemoved with medium CPU in the pool's event stream.
type offloadStore struct {
	capacity   int
	m          map[kvevents.EngineHash]*offEntry
	head, tail *offEntry // head: least recently used
}

type offEntry struct {
	hash, parent kvevents.EngineHash
	hasParent    bool
	prefix       []uint32
	prev, next   *offEntry
}

func newOffloadStore(capacity int) *offloadStore {
	return &offloadStore{capacity: capacity, m: make(map[kvevents.EngineHash]*offEntry)}
}

func (o *offloadStore) unlink(e *offEntry) {
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		o.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		o.tail = e.prev
	}
	e.prev, e.next = nil, nil
}

func (o *offloadStore) pushBack(e *offEntry) {
	e.prev, e.next = o.tail, nil
	if o.tail != nil {
		o.tail.next = e
	} else {
		o.head = e
	}
	o.tail = e
}

// has reports whether h is offloaded.
func (o *offloadStore) has(h kvevents.EngineHash) bool { return o.m[h] != nil }

// touch marks h recently used.
func (o *offloadStore) touch(h kvevents.EngineHash) {
	if e := o.m[h]; e != nil {
		o.unlink(e)
		o.pushBack(e)
	}
}

// put offloads a cached block the GPU pool is evicting, evicting the least
// recently used offloaded block beyond capacity.
func (o *offloadStore) put(p *blockPool, b *block) {
	if e := o.m[b.hash]; e != nil {
		o.touch(b.hash)
		return
	}
	e := &offEntry{hash: b.hash, parent: b.parent, hasParent: b.hasParent, prefix: b.prefix}
	o.m[b.hash] = e
	o.pushBack(e)
	if p.emitEvents {
		toks := b.prefix[len(b.prefix)-p.blockSize:]
		p.events = append(p.events, kvevents.Event{Kind: kvevents.KindBlockStored, Stored: &kvevents.BlockStored{
			BlockHashes: []kvevents.EngineHash{b.hash}, ParentBlockHash: b.parent, HasParent: b.hasParent,
			TokenIDs: append([]uint32(nil), toks...), BlockSize: p.blockSize, Medium: MediumCPU,
		}})
	}
	if len(o.m) > o.capacity {
		old := o.head
		o.unlink(old)
		delete(o.m, old.hash)
		if p.emitEvents {
			p.events = append(p.events, kvevents.Event{Kind: kvevents.KindBlockRemoved,
				Removed: &kvevents.BlockRemoved{BlockHashes: []kvevents.EngineHash{old.hash}, Medium: MediumCPU}})
		}
	}
}

// clear drops every offloaded block (a prefix-cache reset; the pool's
// AllBlocksCleared covers it).
func (o *offloadStore) clear() {
	clear(o.m)
	o.head, o.tail = nil, nil
}

// OffloadedBlocks returns the blocks the engine's CPU offload tier holds,
// in no particular order (nil without one): what a consumer of its
// CPU-tier events should hold there.
func (e *Engine) OffloadedBlocks() []CachedBlock {
	o := e.pool.offload
	if o == nil {
		return nil
	}
	out := make([]CachedBlock, 0, len(o.m))
	bs := e.cfg.BlockSize
	for _, x := range o.m {
		out = append(out, CachedBlock{Hash: x.hash, Parent: x.parent, HasParent: x.hasParent,
			Tokens: x.prefix[len(x.prefix)-bs:], Prefix: x.prefix})
	}
	return out
}
