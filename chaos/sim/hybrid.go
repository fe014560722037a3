package sim

import (
	"fmt"

	"github.com/kvmesh/kvmesh/kvevents"
)

// Group spec kinds as vLLM names them in kv_cache_spec_kind.
const (
	SpecFullAttention = "full_attention"
	SpecSlidingWindow = "sliding_window"
)

// HybridCache is the prefix cache of a hybrid-attention model: group 0
// full attention and group 1 a sliding window of Window tokens, each with
// its own pool of blocks that caches and evicts on its own (vLLM shares
// one pool between groups, keyed by hash and group; separate pools evict
// the groups just as independently). Both groups hash blocks alike, so
// they report the same hashes, told apart only by group_idx, as vLLM does.
//
// A request (Serve) hits what Hit says, allocates the rest in both
// groups, caches its full blocks, and then, as vLLM's sliding-window
// manager does once blocks fall out of the window (remove_skipped_blocks),
// frees the window group's blocks before the last Window tokens; at the
// end it frees the rest. Freed blocks stay cached until their pool needs
// them. Not safe for concurrent use.
type HybridCache struct {
	bs, window int
	pools      [2]*blockPool
	held       [2][]*block
	hashes     []kvevents.EngineHash
	prefixes   [][]uint32
}

// NewHybridCache returns a hybrid cache whose full-attention group has
// fullBlocks blocks and whose window group has windowPool blocks, of
// blockSize tokens, with a window of window tokens, hashing with seed.
func NewHybridCache(fullBlocks, windowPool, blockSize, window int, seed uint64) (*HybridCache, error) {
	if fullBlocks <= 0 || windowPool <= 0 || blockSize <= 0 || window <= 1 {
		return nil, fmt.Errorf("%w: hybrid cache of %d and %d blocks of %d, window %d",
			ErrInvalidConfig, fullBlocks, windowPool, blockSize, window)
	}
	h := &HybridCache{bs: blockSize, window: window}
	h.pools[0] = newBlockPool(fullBlocks, blockSize, seed, true)
	h.pools[1] = newBlockPool(windowPool, blockSize, seed, true)
	return h, nil
}

// windowBlocks is vLLM's sliding_window_contiguous_blocks:
// cdiv(window-1, block size).
func (h *HybridCache) windowBlocks() int { return (h.window - 1 + h.bs - 1) / h.bs }

// hashAll computes the chained hashes of tokens' full blocks into h.hashes.
func (h *HybridCache) hashAll(tokens []uint32) {
	h.hashes, h.prefixes = h.hashes[:0], h.prefixes[:0]
	var parent kvevents.EngineHash
	for i := 0; (i+1)*h.bs <= len(tokens); i++ {
		parent = h.pools[0].hashBlock(parent, i > 0, tokens[i*h.bs:(i+1)*h.bs])
		h.hashes = append(h.hashes, parent)
		h.prefixes = append(h.prefixes, tokens[:(i+1)*h.bs])
	}
}

// Hit returns how many leading full blocks of tokens the model would take
// from its cache, by vLLM's hybrid rule: the full-attention group's run of
// cached blocks from the start bounds the hit; within it, the window group
// needs windowBlocks contiguous cached blocks ending at the hit point,
// searched from the right (or, without such a run, its own run from the
// start).
func (h *HybridCache) Hit(tokens []uint32) int {
	h.hashAll(tokens)
	return h.hit()
}

func (h *HybridCache) hit() int {
	full := 0
	for full < len(h.hashes) && h.pools[0].cache[h.hashes[full]] != nil {
		full++
	}
	w, run := h.windowBlocks(), 0
	for i := full - 1; i >= 0; i-- {
		if h.pools[1].cache[h.hashes[i]] == nil {
			run = 0
			continue
		}
		if run++; run >= w {
			return i + run
		}
	}
	return run
}

// Serve runs one request of tokens through the cache and returns its hit
// (in blocks) and the KV events it caused, group by group, with group_idx
// and the group's spec filled in. The events alias tokens.
func (h *HybridCache) Serve(tokens []uint32) (int, []kvevents.Event, error) {
	h.hashAll(tokens)
	n := len(h.hashes)
	if n > min(len(h.pools[0].blocks), len(h.pools[1].blocks)) {
		return 0, nil, fmt.Errorf("%w: %d blocks", ErrRequestTooLarge, n)
	}
	hit := h.hit()
	// The window group uses only the hit's last windowBlocks blocks; the
	// ones before are vLLM's null blocks.
	from := [2]int{0, max(0, hit-h.windowBlocks())}
	for g, p := range h.pools {
		held := h.held[g][:0]
		for i := from[g]; i < hit; i++ {
			b := p.cache[h.hashes[i]]
			p.touch(b)
			held = append(held, b)
		}
		held = p.allocate(n-hit, held)
		newBlocks := held[len(held)-(n-hit):]
		var parent kvevents.EngineHash
		if hit > 0 {
			parent = h.hashes[hit-1]
		}
		p.cacheRun(newBlocks, h.hashes[hit:], h.prefixes[hit:], parent, hit > 0)
		h.held[g] = held
	}
	// Blocks wholly before the last window tokens leave the window group
	// (vLLM: last_useful_token = num_tokens - window + 1).
	useful := max(0, (len(tokens)-h.window+1)/h.bs)
	w := h.held[1]
	if skip := useful - from[1]; skip > 0 {
		h.pools[1].free(w[:skip])
		w = w[skip:]
	}
	h.pools[1].free(w)
	h.pools[0].free(h.held[0])
	evs := h.pools[0].takeEvents()
	for i := range evs {
		if s := evs[i].Stored; s != nil {
			s.SpecKind = SpecFullAttention
		}
	}
	for _, ev := range h.pools[1].takeEvents() {
		switch {
		case ev.Stored != nil:
			ev.Stored.GroupIdx, ev.Stored.SpecKind, ev.Stored.SlidingWindow = 1, SpecSlidingWindow, h.window
		case ev.Removed != nil:
			ev.Removed.GroupIdx = 1
		}
		evs = append(evs, ev)
	}
	return hit, evs, nil
}
