package study

import (
	"context"
	"fmt"
	"slices"
)

// Scenario names.
const (
	ScenarioCold      = "cold"
	ScenarioWarm      = "warm"
	ScenarioHot50     = "hot50"
	ScenarioHot90     = "hot90"
	ScenarioMultiturn = "multiturn"
)

// Scenarios lists every scenario name in the order the seed ran them.
var Scenarios = []string{ScenarioCold, ScenarioWarm, ScenarioHot50, ScenarioHot90, ScenarioMultiturn}

// initQuestionBase numbers initialisation requests, far from measured ones.
const initQuestionBase = 900000

// initStrategy is the strategy every initialisation step routes with, for
// every measured strategy alike (the seed's rule).
const initStrategy = "prefix-cache"

// Phase is one measured run: a scenario under one strategy, round and cell.
type Phase struct {
	// Name identifies the phase, e.g. "r1-hot50-prefix-cache@history/g1";
	// salts derive from it, so every phase has its own prefixes.
	Name     string
	Scenario string
	Round    int
	Strategy string
	Cell     Cell
	// Seed is the round's seed: the arrival sequence depends on it and on
	// the scenario only, so every strategy in a round sees the same one.
	Seed uint64
}

// Placement records one initialisation request's landing replica.
type Placement struct {
	Document int    `json:"document"`
	Replica  string `json:"replica"`
	Complete bool   `json:"complete"`
}

// InitInfo describes how a scenario established its initial state.
type InitInfo struct {
	// Attempts is how many initialisation attempts ran (hot scenarios retry).
	Attempts int `json:"attempts"`
	// Candidates maps each candidate document of the last attempt to the
	// replica both of its initial sends landed on ("" if they disagreed or
	// failed). Hot scenarios only.
	Candidates []Placement `json:"candidates,omitempty"`
	// Bootstrap lists where each group's history-bootstrap request landed
	// (warm scenario): the routing index's initial layout.
	Bootstrap []Placement `json:"bootstrap,omitempty"`
	// Home is the replica each logical group's prefix was placed on (hot
	// scenarios), indexed by logical group; group 0 is the hot group.
	Home []string `json:"home,omitempty"`
	// Note says anything else worth knowing (e.g. why an attempt failed).
	Note string `json:"note,omitempty"`
}

// Plan is what a scenario hands the driver: the documents of its logical
// groups and the arrivals.
type Plan struct {
	// Docs are the logical groups' documents.
	Docs []Document
	// Sequence is the logical group of each single-turn arrival.
	Sequence []int
	// Sessions and Turns describe a multi-turn phase (Turns > 1): session s
	// uses document Docs[SessionGroup[s]].
	Sessions     int
	Turns        int
	SessionGroup []int
	// Workload, when set, replaces Docs, Sequence and the sessions: the
	// phase replays a user's workload file (ScenarioWorkload).
	Workload *Workload
	// Init records how the initial state was established.
	Init InitInfo
}

// prepare establishes a phase's initial state on e and returns its plan.
// Each scenario starts from idle engines with reset prefix caches.
func prepare(ctx context.Context, e Engine, cfg *Config, ph *Phase) (*Plan, error) {
	if err := e.ResetCaches(ctx); err != nil {
		return nil, err
	}
	switch ph.Scenario {
	case ScenarioCold:
		return &Plan{
			Docs:     cfg.documents(ph.Name, 0, cfg.Groups, 0),
			Sequence: GroupSequence(ph.Seed, ph.Scenario, cfg.Groups, cfg.Arrivals, 0),
			Init:     InitInfo{Attempts: 1},
		}, nil
	case ScenarioWarm:
		return prepareWarm(ctx, e, cfg, ph)
	case ScenarioHot50, ScenarioHot90:
		return prepareHot(ctx, e, cfg, ph)
	case ScenarioWorkload:
		if cfg.Workload == nil {
			return nil, fmt.Errorf("%w: scenario %s needs a workload file", ErrInvalidConfig, ScenarioWorkload)
		}
		return &Plan{Workload: cfg.Workload, Init: InitInfo{Attempts: 1}}, nil
	case ScenarioMultiturn:
		sessions := (cfg.Arrivals + cfg.Turns - 1) / cfg.Turns
		return &Plan{
			Docs:         cfg.documents(ph.Name, 0, cfg.Groups, 0),
			Sessions:     sessions,
			Turns:        cfg.Turns,
			SessionGroup: GroupSequence(ph.Seed, ph.Scenario, cfg.Groups, sessions, 0),
			Init:         InitInfo{Attempts: 1},
		}, nil
	}
	return nil, fmt.Errorf("%w: %q", ErrUnknownScenario, ph.Scenario)
}

// prepareWarm warms every engine with every group's prefix (sent straight
// to each engine), then builds the routing index from history by sending
// each group once, in order, through gateway 0 with prefix-cache. The index
// layout that results is whatever the gateway chose: the seed did not force
// 4/4, and neither does this.
func prepareWarm(ctx context.Context, e Engine, cfg *Config, ph *Phase) (*Plan, error) {
	docs := cfg.documents(ph.Name, 0, cfg.Groups, 0)
	var direct []Request
	for g, d := range docs {
		for r := range e.Replicas() {
			direct = append(direct, Request{
				Prompt:    d.Prompt(initQuestionBase + g*len(e.Replicas()) + r),
				MaxTokens: cfg.InitMaxTokens,
				Target:    Target{Direct: true, Replica: r},
			})
		}
	}
	outs, err := Do(ctx, e, direct...)
	if err != nil {
		return nil, err
	}
	for i, o := range outs {
		if !Complete(o, cfg.InitMaxTokens) {
			return nil, fmt.Errorf("%w: warm-up request %d to replica %d: status %d %s", ErrInitFailed, i, direct[i].Target.Replica, o.Status, o.Err)
		}
	}
	info := InitInfo{Attempts: 1}
	for g, d := range docs {
		o, err := Do(ctx, e, Request{
			Prompt:    d.Prompt(initQuestionBase + 500 + g),
			MaxTokens: cfg.InitMaxTokens,
			Target:    Target{Gateway: 0, Strategy: initStrategy},
		})
		if err != nil {
			return nil, err
		}
		ok := Complete(o[0], cfg.InitMaxTokens)
		if !ok {
			return nil, fmt.Errorf("%w: bootstrap of group %d: status %d %s", ErrInitFailed, g, o[0].Status, o[0].Err)
		}
		info.Bootstrap = append(info.Bootstrap, Placement{Document: d.Number, Replica: o[0].Replica, Complete: ok})
	}
	return &Plan{
		Docs:     docs,
		Sequence: GroupSequence(ph.Seed, ph.Scenario, cfg.Groups, cfg.Arrivals, 0),
		Init:     info,
	}, nil
}

// HotArrivals returns how many of n arrivals go to the hot group in a hot
// scenario: 50 % for hot50 and 89.6 % (86 of 96) for hot90, rounded.
func HotArrivals(scenario string, n int) int {
	switch scenario {
	case ScenarioHot50:
		return (n + 1) / 2
	case ScenarioHot90:
		return (n*896 + 500) / 1000
	}
	return 0
}

// Quotas returns how many logical groups each replica must hold in a hot
// scenario: groups spread as evenly as possible, the last replica (B, the
// hot replica) first in line for a remainder.
func Quotas(groups, replicas int) []int {
	q := make([]int, replicas)
	for i := range q {
		q[i] = groups / replicas
	}
	for k := 0; k < groups%replicas; k++ {
		q[replicas-1-k]++
	}
	return q
}

// prepareHot runs the seed's hot-spot initialisation: Candidates prefixes,
// each sent twice in sequence through gateway 0 with prefix-cache; a
// candidate qualifies when both sends completed on the same replica. The
// first qualifying candidates on each replica, up to its quota, become the
// logical groups; group 0, the hot group, lives on the last replica. If some
// replica has too few, the caches are reset and the attempt repeats with
// fresh salts, up to InitRetries more times. Selection depends only on the
// initial placement, never on measured latency.
func prepareHot(ctx context.Context, e Engine, cfg *Config, ph *Phase) (*Plan, error) {
	names := e.Replicas()
	quota := Quotas(cfg.Groups, len(names))
	cands := cfg.Candidates
	if min := 2 * cfg.Groups; cands < min {
		cands = min
	}
	info := InitInfo{}
	for attempt := 0; attempt <= cfg.InitRetries; attempt++ {
		info.Attempts = attempt + 1
		if attempt > 0 {
			if err := e.ResetCaches(ctx); err != nil {
				return nil, err
			}
		}
		docs := cfg.documents(ph.Name, 0, cands, attempt)
		info.Candidates = info.Candidates[:0]
		byReplica := make([][]int, len(names))
		for c, d := range docs {
			var landed [2]string
			ok := true
			for k := range 2 {
				o, err := Do(ctx, e, Request{
					Prompt:    d.Prompt(initQuestionBase + 2*c + k),
					MaxTokens: cfg.InitMaxTokens,
					Target:    Target{Gateway: 0, Strategy: initStrategy},
				})
				if err != nil {
					return nil, err
				}
				landed[k] = o[0].Replica
				ok = ok && Complete(o[0], cfg.InitMaxTokens)
			}
			p := Placement{Document: d.Number, Complete: ok}
			if ok && landed[0] == landed[1] {
				p.Replica = landed[0]
				if r := slices.Index(names, landed[0]); r >= 0 {
					byReplica[r] = append(byReplica[r], c)
				}
			}
			info.Candidates = append(info.Candidates, p)
		}
		short := false
		counts := make([]int, len(names))
		for r := range names {
			counts[r] = len(byReplica[r])
			short = short || counts[r] < quota[r]
		}
		if short {
			info.Note = fmt.Sprintf("attempt %d placed %v candidates per replica, need %v", attempt+1, counts, quota)
			continue
		}
		// Logical groups: the hot replica's (last) first, so group 0 is
		// the hot group there; then the others in replica order.
		var sel []Document
		var home []string
		order := append([]int{len(names) - 1}, seqInts(len(names)-1)...)
		for _, r := range order {
			for _, c := range byReplica[r][:quota[r]] {
				sel = append(sel, docs[c])
				home = append(home, names[r])
			}
		}
		info.Home = home
		info.Note = ""
		return &Plan{
			Docs:     sel,
			Sequence: GroupSequence(ph.Seed, ph.Scenario, cfg.Groups, cfg.Arrivals, HotArrivals(ph.Scenario, cfg.Arrivals)),
			Init:     info,
		}, nil
	}
	return &Plan{Init: info}, fmt.Errorf("%w: %s: %s", ErrInitFailed, ph.Name, info.Note)
}

func seqInts(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}
