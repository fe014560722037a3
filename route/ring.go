package route

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"

	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/index"
)

// RingMember is a replica placed on a Ring.
type RingMember struct {
	ID   index.ReplicaID
	Name string
}

// Ring is an immutable consistent-hash ring with virtual nodes. Points are
// placed by hashing the member's Name (not its process-local ID), so every
// gateway with the same members builds the same ring. A Ring is safe for
// concurrent use.
type Ring struct {
	points   []ringPoint
	members  []RingMember
	memberOf []int32 // ReplicaID → position in members, -1 if absent
	vnodes   int
}

type ringPoint struct {
	hash   uint64
	member int32
}

// NewRing places vnodes points per member. Members with a duplicate ID or
// Name keep their first occurrence. vnodes must be ≥ 1.
func NewRing(members []RingMember, vnodes int) (*Ring, error) {
	if vnodes < 1 {
		return nil, fmt.Errorf("%w: ring needs ≥ 1 virtual node per replica, got %d", ErrInvalidConfig, vnodes)
	}
	r := &Ring{vnodes: vnodes}
	seenName := make(map[string]bool, len(members))
	maxID := -1
	for _, m := range members {
		if seenName[m.Name] || slices.ContainsFunc(r.members, func(o RingMember) bool { return o.ID == m.ID }) {
			continue
		}
		seenName[m.Name] = true
		r.members = append(r.members, m)
		maxID = max(maxID, int(m.ID))
	}
	r.memberOf = make([]int32, maxID+1)
	for i := range r.memberOf {
		r.memberOf[i] = -1
	}
	r.points = make([]ringPoint, 0, len(r.members)*vnodes)
	buf := make([]byte, 0, 64)
	for mi, m := range r.members {
		r.memberOf[m.ID] = int32(mi)
		for v := 0; v < vnodes; v++ {
			buf = append(append(append(buf[:0], m.Name...), '#'), strconv.Itoa(v)...)
			r.points = append(r.points, ringPoint{hash: xxh3.Hash(buf), member: int32(mi)})
		}
	}
	slices.SortFunc(r.points, func(a, b ringPoint) int {
		if c := cmp.Compare(a.hash, b.hash); c != 0 {
			return c
		}
		return cmp.Compare(r.members[a.member].Name, r.members[b.member].Name)
	})
	return r, nil
}

// Members returns the ring's members (do not modify).
func (r *Ring) Members() []RingMember { return r.members }

// VirtualNodes returns the number of points per member.
func (r *Ring) VirtualNodes() int { return r.vnodes }

// Owner returns the member that owns key (after the same mixing Pick
// applies to Request.SessionKey), ignoring load. ok is false for an empty
// ring.
func (r *Ring) Owner(key uint64) (m RingMember, ok bool) {
	if len(r.points) == 0 {
		return RingMember{}, false
	}
	return r.members[r.points[r.start(key)].member], true
}

// start returns the index of the first point at or after key's position.
func (r *Ring) start(key uint64) int {
	h := mix64(key)
	i, _ := slices.BinarySearchFunc(r.points, h, func(p ringPoint, t uint64) int { return cmp.Compare(p.hash, t) })
	if i == len(r.points) {
		i = 0
	}
	return i
}

// covers reports whether every candidate is a member under the same name.
func (r *Ring) covers(cands []Candidate) bool {
	for i := range cands {
		m := r.member(cands[i].ID)
		if m < 0 || r.members[m].Name != cands[i].Name {
			return false
		}
	}
	return true
}

func (r *Ring) member(id index.ReplicaID) int32 {
	if int(id) >= len(r.memberOf) {
		return -1
	}
	return r.memberOf[id]
}
