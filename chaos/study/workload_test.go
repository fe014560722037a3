package study_test

import (
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
)

func TestPromptStructure(t *testing.T) {
	d := study.Document{Number: 3, Salt: study.Salt(102, "r1-cold-random@history/g1", 3, 0)}
	p := d.Prompt(17)
	lines := strings.Split(p, "\n")
	require.Len(t, lines, 1+1+300+1, "salt, Document line, 300 sentences, question")
	assert.Regexp(t, regexp.MustCompile(`^[0-9a-f]{256}$`), lines[0])
	assert.Equal(t, "Document 3", lines[1])
	for i := 2; i < 302; i++ {
		require.Equal(t, "The service tracks request latency, token throughput, cache utilization, and healthy replicas.", lines[i])
	}
	assert.Equal(t, "Question 000017: Explain the operational tradeoffs in detail.", lines[302])
	assert.True(t, strings.HasPrefix(p, d.Prefix()+"\n"))
}

func TestSaltsDeterministicAndDistinct(t *testing.T) {
	a := study.Salt(102, "phase-x", 0, 0)
	assert.Equal(t, a, study.Salt(102, "phase-x", 0, 0))
	seen := map[string]bool{a: true}
	for _, s := range []string{
		study.Salt(103, "phase-x", 0, 0), study.Salt(102, "phase-y", 0, 0),
		study.Salt(102, "phase-x", 1, 0), study.Salt(102, "phase-x", 0, 1),
	} {
		assert.Len(t, s, 256)
		assert.False(t, seen[s], "salt repeated")
		seen[s] = true
	}
}

func count(seq []int) map[int]int {
	m := map[int]int{}
	for _, g := range seq {
		m[g]++
	}
	return m
}

func TestGroupSequences(t *testing.T) {
	uni := study.GroupSequence(102, "cold", 8, 96, 0)
	require.Len(t, uni, 96)
	for g := range 8 {
		assert.Equal(t, 12, count(uni)[g])
	}
	assert.Equal(t, uni, study.GroupSequence(102, "cold", 8, 96, 0), "same seed, same sequence")
	assert.NotEqual(t, uni, study.GroupSequence(103, "cold", 8, 96, 0))

	h50 := count(study.GroupSequence(102, "hot50", 8, 96, study.HotArrivals(study.ScenarioHot50, 96)))
	assert.Equal(t, 48, h50[0])
	for g := 1; g < 8; g++ {
		assert.Contains(t, []int{6, 7}, h50[g], "group %d", g)
	}
	h90 := count(study.GroupSequence(102, "hot90", 8, 96, study.HotArrivals(study.ScenarioHot90, 96)))
	assert.Equal(t, 86, h90[0], "89.6 %% of 96")
	rest := 0
	for g := 1; g < 8; g++ {
		assert.Contains(t, []int{1, 2}, h90[g])
		rest += h90[g]
	}
	assert.Equal(t, 10, rest)
}

func TestQuotas(t *testing.T) {
	assert.Equal(t, []int{4, 4}, study.Quotas(8, 2))
	assert.Equal(t, []int{2, 3, 3}, study.Quotas(8, 3))
}

func TestTurnPromptsGrow(t *testing.T) {
	d := study.Document{Number: 1, Salt: strings.Repeat("a", 256)}
	p1 := study.TurnPrompt(d, 7, 1, "", "")
	assert.True(t, strings.HasPrefix(p1, d.Prefix()+"\n\nSession 000007."))
	assert.True(t, strings.HasSuffix(p1, "Assistant:"))
	p2 := study.TurnPrompt(d, 7, 2, p1, " first answer")
	assert.True(t, strings.HasPrefix(p2, p1+" first answer\nUser: "), "turn 2 extends turn 1 and its answer")
	p3 := study.TurnPrompt(d, 7, 3, p2, " second")
	assert.True(t, strings.HasPrefix(p3, p2+" second\nUser: "))
}
