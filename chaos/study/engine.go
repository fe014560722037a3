package study

import (
	"context"
	"fmt"
	"time"
)

// Target says where a request goes: through a gateway with a routing
// strategy, or straight to one engine replica (bypassing every gateway, as
// the warm scenario's engine pre-warming does).
type Target struct {
	// Direct sends the request straight to engine Replica instead of a
	// gateway.
	Direct bool
	// Replica is the engine index (0-based, in Engine.Replicas order) for a
	// direct request.
	Replica int
	// Gateway is the gateway index (0-based) for a routed request.
	Gateway int
	// Strategy is the routing strategy a routed request asks for (the
	// routing-strategy header).
	Strategy string
}

// Request is one completion request as the scenarios build it. The engine
// adds the model name and the fixed sampling fields (temperature 0,
// ignore_eos, stream with include_usage).
type Request struct {
	// Prompt is the full prompt text.
	Prompt string
	// MaxTokens is the number of tokens to generate; a request succeeds only
	// if usage reports exactly this many completion tokens.
	MaxTokens int
	// Session identifies a multi-turn session ("" for single-turn
	// requests); engines pass it to the gateway so session-affine
	// strategies can use it.
	Session string
	// Target is where the request goes.
	Target Target
}

// Outcome is what the client observed for one request. Offsets are model
// time; Start is on the engine's clock (Engine.Now), the others are relative
// to Start.
type Outcome struct {
	// Start is the model time at which the POST began.
	Start time.Duration
	// Status is the HTTP status (0 when no response arrived).
	Status int
	// Replica is the replica that served the request, from the gateway's
	// x-kvmesh-replica header (or the engine's name for direct requests).
	Replica string
	// FirstContent is the time from Start to the first chunk with content
	// (the TTFT); zero when no content arrived.
	FirstContent time.Duration
	// LastContent is the time from Start to the last chunk with content.
	LastContent time.Duration
	// End is the time from Start to the end of the stream (E2E).
	End time.Duration
	// ContentChunks counts stream chunks that carried content.
	ContentChunks int
	// GotDone reports whether the stream ended with "data: [DONE]".
	GotDone bool
	// HasUsage reports whether a usage object arrived.
	HasUsage bool
	// PromptTokens and CompletionTokens are the usage the server reported.
	PromptTokens     int
	CompletionTokens int
	// CachedTokens is usage.prompt_tokens_details.cached_tokens when the
	// server reports it (vLLM does when asked to), else -1.
	CachedTokens int
	// Text is the generated content (needed to build the next turn of a
	// multi-turn session). It is never logged.
	Text string
	// Err describes a transport or protocol failure ("" if none).
	Err string
}

// Observation is one sample of the engines' gauges, indexed like
// Engine.Replicas.
type Observation struct {
	// At is the model time of the sample.
	At time.Duration `json:"at_ns"`
	// Running and Waiting are vllm:num_requests_running and
	// vllm:num_requests_waiting per replica (-1 when a scrape failed).
	Running []int `json:"running"`
	Waiting []int `json:"waiting"`
}

// Counters are cumulative engine and gateway counters at one instant; the
// study reports deltas between two snapshots.
type Counters struct {
	// Queries and Hits are vllm:prefix_cache_queries_total and
	// vllm:prefix_cache_hits_total per replica.
	Queries []float64
	Hits    []float64
	// Success is vllm:request_success_total per replica.
	Success []float64
	// Selections is kvmesh_route_decisions_total summed over gateways, keyed
	// by a label of the decision ("strategy/selection"); nil when the
	// gateways do not expose it.
	Selections map[string]float64
}

// Engine is the world a study runs in. It is a reactor: At, Send and Observe
// register work whose callbacks run, one at a time, on the goroutine that
// calls Run; Run returns when no work is pending. The methods are not safe
// for concurrent use: call them before Run or from callbacks. The control
// operations (ResetCaches, Counters, WaitIdle) are only valid while Run is
// not running.
type Engine interface {
	// Replicas returns the replica names, as the gateways' x-kvmesh-replica
	// header spells them, in a fixed order (index 0 is "A" in the seed's
	// terms, 1 is "B").
	Replicas() []string
	// Gateways returns how many gateways there are.
	Gateways() int
	// Now returns the current model time.
	Now() time.Duration
	// At schedules fn at model time t (immediately if t has passed).
	At(t time.Duration, fn func())
	// Send starts req and calls done with its outcome. It never retries.
	Send(req Request, done func(Outcome))
	// Observe samples the engines' gauges and calls done with the sample.
	Observe(done func(Observation))
	// Run executes callbacks until nothing is pending or ctx ends; on ctx's
	// end it abandons pending timers, waits for in-flight requests to stop
	// and returns ctx's error.
	Run(ctx context.Context) error
	// ResetCaches clears every engine's prefix cache and fails unless each
	// engine reports success.
	ResetCaches(ctx context.Context) error
	// Counters returns a snapshot of the cumulative counters.
	Counters(ctx context.Context) (Counters, error)
	// WaitIdle blocks until no engine has running or waiting requests.
	WaitIdle(ctx context.Context) error
	// Close releases the engine; it is idempotent.
	Close() error
}

// PrefixSender is an optional Engine extension for prompts that share a
// long prefix (a document's ~29 KB Prefix): SendPrefixed is Send with
// req.Prompt replaced by prefix+req.Prompt, without the caller building
// that string. The driver passes the same prefix string for every request
// of a document in a phase. An engine implementing it must treat
// SendPrefixed(prefix, req, done) exactly as Send of the joined prompt;
// engines that do not implement it get the joined prompt through Send.
type PrefixSender interface {
	SendPrefixed(prefix string, req Request, done func(Outcome))
}

// HostChecker is implemented by engines whose model time depends on the
// host keeping up with the simulators (a live engine at speed S turns every
// wall millisecond of scheduling delay into S model milliseconds). The
// Runner calls it once per cell, before the first phase, and records the
// result in Config.HostChecks.
type HostChecker interface {
	HostCheck(ctx context.Context) (HostCheck, error)
}

// HostCheck compares a batch's measured TPOT with the modelled one on an
// idle engine: a ratio well above 1 means the host is too slow for the
// chosen speed and every latency in the study is inflated.
type HostCheck struct {
	Cell string `json:"cell"`
	// ModelledTPOTms is what the engine profile predicts for the probe.
	ModelledTPOTms float64 `json:"modelled_tpot_ms"`
	// MeasuredTPOTms is the worst replica's mean measured TPOT.
	MeasuredTPOTms float64 `json:"measured_tpot_ms"`
	// Ratio is Measured / Modelled.
	Ratio float64 `json:"ratio"`
	// OK is Ratio <= HostCheckTolerance.
	OK bool `json:"ok"`
}

// HostCheckTolerance is the largest measured/modelled TPOT ratio a host
// check accepts.
const HostCheckTolerance = 1.15

// Cell is one setting of the grid axes that need their own world: the index
// mode, the number of gateways and whether they share an index. An
// EngineFactory builds an Engine for it.
type Cell struct {
	Mode     string
	Gateways int
	Replicas int
	// Isolated is set for a cell of several gateways that share nothing
	// (each routes on its own index and its own load counts: the
	// `--no-sync` baseline). Unset with several gateways, they form one
	// cluster sharing the index (decision deltas, KV events) and load
	// reports. Always false for one gateway.
	Isolated bool
}

// Name is the cell's short name in phase names and host checks, e.g.
// "history/g1", "hybrid/g3" (synced) or "hybrid/g3-isolated".
func (c Cell) Name() string {
	return cellName(c.Mode, c.Gateways, c.Isolated)
}

func cellName(mode string, gateways int, isolated bool) string {
	if isolated && gateways > 1 {
		return fmt.Sprintf("%s/g%d-isolated", mode, gateways)
	}
	return fmt.Sprintf("%s/g%d", mode, gateways)
}

// Settler is implemented by engines whose gateways share state
// asynchronously (a replicated index). In cells of several synced
// gateways RunPhase calls Settle after a scenario's initialisation (and
// cache reset) and before the first arrival, so that every gateway starts the phase with the state the
// initialisation established through gateway 0, as one gateway would.
// Settle polls; it must not be called while Run is running.
type Settler interface {
	Settle(ctx context.Context) error
}

// EngineFactory builds a fresh Engine for a cell. The Runner closes it when
// the cell is done.
type EngineFactory func(ctx context.Context, cell Cell) (Engine, error)

// Do sends reqs concurrently on e, runs e until all complete, and returns
// their outcomes in order. It is a convenience for initialisation steps and
// must not be called while e.Run is running.
func Do(ctx context.Context, e Engine, reqs ...Request) ([]Outcome, error) {
	out := make([]Outcome, len(reqs))
	for i := range reqs {
		e.Send(reqs[i], func(o Outcome) { out[i] = o })
	}
	if err := e.Run(ctx); err != nil {
		return nil, err
	}
	return out, nil
}
