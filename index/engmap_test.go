package index

import (
	"math/rand/v2"
	"testing"
)

// TestEngMapMatchesGoMap drives engMap and a Go map with the same random
// operations over a small key space (collisions, wrap-around, hash 0).
func TestEngMapMatchesGoMap(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 7))
		var m engMap
		ref := map[uint64]engEntry{}
		keys := []uint64{0}
		for range 300 {
			keys = append(keys, rng.Uint64())
		}
		for step := range 5000 {
			h := keys[rng.IntN(len(keys))]
			switch op := rng.IntN(10); {
			case op < 5:
				e, existed := m.upsert(h)
				_, want := ref[h]
				if existed != want {
					t.Fatalf("seed %d step %d: upsert existed %v, want %v", seed, step, existed, want)
				}
				e.key, e.reps = BlockKey(step), uint64(step)|1
				ref[h] = *e
			case op < 8:
				m.del(h)
				delete(ref, h)
			case op < 9:
				// Clear some reps and rehash, as engClear does.
				m.each(func(h uint64, e *engEntry) {
					if h%3 == 0 {
						e.reps = 0
						delete(ref, h)
					}
				})
				m.resize(len(m.slots))
			default:
				e := m.ptr(h)
				want, ok := ref[h]
				if (e != nil) != ok || ok && *e != want {
					t.Fatalf("seed %d step %d: ptr %v, want %v %v", seed, step, e, want, ok)
				}
			}
			if m.len() != len(ref) {
				t.Fatalf("seed %d step %d: len %d, want %d", seed, step, m.len(), len(ref))
			}
		}
		n := 0
		m.each(func(h uint64, e *engEntry) {
			n++
			if ref[h] != *e {
				t.Fatalf("seed %d: entry %x = %v, want %v", seed, h, *e, ref[h])
			}
		})
		if n != len(ref) {
			t.Fatalf("seed %d: each visited %d, want %d", seed, n, len(ref))
		}
	}
}
