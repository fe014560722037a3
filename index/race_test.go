package index

import (
	"sync"
	"testing"
	"time"
)

// TestConcurrentReadersAndWriters runs Match readers against Record,
// ApplyStored/ApplyRemoved, Expire and snapshot writers. Run with -race.
// Bounded in iterations; each goroutine is joined before the test ends.
func TestConcurrentReadersAndWriters(t *testing.T) {
	x := newTestIndex(t, func(c *Config) { c.Capacity = 2000 })
	h := x.Hasher()
	root := h.Root("m", "", "")
	var prompts [][]uint32
	for p := range 8 {
		prompts = append(prompts, seqTokens(40*4, uint32(p%3)))
	}
	for r := range ReplicaID(4) {
		x.SetReplicaRoot(r, root)
		x.SetPublishesEvents(r, r%2 == 0)
	}
	iters := 2000
	if testing.Short() {
		iters = 300
	}
	var wg sync.WaitGroup
	for g := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cands := []ReplicaID{0, 1, 2, 3, 70}
			out := make([]int32, len(cands))
			for i := range iters {
				keys := h.AppendKeys(nil, root, prompts[(i+g)%len(prompts)])
				l := x.Match(keys, cands, Mode(i%3), t0+int64(i)*int64(time.Millisecond), out)
				if l > len(keys) {
					t.Errorf("longest %d > %d blocks", l, len(keys))
					return
				}
				_ = x.Stats()
			}
		}()
	}
	wg.Add(2)
	go func() {
		defer wg.Done()
		for i := range iters {
			p := prompts[i%len(prompts)]
			keys := h.AppendKeys(nil, root, p)
			if err := x.Record(keys, ReplicaID(i%4), Ledger(i%2), t0+int64(i)*int64(time.Millisecond)); err != nil {
				t.Error(err)
				return
			}
			if err := x.Record(keys[:10], 70, History, t0); err != nil {
				t.Error(err)
				return
			}
			if i%50 == 0 {
				x.Expire(t0+int64(i)*int64(time.Second), 100)
			}
		}
	}()
	go func() {
		defer wg.Done()
		for i := range iters {
			r := ReplicaID(i % 4)
			p := prompts[i%len(prompts)]
			hashes := make([]uint64, 40)
			for b := range hashes {
				hashes[b] = uint64(i%len(prompts))<<32 | uint64(b)
			}
			_ = x.ApplyStored(r, StoredBlocks{Hashes: hashes, Tokens: p, BlockTokens: 4})
			if i%3 == 0 {
				x.ApplyRemoved(r, hashes[20:])
			}
			if i%97 == 0 {
				x.ClearReplica(r)
			}
			if i%211 == 0 {
				snap := x.AppendSnapshot(nil, nil, nil)
				if _, err := x.Restore(snap, nil); err != nil {
					t.Error(err)
					return
				}
			}
		}
	}()
	wg.Wait()
	if s := x.Stats(); s.TotalEntries() > 2000 {
		t.Fatalf("entries %d over capacity", s.TotalEntries())
	}
}
