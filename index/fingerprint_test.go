package index

import (
	"math/rand/v2"
	"testing"
)

// scanFingerprint is EngineFingerprint by definition: a scan of the
// engine maps (what EngineFingerprint did before it kept its figures).
func scanFingerprint(x *Index, r ReplicaID) (n int, sum uint64) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	if r < inlineReplicas {
		b := uint64(1) << r
		x.eng.each(func(h uint64, e *engEntry) {
			if e.reps&b != 0 {
				n++
				sum += mix64(h)
			}
		})
	}
	if rs := x.replicas[r]; rs != nil {
		for h := range rs.eng {
			n++
			sum += mix64(h)
		}
	}
	return n, sum
}

// The kept figures follow a mapping between the shared map and a
// replica's private one: an engine hash two replicas map to one key is
// shared; one of them storing it again under another key (other tokens)
// takes it private; storing the shared key again takes it back.
func TestEngineFingerprintFollowsSharedAndPrivate(t *testing.T) {
	x := newTestIndex(t, nil)
	h := x.Hasher()
	root := h.Root("m", "", "")
	for _, r := range []ReplicaID{1, 2, 70} {
		x.SetReplicaRoot(r, root)
	}
	a, b := seqTokens(3*4, 1), seqTokens(3*4, 500)
	check := func(step string) {
		t.Helper()
		for _, r := range []ReplicaID{1, 2, 70} {
			n, sum := x.EngineFingerprint(r)
			wn, wsum := scanFingerprint(x, r)
			if n != wn || sum != wsum {
				t.Fatalf("%s: r%d fingerprint (%d, %x), scan (%d, %x)", step, r, n, sum, wn, wsum)
			}
		}
	}
	must(t, x.ApplyStored(1, stored([]uint64{10, 11, 12}, 0, false, a, 4)))
	must(t, x.ApplyStored(2, stored([]uint64{10, 11, 12}, 0, false, a, 4)))
	must(t, x.ApplyStored(70, stored([]uint64{10, 11, 12}, 0, false, a, 4)))
	check("shared by 1 and 2, private on 70")
	must(t, x.ApplyStored(1, stored([]uint64{10, 11, 12}, 0, false, b, 4)))
	check("1 goes private")
	if n, _ := x.EngineFingerprint(1); n != 3 {
		t.Fatalf("r1 holds %d engine hashes, want 3", n)
	}
	must(t, x.ApplyStored(1, stored([]uint64{10, 11, 12}, 0, false, a, 4)))
	check("1 back to shared")
	x.ApplyRemoved(2, []uint64{11})
	x.ApplyRemoved(70, []uint64{10, 12})
	check("removals")
	x.ClearReplica(1)
	check("clear")
	snap := x.AppendSnapshot(nil, nil, nil)
	if _, err := x.Restore(snap, nil); err != nil {
		t.Fatal(err)
	}
	check("restore")
	x.DropReplica(2)
	check("drop")
}

// Random stores (two token sets per engine hash, so mappings move between
// the shared and private maps), removals, clears and restores.
func TestEngineFingerprintRandom(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 7))
		x := newTestIndex(t, nil)
		h := x.Hasher()
		root := h.Root("m", "", "")
		reps := []ReplicaID{0, 1, 2, 65}
		for _, r := range reps {
			x.SetReplicaRoot(r, root)
		}
		toks := [2][]uint32{seqTokens(4*4, 1), seqTokens(4*4, 900)}
		for step := range 300 {
			r := reps[rng.IntN(len(reps))]
			switch k := rng.IntN(20); {
			case k < 12:
				first := uint64(rng.IntN(4))
				hashes := []uint64{100 + first}
				tk := toks[rng.IntN(2)]
				_ = x.ApplyStored(r, stored(hashes, 0, false, tk[first*4:first*4+4], 4))
			case k < 17:
				x.ApplyRemoved(r, []uint64{100 + uint64(rng.IntN(4))})
			case k < 18:
				x.ClearReplica(r)
			case k < 19:
				if _, err := x.Restore(x.AppendSnapshot(nil, nil, nil), nil); err != nil {
					t.Fatal(err)
				}
			default:
				x.DropReplica(r)
				x.SetReplicaRoot(r, root)
			}
			for _, r := range reps {
				n, sum := x.EngineFingerprint(r)
				if wn, wsum := scanFingerprint(x, r); n != wn || sum != wsum {
					t.Fatalf("seed %d step %d: r%d fingerprint (%d, %x), scan (%d, %x)", seed, step, r, n, sum, wn, wsum)
				}
			}
		}
	}
}
