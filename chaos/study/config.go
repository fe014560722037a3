package study

import (
	"fmt"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/route"
)

// Config is one study: the grid of axes and the workload parameters. It is
// written verbatim into results.json's "config".
type Config struct {
	// Engine names the engine the study runs on ("live"); informational.
	Engine string `json:"engine"`
	// Scenarios to run, in order (cold, warm, hot50, hot90, multiturn).
	Scenarios []string `json:"scenarios"`
	// Strategies in round-1 order; odd rounds run them in this order, even
	// rounds in reverse (the seed's counterbalancing).
	Strategies []string `json:"strategies"`
	// Modes are the gateway index modes (history, kv-events, hybrid).
	Modes []string `json:"modes"`
	// Gateways lists gateway counts; arrivals rotate over the gateways.
	Gateways []int `json:"gateways"`
	// Sync lists, for gateway counts above 1, whether the gateways share
	// an index: SyncSynced (one cluster: decision deltas, KV events and
	// load reports shared) and/or SyncIsolated (independent gateways, the
	// `--no-sync` baseline). Each gateway count above 1 runs once per
	// entry; a single gateway runs once. Empty: SyncIsolated when
	// GatewaysIsolated is set, else SyncSynced.
	Sync []string `json:"sync,omitempty"`
	// GatewaysIsolated records that every gateway count > 1 measures
	// isolated gateways (Sync is exactly [SyncIsolated], or, in older
	// results, no replication existed).
	GatewaysIsolated bool `json:"gateways_isolated"`
	// Rounds is the number of repetitions (seed: 2).
	Rounds int `json:"rounds"`
	// Replicas is the number of engine replicas (seed: 2).
	Replicas int `json:"replicas"`
	// Seed drives salts and arrival sequences; round r uses Seed+r−1 for its
	// arrival sequence (the seed study used 102 and 103).
	Seed uint64 `json:"seed"`
	// Speed is the simulator's time compression; every reported time is
	// model time (wall × Speed).
	Speed float64 `json:"speed"`
	// Profile is the simulator's engine profile.
	Profile string `json:"profile"`
	// EngineBlockSize is the simulated engines' KV block size in tokens
	// (informational: the engine factory applies it). 16 is vLLM's default
	// and works in every mode; 1568 is the seed's hybrid-model attention
	// granularity (history mode only: the gateway index caps blocks at 1024
	// tokens).
	EngineBlockSize int `json:"engine_block_size,omitempty"`
	// EngineProfile describes engines other than plain single-group ones
	// without an offload tier (informational, like EngineBlockSize: a
	// hybrid model's KV-cache groups, a CPU tier); "" for plain engines.
	EngineProfile string `json:"engine_profile,omitempty"`
	// RPS is the fixed arrival rate in model time (seed: 1.6).
	RPS float64 `json:"rps"`
	// Arrivals per phase (seed: 96).
	Arrivals int `json:"arrivals"`
	// InflightCap is the client's in-flight limit; an arrival that finds it
	// full is not sent and counts as a failure (seed: 48).
	InflightCap int `json:"inflight_cap"`
	// MaxTokens per measured request (seed: 128).
	MaxTokens int `json:"max_tokens"`
	// InitMaxTokens per initialisation request (seed: 16 after its fix log).
	InitMaxTokens int `json:"init_max_tokens"`
	// Groups is the number of logical prefix groups (seed: 8).
	Groups int `json:"groups"`
	// Candidates is the number of hot-spot candidates (seed: 16; at least
	// 2·Groups).
	Candidates int `json:"candidates"`
	// InitRetries is how often the hot-spot initialisation may retry with
	// fresh salts after a reset (seed: 3).
	InitRetries int `json:"init_retries"`
	// Turns per multi-turn session (Ray seed: 5).
	Turns int `json:"turns"`
	// Think is the model time between a turn's answer and the next turn.
	Think time.Duration `json:"think_ns"`
	// SampleEvery is the model-time period of engine gauge samples (seed: 5 s).
	SampleEvery time.Duration `json:"sample_every_ns"`
	// SLO is the pass rule.
	SLO SLO `json:"slo_ns"`
	// HostChecks are filled in by the Runner (one per cell, when the
	// engine is a HostChecker): how faithfully the host kept model time.
	HostChecks []HostCheck `json:"host_checks,omitempty"`
	// BodyRepeats is how often Sentence appears in a seed document's
	// body; 0 means SentenceRepeats (300, the seed's). Prompt sizing
	// (PromptSizing) sets it.
	BodyRepeats int `json:"body_repeats,omitempty"`
	// PromptSizing, when set, records how BodyRepeats was chosen: the
	// seed's prompts sized in the engine's own tokens.
	PromptSizing *PromptSizing `json:"prompt_sizing,omitempty"`
	// Workload, when set, is the user's traffic (kvbench --workload):
	// Scenarios is then exactly [ScenarioWorkload] and Arrivals its
	// request count. results.json records its summary (path, hash,
	// counts), not its prompts.
	Workload *Workload `json:"workload,omitempty"`
	// Target describes the deployment of a target run (nil otherwise).
	// The engine factory fills in ModeSwitches as the run goes: copies of
	// a Config share it.
	Target *TargetInfo `json:"target,omitempty"`
}

// Gateway sharing settings (Config.Sync).
const (
	// SyncSynced runs several gateways as one cluster sharing the index.
	SyncSynced = "synced"
	// SyncIsolated runs several gateways that share nothing.
	SyncIsolated = "isolated"
)

// Strategies are the gateway's strategy names, as route defines them: a
// strategy added to route can be studied without a change here.
var Strategies = route.Names()

// Modes are the gateway index modes.
var Modes = []string{"history", "kv-events", "hybrid"}

// ClientStrategies are the strategies of a run straight at engines, no
// gateway (kvbench --engines without --target): kvbench itself picks the
// replica per request, the baselines any gateway must beat.
var ClientStrategies = []string{"random", "round-robin"}

// ModeNone is the only mode of a run straight at engines: no index.
const ModeNone = "none"

// Direct reports whether the study runs straight at engines, without a
// gateway (Target set with no gateways).
func (c *Config) Direct() bool { return c.Target != nil && len(c.Target.Gateways) == 0 }

// DefaultConfig returns the default grid: the seed's four scenarios and
// three strategies plus cost, in history mode (the seed's calibration) and
// hybrid mode (where cost is meant to win), one gateway, two replicas, two
// rounds, at speed 10 so the whole grid finishes within 15 minutes on two
// cores.
func DefaultConfig() Config {
	return Config{
		Engine:          "live",
		Scenarios:       []string{ScenarioCold, ScenarioWarm, ScenarioHot50, ScenarioHot90},
		Strategies:      []string{"random", "least-request", "prefix-cache", "cost"},
		Modes:           []string{"history", "hybrid"},
		Gateways:        []int{1},
		Rounds:          2,
		Replicas:        2,
		Seed:            102,
		Speed:           10,
		Profile:         "l20-qwen27b-fp8",
		EngineBlockSize: 16,
		RPS:             1.6,
		Arrivals:        96,
		InflightCap:     48,
		MaxTokens:       128,
		InitMaxTokens:   16,
		Groups:          8,
		Candidates:      16,
		InitRetries:     3,
		Turns:           5,
		Think:           2 * time.Second,
		SampleEvery:     5 * time.Second,
		SLO:             DefaultSLO(),
	}
}

// QuickConfig returns the reduced grid behind --quick: one round of warm
// and hot50 with least-request, prefix-cache and cost in history mode, 48
// arrivals per phase, at speed 10; it finishes in about a minute on two
// cores (the limit is 3).
func QuickConfig() Config {
	c := DefaultConfig()
	c.Scenarios = []string{ScenarioWarm, ScenarioHot50}
	c.Strategies = []string{"least-request", "prefix-cache", "cost"}
	c.Modes = []string{"history"}
	c.Rounds = 1
	c.Arrivals = 48
	return c
}

// Validate reports the first problem with c.
func (c *Config) Validate() error {
	bad := func(f string, a ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalidConfig, fmt.Sprintf(f, a...))
	}
	if len(c.Scenarios) == 0 || len(c.Strategies) == 0 || len(c.Modes) == 0 || len(c.Gateways) == 0 {
		return bad("scenarios, strategies, modes and gateways must be non-empty")
	}
	if c.Workload != nil {
		if len(c.Scenarios) != 1 || c.Scenarios[0] != ScenarioWorkload {
			return bad("a workload file replaces the scenarios: scenarios must be [%s], not %v", ScenarioWorkload, c.Scenarios)
		}
		if c.Arrivals != c.Workload.Requests {
			return bad("arrivals %d: the workload has %d requests", c.Arrivals, c.Workload.Requests)
		}
	}
	for _, s := range c.Scenarios {
		if s == ScenarioWorkload && c.Workload == nil {
			return fmt.Errorf("%w: %q needs a workload file (--workload)", ErrUnknownScenario, s)
		}
		if !slices.Contains(Scenarios, s) && s != ScenarioWorkload {
			return fmt.Errorf("%w: %q", ErrUnknownScenario, s)
		}
	}
	strategies, modes := Strategies, Modes
	if c.Direct() {
		strategies, modes = ClientStrategies, []string{ModeNone}
	}
	for _, s := range c.Strategies {
		if !slices.Contains(strategies, s) {
			return bad("unknown strategy %q (want one of %v)", s, strategies)
		}
	}
	for _, m := range c.Modes {
		if !slices.Contains(modes, m) {
			return bad("unknown mode %q (want one of %v)", m, modes)
		}
	}
	for _, g := range c.Gateways {
		if g < 1 {
			return bad("gateway count %d < 1", g)
		}
	}
	for i, s := range c.Sync {
		if s != SyncSynced && s != SyncIsolated {
			return bad("unknown gateway sync %q (want %s or %s)", s, SyncSynced, SyncIsolated)
		}
		if slices.Contains(c.Sync[:i], s) {
			return bad("gateway sync %q listed twice", s)
		}
	}
	switch {
	case c.Rounds < 1:
		return bad("rounds %d < 1", c.Rounds)
	case c.Replicas < 1:
		return bad("replicas %d < 1", c.Replicas)
	case !(c.Speed > 0):
		return bad("speed must be > 0")
	case !(c.RPS > 0):
		return bad("rps must be > 0")
	case c.Arrivals < 1:
		return bad("arrivals %d < 1", c.Arrivals)
	case c.InflightCap < 1:
		return bad("inflight cap %d < 1", c.InflightCap)
	case c.MaxTokens < 1 || c.InitMaxTokens < 1:
		return bad("max tokens must be >= 1")
	case c.Groups < 2:
		return bad("groups %d < 2", c.Groups)
	case c.Groups < c.Replicas:
		return bad("groups %d < replicas %d: every replica needs a group", c.Groups, c.Replicas)
	case c.InitRetries < 0:
		return bad("init retries < 0")
	case c.BodyRepeats < 0:
		return bad("body repeats %d < 0", c.BodyRepeats)
	case c.Turns < 1:
		return bad("turns %d < 1", c.Turns)
	case c.Think < 0:
		return bad("think < 0")
	case c.SampleEvery <= 0:
		return bad("sample period must be > 0")
	case c.SLO.TTFT <= 0 || c.SLO.TPOT <= 0 || c.SLO.E2E <= 0:
		return bad("SLO bounds must be > 0")
	}
	for _, s := range c.Scenarios {
		if (s == ScenarioHot50 || s == ScenarioHot90) && HotArrivals(s, c.Arrivals) >= c.Arrivals {
			return bad("%s needs more than %d arrivals", s, c.Arrivals)
		}
	}
	return nil
}

// SyncSettings returns Sync, or its default when empty: SyncIsolated
// when GatewaysIsolated is set, else SyncSynced.
func (c *Config) SyncSettings() []string {
	if len(c.Sync) > 0 {
		return c.Sync
	}
	if c.GatewaysIsolated {
		return []string{SyncIsolated}
	}
	return []string{SyncSynced}
}

// Cells returns the grid's cells in run order: for each mode, for each
// gateway count, one cell per sync setting (a single gateway once).
func (c *Config) Cells() []Cell {
	var out []Cell
	for _, mode := range c.Modes {
		for _, g := range c.Gateways {
			if g == 1 {
				out = append(out, Cell{Mode: mode, Gateways: 1, Replicas: c.Replicas})
				continue
			}
			for _, s := range c.SyncSettings() {
				out = append(out, Cell{Mode: mode, Gateways: g, Replicas: c.Replicas, Isolated: s == SyncIsolated})
			}
		}
	}
	return out
}

// RoundStrategies returns the strategies in the order round r (1-based)
// runs them: as configured in odd rounds, reversed in even rounds.
func (c *Config) RoundStrategies(r int) []string {
	s := slices.Clone(c.Strategies)
	if r%2 == 0 {
		slices.Reverse(s)
	}
	return s
}

// TargetInfo describes the deployment a target run (kvbench --target)
// measured: what ran where, and how phases were isolated. It is absent for
// the in-process engines.
type TargetInfo struct {
	// Gateways are the gateways' base URLs, in arrival rotation order
	// (empty when requests went straight to the engines).
	Gateways []string `json:"gateways"`
	// GatewayVersions are the versions the gateways report in
	// kvmesh_build_info, in Gateways order ("?" when not exposed).
	GatewayVersions []string `json:"gateway_versions"`
	// Engines are the engine replicas as name=URL, in study order.
	Engines []string `json:"engines"`
	// Model is the served model (from /v1/models unless given).
	Model string `json:"model"`
	// Models are every id /v1/models listed.
	Models []string `json:"models,omitempty"`
	// Clustered reports that the gateways answer the cluster admin API
	// and form one cluster (sharing the index; index modes can be
	// switched).
	Clustered bool `json:"clustered"`
	// Clusters is how many separate clusters the gateways that answer
	// the admin API form (each is switched through its own admin API);
	// gateways without it are not counted.
	Clusters int `json:"clusters,omitempty"`
	// Isolation is how phases were kept from each other's cached
	// prefixes: IsolationReset or IsolationSalt.
	Isolation string `json:"isolation"`
	// ModeSwitches records every index-mode change and its verification.
	ModeSwitches []ModeSwitch `json:"mode_switches,omitempty"`
}

// Cache isolation methods of a target run (TargetInfo.Isolation).
const (
	// IsolationReset clears every engine's prefix cache through POST
	// /reset_prefix_cache before each phase (and init retry).
	IsolationReset = "reset"
	// IsolationSalt sends a fresh cache_salt per phase (and init retry)
	// when an engine refuses the reset.
	IsolationSalt = "cache_salt"
)

// ModeSwitch is one index-mode change of a target run: the admin API's
// config version and the wall time until every gateway routed in the mode.
type ModeSwitch struct {
	Mode          string `json:"mode"`
	ConfigVersion uint64 `json:"config_version"`
	// ConfigVersions are every written cluster's config version when
	// the gateways form several clusters (the first is ConfigVersion).
	ConfigVersions []uint64 `json:"config_versions,omitempty"`
	// Scope is what was written: "cluster" (the default index_mode),
	// "model" (models.<model>.index_mode) or "mixed" (both, in different
	// clusters); empty when nothing was written.
	Scope    string  `json:"scope,omitempty"`
	Verified int     `json:"verified_gateways"`
	WaitMS   float64 `json:"wait_ms"`
}
