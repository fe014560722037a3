package sim

import "github.com/kvmesh/kvmesh/kvevents"

// A hybrid engine (EngineConfig.SlidingWindow > 0) models a
// hybrid-attention model as vLLM's v1 KV-cache manager runs it (the
// HybridKVCacheCoordinator with a FullAttentionManager and a
// SlidingWindowManager, as read at vllm-project/vllm commit 002f349, the
// rule index.Match follows):
//
//   - Group 0 (full attention) lives in Engine.pool, group 1 (a sliding
//     window of W tokens) in Engine.wpool. Both hash blocks alike, so they
//     store and remove the same hashes, told apart by group_idx in the KV
//     events, and each pool evicts on its own (LRU over its free queue).
//   - The prefix hit of a new request: group 0's run of cached blocks from
//     the start (at most the prompt minus one token) bounds it; within
//     that run, group 1 needs cdiv(W-1, block) contiguous cached blocks
//     ending at the hit point, searched from the right, or, without such
//     a run, its own run from the start (SlidingWindowManager.
//     find_longest_cache_hit). Group 0's hit is cut to the result.
//   - Group 1 holds real blocks only for the hit's last cdiv(W-1, block)
//     blocks and what the request computes; earlier positions are vLLM's
//     null blocks. Each time a running request is scheduled, the blocks
//     wholly before its last W-1 computed tokens are freed (vLLM's
//     remove_skipped_blocks), so they stay cached only until the window
//     pool needs them, while group 0 keeps them until the request ends.

// windowBlocks is vLLM's sliding_window_contiguous_blocks:
// cdiv(window-1, block size).
func (e *Engine) windowBlocks() int {
	return ceilDiv(e.cfg.SlidingWindow-1, e.cfg.BlockSize)
}

// hybridHit applies the window group's rule to full, the full-attention
// group's cached run of s, and returns the hit's group-0 blocks and the
// window group's blocks of its window (the blocks before are null). The
// second slice is a buffer reused by the next call.
func (e *Engine) hybridHit(s *seq, full []*block) ([]*block, []*block) {
	w := e.windowBlocks()
	hit := e.windowRule(len(full), w, func(i int) bool { return e.wpool.cache[e.blockHash(s, i)] != nil })
	whit := e.whit[:0]
	for i := max(0, hit-w); i < hit; i++ {
		whit = append(whit, e.wpool.cache[e.blockHash(s, i)])
	}
	e.whit = whit
	return full[:hit], whit
}

// windowRule is SlidingWindowManager.find_longest_cache_hit over the
// first full blocks: the end of the rightmost run of w cached blocks, else
// the run cached from the start.
func (e *Engine) windowRule(full, w int, cached func(i int) bool) int {
	run := 0
	for i := full - 1; i >= 0; i-- {
		if !cached(i) {
			run = 0
			continue
		}
		if run++; run >= w {
			return i + run
		}
	}
	return run
}

// freeCount is the number of blocks that no request references.
func freeCount(bs []*block) int {
	n := 0
	for _, b := range bs {
		if b.refCnt == 0 {
			n++
		}
	}
	return n
}

// numFree is the number of blocks every group can allocate.
func (e *Engine) numFree() int {
	if e.wpool == nil {
		return e.pool.numFree()
	}
	return min(e.pool.numFree(), e.wpool.numFree())
}

// removeSkipped frees the window group's blocks of s that lie wholly
// before its last window-1 computed tokens (vLLM's remove_skipped_blocks,
// run before each allocation of a running request). Freed blocks stay
// cached until the window pool reuses them.
func (e *Engine) removeSkipped(s *seq) {
	if e.wpool == nil {
		return
	}
	skipped := min((s.numComputed-e.cfg.SlidingWindow+1)/e.cfg.BlockSize, len(s.wblocks))
	// vLLM walks back from the last skipped block and stops at the first
	// null block: everything before it was removed already.
	from := skipped
	for from > 0 && s.wblocks[from-1] != nil {
		from--
	}
	if from < skipped {
		e.wpool.free(s.wblocks[from:skipped])
		clear(s.wblocks[from:skipped])
	}
}

// freeWindow releases s's window-group blocks (tail first, as free does).
func (e *Engine) freeWindow(s *seq) {
	if e.wpool == nil {
		return
	}
	live := s.wblocks[:0]
	for _, b := range s.wblocks {
		if b != nil {
			live = append(live, b)
		}
	}
	e.wpool.free(live)
	clear(s.wblocks)
	s.wblocks = s.wblocks[:0]
}

// takeEvents returns the step's KV events: group 0's, then, for a hybrid
// engine, group 1's, each stamped with its group and spec as vLLM's
// map-form events carry them.
func (e *Engine) takeEvents() []kvevents.Event {
	evs := e.pool.takeEvents()
	if e.wpool == nil {
		return evs
	}
	for i := range evs {
		if st := evs[i].Stored; st != nil {
			st.SpecKind = SpecFullAttention
		}
	}
	for _, ev := range e.wpool.takeEvents() {
		switch {
		case ev.Stored != nil:
			ev.Stored.GroupIdx, ev.Stored.SpecKind, ev.Stored.SlidingWindow = 1, SpecSlidingWindow, e.cfg.SlidingWindow
		case ev.Removed != nil:
			ev.Removed.GroupIdx = 1
		}
		evs = append(evs, ev)
	}
	return evs
}

// PrefixHit returns what a new request with tokens would take from the
// engine's caches right now, in blocks: gpu from the GPU pool by the
// engine's own rule (a hybrid engine's by vLLM's hybrid rule), capped at
// the prompt minus one token, and offloaded the blocks right after it that
// the offload tier would load. It changes nothing (no LRU touch).
func (e *Engine) PrefixHit(tokens []uint32) (gpu, offloaded int) {
	hs := e.HashTokens(tokens)
	limit := min(len(hs), (len(tokens)-1)/e.cfg.BlockSize)
	for gpu < limit && e.pool.cache[hs[gpu]] != nil {
		gpu++
	}
	if e.wpool != nil {
		gpu = e.windowRule(gpu, e.windowBlocks(), func(i int) bool { return e.wpool.cache[hs[i]] != nil })
	}
	if o := e.pool.offload; o != nil {
		for i := gpu; i < limit && o.has(hs[i]); i++ {
			offloaded++
		}
	}
	return gpu, offloaded
}

// WindowCachedBlocks returns the blocks a hybrid engine's sliding-window
// group holds cached, in block-id order (nil for a single-group engine).
func (e *Engine) WindowCachedBlocks() []CachedBlock {
	if e.wpool == nil {
		return nil
	}
	return e.wpool.cachedBlocks()
}
