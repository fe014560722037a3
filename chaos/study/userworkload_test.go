package study_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/chaos/study/studytest"
)

func TestReadWorkloadRejectsBadLines(t *testing.T) {
	cases := []struct {
		name, file, want string
	}{
		{"not json", `{"prompt":"a"}` + "\n" + `prompt: b`, "line 2:"},
		{"unknown field", `{"prompt":"a","promt":"b"}`, `line 1: json: unknown field "promt"`},
		{"no prompt", "\n\n" + `{"session":"s"}`, `line 3: "prompt" is missing`},
		{"empty prompt", `{"prompt":""}`, `line 1: "prompt" is missing or empty`},
		{"two values", `{"prompt":"a"} {"prompt":"b"}`, "line 1: more than one JSON value"},
		{"bad max_tokens", `{"prompt":"a","max_tokens":0}`, `line 1: "max_tokens" 0 < 1`},
		{"negative at", `{"prompt":"a","at_ms":-5}`, `line 1: "at_ms" -5 must be >= 0`},
		{"mixed schedule", `{"prompt":"a","at_ms":0}` + "\n" + `{"prompt":"b"}`, `line 2: line 1 has "at_ms" and line 2 has none`},
		{"at on later turn", `{"prompt":"a","session":"s","at_ms":0}` + "\n" + `{"prompt":"b","session":"s","at_ms":9}`, `line 2: "at_ms" on turn 2 of session "s"`},
		{"think on first turn", `{"prompt":"a","session":"s","think_ms":5}`, `line 1: "think_ms" on a first turn`},
		{"empty session", `{"prompt":"a","session":""}`, `line 1: "session" is empty`},
		{"wrong type", `{"prompt":7}`, "line 1: json: cannot unmarshal number"},
		{"nothing", "\n  \n", "no requests"},
	}
	for _, c := range cases {
		_, err := study.ReadWorkload(strings.NewReader(c.file))
		require.ErrorIs(t, err, study.ErrBadWorkload, c.name)
		assert.Contains(t, err.Error(), c.want, c.name)
	}
	// A later turn without at_ms is fine in a scheduled file.
	w, err := study.ReadWorkload(strings.NewReader(`{"prompt":"a","session":"s","at_ms":0}` + "\n" + `{"prompt":"b","session":"s"}` + "\n" + `{"prompt":"c","at_ms":10}`))
	require.NoError(t, err)
	assert.True(t, w.Scheduled)
	assert.Equal(t, 3, w.Requests)
	assert.Equal(t, 2, w.Units)
	assert.Equal(t, 1, w.Sessions)
	assert.Len(t, w.SHA256, 64)
}

// workloadFile has two single requests and two sessions, interleaved, with
// an arrival schedule.
const workloadFile = `{"prompt":"Shared system text. Q1","at_ms":0}
{"session":"chat-a","prompt":"Chat A turn one\nAssistant:","at_ms":500}
{"prompt":"Shared system text. Q2","at_ms":250,"max_tokens":8}
{"session":"chat-b","prompt":"Chat B turn one\nAssistant:","at_ms":1000}
{"session":"chat-a","prompt":"\nUser: A again\nAssistant:","think_ms":300}
{"session":"chat-a","prompt":"\nUser: A third\nAssistant:"}
`

// TestWorkloadPhases runs a workload on the toy engine: one record per
// line in file order, arrivals at at_ms, a session's turns built from the
// previous prompt and answer, per-line max_tokens, and a per-phase salt
// line shared by every request of a phase and different between phases.
func TestWorkloadPhases(t *testing.T) {
	w, err := study.ReadWorkload(strings.NewReader(workloadFile))
	require.NoError(t, err)
	w.Salted = true
	cfg := smallConfig()
	cfg.Scenarios = []string{study.ScenarioWorkload}
	cfg.Strategies = []string{"least-request", "prefix-cache"}
	cfg.Rounds = 1
	cfg.Workload = w
	cfg.Arrivals = w.Requests
	var sent []study.Request
	rn := &study.Runner{Config: cfg, Factory: toyFactory(func(ty *studytest.Toy) {
		ty.Drop = func(req study.Request) bool {
			sent = append(sent, req)
			return false
		}
	})}
	res, err := rn.Run(context.Background())
	require.NoError(t, err)
	checkInvariants(t, res)
	require.Len(t, res.Runs, 2)
	for _, r := range res.Runs {
		assert.Equal(t, study.ScenarioWorkload, r.Scenario)
		assert.Equal(t, 6, r.Arrivals)
		assert.Equal(t, 6, r.Succeeded)
	}
	require.Len(t, res.Requests, 12)
	recs := res.Requests[:6]
	assert.Equal(t, []float64{0, 0.5, 0.25, 1}, []float64{recs[0].Scheduled, recs[1].Scheduled, recs[2].Scheduled, recs[3].Scheduled})
	for i, r := range recs {
		assert.Equal(t, i, r.Seq)
		assert.Equal(t, []int{1, 2, 3, 4, 5, 6}[i], r.Document, "document is the file line")
	}
	assert.Equal(t, 8, recs[2].MaxTokens)
	assert.Equal(t, 8, recs[2].Usage.CompletionTokens)
	assert.Equal(t, cfg.MaxTokens, recs[0].MaxTokens)
	assert.Equal(t, [2]int{1, 1}, [2]int{recs[1].Session, recs[1].Turn})
	assert.Equal(t, [2]int{1, 3}, [2]int{recs[5].Session, recs[5].Turn})
	assert.Equal(t, [2]int{2, 1}, [2]int{recs[3].Session, recs[3].Turn})
	assert.Zero(t, recs[0].Session)
	// Turn 2 went out 300 ms (think_ms) after turn 1's answer (the toy
	// answers at its last content), turn 3
	// cfg.Think after turn 2's.
	assert.InDelta(t, recs[1].Start+recs[1].Last+0.3, recs[4].Scheduled, 1e-6)
	assert.InDelta(t, recs[4].Start+recs[4].Last+cfg.Think.Seconds(), recs[5].Scheduled, 1e-6)

	require.Len(t, sent, 12)
	phase1 := sent[:6]
	salt := study.WorkloadSalt(cfg.Seed, res.Phases[0].Name)
	var chatA []string
	for _, req := range phase1 {
		assert.True(t, strings.HasPrefix(req.Prompt, salt), "every prompt of the phase carries its salt")
		if req.Session != "" && strings.Contains(req.Prompt, "Chat A") {
			chatA = append(chatA, req.Prompt)
		}
	}
	require.Len(t, chatA, 3)
	assert.Equal(t, salt+"Chat A turn one\nAssistant:", chatA[0])
	assert.Equal(t, chatA[0]+" answer from A.\nUser: A again\nAssistant:", strings.Replace(chatA[1], " answer from B.", " answer from A.", 1))
	assert.True(t, strings.HasPrefix(chatA[2], chatA[1]))
	assert.True(t, strings.HasSuffix(chatA[2], "\nUser: A third\nAssistant:"))
	other := study.WorkloadSalt(cfg.Seed, res.Phases[1].Name)
	assert.NotEqual(t, salt, other)
	assert.True(t, strings.HasPrefix(sent[6].Prompt, other))
}

// TestWorkloadPacedByRPS checks a file without at_ms: units in file order
// at RPS overall, a session taking one slot per turn; unsalted prompts go
// as written.
func TestWorkloadPacedByRPS(t *testing.T) {
	w, err := study.ReadWorkload(strings.NewReader(`{"prompt":"p1"}
{"session":"s","prompt":"t1"}
{"session":"s","prompt":"t2"}
{"prompt":"p2"}
`))
	require.NoError(t, err)
	assert.False(t, w.Scheduled)
	assert.Equal(t, 3*500*time.Millisecond, w.Span(2))
	cfg := smallConfig()
	cfg.Scenarios = []string{study.ScenarioWorkload}
	cfg.Strategies = []string{"random"}
	cfg.Rounds = 1
	cfg.RPS = 2
	cfg.Workload = w
	cfg.Arrivals = w.Requests
	var prompts []string
	rn := &study.Runner{Config: cfg, Factory: toyFactory(func(ty *studytest.Toy) {
		ty.Drop = func(req study.Request) bool { prompts = append(prompts, req.Prompt); return false }
	})}
	res, err := rn.Run(context.Background())
	require.NoError(t, err)
	assert.Equal(t, 0.0, res.Requests[0].Scheduled)
	assert.Equal(t, 0.5, res.Requests[1].Scheduled)
	assert.Equal(t, 1.5, res.Requests[3].Scheduled)
	assert.Equal(t, "p1", prompts[0])
	assert.Contains(t, prompts, "p2")
	assert.Contains(t, prompts, "t1")
}

func TestWorkloadConfigValidation(t *testing.T) {
	w, err := study.ReadWorkload(strings.NewReader(`{"prompt":"p1"}`))
	require.NoError(t, err)
	cfg := smallConfig()
	cfg.Workload = w
	cfg.Arrivals = 1
	err = cfg.Validate()
	require.ErrorIs(t, err, study.ErrInvalidConfig, "seed scenarios with a workload")
	cfg.Scenarios = []string{study.ScenarioWorkload}
	require.NoError(t, cfg.Validate())
	cfg.Arrivals = 2
	require.ErrorIs(t, cfg.Validate(), study.ErrInvalidConfig)
	cfg.Workload = nil
	require.True(t, errors.Is(cfg.Validate(), study.ErrUnknownScenario), "workload scenario without a file")
}
