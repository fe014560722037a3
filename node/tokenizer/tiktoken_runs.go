package tokenizer

import (
	"math"
	"sync"
)

// cl100k's BPE merges the adjacent pair whose concatenation has the
// lowest rank, leftmost first: the same process as Hugging Face BPE with a
// merge (A, B) -> AB of rank rank(AB) for every split of every token into
// two tokens. runsCore builds that merge table once, on the first long
// piece, so long pieces use hf_bpe.go's run-length BPE (exact, see there):
// a megabyte of one character costs milliseconds instead of ~0.6 s on the
// heap.
type tiktokenRuns struct {
	once sync.Once
	core *HF
}

// runsCore returns the BPE core over t's vocabulary (ids are ranks).
func (t *Tiktoken) runsCore() *HF {
	t.runs.once.Do(func() {
		h := &HF{}
		maxRank := 0
		for _, r := range t.ranks {
			maxRank = max(maxRank, r)
		}
		for b := range 256 {
			h.byteID[b] = uint32(t.ranks[string([]byte{byte(b)})])
		}
		h.minUsed = make([]uint32, maxRank+1)
		for i := range h.minUsed {
			h.minUsed[i] = math.MaxUint32
		}
		h.merges = make(map[uint64]uint64, 4*len(t.ranks))
		for tok, r := range t.ranks {
			for k := 1; k < len(tok); k++ {
				a, okA := t.ranks[tok[:k]]
				b, okB := t.ranks[tok[k:]]
				if !okA || !okB {
					continue
				}
				h.merges[uint64(a)<<32|uint64(b)] = uint64(r)<<32 | uint64(r)
				h.minUsed[a] = min(h.minUsed[a], uint32(r))
				h.minUsed[b] = min(h.minUsed[b], uint32(r))
			}
		}
		t.runs.core = h
	})
	return t.runs.core
}
