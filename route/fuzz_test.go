package route

import (
	"encoding/binary"
	"fmt"
	"testing"

	"github.com/kvmesh/kvmesh/index"
)

// FuzzPick feeds every strategy arbitrary (including nonsensical) inputs:
// negative and oversized counts, matches beyond the prompt, odd KV usage.
// A Pick must never panic, must return an index into cands and a label,
// and must be deterministic for a seed.
func FuzzPick(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20}, uint64(1))
	f.Add(make([]byte, 200), uint64(0))
	f.Add([]byte("\xff\xff\xff\xff\xff\xff\xff\xff\x80\x00\x00\x00\x7f\xff\xff\xff"), uint64(42))
	set, err := NewSet(DefaultConfig())
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte, seed uint64) {
		next := func() int32 {
			if len(data) < 4 {
				return 0
			}
			v := int32(binary.LittleEndian.Uint32(data))
			data = data[4:]
			return v
		}
		req := Request{
			TotalBlocks:  int(next() % 5000),
			BlockTokens:  int(next() % 1024),
			PromptTokens: int(next()),
			SessionKey:   uint64(next()),
		}
		n := 1 + int(uint32(next())%20)
		cands := make([]Candidate, n)
		for i := range cands {
			cands[i] = Candidate{
				ID:                  index.ReplicaID(uint32(next()) % 64),
				Name:                fmt.Sprintf("r%d", uint32(next())%32),
				Matched:             int(next() % 10000),
				InFlight:            int(next() % 100000),
				LocalInFlight:       int(next() % 100000),
				Running:             int(next() % 1000),
				Waiting:             int(next() % 1000),
				KVUsage:             float64(next()) / 1e9,
				QueuedPrefillTokens: int(next()),
			}
		}
		for _, name := range Names() {
			s, err := set.Get(name)
			if err != nil {
				t.Fatal(err)
			}
			r1, r2 := NewRand(seed), NewRand(seed)
			var ex Explanation
			d1 := s.Pick(&req, cands, &r1, &ex)
			d2 := s.Pick(&req, cands, &r2, nil)
			if d1.Index < 0 || d1.Index >= n || d1.Selection == SelectionNone {
				t.Fatalf("%s: decision %+v over %d candidates", name, d1, n)
			}
			// consistent-hash may rebuild its ring between the two calls when
			// IDs and names collide; every other strategy must repeat itself.
			if name != NameConsistentHash && d1 != d2 {
				t.Fatalf("%s: same seed, different decisions %+v / %+v", name, d1, d2)
			}
		}
	})
}
