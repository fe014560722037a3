package sim

import (
	"encoding/binary"
	"unsafe"

	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/kvevents"
)

// MediumGPU is the medium the simulator reports for its blocks.
const MediumGPU = "GPU"

// block is one KV block slot of the pool.
type block struct {
	id     int
	refCnt int
	// cached is true while the block's hash is registered in the pool's
	// hash map (the block is full and reusable by a prefix hit).
	cached bool
	hash   kvevents.EngineHash
	parent kvevents.EngineHash
	// hasParent is false for a sequence's first block.
	hasParent bool
	// prefix is the sequence's tokens from its first through this block's
	// last; the block's own tokens are its last blockSize entries. It
	// aliases the sequence's token array, whose written entries never change.
	prefix []uint32

	// child is the block a prefix lookup last found after this one (a
	// hint: it is used only while it is cached under the hash looked up).
	child *block

	// free-queue links; inFree is true while the block is in the queue.
	prev, next *block
	inFree     bool
}

// freeQueue is vLLM's free-block queue: a doubly linked list where
// allocation takes from the front (least recently freed) and freeing appends
// to the back, so cached blocks are evicted in LRU order. A block touched by
// a prefix hit is removed from the middle.
type freeQueue struct {
	head, tail *block
	n          int
}

func (q *freeQueue) pushBack(b *block) {
	b.prev, b.next = q.tail, nil
	if q.tail != nil {
		q.tail.next = b
	} else {
		q.head = b
	}
	q.tail = b
	b.inFree = true
	q.n++
}

func (q *freeQueue) remove(b *block) {
	if b.prev != nil {
		b.prev.next = b.next
	} else {
		q.head = b.next
	}
	if b.next != nil {
		b.next.prev = b.prev
	} else {
		q.tail = b.prev
	}
	b.prev, b.next, b.inFree = nil, nil, false
	q.n--
}

func (q *freeQueue) popFront() *block {
	b := q.head
	if b != nil {
		q.remove(b)
	}
	return b
}

// blockPool is a fixed set of KV blocks with prefix caching. It records the
// KV events its changes cause, in order, until takeEvents.
type blockPool struct {
	blockSize int
	blocks    []block
	freeQ     freeQueue
	cache     map[kvevents.EngineHash]*block
	seed      uint64
	events    []kvevents.Event
	hbuf      []byte // hashBlock scratch
	// evictions counts cached hashes dropped (evictions and resets): a
	// cached hash stays mapped to its block until this changes.
	evictions uint64
	// emitEvents turns event recording on; with it off the pool keeps no
	// event backlog.
	emitEvents bool
	// offload, when set, receives every evicted cached block.
	offload *offloadStore
}

func newBlockPool(numBlocks, blockSize int, seed uint64, emitEvents bool) *blockPool {
	p := &blockPool{
		blockSize:  blockSize,
		blocks:     make([]block, numBlocks),
		cache:      make(map[kvevents.EngineHash]*block),
		seed:       seed,
		emitEvents: emitEvents,
	}
	for i := range p.blocks {
		p.blocks[i].id = i
		p.freeQ.pushBack(&p.blocks[i])
	}
	return p
}

// hashBlock is the engine's chained block hash: seeded xxh3 over the parent
// hash and the block's token IDs. The seed is random per process unless the
// config fixes it, so consumers cannot rely on the value, as with vLLM's
// default hash.
func (p *blockPool) hashBlock(parent kvevents.EngineHash, hasParent bool, tokens []uint32) kvevents.EngineHash {
	n := 9 + 4*len(tokens)
	if cap(p.hbuf) < n {
		p.hbuf = make([]byte, n)
	}
	buf := p.hbuf[:n]
	clear(buf[:9])
	if hasParent {
		buf[0] = 1
		binary.LittleEndian.PutUint64(buf[1:], uint64(parent))
	}
	if littleEndian && len(tokens) > 0 {
		// The tokens' memory already is their little-endian encoding.
		copy(buf[9:], unsafe.Slice((*byte)(unsafe.Pointer(&tokens[0])), 4*len(tokens)))
	} else {
		for i, t := range tokens {
			binary.LittleEndian.PutUint32(buf[9+4*i:], t)
		}
	}
	return kvevents.EngineHash(xxh3.HashSeed(buf, p.seed))
}

// littleEndian reports whether uint32s are stored little-endian in memory.
var littleEndian = func() bool {
	v := uint32(1)
	return *(*byte)(unsafe.Pointer(&v)) == 1
}()

// numFree is the number of blocks that can be allocated (free, cached or not).
func (p *blockPool) numFree() int { return p.freeQ.n }

// numUsed is the number of blocks referenced by at least one sequence.
func (p *blockPool) numUsed() int { return len(p.blocks) - p.freeQ.n }

func (p *blockPool) usage() float64 {
	if len(p.blocks) == 0 {
		return 0
	}
	return float64(p.numUsed()) / float64(len(p.blocks))
}

// lookupAfter returns the cached block with hash h (nil if none) that
// follows prev (nil for a
// sequence's first block) in a chain. Requests of one prefix walk the same
// chain, so prev's child hint usually answers without the map: only one
// block is cached per hash, so a cached block holding h is p.cache[h].
func (p *blockPool) lookupAfter(prev *block, h kvevents.EngineHash) *block {
	if prev == nil {
		return p.cache[h]
	}
	if c := prev.child; c != nil && c.cached && c.hash == h {
		return c
	}
	b := p.cache[h]
	if b != nil {
		prev.child = b
	}
	return b
}

// touch takes a reference on a cached block found by a prefix hit, removing
// it from the free queue if nothing referenced it.
func (p *blockPool) touch(b *block) {
	if b.refCnt == 0 && b.inFree {
		p.freeQ.remove(b)
	}
	b.refCnt++
}

// allocate takes n blocks from the front of the free queue, evicting cached
// ones (and recording BlockRemoved for each). The caller checks numFree first.
func (p *blockPool) allocate(n int, dst []*block) []*block {
	for range n {
		b := p.freeQ.popFront()
		if b == nil {
			panic("sim: block pool allocate beyond free count") // caller bug
		}
		if b.cached {
			p.evict(b)
		}
		b.refCnt = 1
		dst = append(dst, b)
	}
	return dst
}

// evict drops a cached block's hash. A block is cached exactly while the
// map holds it under its hash (cacheRun maps a hash only when no block
// holds it; evict and reset unmap), so the entry is deleted without
// looking it up first.
func (p *blockPool) evict(b *block) {
	p.evictions++
	delete(p.cache, b.hash)
	if p.offload != nil {
		// Stored on CPU before removed from the GPU, as an offloading
		// engine copies a block out before reusing its slot.
		p.offload.put(p, b)
	}
	if p.emitEvents {
		p.events = append(p.events, kvevents.Event{
			Kind:    kvevents.KindBlockRemoved,
			Removed: &kvevents.BlockRemoved{BlockHashes: []kvevents.EngineHash{b.hash}, Medium: MediumGPU},
		})
	}
	b.cached, b.hash, b.parent, b.hasParent, b.prefix = false, 0, 0, false, nil
}

// free drops one reference from each block; blocks reaching zero go to the
// back of the free queue in reverse order, so a sequence's tail blocks are
// evicted before its head blocks (vLLM's order).
func (p *blockPool) free(blocks []*block) {
	for i := len(blocks) - 1; i >= 0; i-- {
		b := blocks[i]
		b.refCnt--
		if b.refCnt == 0 {
			p.freeQ.pushBack(b)
		}
	}
}

// cacheRun registers newly full blocks of one sequence. hashes[i] and
// prefixes[i] (the sequence's tokens through that block) belong to
// blocks[i]; parent/hasParent is the hash before blocks[0]. A block whose
// hash is already cached elsewhere stays uncached. One BlockStored is
// recorded per run of consecutive newly cached blocks.
func (p *blockPool) cacheRun(blocks []*block, hashes []kvevents.EngineHash, prefixes [][]uint32, parent kvevents.EngineHash, hasParent bool) {
	var ev *kvevents.BlockStored
	for i, b := range blocks {
		h := hashes[i]
		par, hp := parent, hasParent
		if i > 0 {
			par, hp = hashes[i-1], true
		}
		if b == nil || b.cached || p.cache[h] != nil {
			ev = nil
			continue
		}
		b.cached, b.hash, b.parent, b.hasParent = true, h, par, hp
		b.prefix = prefixes[i]
		p.cache[h] = b
		if !p.emitEvents {
			continue
		}
		if ev == nil {
			ev = &kvevents.BlockStored{ParentBlockHash: par, HasParent: hp, BlockSize: p.blockSize, Medium: MediumGPU,
				BlockHashes: make([]kvevents.EngineHash, 0, len(blocks)-i),
				TokenIDs:    make([]uint32, 0, (len(blocks)-i)*p.blockSize)}
			p.events = append(p.events, kvevents.Event{Kind: kvevents.KindBlockStored, Stored: ev})
		}
		ev.BlockHashes = append(ev.BlockHashes, h)
		ev.TokenIDs = append(ev.TokenIDs, prefixes[i][len(prefixes[i])-p.blockSize:]...)
	}
}

// reset drops every cached hash. It refuses (returns false) while any block
// is referenced, as vLLM's reset_prefix_cache does.
func (p *blockPool) reset() bool {
	if p.numUsed() != 0 {
		return false
	}
	for i := range p.blocks {
		b := &p.blocks[i]
		b.cached, b.hash, b.parent, b.hasParent, b.prefix = false, 0, 0, false, nil
	}
	clear(p.cache)
	if p.offload != nil {
		p.offload.clear()
	}
	p.evictions++
	if p.emitEvents {
		p.events = append(p.events, kvevents.Event{Kind: kvevents.KindAllBlocksCleared})
	}
	return true
}

func (p *blockPool) takeEvents() []kvevents.Event {
	ev := p.events
	p.events = nil
	return ev
}
