package study_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/chaos/study/studytest"
)

// wordCounter counts whitespace-separated words plus a BOS: a tokenizer
// whose per-sentence count (12) differs from the seed's.
type wordCounter struct{ calls *int }

func (wordCounter) Name() string { return "words" }

func (w wordCounter) CountTokens(_ context.Context, p string) (int, error) {
	*w.calls++
	return 1 + len(strings.Fields(p)), nil
}

type failingCounter struct{}

func (failingCounter) Name() string { return "down" }
func (failingCounter) CountTokens(context.Context, string) (int, error) {
	return 0, errors.New("connection refused")
}

// TestSizePromptsPicksTheClosest checks SizePrompts against every repeat
// count: none is closer to the target than the one it picks, and it
// counts only a few prompts.
func TestSizePromptsPicksTheClosest(t *testing.T) {
	calls := 0
	c := wordCounter{&calls}
	for _, target := range []int{40, 1000, 2500, 3907, 5042} {
		calls = 0
		ps, err := study.SizePrompts(context.Background(), c, target)
		require.NoError(t, err, target)
		assert.LessOrEqual(t, calls, 8, "a handful of counts, not a scan")
		n, _ := c.CountTokens(context.Background(), study.SizingProbe(ps.Repeats))
		assert.Equal(t, n, ps.ProbeTokens)
		best := -1
		for r := 1; r <= 600; r++ {
			m, _ := c.CountTokens(context.Background(), study.SizingProbe(r))
			d := m - target
			if d < 0 {
				d = -d
			}
			if best < 0 || d < best {
				best = d
			}
		}
		d := n - target
		if d < 0 {
			d = -d
		}
		assert.Equal(t, best, d, "target %d: %d sentences give %d tokens", target, ps.Repeats, n)
		assert.InDelta(t, 12, ps.SentenceTokens, 0.01)
	}
	_, err := study.SizePrompts(context.Background(), c, 5)
	require.ErrorIs(t, err, study.ErrSizing)
	_, err = study.SizePrompts(context.Background(), failingCounter{}, 5042)
	require.ErrorIs(t, err, study.ErrSizing)
	assert.Contains(t, err.Error(), "connection refused")
	_, err = study.SizePrompts(context.Background(), c, 50_000_000)
	require.ErrorIs(t, err, study.ErrSizing)
}

// TestBodyRepeatsReachThePrompts runs a phase with a sized body: every
// prompt (warm-up, bootstrap and measured) carries that many sentences.
func TestBodyRepeatsReachThePrompts(t *testing.T) {
	assert.Equal(t, study.SizingProbe(0), study.SizingProbe(study.SentenceRepeats))
	assert.Equal(t, 7, strings.Count(study.SizingProbe(7), study.Sentence))

	cfg := smallConfig()
	cfg.Scenarios = []string{study.ScenarioWarm}
	cfg.Strategies = []string{"prefix-cache"}
	cfg.Rounds = 1
	cfg.Arrivals = 6
	cfg.BodyRepeats = 12
	var counts []int
	rn := &study.Runner{Config: cfg, Factory: toyFactory(func(ty *studytest.Toy) {
		ty.Drop = func(req study.Request) bool {
			counts = append(counts, strings.Count(req.Prompt, study.Sentence))
			return false
		}
	})}
	res, err := rn.Run(context.Background())
	require.NoError(t, err)
	require.Len(t, res.Runs, 1)
	require.NotEmpty(t, counts)
	for _, n := range counts {
		assert.Equal(t, 12, n)
	}
	cfg.BodyRepeats = -1
	require.ErrorIs(t, cfg.Validate(), study.ErrInvalidConfig)
}
