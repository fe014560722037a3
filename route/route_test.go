package route

import (
	"encoding/json"
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseName(t *testing.T) {
	for _, n := range Names() {
		got, err := ParseName(n)
		require.NoError(t, err)
		require.Equal(t, n, got)
	}
	_, err := ParseName("round-robin")
	require.ErrorIs(t, err, ErrUnknownStrategy)

	set, err := NewSet(DefaultConfig())
	require.NoError(t, err)
	for _, n := range Names() {
		s, err := set.Get(n)
		require.NoError(t, err)
		require.Equal(t, n, s.Name())
	}
	_, err = set.Get("nope")
	require.ErrorIs(t, err, ErrUnknownStrategy)
}

func TestConfigValidate(t *testing.T) {
	require.NoError(t, DefaultConfig().Validate())
	bad := []func(*Config){
		func(c *Config) { c.PrefixCache.ImbalanceAbsCount = -1 },
		func(c *Config) { c.PrefixCache.StdDevFactor = -0.5 },
		func(c *Config) { c.ConsistentHash.VirtualNodes = 0 },
		func(c *Config) { c.ConsistentHash.LoadFactor = 0.9 },
		func(c *Config) { c.ConsistentHash.MinCapacity = 0 },
		func(c *Config) { c.Cost.PriorPrefillTokensPerSecond = 0 },
		func(c *Config) { c.Cost.PriorDecodeStepSeconds = -1 },
		func(c *Config) { c.Cost.PriorOutputTokens = 0 },
		func(c *Config) { c.Cost.PrefillOverheadSeconds = -1 },
		func(c *Config) { c.Cost.ChunkTokens = 0 },
		func(c *Config) { c.Cost.MaxRunning = -1 },
		func(c *Config) { c.Cost.KVSaturation = 0 },
		func(c *Config) { c.Cost.Alpha = 1.5 },
		func(c *Config) { c.Cost.MinSampleTokens = 0 },
		func(c *Config) { c.Cost.ShareTauSeconds = -1 },
		func(c *Config) { c.Cost.ShareTauSeconds = math.Inf(1) },
		func(c *Config) { c.Cost.ShareTauSeconds = math.NaN() },
		func(c *Config) { c.Cost.TTFTTargetSeconds = -1 },
		func(c *Config) { c.Cost.TTFTTargetSeconds = math.Inf(1) },
		func(c *Config) { c.Cost.TTFTTargetSeconds = math.NaN() },
		func(c *Config) { c.Cost.TargetMissCharge = -0.5 },
		func(c *Config) { c.Cost.TargetMissCharge = math.NaN() },
		func(c *Config) { c.PeerLoadDelaySeconds = math.NaN() },
		func(c *Config) { c.PeerLoadDelaySeconds = math.Inf(1) },
	}
	for i, mutate := range bad {
		c := DefaultConfig()
		mutate(&c)
		err := c.Validate()
		require.Error(t, err, "case %d", i)
		require.True(t, errors.Is(err, ErrInvalidConfig), "case %d: %v", i, err)
		_, err = NewSet(c)
		require.ErrorIs(t, err, ErrInvalidConfig, "case %d", i)
	}
}

func TestSelectionLabels(t *testing.T) {
	seen := map[string]bool{}
	for _, s := range Selections() {
		name := s.String()
		require.NotEqual(t, "unknown", name)
		require.NotEqual(t, "none", name)
		require.False(t, seen[name], "duplicate label %q", name)
		seen[name] = true
	}
	// AIBrix's label values, which dashboards built for AIBrix expect.
	require.Equal(t, "prefix_match", SelectionPrefixMatch.String())
	require.Equal(t, "prefix_match_skipped", SelectionPrefixMatchSkipped.String())
	require.Equal(t, "least_request_fallback", SelectionLeastRequestFallback.String())
	require.Equal(t, "unknown", Selection(200).String())
}

func TestRandIntNUniformAndDeterministic(t *testing.T) {
	a, b := NewRand(42), NewRand(42)
	counts := make([]int, 5)
	for i := 0; i < 50000; i++ {
		x := a.IntN(5)
		require.Equal(t, x, b.IntN(5))
		counts[x]++
	}
	for i, c := range counts {
		require.InDelta(t, 10000, c, 500, "bucket %d", i)
	}
	require.Panics(t, func() { a.IntN(0) })
}

func TestEveryStrategyPicksAValidCandidate(t *testing.T) {
	req, cands := benchCandidates()
	for _, s := range benchStrategies(t) {
		rng := NewRand(3)
		var ex Explanation
		for n := 1; n <= len(cands); n++ {
			d := s.Pick(&req, cands[:n], &rng, &ex)
			require.GreaterOrEqual(t, d.Index, 0, s.Name())
			require.Less(t, d.Index, n, s.Name())
			require.NotEqual(t, SelectionNone, d.Selection, s.Name())
			require.Len(t, ex.Replicas, n)
			require.Equal(t, d.Index, ex.Picked)
			require.Equal(t, cands[d.Index].Name, ex.PickedName)
			require.True(t, ex.Replicas[d.Index].Picked)
			_, err := json.Marshal(&ex)
			require.NoError(t, err)
		}
	}
}

func TestExplanationJSON(t *testing.T) {
	req, cands := benchCandidates()
	pc, err := NewPrefixCache(DefaultPrefixCacheConfig())
	require.NoError(t, err)
	rng := NewRand(1)
	var ex Explanation
	cands = append([]Candidate(nil), cands[:3]...)
	cands[1].QueuedPrefillTokens, cands[1].PeerQueuedPrefillTokens = 700, 1335
	pc.Pick(&req, cands, &rng, &ex)
	raw, err := json.Marshal(&ex)
	require.NoError(t, err)
	var back map[string]any
	require.NoError(t, json.Unmarshal(raw, &back))
	require.Equal(t, "prefix-cache", back["strategy"])
	require.Contains(t, []any{"prefix_match", "prefix_match_skipped", "least_request_fallback"}, back["selection"])
	reps := back["replicas"].([]any)
	require.Len(t, reps, 3)
	first := reps[0].(map[string]any)
	for _, k := range []string{"name", "matched_blocks", "match_fraction", "in_flight", "running", "waiting", "kv_usage",
		"queued_prefill_tokens", "peer_queued_prefill_tokens", "score"} {
		require.Contains(t, first, k)
	}
	second := reps[1].(map[string]any)
	require.EqualValues(t, 700, second["queued_prefill_tokens"])
	require.EqualValues(t, 1335, second["peer_queued_prefill_tokens"])
}
