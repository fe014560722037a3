package route

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/index"
)

// arrayLoad is a LoadView over arrays, as the discrete-event simulator's.
type arrayLoad struct {
	names     []string
	inflight  []int
	queued    []int
	publishes []bool
}

func (a *arrayLoad) Candidate(i int, c *Candidate) {
	c.Name = a.names[i]
	c.InFlight, c.LocalInFlight = a.inflight[i], a.inflight[i]
	c.Running, c.Waiting, c.KVUsage = Unknown, Unknown, Unknown
	c.QueuedPrefillTokens = a.queued[i]
}

func (a *arrayLoad) PublishesKVEvents(i int) bool { return a.publishes[i] }

var _ LoadView = (*arrayLoad)(nil)

// coreFixture is an index with n replicas, the first prompt's keys
// recorded (history) on replica 2, and a load view over them.
func coreFixture(t testing.TB, n int) (*index.Index, []index.ReplicaID, *arrayLoad, []index.BlockKey, index.BlockKey) {
	t.Helper()
	cfg := index.DefaultConfig()
	cfg.BlockTokens = CharacterBlockTokens
	ix, err := index.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := ix.Hasher()
	root := h.Root("m", "", "")
	keys := h.AppendKeysString(nil, root, strings.Repeat("the same long system prompt ", 100))
	load := &arrayLoad{}
	ids := make([]index.ReplicaID, n)
	for i := range ids {
		ids[i] = index.ReplicaID(i)
		load.names = append(load.names, fmt.Sprintf("r%d", i))
		load.inflight = append(load.inflight, i%3)
		load.queued = append(load.queued, 100*i)
		load.publishes = append(load.publishes, i%2 == 0)
	}
	if err := ix.Record(keys, 2, index.History, 1); err != nil {
		t.Fatal(err)
	}
	return ix, ids, load, keys, root
}

// TestRouteBuildsCandidatesAndOutcome: Route matches every replica in the
// index, takes the load from the view by position, marks the replicas
// whose holdings the index learns from KV events, and returns the pick
// with its uncached work, the ledger for its mode and the observation to
// complete later.
func TestRouteBuildsCandidatesAndOutcome(t *testing.T) {
	ix, ids, load, keys, root := coreFixture(t, 4)
	set, err := NewSet(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	prompt := len(keys)*CharacterBlockTokens + 17
	req := NewRequest(keys, root, CharacterBlockTokens, prompt, 64, "")
	req.Now = 2
	var s Scratch
	rng := NewRand(1)
	for _, tc := range []struct {
		mode   index.Mode
		ledger index.Ledger
	}{
		{index.ModeHistory, index.History},
		{index.ModeHybrid, index.Speculative}, // replica 2 publishes
		{index.ModeKVEvents, index.Speculative},
	} {
		out := s.Route(&Input{Keys: keys, Replicas: ids, Index: ix, Mode: tc.mode, Load: load,
			Strategy: set.PrefixCache, Rand: &rng, Request: &req})
		if tc.mode == index.ModeKVEvents {
			// Nothing confirmed: no replica matches, least-request picks.
			if out.Matched != 0 || out.Uncached != prompt || out.Decision.Selection != SelectionLeastRequestFallback {
				t.Fatalf("kv-events: %+v", out)
			}
			if out.Ledger != tc.ledger {
				t.Fatalf("kv-events ledger %v", out.Ledger)
			}
			continue
		}
		if out.Decision.Index != 2 || out.Matched != len(keys) || out.Uncached != 17 {
			t.Fatalf("%v: picked %d matched %d uncached %d, want 2, %d, 17", tc.mode, out.Decision.Index, out.Matched, out.Uncached, len(keys))
		}
		if out.Ledger != tc.ledger || out.Candidates != 4 {
			t.Fatalf("%v: ledger %v candidates %d", tc.mode, out.Ledger, out.Candidates)
		}
		if out.Observation != (Observation{UncachedTokens: 17, QueueSeconds: out.Decision.EstimatedQueue}) {
			t.Fatalf("%v: observation %+v", tc.mode, out.Observation)
		}
		for i, c := range s.Candidates() {
			want := Candidate{ID: ids[i], Name: load.names[i], InFlight: load.inflight[i], LocalInFlight: load.inflight[i],
				Running: Unknown, Waiting: Unknown, KVUsage: Unknown, QueuedPrefillTokens: load.queued[i]}
			if i == 2 {
				want.Matched = len(keys)
			}
			// In hybrid mode what a publishing replica holds comes from its
			// KV events.
			want.EventsFed = tc.mode == index.ModeHybrid && load.publishes[i]
			if c != want {
				t.Fatalf("%v: candidate %d = %+v, want %+v", tc.mode, i, c, want)
			}
		}
	}
}

func TestLedgerFor(t *testing.T) {
	for _, tc := range []struct {
		mode      index.Mode
		publishes bool
		want      index.Ledger
	}{
		{index.ModeHistory, false, index.History},
		{index.ModeHistory, true, index.History},
		{index.ModeHybrid, false, index.History},
		{index.ModeHybrid, true, index.Speculative},
		{index.ModeKVEvents, false, index.Speculative},
		{index.ModeKVEvents, true, index.Speculative},
	} {
		if got := LedgerFor(tc.mode, tc.publishes); got != tc.want {
			t.Errorf("LedgerFor(%v, %v) = %v, want %v", tc.mode, tc.publishes, got, tc.want)
		}
	}
}

func TestSessionKey(t *testing.T) {
	keys := []index.BlockKey{11, 22, 33, 44, 55}
	for _, tc := range []struct {
		session string
		keys    []index.BlockKey
		want    uint64
	}{
		{"alice", keys, xxh3.HashString("alice")},
		{"", keys, 44},
		{"", keys[:2], 22},
		{"", nil, 7},
	} {
		if got := SessionKey(tc.session, 7, tc.keys); got != tc.want {
			t.Errorf("SessionKey(%q, %v) = %d, want %d", tc.session, tc.keys, got, tc.want)
		}
	}
	r := NewRequest(keys, 7, 16, 100, 8, "")
	if r != (Request{TotalBlocks: 5, BlockTokens: 16, PromptTokens: 100, MaxTokens: 8, SessionKey: 44, Prefixes: NewPrefixes(keys)}) {
		t.Errorf("NewRequest = %+v", r)
	}
	// A session keys consistent-hash; the prefixes stay the prompt's.
	r = NewRequest(keys, 7, 16, 100, 8, "alice")
	if r.SessionKey != xxh3.HashString("alice") || r.Prefixes != NewPrefixes(keys) {
		t.Errorf("NewRequest with a session = %+v", r)
	}
}

// TestPrefixes: depths 1, 2, 4, … and the last block, each with its key;
// at finds the shallowest prefix at least that deep.
func TestPrefixes(t *testing.T) {
	keys := make([]index.BlockKey, 11)
	for i := range keys {
		keys[i] = index.BlockKey(100 + i)
	}
	p := NewPrefixes(keys)
	require.EqualValues(t, 5, p.n)
	require.Equal(t, []int32{1, 2, 4, 8, 11}, p.depth[:p.n])
	require.Equal(t, []uint64{100, 101, 103, 107, 110}, p.key[:p.n])
	for d, want := range map[int]int{0: 0, 1: 0, 2: 1, 3: 2, 4: 2, 5: 3, 8: 3, 9: 4, 11: 4, 12: -1} {
		require.Equal(t, want, p.at(d), "at(%d)", d)
	}
	// A power-of-two length ends on its own depth; no keys, no prefixes.
	p = NewPrefixes(keys[:8])
	require.Equal(t, []int32{1, 2, 4, 8}, p.depth[:p.n])
	p = NewPrefixes(nil)
	require.Zero(t, p.n)
	require.Equal(t, -1, p.at(1))
	// AddMatch inserts the best match's depth in order, once; a depth
	// the prompt has, none or one beyond the prompt add nothing.
	p = NewPrefixes(keys)
	p.AddMatch(6, keys)
	require.Equal(t, []int32{1, 2, 4, 6, 8, 11}, p.depth[:p.n])
	require.Equal(t, []uint64{100, 101, 103, 105, 107, 110}, p.key[:p.n])
	require.Equal(t, 3, p.at(5))
	require.Equal(t, 4, p.at(7))
	for _, d := range []int{6, 8, 11, 0, 12} {
		p.AddMatch(d, keys)
	}
	require.Equal(t, []int32{1, 2, 4, 6, 8, 11}, p.depth[:p.n])
	// The deepest power kept is 2^15; the last block still comes last.
	long := make([]index.BlockKey, 1<<17)
	p = NewPrefixes(long)
	require.EqualValues(t, maxPrefixes-1, p.n)
	require.EqualValues(t, 1<<15, p.depth[maxPrefixes-3])
	require.EqualValues(t, 1<<17, p.depth[maxPrefixes-2])
	// There is room for the match, and no more.
	p.AddMatch(1<<16, long)
	require.EqualValues(t, maxPrefixes, p.n)
	require.EqualValues(t, 1<<16, p.depth[maxPrefixes-2])
	p.AddMatch(3, long)
	require.EqualValues(t, maxPrefixes, p.n)
	require.Equal(t, 2, p.at(3))
}

// TestObservationStream: TPOT spreads the first-to-last span over the
// tokens after the first event's; one event gives no TPOT.
func TestObservationStream(t *testing.T) {
	base := Observation{UncachedTokens: 300, QueueSeconds: 0.5}
	got := base.Stream(1.5, 11, 11, 2)
	if got.TTFT != 1.5 || got.OutputTokens != 11 || got.TPOT != 0.2 || got.UncachedTokens != 300 || got.QueueSeconds != 0.5 {
		t.Fatalf("one token an event: %+v", got)
	}
	// 40 tokens in 5 events: the span covers 32 of them.
	if got := base.Stream(1, 40, 5, 3.2); got.TPOT != 0.1 || got.OutputTokens != 40 {
		t.Fatalf("stream interval: %+v", got)
	}
	if got := base.Stream(1, 1, 1, 0); got.TPOT != 0 || got.OutputTokens != 1 {
		t.Fatalf("single token: %+v", got)
	}
	if got := base.Stream(1, 0, 0, 0); got.TPOT != 0 || got.OutputTokens != 0 {
		t.Fatalf("no output: %+v", got)
	}
}

func TestDefaultBlockTokens(t *testing.T) {
	if DefaultBlockTokens(true) != 128 || DefaultBlockTokens(false) != 16 {
		t.Fatal(DefaultBlockTokens(true), DefaultBlockTokens(false))
	}
}

// TestRouteAllocs: the routing core allocates nothing once its scratch
// has grown, for every strategy (STYLE 9).
func TestRouteAllocs(t *testing.T) {
	ix, ids, load, keys, root := coreFixture(t, 16)
	req := NewRequest(keys, root, CharacterBlockTokens, 0, 64, "")
	var s Scratch
	rng := NewRand(1)
	for _, strat := range benchStrategies(t) {
		in := &Input{Keys: keys, Replicas: ids, Index: ix, Mode: index.ModeHistory, Load: load, Strategy: strat, Rand: &rng, Request: &req}
		s.Route(in)
		if got := testing.AllocsPerRun(200, func() {
			req.Now += 1000
			s.Route(in)
		}); got != 0 {
			t.Errorf("%s: %v allocs per Route", strat.Name(), got)
		}
	}
}

// BenchmarkRoute is the whole routing step over 16 replicas: index match
// of a 223-block prompt, candidates from the load view, pick.
func BenchmarkRoute(b *testing.B) {
	ix, ids, load, keys, root := coreFixture(b, 16)
	for _, strat := range benchStrategies(b) {
		b.Run(strat.Name(), func(b *testing.B) {
			req := NewRequest(keys, root, CharacterBlockTokens, 0, 64, "")
			var s Scratch
			rng := NewRand(1)
			in := &Input{Keys: keys, Replicas: ids, Index: ix, Mode: index.ModeHistory, Load: load, Strategy: strat, Rand: &rng, Request: &req}
			b.ReportAllocs()
			for b.Loop() {
				req.Now += 1000
				s.Route(in)
			}
		})
	}
}

// TestCostCountsChunksInTokens: with character keys the cost model
// converts the keys' units into engine tokens (Request.UnitsPerToken), so
// a 28,600-character cold prompt is 7,150 tokens: 4 prefill chunks of
// 2,048 tokens (not 14 of characters), and its own prefill at the prior
// rate takes 7,150 / 3,000 s; with token keys nothing changes.
func TestCostCountsChunksInTokens(t *testing.T) {
	m, err := NewModel(DefaultCostConfig())
	if err != nil {
		t.Fatal(err)
	}
	c := NewCost(m)
	cand := Candidate{ID: 0, Name: "a", InFlight: 2, Running: Unknown, Waiting: Unknown, KVUsage: Unknown,
		QueuedPrefillTokens: 4000}
	chars := Request{TotalBlocks: 223, BlockTokens: 128, PromptTokens: 28600, UnitsPerToken: CharsPerToken}
	toks := chars
	toks.UnitsPerToken = 0
	if got := c.chunks(&chars, &cand); got != 4 {
		t.Fatalf("character keys: %d chunks, want 4", got)
	}
	if got := c.chunks(&toks, &cand); got != 14 {
		t.Fatalf("token keys: %d chunks, want 14", got)
	}
	r := m.rate(0)
	ttft, queue, _, _ := c.estimate(&chars, &cand, r, nil, placement{}, nil, nil)
	p := 1 / m.Config().PriorPrefillTokensPerSecond
	d := m.Config().PriorDecodeStepSeconds
	// queued 1,000 tokens, own 7,150; (1,000+7,150)/2,048 → 4 chunks, 2 running;
	// no token timing: half a step's wait for the step in progress.
	wantQueue := d/2 + 1000*p + 4*(d+2*p)
	wantTTFT := m.Config().PrefillOverheadSeconds + wantQueue + 7150*p
	if math.Abs(queue-wantQueue) > 1e-9 || math.Abs(ttft-wantTTFT) > 1e-9 {
		t.Fatalf("character keys: ttft %v queue %v, want %v %v", ttft, queue, wantTTFT, wantQueue)
	}
	ttft, queue, _, _ = c.estimate(&toks, &cand, r, nil, placement{}, nil, nil)
	wantQueue = d/2 + 4000*p + 16*(d+2*p)
	wantTTFT = m.Config().PrefillOverheadSeconds + wantQueue + 28600*p
	if math.Abs(queue-wantQueue) > 1e-9 || math.Abs(ttft-wantTTFT) > 1e-9 {
		t.Fatalf("token keys: ttft %v queue %v, want %v %v", ttft, queue, wantTTFT, wantQueue)
	}
}

// TestRouteObservationInTokens: the core's observation carries the
// uncached work in engine tokens and says whether the strategy estimated
// the queue.
func TestRouteObservationInTokens(t *testing.T) {
	ix, ids, load, keys, root := coreFixture(t, 4)
	set, err := NewSet(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	req := NewRequest(keys, root, CharacterBlockTokens, len(keys)*CharacterBlockTokens+401, 64, "")
	req.UnitsPerToken = CharsPerToken
	var s Scratch
	rng := NewRand(1)
	in := &Input{Keys: keys, Replicas: ids, Index: ix, Mode: index.ModeHistory, Load: load, Strategy: set.Cost, Rand: &rng, Request: &req}
	out := s.Route(in)
	if out.Decision.Index != 2 || out.Uncached != 401 {
		t.Fatalf("cost: picked %d uncached %d, want 2, 401", out.Decision.Index, out.Uncached)
	}
	if out.Observation.UncachedTokens != 100 || !out.Observation.QueueEstimated {
		t.Fatalf("cost observation %+v, want 100 tokens (401 characters), queue estimated", out.Observation)
	}
	// The prompt's characters, for the model to learn the ratio from
	// with the engine's prompt_tokens (Engine).
	if out.Observation.PromptUnits != req.PromptTokens {
		t.Fatalf("character keys: observation's prompt units %d, want %d", out.Observation.PromptUnits, req.PromptTokens)
	}
	if obs := out.Observation.Prompt(1200); obs.PromptTokens != 1200 {
		t.Fatalf("engine usage: %+v, want 1,200 prompt tokens", obs)
	}
	tokReq := req
	tokReq.UnitsPerToken = 0
	in.Request = &tokReq
	if out := s.Route(in); out.Observation.PromptUnits != 0 {
		t.Fatalf("token keys: observation's prompt units %d, want 0", out.Observation.PromptUnits)
	}
	in.Request = &req
	in.Strategy = set.LeastRequest
	if out := s.Route(in); out.Observation.QueueEstimated || out.Observation.QueueSeconds != 0 {
		t.Fatalf("least-request observation %+v: no queue estimated", out.Observation)
	}
}
