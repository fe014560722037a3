package sim

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/kvevents"
)

func testEngineConfig() EngineConfig {
	return EngineConfig{
		MaxModelLen: 4096, MaxNumSeqs: 4, MaxNumBatchedTokens: 256,
		BlockSize: 16, NumBlocks: 256, Profile: ProfileFast, HashSeed: 7, EmitEvents: true,
	}
}

// mirror applies KV events to a naive set, as an event consumer would.
type mirror map[kvevents.EngineHash]kvevents.EngineHash // hash -> parent

func (m mirror) apply(t *testing.T, evs []kvevents.Event) {
	t.Helper()
	for _, ev := range evs {
		switch ev.Kind {
		case kvevents.KindBlockStored:
			st := ev.Stored
			require.Len(t, st.TokenIDs, len(st.BlockHashes)*st.BlockSize)
			require.Equal(t, MediumGPU, st.Medium)
			parent := st.ParentBlockHash
			for _, h := range st.BlockHashes {
				_, dup := m[h]
				require.False(t, dup, "BlockStored for an already stored block %x", h)
				m[h] = parent
				parent = h
			}
		case kvevents.KindBlockRemoved:
			for _, h := range ev.Removed.BlockHashes {
				_, ok := m[h]
				require.True(t, ok, "BlockRemoved for a block never stored %x", h)
				delete(m, h)
			}
		case kvevents.KindAllBlocksCleared:
			clear(m)
		}
	}
}

// cacheView is what both Engine and Server expose about their cache.
type cacheView interface {
	CachedBlocks() []CachedBlock
	HashTokens([]uint32) []kvevents.EngineHash
}

func (m mirror) requireMatches(t *testing.T, e cacheView) {
	t.Helper()
	got := make(map[kvevents.EngineHash]kvevents.EngineHash)
	for _, b := range e.CachedBlocks() {
		bs := len(b.Tokens)
		got[b.Hash] = b.Parent
		// The token chain re-hashes to the block's hash and parent.
		require.Zero(t, len(b.Prefix)%bs)
		require.Equal(t, b.Prefix[len(b.Prefix)-bs:], b.Tokens)
		hs := e.HashTokens(b.Prefix)
		require.Equal(t, b.Hash, hs[len(hs)-1])
		require.Equal(t, len(hs) > 1, b.HasParent)
		if b.HasParent {
			require.Equal(t, b.Parent, hs[len(hs)-2])
		}
	}
	require.Equal(t, map[kvevents.EngineHash]kvevents.EngineHash(m), got)
}

// runUntilIdle steps e with a fake clock until nothing is scheduled.
func runUntilIdle(t *testing.T, e *Engine, now time.Time, each func(StepResult)) time.Time {
	t.Helper()
	for range 1_000_000 {
		r := e.Step(now)
		if r.Idle() {
			return now
		}
		each(r)
		now = r.End()
	}
	t.Fatal("engine did not go idle")
	return now
}

func TestSchedulerInvariants(t *testing.T) {
	cfg := testEngineConfig()
	cfg.NumBlocks = 96 // tight: forces preemption and eviction
	e, err := NewEngine(cfg)
	require.NoError(t, err)
	rng := rand.New(rand.NewPCG(1, 2))
	now := time.Unix(1000, 0)
	want := map[RequestID]int{}
	for i := range 60 {
		// a few shared prefixes so hits, evictions and preemptions all happen
		p := make([]uint32, 100+rng.IntN(500))
		fam := uint32(rng.IntN(4))
		for j := range p {
			p[j] = fam*1000 + uint32(j)
		}
		p[len(p)-1] = uint32(i)
		id := RequestID(fmt.Sprint("r", i))
		mt := 1 + rng.IntN(40)
		require.NoError(t, e.Add(Request{ID: id, Prompt: p, MaxTokens: mt}, now))
		want[id] = mt
	}
	got := map[RequestID]int{}
	finished := map[RequestID]bool{}
	m := mirror{}
	steps := 0
	runUntilIdle(t, e, now, func(r StepResult) {
		steps++
		st := e.Stats()
		require.LessOrEqual(t, st.Running, cfg.MaxNumSeqs)
		require.LessOrEqual(t, len(r.Scheduled), cfg.MaxNumSeqs)
		sum := 0
		for _, s := range r.Scheduled {
			require.Positive(t, s.NumTokens)
			sum += s.NumTokens
		}
		require.LessOrEqual(t, sum, cfg.MaxNumBatchedTokens)
		require.Equal(t, cfg.Profile.StepTime(r.PrefillTokens, r.DecodeSeqs), r.Duration)
		for _, o := range r.Outputs {
			require.Equal(t, got[o.ID], o.Index, "outputs of %s in order", o.ID)
			got[o.ID]++
		}
		for _, f := range r.Finished {
			require.False(t, finished[f.ID])
			finished[f.ID] = true
			require.Equal(t, want[f.ID], f.OutputTokens)
		}
		m.apply(t, r.Events)
		m.requireMatches(t, e)
	})
	require.Equal(t, want, got)
	require.Len(t, finished, len(want))
	st := e.Stats()
	require.Zero(t, st.Running)
	require.Zero(t, st.Waiting)
	require.Zero(t, st.KVUsage)
	require.Positive(t, st.Preemptions, "the tight pool should have forced preemption")
	t.Logf("%d steps, %d preemptions, hits %d/%d tokens", steps, st.Preemptions, st.PrefixHits, st.PrefixQueries)
}

func TestPrefixHitOnRepeatedPrompt(t *testing.T) {
	e, err := NewEngine(testEngineConfig())
	require.NoError(t, err)
	prompt := make([]uint32, 100) // 6 full blocks + 4 tokens
	for i := range prompt {
		prompt[i] = uint32(i + 1)
	}
	now := time.Unix(0, 0)
	var fin []Finished
	var stored int
	collect := func(r StepResult) {
		fin = append(fin, r.Finished...)
		for _, ev := range r.Events {
			if ev.Kind == kvevents.KindBlockStored {
				stored += len(ev.Stored.BlockHashes)
			}
		}
	}
	require.NoError(t, e.Add(Request{ID: "a", Prompt: prompt, MaxTokens: 4}, now))
	now = runUntilIdle(t, e, now, collect)
	// 100 prompt + 3 computed outputs = 103 computed tokens = 6 full blocks.
	require.Equal(t, 6, stored)
	require.NoError(t, e.Add(Request{ID: "b", Prompt: prompt, MaxTokens: 4}, now))
	stored = 0
	runUntilIdle(t, e, now, collect)
	require.Len(t, fin, 2)
	require.Equal(t, 0, fin[0].CachedTokens)
	require.Equal(t, 96, fin[1].CachedTokens)
	require.Equal(t, 0, stored, "a prefix hit must not re-emit BlockStored")
	st := e.Stats()
	require.Equal(t, uint64(200), st.PrefixQueries)
	require.Equal(t, uint64(fin[0].CachedTokens+fin[1].CachedTokens), st.PrefixHits)
}

func TestFullyCachedPromptRecomputesLastToken(t *testing.T) {
	e, err := NewEngine(testEngineConfig())
	require.NoError(t, err)
	prompt := make([]uint32, 64) // exactly 4 blocks
	for i := range prompt {
		prompt[i] = uint32(i + 1)
	}
	now := time.Unix(0, 0)
	var fin []Finished
	for _, id := range []RequestID{"a", "b"} {
		require.NoError(t, e.Add(Request{ID: id, Prompt: prompt, MaxTokens: 1}, now))
		now = runUntilIdle(t, e, now, func(r StepResult) { fin = append(fin, r.Finished...) })
	}
	require.Equal(t, 48, fin[1].CachedTokens, "the last block is recomputed so at least one token runs")
}

func TestEvictionEmitsExactlyEvictedBlocks(t *testing.T) {
	cfg := testEngineConfig()
	cfg.NumBlocks = 10
	e, err := NewEngine(cfg)
	require.NoError(t, err)
	now := time.Unix(0, 0)
	m := mirror{}
	mk := func(base uint32) []uint32 {
		p := make([]uint32, 96) // 6 blocks
		for i := range p {
			p[i] = base + uint32(i)
		}
		return p
	}
	require.NoError(t, e.Add(Request{ID: "a", Prompt: mk(0), MaxTokens: 1}, now))
	now = runUntilIdle(t, e, now, func(r StepResult) { m.apply(t, r.Events) })
	before := e.CachedBlocks()
	require.Len(t, before, 6)
	// b needs 7 blocks (96 prompt + 1 slot for the sampled token is not
	// computed: 96 tokens = 6 blocks); 4 are free and uncached, so 2 of a's
	// cached blocks must go, the LRU ones: a's tail blocks first.
	require.NoError(t, e.Add(Request{ID: "b", Prompt: mk(5000), MaxTokens: 1}, now))
	var removed []kvevents.EngineHash
	runUntilIdle(t, e, now, func(r StepResult) {
		for _, ev := range r.Events {
			if ev.Kind == kvevents.KindBlockRemoved {
				removed = append(removed, ev.Removed.BlockHashes...)
			}
		}
		m.apply(t, r.Events)
		m.requireMatches(t, e)
	})
	require.ElementsMatch(t, []kvevents.EngineHash{before[5].Hash, before[4].Hash}, removed)
	after := map[kvevents.EngineHash]bool{}
	for _, b := range e.CachedBlocks() {
		after[b.Hash] = true
	}
	for i, b := range before {
		require.Equal(t, i < 4, after[b.Hash], "block %d", i)
	}
}

func TestResetPrefixCache(t *testing.T) {
	e, err := NewEngine(testEngineConfig())
	require.NoError(t, err)
	now := time.Unix(0, 0)
	p := make([]uint32, 40)
	require.NoError(t, e.Add(Request{ID: "a", Prompt: p, MaxTokens: 3}, now))
	r := e.Step(now) // a is now running and holds blocks
	ok, evs := e.ResetPrefixCache()
	require.False(t, ok, "reset must refuse while blocks are in use")
	require.Empty(t, evs)
	runUntilIdle(t, e, r.End(), func(StepResult) {})
	require.NotEmpty(t, e.CachedBlocks())
	ok, evs = e.ResetPrefixCache()
	require.True(t, ok)
	require.Equal(t, []kvevents.Event{{Kind: kvevents.KindAllBlocksCleared}}, evs)
	require.Empty(t, e.CachedBlocks())
}

func TestAbortFreesBlocks(t *testing.T) {
	e, err := NewEngine(testEngineConfig())
	require.NoError(t, err)
	now := time.Unix(0, 0)
	require.NoError(t, e.Add(Request{ID: "a", Prompt: make([]uint32, 50), MaxTokens: 100}, now))
	r := e.Step(now)
	require.Positive(t, e.Stats().KVUsage)
	require.True(t, e.Abort("a"))
	require.False(t, e.Abort("a"))
	require.Zero(t, e.Stats().KVUsage)
	require.Zero(t, e.Stats().Running)
	require.True(t, e.Step(r.End()).Idle())
}

func TestDefaultEngineConfigValid(t *testing.T) {
	require.NoError(t, DefaultEngineConfig().Validate())
	require.NoError(t, DefaultConfig().Validate())
	require.NoError(t, LocalConfig().Validate())
	bad := DefaultEngineConfig()
	bad.NumBlocks = 0
	require.ErrorIs(t, bad.Validate(), ErrInvalidConfig)
	p := ProfileFast
	p.WeightRead, p.StepOverhead, p.PrefillPerToken = 0, 0, 0
	require.ErrorIs(t, p.Validate(), ErrInvalidConfig)
}

func TestCheckRejects(t *testing.T) {
	cfg := testEngineConfig()
	cfg.NumBlocks = 4
	e, err := NewEngine(cfg)
	require.NoError(t, err)
	require.ErrorIs(t, e.Check(0, 1), ErrBadRequest)
	require.ErrorIs(t, e.Check(1, 0), ErrBadRequest)
	require.ErrorIs(t, e.Check(4000, 100), ErrPromptTooLong)
	require.ErrorIs(t, e.Check(60, 10), ErrRequestTooLarge)
	require.NoError(t, e.Check(60, 4))
}

// seedPrompt builds the seed study's prompt shape.
func seedPrompt(salt string, doc, question int) string {
	var b strings.Builder
	b.WriteString(salt)
	fmt.Fprintf(&b, "\nDocument %d\n", doc)
	for range 300 {
		b.WriteString("The service tracks request latency, token throughput, cache utilization, and healthy replicas.\n")
	}
	fmt.Fprintf(&b, "Question %06d: Explain the operational tradeoffs in detail.", question)
	return b.String()
}

// seedTokens is a token-level stand-in for the seed prompt under a BPE
// tokenizer (cl100k gives ~5K tokens): a 256-hex-char salt as 130 unique
// tokens, "Document 1" as 3, the 16-token sentence ×300, and a 12-token
// question that varies with q.
func seedTokens(q int) []uint32 {
	p := make([]uint32, 0, 5100)
	for i := range 130 {
		p = append(p, uint32(50_000+i))
	}
	p = append(p, 100, 101, 102)
	for range 300 {
		for j := range 16 {
			p = append(p, uint32(200+j))
		}
	}
	for j := range 12 {
		p = append(p, uint32(300+j+q*12))
	}
	return p
}

// TestCalibrationL20 reports the l20-qwen27b-fp8 profile's TTFT for a
// seed-shaped prompt in model time (fake clock) and checks it stays in the
// band the seed implies.
func TestCalibrationL20(t *testing.T) {
	name, enc := "synthetic", seedTokens
	if tok, err := newTokenizer("tiktoken"); err == nil {
		rng := rand.New(rand.NewPCG(3, 4))
		var sb strings.Builder
		for range 256 {
			sb.WriteByte("0123456789abcdef"[rng.IntN(16)])
		}
		salt := sb.String()
		name, enc = tok.Name(), func(q int) []uint32 { return tok.Encode(nil, seedPrompt(salt, 1, q)) }
	}
	prompt, prompt2 := enc(1), enc(2)
	for _, bs := range []int{16, 1568} {
		cfg := EngineConfig{
			MaxModelLen: 32768, MaxNumSeqs: 8, MaxNumBatchedTokens: DefaultConfig().MaxNumBatchedTokens,
			BlockSize: bs, NumBlocks: 200_000 / bs, Profile: ProfileL20Qwen27BFP8, HashSeed: 1,
		}
		e, err := NewEngine(cfg)
		require.NoError(t, err)
		now := time.Unix(0, 0)
		ttft := func(id RequestID, p []uint32) (time.Duration, time.Duration) {
			require.NoError(t, e.Add(Request{ID: id, Prompt: p, MaxTokens: 128}, now))
			var first, last time.Time
			var tt time.Duration
			now = runUntilIdle(t, e, now, func(r StepResult) {
				for _, o := range r.Outputs {
					if o.Index == 0 {
						tt, first = o.TTFT, r.End()
					}
					last = r.End()
				}
			})
			return tt, last.Sub(first) / 127
		}
		cold, tpot1 := ttft("cold", prompt)
		warm, _ := ttft("warm", prompt2)
		// TPOT at batch 8: 8 warm requests at once.
		var batchTPOT time.Duration
		var firsts []time.Time
		start := now
		for i := range 8 {
			require.NoError(t, e.Add(Request{ID: RequestID(fmt.Sprint("b", i)), Prompt: enc(10 + i), MaxTokens: 128}, now))
		}
		var last time.Time
		runUntilIdle(t, e, now, func(r StepResult) {
			for _, o := range r.Outputs {
				if o.Index == 0 {
					firsts = append(firsts, r.End())
				}
				last = r.End()
			}
		})
		batchTPOT = last.Sub(firsts[len(firsts)-1]) / 127
		t.Logf("l20-qwen27b-fp8 (%s tokenizer, block %d): prompt %d tokens: cold TTFT %v, warm TTFT %v, TPOT batch1 %v, TPOT batch8 %v (batch of 8 warm: last first-token at +%v)",
			name, bs, len(prompt), cold, warm, tpot1, batchTPOT, firsts[len(firsts)-1].Sub(start))
		require.Greater(t, cold, 1200*time.Millisecond)
		require.Less(t, cold, 3000*time.Millisecond)
		require.Less(t, warm, 400*time.Millisecond)
		require.Greater(t, batchTPOT, 50*time.Millisecond)
		require.Less(t, batchTPOT, 70*time.Millisecond)
	}
}

// loadResult is the outcome of simulateLoad.
type loadResult struct{ ttftP95, tpotP95 time.Duration }

// simulateLoad drives e with fixed-rate arrivals of seed-shaped requests
// (128 output tokens) on a fake clock: n requests at rps, spread round-robin
// over groups prefix groups, and returns the P95s (nearest rank).
func simulateLoad(t *testing.T, e *Engine, rps float64, n, groups, qBase int) loadResult {
	t.Helper()
	gap := time.Duration(float64(time.Second) / rps)
	now := time.Unix(10_000, 0)
	start := now
	first := map[RequestID]time.Time{}
	var ttfts, tpots []time.Duration
	next := 0
	for done := 0; done < n; {
		for next < n && !start.Add(time.Duration(next)*gap).After(now) {
			p := seedTokens(qBase + next)
			for j := range 130 {
				p[j] += uint32(1000 * (next % groups)) // the group's salt
			}
			require.NoError(t, e.Add(Request{ID: RequestID(fmt.Sprint("L", qBase+next)), Prompt: p, MaxTokens: 128}, start.Add(time.Duration(next)*gap)))
			next++
		}
		r := e.Step(now)
		if r.Idle() {
			now = start.Add(time.Duration(next) * gap)
			continue
		}
		for _, o := range r.Outputs {
			if o.Index == 0 {
				ttfts = append(ttfts, o.TTFT)
				first[o.ID] = r.End()
			}
		}
		for _, f := range r.Finished {
			tpots = append(tpots, r.End().Sub(first[f.ID])/127)
			done++
		}
		now = r.End()
	}
	p95 := func(d []time.Duration) time.Duration {
		slices.Sort(d)
		return d[(len(d)*95+99)/100-1]
	}
	return loadResult{p95(ttfts), p95(tpots)}
}

// TestCalibrationUnderLoad reports the l20 profile on one replica under the
// seed's per-replica loads (model time, fake clock): half of 1.6 RPS with
// warm and with cold prefix groups, and the hot replica's ~1.15 RPS.
func TestCalibrationUnderLoad(t *testing.T) {
	for _, bs := range []int{16, 1568} {
		mk := func() *Engine {
			e, err := NewEngine(EngineConfig{
				MaxModelLen: 32768, MaxNumSeqs: 8, MaxNumBatchedTokens: DefaultConfig().MaxNumBatchedTokens,
				BlockSize: bs, NumBlocks: 200_000 / bs, Profile: ProfileL20Qwen27BFP8, HashSeed: 1,
			})
			require.NoError(t, err)
			return e
		}
		cold := simulateLoad(t, mk(), 0.8, 48, 8, 0)
		e := mk()
		simulateLoad(t, e, 0.8, 8, 8, 0) // warm the 8 groups
		warm := simulateLoad(t, e, 0.8, 48, 8, 100)
		e = mk()
		simulateLoad(t, e, 0.8, 8, 8, 0)
		hot := simulateLoad(t, e, 69.0/60, 69, 8, 100)
		// Seed (two rounds): cold TTFT P95 5.6–9.2 s, TPOT P95 66–106 ms;
		// warm TTFT P95 0.33 s, TPOT P95 58.5–60.4 ms; hot replica
		// (69 of 96 requests) TTFT P95 8.3 s, TPOT P95 59.8 ms.
		t.Logf("block %d: cold 8 groups @0.8 RPS: TTFT P95 %v TPOT P95 %v; warm @0.8 RPS: TTFT P95 %v TPOT P95 %v; warm hot replica @1.15 RPS: TTFT P95 %v TPOT P95 %v",
			bs, cold.ttftP95, cold.tpotP95, warm.ttftP95, warm.tpotP95, hot.ttftP95, hot.tpotP95)
		require.Less(t, warm.ttftP95, cold.ttftP95)
		require.Greater(t, warm.tpotP95, 40*time.Millisecond)
		require.Less(t, warm.tpotP95, 90*time.Millisecond)
	}
}

// TestWaitingGaugeIsTheLastSchedules: num_requests_waiting counts the
// requests a step's schedule left waiting, as vLLM's scheduler stats do;
// a request added since the last step is Queued until a step sees it,
// and aborting it takes it off Queued, not off the gauge.
func TestWaitingGaugeIsTheLastSchedules(t *testing.T) {
	cfg := testEngineConfig()
	cfg.MaxNumSeqs = 1
	e, err := NewEngine(cfg)
	require.NoError(t, err)
	now := time.Unix(0, 0)
	add := func(id string, tok uint32) {
		t.Helper()
		prompt := slices.Repeat([]uint32{tok}, 20)
		require.NoError(t, e.Add(Request{ID: RequestID(id), Prompt: prompt, MaxTokens: 50}, now))
	}
	gauges := func() [3]int {
		st := e.Stats()
		g := e.Gauges()
		require.Equal(t, [2]int{st.Running, st.Waiting}, [2]int{g.Running, g.Waiting}, "Gauges reads Stats' gauges")
		return [3]int{st.Running, st.Waiting, st.Queued}
	}

	add("a", 1)
	add("b", 2)
	require.Equal(t, [3]int{0, 0, 2}, gauges(), "no step has seen a or b")
	res := e.Step(now)
	require.False(t, res.Idle())
	require.Equal(t, [3]int{1, 1, 0}, gauges(), "a runs; one slot, so the schedule left b waiting")

	add("c", 3)
	require.Equal(t, [3]int{1, 1, 1}, gauges(), "c arrived after the step")
	require.True(t, e.Abort("c"))
	require.Equal(t, [3]int{1, 1, 0}, gauges(), "aborting c takes it off Queued")
	add("d", 4)
	require.True(t, e.Abort("b"))
	require.Equal(t, [3]int{1, 0, 1}, gauges(), "aborting b, which a step saw, takes it off the gauge; d stays Queued")

	now = now.Add(res.Duration)
	e.Step(now)
	require.Equal(t, [3]int{1, 1, 0}, gauges(), "the next step sees d and leaves it waiting behind a")
}
