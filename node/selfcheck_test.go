package node

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseUsage(t *testing.T) {
	for _, tc := range []struct {
		in             string
		prompt, cached int
		pOK, cOK       bool
	}{
		{`{"choices":[],"usage":{"prompt_tokens":40,"total_tokens":44,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":32}}}`, 40, 32, true, true},
		{`{"usage":{"prompt_tokens":40,"completion_tokens":4,"prompt_tokens_details":null}}`, 40, 0, true, false},
		{`{"usage": {"prompt_tokens" : 7 , "prompt_tokens_details": {"cached_tokens": 0}}}`, 7, 0, true, true},
		// Prompt text that spells the keys is escaped inside its string.
		{`{"text":"\"usage\" \"cached_tokens\": 99"}`, 0, 0, false, false},
		{`{"id":"x"}`, 0, 0, false, false},
	} {
		u := parseUsage([]byte(tc.in))
		assert.Equal(t, usageFigures{prompt: tc.prompt, cached: tc.cached, promptOK: tc.pOK, cachedOK: tc.cOK}, u, tc.in)
	}
}

func TestBodyTail(t *testing.T) {
	var bt bodyTail
	var all strings.Builder
	for i := 0; i < 300; i++ {
		c := fmt.Sprintf("chunk-%d;", i)
		if i%50 == 0 {
			c = strings.Repeat("x", 1500) // longer than the tail
		}
		bt.feed([]byte(c))
		all.WriteString(c)
		s := all.String()
		want := s[max(0, len(s)-bodyTailCap):]
		require.Equal(t, want, string(bt.bytes()), "after chunk %d", i)
	}
}

// The windows judge only KV-event predictions, need a persistent majority
// of failures to suspect and a quiet window to clear.
func TestPredictionCheckThresholds(t *testing.T) {
	now := time.Unix(1e9, 0)
	ok := predictionSample{judged: true, blockTokens: 16, confirmedTokens: 160, routedTokens: 160, cachedTokens: 160, gatewayPrompt: 170, enginePrompt: 170}
	over := ok
	over.cachedTokens = 0
	var c predictionCheck

	// History predictions are never judged.
	h := over
	h.judged = false
	for range 30 {
		tr, _ := c.observe(h, now)
		require.Equal(t, [numSuspect]int{}, tr)
	}
	// Noise: one over-prediction in four never suspects.
	for i := range 40 {
		s := ok
		if i%4 == 0 {
			s = over
		}
		tr, _ := c.observe(s, now)
		require.Zero(t, tr[idxOver], i)
	}
	// A persistent over-prediction does, within a few responses.
	got := -1
	for i := range 20 {
		tr, fails := c.observe(over, now)
		require.True(t, fails[idxOver])
		if tr[idxOver] == 1 {
			got = i
			break
		}
	}
	require.GreaterOrEqual(t, got, 0, "never suspected")
	assert.Less(t, got, 10)
	assert.Len(t, c.appendSuspects(nil, "b"), 1)
	// The one-block slack: a fully cached prompt recomputes its last block.
	slack := ok
	slack.cachedTokens = 160 - 16
	_, fails := c.observe(slack, now)
	assert.False(t, fails[idxOver])
	// Clears once the window is mostly good again.
	cleared := false
	for range suspectWindow {
		tr, _ := c.observe(ok, now)
		if tr[idxOver] == -1 {
			cleared = true
			break
		}
	}
	assert.True(t, cleared)
	assert.Empty(t, c.appendSuspects(nil, "b"))

	// Under-prediction and a prompt-token mismatch.
	var d predictionCheck
	under := predictionSample{judged: true, blockTokens: 16, cachedTokens: 320, gatewayPrompt: 400, enginePrompt: 100}
	var trs [numSuspect]int
	for range suspectMinFailures {
		tr, _ := d.observe(under, now)
		for i := range tr {
			trs[i] += tr[i]
		}
	}
	assert.Equal(t, [numSuspect]int{0, 1, 1}, trs)
	r := d.appendSuspects(nil, "a")
	require.Len(t, r, 2)
	assert.Equal(t, SuspectUnderPrediction, r[0].Reason)
	assert.Equal(t, SuspectPromptTokens, r[1].Reason)
	assert.Contains(t, r[1].LikelyCause, "tokenizer")
}
