package tokenizer

import (
	"slices"
	"sync/atomic"

	"github.com/zeebo/xxh3"
)

// Byte-level BPE over Hugging Face merges.
//
// A piece starts as one symbol per byte; BPE repeatedly merges the
// adjacent pair with the lowest merge rank, leftmost first, until no pair
// has a merge (the Rust tokenizers' Word::merge_all with its priority
// queue does exactly this). Three equivalent ways to run it:
//
//   - bpeShort rescans the parts per merge, on stack arrays: fastest for
//     the short pieces prose is made of.
//   - bpeHeap keeps candidate merges in a min-heap ordered by (rank,
//     position), skipping stale ones: O(n log n) for any long piece.
//   - bpeRuns applies one rule at a time to a run-length encoded piece.
//     While each rule applied creates no pair of lower rank than its own
//     (its result C has minUsed[C] > its rank; for rank-monotone merges,
//     HF.monotone, always), the heap's pops come in non-decreasing rank
//     order and, within one rank, left to right; applying each rank's rule
//     to the whole piece greedily from the left is the same sequence of
//     merges. A long run of one character then costs a few passes over a
//     few runs instead of n log n heap work. bpeRuns hands its state to
//     bpeHeap, from which the heap continues exactly, when the next rule
//     could create a lower-ranked pair or the runs do not compress.
//
// hf_test.go checks the three against each other on random pieces.

// shortPiece is the piece length up to which bpeShort is used.
const shortPiece = 64

// encodePiece appends the tokens of one pre-tokenizer piece.
func (h *HF) encodePiece(dst []uint32, piece string) []uint32 {
	if id, ok := h.vocab[piece]; ok && (h.ignoreMerges || h.selfEnc[id]) {
		return append(dst, id)
	}
	switch {
	case len(piece) <= pieceCacheMax:
		if toks, ok := h.pieces.get(piece); ok {
			return append(dst, toks...)
		}
		n := len(dst)
		dst = h.bpeShort(dst, piece)
		h.pieces.put(piece, dst[n:])
		return dst
	case len(piece) <= shortPiece:
		return h.bpeShort(dst, piece)
	}
	return h.bpeRuns(dst, piece)
}

// mergeOf returns the rank and result of merging a and b.
func (h *HF) mergeOf(a, b uint32) (rank, id uint32, ok bool) {
	v, ok := h.merges[uint64(a)<<32|uint64(b)]
	return uint32(v >> 32), uint32(v), ok
}

const noMerge = ^uint32(0)

// bpeShort is BPE by rescanning, on stack arrays; len(piece) <=
// shortPiece.
func (h *HF) bpeShort(dst []uint32, piece string) []uint32 {
	var idBuf, rankBuf, resBuf [shortPiece]uint32
	n := len(piece)
	ids, ranks, res := idBuf[:n], rankBuf[:n], resBuf[:n]
	for i := range n {
		ids[i] = h.byteID[piece[i]]
	}
	pair := func(i int) {
		if i+1 < n {
			if r, id, ok := h.mergeOf(ids[i], ids[i+1]); ok {
				ranks[i], res[i] = r, id
				return
			}
		}
		ranks[i] = noMerge
	}
	for i := range n {
		pair(i)
	}
	for n > 1 {
		best, at := noMerge, -1
		for i := 0; i < n-1; i++ {
			if ranks[i] < best {
				best, at = ranks[i], i
			}
		}
		if at < 0 {
			break
		}
		ids[at] = res[at]
		copy(ids[at+1:], ids[at+2:n])
		copy(ranks[at+1:], ranks[at+2:n])
		copy(res[at+1:], res[at+2:n])
		n--
		ids, ranks, res = ids[:n], ranks[:n], res[:n]
		pair(at)
		if at > 0 {
			pair(at - 1)
		}
	}
	return append(dst, ids...)
}

// heapCand is a candidate merge at position pos with rank rank, packed
// as rank<<32|pos so that integer order is (rank, position) order.
type heapCand uint64

// bpeHeap is BPE with a min-heap of candidate merges over ids (the
// symbols so far, which it may overwrite).
func (h *HF) bpeHeap(dst []uint32, ids []uint32) []uint32 {
	n := len(ids)
	if n == 0 {
		return dst
	}
	next := make([]int32, n)
	prev := make([]int32, n)
	alive := make([]bool, n)
	hp := make([]heapCand, 0, n)
	push := func(c heapCand) {
		hp = append(hp, c)
		for i := len(hp) - 1; i > 0; {
			p := (i - 1) / 2
			if hp[p] <= hp[i] {
				break
			}
			hp[i], hp[p] = hp[p], hp[i]
			i = p
		}
	}
	pop := func() heapCand {
		top := hp[0]
		last := len(hp) - 1
		hp[0] = hp[last]
		hp = hp[:last]
		for i := 0; ; {
			l, m := 2*i+1, i
			if l < len(hp) && hp[l] < hp[m] {
				m = l
			}
			if l+1 < len(hp) && hp[l+1] < hp[m] {
				m = l + 1
			}
			if m == i {
				break
			}
			hp[i], hp[m] = hp[m], hp[i]
			i = m
		}
		return top
	}
	cand := func(i int32) {
		if j := next[i]; int(j) < n {
			if r, _, ok := h.mergeOf(ids[i], ids[j]); ok {
				push(heapCand(uint64(r)<<32 | uint64(i)))
			}
		}
	}
	for i := range n {
		next[i], prev[i], alive[i] = int32(i+1), int32(i-1), true
	}
	for i := range int32(n) {
		cand(i)
	}
	for len(hp) > 0 {
		c := pop()
		i := int32(uint32(c))
		rank := uint32(uint64(c) >> 32)
		j := next[i]
		if !alive[i] || int(j) >= n {
			continue
		}
		// Stale unless the pair at i still merges with this rank (the rank
		// fixes both symbols, hence the result).
		r, id, ok := h.mergeOf(ids[i], ids[j])
		if !ok || r != rank {
			continue
		}
		ids[i] = id
		alive[j] = false
		next[i] = next[j]
		if int(next[j]) < n {
			prev[next[j]] = i
		}
		cand(i)
		if p := prev[i]; p >= 0 {
			cand(p)
		}
	}
	for i := int32(0); int(i) < n; i = next[i] {
		dst = append(dst, ids[i])
	}
	return dst
}

// symRun is count copies of symbol id.
type symRun struct {
	id    uint32
	count int32
}

// mergeMemo remembers the last merges looked up: a long piece repeats a
// few pairs (its runs alternate), so most lookups skip the map.
type mergeMemo struct {
	keys [16]uint64
	vals [16]uint64 // rank<<32|id, or noMergeMemo
}

const noMergeMemo = ^uint64(0)

func (m *mergeMemo) get(h *HF, a, b uint32) (rank, id uint32, ok bool) {
	k := uint64(a)<<32 | uint64(b)
	slot := (a*31 + b) & 15
	v := m.vals[slot]
	if m.keys[slot] != k || v == 0 {
		var found bool
		v, found = h.merges[k]
		if !found {
			v = noMergeMemo
		}
		m.keys[slot], m.vals[slot] = k, v
	}
	if v == noMergeMemo {
		return 0, 0, false
	}
	return uint32(v >> 32), uint32(v), true
}

// bpeRuns is BPE on a run-length encoded piece, applying one rule (the
// lowest-ranked one that applies anywhere) per pass while that is exact
// (see the file comment); otherwise, or when the passes do not compress,
// it continues with bpeHeap.
func (h *HF) bpeRuns(dst []uint32, piece string) []uint32 {
	var memo mergeMemo
	nr := 1
	for i := 1; i < len(piece); i++ {
		if piece[i] != piece[i-1] {
			nr++
		}
	}
	runs := make([]symRun, 0, nr)
	for i := range len(piece) {
		id := h.byteID[piece[i]]
		if k := len(runs) - 1; k >= 0 && runs[k].id == id {
			runs[k].count++
		} else {
			runs = append(runs, symRun{id, 1})
		}
	}
	work := 0 // run visits so far; bounded by a multiple of the piece
	budget := 8*len(piece) + 1024
	out := make([]symRun, 0, nr)
	for {
		// The lowest-ranked merge among adjacent symbols.
		best, bestID := noMerge, uint32(0)
		var ba, bb uint32
		for k, r := range runs {
			if r.count > 1 {
				if rk, id, ok := memo.get(h, r.id, r.id); ok && rk < best {
					best, bestID, ba, bb = rk, id, r.id, r.id
				}
			}
			if k+1 < len(runs) {
				if rk, id, ok := memo.get(h, r.id, runs[k+1].id); ok && rk < best {
					best, bestID, ba, bb = rk, id, r.id, runs[k+1].id
				}
			}
		}
		work += 2 * len(runs)
		if best == noMerge {
			break
		}
		if h.minUsed[bestID] <= best {
			// Merging could create a pair of lower rank, which the heap
			// would take before this rule's later occurrences.
			return h.bpeHeap(dst, expandRuns(runs))
		}
		// Apply the rule (ba, bb) -> bestID greedily from the left.
		out = out[:0]
		add := func(id uint32, count int32) {
			if count == 0 {
				return
			}
			if k := len(out) - 1; k >= 0 && out[k].id == id {
				out[k].count += count
			} else {
				out = append(out, symRun{id, count})
			}
		}
		if ba == bb {
			for _, r := range runs {
				if r.id == ba {
					add(bestID, r.count/2)
					add(ba, r.count%2)
				} else {
					add(r.id, r.count)
				}
			}
		} else {
			// Occurrences sit at run boundaries ba|bb and cannot overlap.
			carry := int32(0) // symbols of the current run already consumed
			for k, r := range runs {
				cnt := r.count - carry
				carry = 0
				if r.id == ba && k+1 < len(runs) && runs[k+1].id == bb && cnt > 0 {
					add(ba, cnt-1)
					add(bestID, 1)
					carry = 1
					continue
				}
				add(r.id, cnt)
			}
		}
		runs, out = out, runs
		if work > budget {
			// Not compressing: continue exactly with the heap from here
			// (every pair of rank <= best has been merged).
			return h.bpeHeap(dst, expandRuns(runs))
		}
	}
	for _, r := range runs {
		for range r.count {
			dst = append(dst, r.id)
		}
	}
	return dst
}

// expandRuns returns the symbols of runs.
func expandRuns(runs []symRun) []uint32 {
	total := 0
	for _, r := range runs {
		total += int(r.count)
	}
	ids := make([]uint32, 0, total)
	for _, r := range runs {
		for range r.count {
			ids = append(ids, r.id)
		}
	}
	return ids
}

// buildSelfEncoding marks the tokens whose own bytes BPE back to them.
func (h *HF) buildSelfEncoding() {
	h.selfEnc = make([]bool, len(h.tokBytes))
	var buf []uint32
	for s, id := range h.vocab {
		if len(s) > shortPiece {
			buf = h.bpeHeap(buf[:0], h.bytesToIDs(s))
		} else {
			buf = h.bpeShort(buf[:0], s)
		}
		h.selfEnc[id] = len(buf) == 1 && buf[0] == id
	}
}

func (h *HF) bytesToIDs(s string) []uint32 {
	ids := make([]uint32, len(s))
	for i := range len(s) {
		ids[i] = h.byteID[s[i]]
	}
	return ids
}

// pieceCacheMax is the longest piece whose tokens are cached.
const pieceCacheMax = 48

// pieceCacheSlots is the number of direct-mapped cache slots (a power of
// two). A slot holds one piece; a collision replaces it.
const pieceCacheSlots = 1 << 14

// pieceCache maps short pieces to their tokens. Entries are immutable
// and published atomically, so lookups take no lock; a lookup compares
// the whole piece, so a hash collision is never a wrong answer.
type pieceCache struct {
	slots [pieceCacheSlots]atomic.Pointer[pieceEntry]
}

type pieceEntry struct {
	piece string
	toks  []uint32
}

func (c *pieceCache) get(piece string) ([]uint32, bool) {
	e := c.slots[xxh3.HashString(piece)&(pieceCacheSlots-1)].Load()
	if e != nil && e.piece == piece {
		return e.toks, true
	}
	return nil, false
}

func (c *pieceCache) put(piece string, toks []uint32) {
	c.slots[xxh3.HashString(piece)&(pieceCacheSlots-1)].Store(&pieceEntry{piece: string([]byte(piece)), toks: slices.Clone(toks)})
}
