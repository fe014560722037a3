package index

import "math/bits"

// engMap is the shared engine-hash map: open addressing with linear probing
// over a flat slot array (no per-entry pointers), growing by 1.5x at 85%
// load so that memory per mapping stays within about 28–42 bytes, where a Go
// map's doubling swings between about 27 and 55. Slot positions use
// multiply-high range reduction, so the table size need not be a power of
// two. Hash 0 marks an empty slot; an engine hash of 0 lives in zero.
type engMap struct {
	slots   []engSlot
	used    int // occupied slots
	hasZero bool
	zero    engEntry
}

type engSlot struct {
	h uint64
	e engEntry
}

func (m *engMap) home(h uint64) int {
	hi, _ := bits.Mul64(h*0x9E3779B97F4A7C15, uint64(len(m.slots)))
	return int(hi)
}

func (m *engMap) len() int {
	if m.hasZero {
		return m.used + 1
	}
	return m.used
}

// ptr returns the entry of h, or nil.
func (m *engMap) ptr(h uint64) *engEntry {
	if h == 0 {
		if m.hasZero {
			return &m.zero
		}
		return nil
	}
	if len(m.slots) == 0 {
		return nil
	}
	for i := m.home(h); ; {
		s := &m.slots[i]
		if s.h == h {
			return &s.e
		}
		if s.h == 0 {
			return nil
		}
		if i++; i == len(m.slots) {
			i = 0
		}
	}
}

// upsert returns the entry of h, inserting a zero entry if h is absent, and
// whether it existed. The pointer is valid until the next upsert or del.
func (m *engMap) upsert(h uint64) (*engEntry, bool) {
	if h == 0 {
		existed := m.hasZero
		if !existed {
			m.hasZero, m.zero = true, engEntry{}
		}
		return &m.zero, existed
	}
	if (m.used+1)*20 > len(m.slots)*17 {
		m.resize(len(m.slots)*3/2 + 64)
	}
	for i := m.home(h); ; {
		s := &m.slots[i]
		if s.h == h {
			return &s.e, true
		}
		if s.h == 0 {
			s.h, s.e = h, engEntry{}
			m.used++
			return &s.e, false
		}
		if i++; i == len(m.slots) {
			i = 0
		}
	}
}

// del removes h (backward-shift deletion: no tombstones).
func (m *engMap) del(h uint64) {
	if h == 0 {
		m.hasZero = false
		return
	}
	if len(m.slots) == 0 {
		return
	}
	n := len(m.slots)
	i := m.home(h)
	for m.slots[i].h != h {
		if m.slots[i].h == 0 {
			return
		}
		if i++; i == n {
			i = 0
		}
	}
	for j := i + 1; ; j++ {
		if j == n {
			j = 0
		}
		s := m.slots[j]
		if s.h == 0 {
			break
		}
		// Move s back into the hole at i unless its home lies cyclically in (i, j].
		if (j-m.home(s.h)+n)%n >= (j-i+n)%n {
			m.slots[i] = s
			i = j
		}
	}
	m.slots[i] = engSlot{}
	m.used--
}

// resize rehashes into n slots, dropping entries whose reps are 0 (which
// engClear leaves behind).
func (m *engMap) resize(n int) {
	old := m.slots
	m.slots = make([]engSlot, n)
	m.used = 0
	for _, s := range old {
		if s.h == 0 || s.e.reps == 0 {
			continue
		}
		i := m.home(s.h)
		for m.slots[i].h != 0 {
			if i++; i == n {
				i = 0
			}
		}
		m.slots[i] = s
		m.used++
	}
	if m.hasZero && m.zero.reps == 0 {
		m.hasZero = false
	}
}

// each calls fn for every entry; fn may modify the entry but not the map.
func (m *engMap) each(fn func(h uint64, e *engEntry)) {
	if m.hasZero {
		fn(0, &m.zero)
	}
	for i := range m.slots {
		if s := &m.slots[i]; s.h != 0 {
			fn(s.h, &s.e)
		}
	}
}

// touch loads the home slots of hashes so their cache misses overlap.
func (m *engMap) touch(hashes []uint64) uint64 {
	var acc uint64
	if len(m.slots) == 0 {
		return 0
	}
	for _, h := range hashes {
		acc ^= m.slots[m.home(h)].h
	}
	return acc
}

// bytes is the memory the map holds.
func (m *engMap) bytes() int64 { return int64(cap(m.slots)) * 24 }
