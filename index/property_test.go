package index

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"
)

// refIndex is the naive reference: maps of maps, no bitmasks, no chains,
// no tables. It implements the documented semantics (TTL clocks per block
// and ledger, promotion, engine maps) in the most direct way.
type refIndex struct {
	h                Hasher
	histTTL, specTTL int32
	blocks           map[BlockKey]*refBlock
	pub              map[ReplicaID]bool
	roots            map[ReplicaID]BlockKey
	eng              map[ReplicaID]map[uint64][]BlockKey
}

type refBlock struct {
	led          [numLedgers]map[ReplicaID]bool
	htime, stime uint32
}

func newRef(x *Index) *refIndex {
	return &refIndex{
		h: x.Hasher(), histTTL: x.histTTL, specTTL: x.specTTL,
		blocks: map[BlockKey]*refBlock{}, pub: map[ReplicaID]bool{},
		roots: map[ReplicaID]BlockKey{}, eng: map[ReplicaID]map[uint64][]BlockKey{},
	}
}

func (m *refIndex) block(k BlockKey) *refBlock {
	b := m.blocks[k]
	if b == nil {
		b = &refBlock{}
		for l := range b.led {
			b.led[l] = map[ReplicaID]bool{}
		}
		m.blocks[k] = b
	}
	return b
}

func (m *refIndex) gc(k BlockKey) {
	b := m.blocks[k]
	if b != nil && len(b.led[0])+len(b.led[1])+len(b.led[2]) == 0 {
		delete(m.blocks, k)
	}
}

func (m *refIndex) holds(k BlockKey, r ReplicaID, mode Mode, t uint32) bool {
	b := m.blocks[k]
	if b == nil {
		return false
	}
	events := mode == ModeKVEvents || mode == ModeHybrid && m.pub[r]
	if events {
		return b.led[Confirmed][r] || b.led[Speculative][r] && alive(t, b.stime, m.specTTL)
	}
	return b.led[History][r] && alive(t, b.htime, m.histTTL)
}

func (m *refIndex) match(keys []BlockKey, cands []ReplicaID, mode Mode, now int64) []int32 {
	out := make([]int32, len(cands))
	t := tickOf(now)
	for j, r := range cands {
		for _, k := range keys {
			if !m.holds(k, r, mode, t) {
				break
			}
			out[j]++
		}
	}
	return out
}

func (m *refIndex) record(keys []BlockKey, r ReplicaID, l Ledger, now int64) {
	t := tickOf(now)
	for _, k := range keys {
		b := m.block(k)
		ts, ttl := &b.htime, m.histTTL
		if l == Speculative {
			ts, ttl = &b.stime, m.specTTL
		}
		// Time never goes back while the ledger holds entries.
		switch {
		case len(b.led[l]) == 0:
			*ts = t
		case !alive(t, *ts, ttl):
			clear(b.led[l])
			*ts = t
		case int32(t-*ts) > 0:
			*ts = t
		}
		b.led[l][r] = true
	}
}

func (m *refIndex) applyStored(r ReplicaID, s StoredBlocks) error {
	bs := m.h.BlockTokens()
	if s.BlockTokens <= 0 || s.BlockTokens > MaxEngineBlockTokens || s.BlockTokens%bs != 0 {
		return ErrBlockSize
	}
	if len(s.Tokens) != len(s.Hashes)*s.BlockTokens {
		return ErrMalformedStored
	}
	if len(s.Hashes) == 0 {
		return nil
	}
	if m.eng[r] == nil {
		m.eng[r] = map[uint64][]BlockKey{}
	}
	var parent BlockKey
	if s.HasParent {
		ks, ok := m.eng[r][s.ParentHash]
		if !ok {
			return ErrUnknownParent
		}
		parent = ks[len(ks)-1]
	} else if root, ok := m.roots[r]; ok {
		parent = root
	} else {
		return ErrNoRoot
	}
	for i, eh := range s.Hashes {
		keys := naiveKeys(parent, s.Tokens[i*s.BlockTokens:(i+1)*s.BlockTokens], bs)
		for _, k := range keys {
			b := m.block(k)
			b.led[Confirmed][r] = true
			delete(b.led[Speculative], r)
		}
		m.eng[r][eh] = keys
		parent = keys[len(keys)-1]
	}
	return nil
}

func (m *refIndex) applyRemoved(r ReplicaID, hashes []uint64) int {
	n := 0
	for _, eh := range hashes {
		ks, ok := m.eng[r][eh]
		if !ok {
			continue
		}
		delete(m.eng[r], eh)
		for _, k := range ks {
			if b := m.blocks[k]; b != nil && b.led[Confirmed][r] {
				delete(b.led[Confirmed], r)
				n++
				m.gc(k)
			}
		}
	}
	return n
}

func (m *refIndex) clearLedgers(r ReplicaID, ledgers ...Ledger) int {
	n := 0
	for k, b := range m.blocks {
		for _, l := range ledgers {
			if b.led[l][r] {
				delete(b.led[l], r)
				n++
			}
		}
		m.gc(k)
	}
	return n
}

func (m *refIndex) expire(now int64) int {
	t := tickOf(now)
	n := 0
	for k, b := range m.blocks {
		if !alive(t, b.htime, m.histTTL) {
			n += len(b.led[History])
			clear(b.led[History])
		}
		if !alive(t, b.stime, m.specTTL) {
			n += len(b.led[Speculative])
			clear(b.led[Speculative])
		}
		m.gc(k)
	}
	return n
}

func sorted[T cmp.Ordered](s []T) []T {
	slices.Sort(s)
	return s
}

func (m *refIndex) replicaKeys(r ReplicaID, l Ledger) []BlockKey {
	var out []BlockKey
	for k, b := range m.blocks {
		if b.led[l][r] {
			out = append(out, k)
		}
	}
	return out
}

func (m *refIndex) engineHashes() int {
	n := 0
	for _, e := range m.eng {
		n += len(e)
	}
	return n
}

func (m *refIndex) entries() [numLedgers]int {
	var e [numLedgers]int
	for _, b := range m.blocks {
		for l := range e {
			e[l] += len(b.led[l])
		}
	}
	return e
}

// propWorld is a small universe of prompts sharing prefixes, with engine
// hashes that (like vLLM's) are a function of the block chain.
type propWorld struct {
	rng     *rand.Rand
	prompts [][]uint32
	root    BlockKey
	reps    []ReplicaID
	ebs     int // engine block size, a multiple of the index block size
}

func newWorld(seed uint64, x *Index) *propWorld {
	w := &propWorld{rng: rand.New(rand.NewPCG(seed, seed^0x5eed))}
	bs := x.Hasher().BlockTokens()
	w.ebs = bs * (1 + w.rng.IntN(2))
	w.root = x.Hasher().Root("m", "", "")
	base := seqTokens(12*w.ebs, 1)
	for range 6 {
		p := slices.Clone(base)
		cut := w.rng.IntN(len(p) + 1)
		for i := cut; i < len(p); i++ {
			p[i] = uint32(w.rng.IntN(50))
		}
		w.prompts = append(w.prompts, p)
	}
	w.reps = []ReplicaID{0, 1, 2, 63, 64, 900}
	return w
}

// engineHash names engine block i of prompt p on replica r: equal chains,
// equal hashes, as vLLM with a fixed hash seed; replica 2 hashes with its
// own seed, so its hashes are never shared.
func (w *propWorld) engineHash(r ReplicaID, p, i int) uint64 {
	seed := BlockKey(1234)
	if r == 2 {
		seed = 4321
	}
	return uint64(naiveKeys(seed, w.prompts[p][:(i+1)*w.ebs], w.ebs)[i])
}

func (w *propWorld) keys(h Hasher, p int) []BlockKey {
	return h.AppendKeys(nil, w.root, w.prompts[p])
}

func (w *propWorld) replica() ReplicaID { return w.reps[w.rng.IntN(len(w.reps))] }

func (w *propWorld) cands() []ReplicaID {
	c := []ReplicaID{}
	for range 1 + w.rng.IntN(7) {
		c = append(c, w.replica())
	}
	return c
}

// step applies one random operation to both and returns its description.
func (w *propWorld) step(t *testing.T, x *Index, m *refIndex, now *int64, exact bool) string {
	// differ reports a count mismatch: index and reference must agree when
	// nothing was evicted; otherwise the index can only have had fewer.
	differ := func(a, b int) bool { return exact && a != b || a > b }
	h := x.Hasher()
	switch op := w.rng.IntN(100); {
	case op < 8:
		*now += int64(w.rng.IntN(4000)) * int64(time.Millisecond)
		return "advance"
	case op < 10:
		*now += int64(w.rng.IntN(120)) * sec
		return "advance long"
	case op < 35:
		p, r := w.rng.IntN(len(w.prompts)), w.replica()
		keys := w.keys(h, p)
		lo := w.rng.IntN(len(keys))
		hi := lo + w.rng.IntN(len(keys)-lo+1)
		if w.rng.IntN(3) == 0 {
			lo = 0
		}
		l := Ledger(w.rng.IntN(2))
		at := *now
		if w.rng.IntN(4) == 0 {
			at -= int64(w.rng.IntN(5000)) * int64(time.Millisecond) // a late peer batch
		}
		must(t, x.Record(keys[lo:hi], r, l, at))
		m.record(keys[lo:hi], r, l, at)
		return fmt.Sprintf("record p%d[%d:%d] r%d %v at %+dms", p, lo, hi, r, l, (at-*now)/int64(time.Millisecond))
	case op < 60:
		p, r := w.rng.IntN(len(w.prompts)), w.replica()
		n := len(w.prompts[p]) / w.ebs
		lo := w.rng.IntN(n)
		hi := lo + 1 + w.rng.IntN(n-lo)
		s := StoredBlocks{Tokens: w.prompts[p][lo*w.ebs : hi*w.ebs], BlockTokens: w.ebs}
		for i := lo; i < hi; i++ {
			s.Hashes = append(s.Hashes, w.engineHash(r, p, i))
		}
		if lo > 0 {
			s.ParentHash, s.HasParent = w.engineHash(r, p, lo-1), true
		}
		e1 := x.ApplyStored(r, s)
		e2 := m.applyStored(r, s)
		if !errors.Is(e1, e2) || (e1 == nil) != (e2 == nil) {
			t.Fatalf("ApplyStored r%d p%d[%d:%d]: index %v, reference %v", r, p, lo, hi, e1, e2)
		}
		return fmt.Sprintf("stored p%d[%d:%d] r%d err=%v", p, lo, hi, r, e1)
	case op < 75:
		r := w.replica()
		var hs []uint64
		for range 1 + w.rng.IntN(4) {
			p := w.rng.IntN(len(w.prompts))
			hs = append(hs, w.engineHash(r, p, w.rng.IntN(len(w.prompts[p])/w.ebs)))
		}
		if a, b := x.ApplyRemoved(r, hs), m.applyRemoved(r, hs); differ(a, b) {
			t.Fatalf("ApplyRemoved r%d: index %d, reference %d", r, a, b)
		}
		return fmt.Sprintf("removed r%d %d hashes", r, len(hs))
	case op < 80:
		r := w.replica()
		pub := w.rng.IntN(2) == 0
		x.SetPublishesEvents(r, pub)
		m.pub[r] = pub
		return fmt.Sprintf("publishes r%d %v", r, pub)
	case op < 84:
		// Usually the common root; sometimes another one (a LoRA adapter),
		// whose keys differ while the engine hashes stay the same: the
		// engine maps then hold conflicting mappings for one hash.
		r, root := w.replica(), w.root
		if w.rng.IntN(3) == 0 {
			root = w.root ^ 0xa1
		}
		x.SetReplicaRoot(r, root)
		m.roots[r] = root
		return fmt.Sprintf("root r%d %x", r, root)
	case op < 87:
		r := w.replica()
		a, b := x.ClearReplica(r), m.clearLedgers(r, Speculative, Confirmed)
		delete(m.eng, r)
		if differ(a, b) {
			t.Fatalf("ClearReplica r%d: index %d, reference %d", r, a, b)
		}
		return fmt.Sprintf("clear r%d", r)
	case op < 89:
		r := w.replica()
		a, b := x.DropReplica(r), m.clearLedgers(r, History, Speculative, Confirmed)
		delete(m.eng, r)
		delete(m.roots, r)
		delete(m.pub, r)
		if differ(a, b) {
			t.Fatalf("DropReplica r%d: index %d, reference %d", r, a, b)
		}
		return fmt.Sprintf("drop r%d", r)
	case op < 94:
		a, _ := x.Expire(*now, 0)
		if b := m.expire(*now); differ(a, b) {
			t.Fatalf("Expire: index %d, reference %d", a, b)
		}
		return "expire"
	default:
		// Snapshot and restore into the same index: must change nothing.
		snap := x.AppendSnapshot(nil, map[string]uint64{"s": 1}, nil)
		if _, err := x.Restore(snap, nil); err != nil {
			t.Fatalf("restore: %v", err)
		}
		return "snapshot+restore"
	}
}

// checkMatches compares Match for every prompt, a random prefix, and modes.
// With exact set, results must be equal; otherwise the index (which may
// have evicted) must never match more than the reference.
func (w *propWorld) checkMatches(t *testing.T, x *Index, m *refIndex, now int64, exact bool, trace []string) {
	h := x.Hasher()
	for p := range w.prompts {
		keys := w.keys(h, p)
		keys = keys[:w.rng.IntN(len(keys)+1)]
		cands := w.cands()
		for _, mode := range []Mode{ModeHistory, ModeKVEvents, ModeHybrid} {
			out := make([]int32, len(cands))
			longest := x.Match(keys, cands, mode, now, out)
			want := m.match(keys, cands, mode, now)
			wantLongest := 0
			for j := range want {
				wantLongest = max(wantLongest, int(out[j]))
				if exact && out[j] != want[j] || out[j] > want[j] {
					t.Fatalf("Match p%d %v cands %v: index %v, reference %v\ntrace (last 20): %v", p, mode, cands, out, want, tail(trace, 20))
				}
			}
			if longest != wantLongest {
				t.Fatalf("longest %d, want %d", longest, wantLongest)
			}
		}
	}
}

func tail(s []string, n int) []string { return s[max(0, len(s)-n):] }

// propertySeeds returns def, or INDEX_PROPERTY_SEEDS when set (for long
// runs: INDEX_PROPERTY_SEEDS=2000 go test -run Property ./index/).
func propertySeeds(t *testing.T, def int) int {
	if v := os.Getenv("INDEX_PROPERTY_SEEDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("INDEX_PROPERTY_SEEDS=%q", v)
		}
		return n
	}
	if testing.Short() {
		return def / 4
	}
	return def
}

func TestPropertyMatchesReference(t *testing.T) {
	seeds, steps := propertySeeds(t, 40), 400
	for seed := range uint64(seeds) {
		x := newTestIndex(t, nil)
		m := newRef(x)
		w := newWorld(seed, x)
		now := t0
		var trace []string
		for range steps {
			trace = append(trace, w.step(t, x, m, &now, true))
			w.checkMatches(t, x, m, now, true, trace)
			if got, want := x.Stats().Entries, m.entries(); got != want {
				t.Fatalf("seed %d: entries %v, reference %v\ntrace: %v", seed, got, want, tail(trace, 20))
			}
			if got, want := x.Stats().EngineHashes, m.engineHashes(); got != want {
				t.Fatalf("seed %d: engine hashes %d, reference %d\ntrace: %v", seed, got, want, tail(trace, 20))
			}
			r := w.replica()
			if got, want := sorted(x.AppendEngineHashes(nil, r)), sorted(slices.Collect(maps.Keys(m.eng[r]))); !slices.Equal(got, want) {
				t.Fatalf("seed %d: engine hashes of r%d %v, reference %v", seed, r, got, want)
			}
			var wantSum uint64
			for h := range m.eng[r] {
				wantSum += mix64(h)
			}
			if n, sum := x.EngineFingerprint(r); n != len(m.eng[r]) || sum != wantSum {
				t.Fatalf("seed %d: engine fingerprint of r%d (%d, %x), reference (%d, %x)", seed, r, n, sum, len(m.eng[r]), wantSum)
			}
			l := Ledger(w.rng.IntN(int(numLedgers)))
			if got, want := sorted(x.AppendReplicaKeys(nil, r, l)), sorted(m.replicaKeys(r, l)); !slices.Equal(got, want) {
				t.Fatalf("seed %d: %v keys of r%d %v, reference %v", seed, l, r, got, want)
			}
		}
	}
}

func TestPropertyCapacity(t *testing.T) {
	seeds := propertySeeds(t, 20)
	for seed := range uint64(seeds) {
		capacity := 10 + int(seed%20)*3
		x := newTestIndex(t, func(c *Config) { c.Capacity = capacity })
		m := newRef(x)
		w := newWorld(seed+1000, x)
		now := t0
		var trace []string
		evicted := false
		for range 400 {
			trace = append(trace, w.step(t, x, m, &now, false))
			w.checkMatches(t, x, m, now, false, trace)
			s := x.Stats()
			if s.TotalEntries() > capacity {
				t.Fatalf("seed %d: %d entries over capacity %d", seed, s.TotalEntries(), capacity)
			}
			evicted = evicted || s.Evictions > 0
		}
		if !evicted {
			t.Fatalf("seed %d: capacity %d never evicted: the test does not exercise it", seed, capacity)
		}
	}
}
