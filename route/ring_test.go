package route

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
)

func members(names ...string) []RingMember {
	out := make([]RingMember, len(names))
	for i, n := range names {
		out[i] = RingMember{ID: index.ReplicaID(i), Name: n}
	}
	return out
}

func owners(t *testing.T, r *Ring, keys int) []string {
	out := make([]string, keys)
	for k := range keys {
		m, ok := r.Owner(uint64(k))
		require.True(t, ok)
		out[k] = m.Name
	}
	return out
}

// TestRingStability: adding a replica moves only keys to it, about 1/(N+1)
// of them; removing one moves only its own keys.
func TestRingStability(t *testing.T) {
	const keys = 20000
	src := rand.New(rand.NewPCG(5, 6))
	for round := range 12 {
		n := 3 + src.IntN(18)
		names := make([]string, n)
		for i := range names {
			names[i] = fmt.Sprintf("replica-%d-%d", round, i)
		}
		before, err := NewRing(members(names...), 100)
		require.NoError(t, err)
		after, err := NewRing(members(append(names, "newcomer")...), 100)
		require.NoError(t, err)
		b, a := owners(t, before, keys), owners(t, after, keys)
		moved := 0
		for k := range keys {
			if a[k] != b[k] {
				require.Equal(t, "newcomer", a[k], "key %d moved between old replicas", k)
				moved++
			}
		}
		share := float64(moved) / keys
		ideal := 1 / float64(n+1)
		require.InDelta(t, ideal, share, 0.45*ideal, "n=%d: moved %.3f, ideal %.3f", n, share, ideal)

		// Removing replica 0: only its keys move.
		rest, err := NewRing(members(names[1:]...), 100)
		require.NoError(t, err)
		r := owners(t, rest, keys)
		for k := range keys {
			if b[k] != names[0] {
				require.Equal(t, b[k], r[k], "key %d of a surviving replica moved", k)
			}
		}
	}
}

// TestRingIndependentOfIDsAndOrder: gateways assign different process-local
// IDs and list members in different orders; the ring must not care.
func TestRingIndependentOfIDsAndOrder(t *testing.T) {
	r1, err := NewRing([]RingMember{{0, "a"}, {1, "b"}, {2, "c"}}, 50)
	require.NoError(t, err)
	r2, err := NewRing([]RingMember{{7, "c"}, {3, "a"}, {9, "b"}}, 50)
	require.NoError(t, err)
	require.Equal(t, owners(t, r1, 5000), owners(t, r2, 5000))

	// Duplicates keep the first occurrence.
	r3, err := NewRing([]RingMember{{0, "a"}, {0, "z"}, {1, "a"}, {2, "b"}}, 10)
	require.NoError(t, err)
	require.Equal(t, []RingMember{{0, "a"}, {2, "b"}}, r3.Members())

	_, err = NewRing(nil, 0)
	require.ErrorIs(t, err, ErrInvalidConfig)
	empty, err := NewRing(nil, 10)
	require.NoError(t, err)
	_, ok := empty.Owner(1)
	require.False(t, ok)
}

// TestConsistentHashBoundedLoad: over random loads the pick is always
// within capacity, and the key's own replica wins whenever it has room.
func TestConsistentHashBoundedLoad(t *testing.T) {
	src := rand.New(rand.NewPCG(7, 8))
	for _, floor := range []int{1, 4} {
		cfg := ConsistentHashConfig{VirtualNodes: 64, LoadFactor: 1.25, MinCapacity: floor}
		h, err := NewConsistentHash(cfg)
		require.NoError(t, err)
		for round := range 3000 {
			n := 1 + src.IntN(10)
			cands := make([]Candidate, n)
			total := 0
			for i := range cands {
				cands[i] = Candidate{ID: index.ReplicaID(i), Name: fmt.Sprintf("r%d", i), InFlight: src.IntN(20)}
				total += cands[i].InFlight
			}
			capacity := max(int(math.Ceil(1.25*float64(total+1)/float64(n))), floor)
			req := Request{SessionKey: src.Uint64()}
			rng := NewRand(uint64(round))
			d := h.Pick(&req, cands, &rng, nil)
			require.LessOrEqual(t, cands[d.Index].InFlight+1, capacity)
			// The strategy's ring may hold replicas that are not candidates
			// now; skipping them must equal a ring of the candidates alone.
			ms := make([]RingMember, n)
			for i := range cands {
				ms[i] = RingMember{ID: cands[i].ID, Name: cands[i].Name}
			}
			fresh, err := NewRing(ms, cfg.VirtualNodes)
			require.NoError(t, err)
			owner, ok := fresh.Owner(req.SessionKey)
			require.True(t, ok)
			ownerIdx := -1
			for i := range cands {
				if cands[i].Name == owner.Name {
					ownerIdx = i
				}
			}
			require.GreaterOrEqual(t, ownerIdx, 0, "every candidate is on the ring")
			if cands[ownerIdx].InFlight+1 <= capacity {
				require.Equal(t, ownerIdx, d.Index)
				require.Equal(t, SelectionHashAffinity, d.Selection)
			} else {
				require.Equal(t, SelectionHashSpillover, d.Selection)
			}
		}
	}
}

// TestConsistentHashRingReuse: the ring is built once per membership.
func TestConsistentHashRingReuse(t *testing.T) {
	h, err := NewConsistentHash(DefaultConsistentHashConfig())
	require.NoError(t, err)
	require.NoError(t, h.SetMembers(members("a", "b", "c", "d")))
	pool := h.Ring()
	cands := []Candidate{{ID: 1, Name: "b"}, {ID: 3, Name: "d"}}
	rng := NewRand(1)
	req := Request{SessionKey: 99}
	h.Pick(&req, cands, &rng, nil)
	require.Same(t, pool, h.Ring(), "a subset of the pool must not rebuild")

	// An unknown replica rebuilds once, keeping the old members.
	cands = append(cands, Candidate{ID: 4, Name: "e"})
	h.Pick(&req, cands, &rng, nil)
	grown := h.Ring()
	require.NotSame(t, pool, grown)
	require.Len(t, grown.Members(), 5)
	h.Pick(&req, cands, &rng, nil)
	require.Same(t, grown, h.Ring())

	// Same ID, new name (replica replaced): rebuild, old name dropped.
	cands[0] = Candidate{ID: 1, Name: "b2"}
	h.Pick(&req, cands, &rng, nil)
	names := map[string]bool{}
	for _, m := range h.Ring().Members() {
		names[m.Name] = true
	}
	require.True(t, names["b2"])
	require.False(t, names["b"])
}

// TestConsistentHashConcurrent exercises Pick and SetMembers together (run
// with -race).
func TestConsistentHashConcurrent(t *testing.T) {
	h, err := NewConsistentHash(DefaultConsistentHashConfig())
	require.NoError(t, err)
	req0, cands := benchCandidates()
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := NewRand(uint64(g))
			req := req0
			for i := range 2000 {
				req.SessionKey = uint64(i)
				d := h.Pick(&req, cands[:1+i%len(cands)], &rng, nil)
				if d.Index < 0 || d.Index > i%len(cands) {
					t.Errorf("index %d out of range", d.Index)
					return
				}
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := range 50 {
			ms := make([]RingMember, 0, len(cands))
			for j := range cands[:1+i%len(cands)] {
				ms = append(ms, RingMember{ID: cands[j].ID, Name: cands[j].Name})
			}
			if err := h.SetMembers(ms); err != nil {
				t.Error(err)
				return
			}
		}
	}()
	wg.Wait()
}
