package route

import (
	"fmt"
	"testing"

	"github.com/kvmesh/kvmesh/index"
)

// benchCandidates is the benchmark shape: a 5K-token prompt (the
// study's 28.6 KB prompt in 128-character blocks: 223 blocks) and 16
// replicas with mixed matches and loads, engine figures scraped.
func benchCandidates() (Request, []Candidate) {
	req := Request{TotalBlocks: 223, BlockTokens: 128, PromptTokens: 28600, MaxTokens: 256, SessionKey: 0xfeedface}
	cands := make([]Candidate, 16)
	for i := range cands {
		cands[i] = Candidate{
			ID:                  index.ReplicaID(i),
			Name:                fmt.Sprintf("replica-%02d", i),
			Matched:             (i * 37) % 224,
			InFlight:            (i * 7) % 13,
			LocalInFlight:       (i * 3) % 5,
			Running:             (i * 5) % 9,
			Waiting:             i % 3,
			KVUsage:             float64(i) / 20,
			QueuedPrefillTokens: (i * 911) % 4096,
		}
	}
	return req, cands
}

func benchStrategies(tb testing.TB) []Strategy {
	set, err := NewSet(DefaultConfig())
	if err != nil {
		tb.Fatal(err)
	}
	out := make([]Strategy, 0, len(Names()))
	for _, n := range Names() {
		s, err := set.Get(n)
		if err != nil {
			tb.Fatal(err)
		}
		out = append(out, s)
	}
	return out
}

// BenchmarkPick is the routing-decision figure: Pick over 16
// candidates whose match lengths are already known (keys → pick; the index
// match is benchmarked in index/). Target ≤ 15 µs/op, ≤ 2 allocs/op.
func BenchmarkPick(b *testing.B) {
	req, cands := benchCandidates()
	for _, s := range benchStrategies(b) {
		b.Run(s.Name(), func(b *testing.B) {
			rng := NewRand(1)
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				req.SessionKey = uint64(i)
				_ = s.Pick(&req, cands, &rng, nil)
			}
		})
	}
}

// BenchmarkCostPeers is cost over 64 replicas behind 8 gateways: peers
// hold 7/8 of the in-flight requests, and decisions come every 20 ms, so
// about 35 recent decisions' worth of unseen peer requests are placed
// before each pick (worst case: BenchmarkPick/cost, whose decisions all
// share one instant, places up to maxUnseen).
func BenchmarkCostPeers(b *testing.B) {
	req := Request{TotalBlocks: 40, BlockTokens: 128, PromptTokens: 5200, MaxTokens: 128}
	cands := make([]Candidate, 64)
	for i := range cands {
		local := i % 3
		cands[i] = Candidate{ID: index.ReplicaID(i), Name: fmt.Sprintf("replica-%02d", i),
			Matched: []int{0, 0, 0, 40}[i%4], LocalInFlight: local, InFlight: 8 * local,
			Running: min(8*local, 8), Waiting: max(8*local-8, 0), KVUsage: 0.4, QueuedPrefillTokens: (i % 5) * 1000}
	}
	benchCostEvery20ms(b, req, cands)
}

// benchCostEvery20ms measures the default cost strategy's Pick over
// cands, one decision every 20 ms of req's clock.
func benchCostEvery20ms(b *testing.B, req Request, cands []Candidate) {
	set, err := NewSet(DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	rng := NewRand(1)
	b.ReportAllocs()
	for b.Loop() {
		req.Now += 20e6
		_ = set.Cost.Pick(&req, cands, &rng, nil)
	}
}

// isolatedHotCandidates is a gateway of several that see each other only
// in the engines' scrapes, routing a hot prefix (every request shares it)
// whose KV events name 8 holders of 64 replicas, 8 more part way through
// computing it: the path of Cost.Pick's hot-herd rules (copyByNeed,
// inProgress, the placements that may leave the holders).
func isolatedHotCandidates() (Request, []Candidate) {
	req := Request{TotalBlocks: 40, BlockTokens: 128, PromptTokens: 5200, MaxTokens: 128,
		Prefixes: NewPrefixes(promptKeys(40, 40, 0))}
	cands := make([]Candidate, 64)
	for i := range cands {
		cands[i] = Candidate{ID: index.ReplicaID(i), Name: fmt.Sprintf("replica-%02d", i), EventsFed: true,
			Matched: []int{40, 8, 0, 0, 0, 0, 0, 0}[i%8], LocalInFlight: i % 2, InFlight: i % 2,
			Running: 1 + i%5, KVUsage: 0.3}
	}
	return req, cands
}

// BenchmarkCostIsolatedHot measures cost's decision on the path of
// isolatedHotCandidates, its own recent decisions 20 ms apart.
func BenchmarkCostIsolatedHot(b *testing.B) {
	req, cands := isolatedHotCandidates()
	benchCostEvery20ms(b, req, cands)
}

// BenchmarkPickExplain measures the /debug/route path (explanation reused).
func BenchmarkPickExplain(b *testing.B) {
	req, cands := benchCandidates()
	for _, s := range benchStrategies(b) {
		b.Run(s.Name(), func(b *testing.B) {
			rng := NewRand(1)
			var ex Explanation
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				req.SessionKey = uint64(i)
				_ = s.Pick(&req, cands, &rng, &ex)
			}
		})
	}
}

// TestPickDoesNotAllocate is the STYLE 9 ceiling: zero allocations per
// Pick for every strategy, with and without a reused Explanation.
func TestPickDoesNotAllocate(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop items, which allocates")
	}
	req, cands := benchCandidates()
	for _, s := range benchStrategies(t) {
		rng := NewRand(7)
		var ex Explanation
		_ = s.Pick(&req, cands, &rng, &ex) // warm: ring build, explanation slice
		key := uint64(0)
		if got := testing.AllocsPerRun(200, func() {
			key++
			req.SessionKey = key
			_ = s.Pick(&req, cands, &rng, nil)
		}); got != 0 {
			t.Errorf("%s: %.1f allocs per Pick, want 0", s.Name(), got)
		}
		if got := testing.AllocsPerRun(200, func() {
			key++
			req.SessionKey = key
			_ = s.Pick(&req, cands, &rng, &ex)
		}); got != 0 {
			t.Errorf("%s: %.1f allocs per Pick with explanation, want 0", s.Name(), got)
		}
	}
	// Cost's hot-herd path (an isolated gateway, a hot prefix).
	set, err := NewSet(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	hot, hotCands := isolatedHotCandidates()
	rng := NewRand(7)
	var ex Explanation
	_ = set.Cost.Pick(&hot, hotCands, &rng, &ex)
	for _, explain := range []*Explanation{nil, &ex} {
		if got := testing.AllocsPerRun(200, func() {
			hot.Now += 20e6
			_ = set.Cost.Pick(&hot, hotCands, &rng, explain)
		}); got != 0 {
			t.Errorf("cost, isolated with a hot prefix (explained: %v): %.1f allocs per Pick, want 0", explain != nil, got)
		}
	}
}
