package route

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"

	"github.com/kvmesh/kvmesh/index"
)

// CostConfig holds the cost model's priors and engine facts. The priors are
// what the model assumes about a replica until observations replace them.
type CostConfig struct {
	// PriorPrefillTokensPerSecond is the assumed prefill throughput of a
	// replica with no observations. Default 3000 tokens/s: prefill is
	// compute-bound at about 2·parameters FLOPs per token, so a ~30B dense
	// model in FP8 on one L20/L40-class GPU (~120–180 dense FP8 TFLOPS)
	// prefills on the order of 2,000–3,500 tokens/s, a 5K-token prompt in
	// about 1.5 s. Too fast a prior makes recomputing a prefix look cheap
	// until the first observations arrive, and the first observations
	// arrive only when the first streams end.
	PriorPrefillTokensPerSecond float64 `json:"prior_prefill_tokens_per_second" yaml:"prior_prefill_tokens_per_second"`
	// PriorDecodeStepSeconds is the assumed time of one decode step (what
	// TPOT measures). Default 0.03 s.
	PriorDecodeStepSeconds float64 `json:"prior_decode_step_seconds" yaml:"prior_decode_step_seconds"`
	// PriorOutputTokens is the assumed output length of a request, used to
	// estimate how long a running request holds its slot. Default 256.
	PriorOutputTokens float64 `json:"prior_output_tokens" yaml:"prior_output_tokens"`
	// PrefillOverheadSeconds is a fixed part of every TTFT (scheduling,
	// first sampling step, network) that does not scale with prompt length.
	// Default 0.02 s.
	PrefillOverheadSeconds float64 `json:"prefill_overhead_seconds" yaml:"prefill_overhead_seconds"`
	// ChunkTokens is the engine's prefill chunk (vLLM max_num_batched_tokens
	// with chunked prefill): each chunk shares its step with the running
	// decode batch. Default 2048. Must be ≥ 1.
	ChunkTokens int `json:"chunk_tokens" yaml:"chunk_tokens"`
	// MaxRunning is the engine's running-set size (vLLM --max-num-seqs), 0
	// if unknown. When unknown, a replica counts as saturated only when it
	// reports waiting requests or KV usage ≥ KVSaturation. Default 0.
	MaxRunning int `json:"max_running" yaml:"max_running"`
	// KVSaturation is the KV-cache usage at or above which the engine
	// cannot admit more sequences (new requests wait for a slot). Default
	// 0.98. Must be in (0, 1].
	KVSaturation float64 `json:"kv_saturation" yaml:"kv_saturation"`
	// Alpha is the EWMA weight of a new observation. Default 0.2 (about
	// the last ten observations dominate). Must be in (0, 1].
	Alpha float64 `json:"alpha" yaml:"alpha"`
	// MinSampleTokens: prefill observations with fewer uncached tokens are
	// not used to learn the prefill rate, because their TTFT is mostly
	// fixed overhead. Default 256.
	MinSampleTokens int `json:"min_sample_tokens" yaml:"min_sample_tokens"`
	// CPULoadTokensPerSecond is how fast an engine loads a prefix it
	// holds in its CPU offload tier (vLLM's CPU offloading, LMCache)
	// instead of recomputing it, in prompt tokens per second
	// (OffloadConfig.CPULoadTokensPerSecond). 0 means the default,
	// 50,000 (so a document without the field gets it); a negative value
	// turns the CPU tier's term off (those blocks priced as a recompute,
	// as before tiers were known). Must be finite.
	CPULoadTokensPerSecond float64 `json:"cpu_load_tokens_per_second" yaml:"cpu_load_tokens_per_second"`
	// DiskLoadTokensPerSecond is the same for a disk tier. 0 means the
	// default, 10,000; negative turns the term off. Must be finite.
	DiskLoadTokensPerSecond float64 `json:"disk_load_tokens_per_second" yaml:"disk_load_tokens_per_second"`
	// ShareTauSeconds is the time constant over which the duplicate-prefill
	// pricing forgets a prefix's share of this gateway's recent requests
	// (see Cost): a request t seconds ago counts e^(−t/ShareTauSeconds).
	// 0 means DefaultShareTauSeconds (so a document without the field
	// gets it). A harness that runs engines faster than real time (the
	// live study at speed S) divides it by S, as it does the gateway's
	// other periods. Must be ≥ 0 and finite.
	ShareTauSeconds float64 `json:"share_tau_seconds" yaml:"share_tau_seconds"`
	// TTFTTargetSeconds is the time to first token the deployment's SLO
	// asks for, 0 if none. With a target, cost charges a replica whose
	// estimated TTFT exceeds it TargetMissCharge·TTFTTargetSeconds more
	// (see Cost): it takes a replica predicted to meet the target over
	// one predicted to miss it where that costs the others at most that
	// much. The charge applies where the gateway sees every request on
	// the candidates (no peer's load reported, none unexplained in the
	// scrapes: one gateway); with several, their stale views would move
	// the same requests at once. A gateway that sees other senders only
	// in the scrapes (no peer's load reported) instead keeps a request on
	// the replicas holding its prefix where recomputing it elsewhere is
	// estimated past the target too, or where half the replicas' scrapes
	// show requests waiting ("cost_held", see Cost). Set it to
	// your SLO's TTFT; the study harnesses set the study's (2 s). Must be
	// ≥ 0 and finite.
	TTFTTargetSeconds float64 `json:"ttft_target_seconds" yaml:"ttft_target_seconds"`
	// TargetMissCharge is what a predicted miss of TTFTTargetSeconds
	// costs, as a fraction of the target. 0 means
	// DefaultTargetMissCharge (1/8). Must be ≥ 0 and finite.
	TargetMissCharge float64 `json:"target_miss_charge" yaml:"target_miss_charge"`
}

// DefaultTargetMissCharge is CostConfig.TargetMissCharge's default: an
// eighth of the target (0.25 s at 2 s). Measured on the discrete-event
// seed grid, seeds 1..30, one gateway, target 2 s: of 240 beat-it rows 27
// missed without a target (9 of them hot rows); a charge of 0.05 of the
// target left 25 (7), 1/8 and 1/4 left 21 (3), 1/2 left 31 (9) and 1 left
// 45 (21). Measured again with the engines' gauges shown from a step's
// end, as vLLM's (chaos/sim), the grid no longer tells the small charges
// apart: 25 rows miss (5 hot) without a target and with 0.05 or 1/8, 25
// (6) with 1/4, 31 (10) with 1/2 and 48 (21) with 1. A charge much above
// the delays cost already weighs sends every predicted miss to a
// recompute elsewhere, and the recomputes delay the requests behind
// them.
const DefaultTargetMissCharge = 0.125

// targetMiss resolves the charge for a predicted miss of the TTFT target,
// in seconds (0 without a target).
func (c *CostConfig) targetMiss() float64 {
	if c.TTFTTargetSeconds <= 0 {
		return 0
	}
	f := c.TargetMissCharge
	if f == 0 {
		f = DefaultTargetMissCharge
	}
	return f * c.TTFTTargetSeconds
}

// DefaultShareTauSeconds is CostConfig.ShareTauSeconds' default (see
// shareTable for why half a minute).
const DefaultShareTauSeconds = 30.0

// shareTau resolves ShareTauSeconds: the default for 0.
func (c *CostConfig) shareTau() float64 {
	if c.ShareTauSeconds == 0 {
		return DefaultShareTauSeconds
	}
	return c.ShareTauSeconds
}

// offload resolves the load rates: the OffloadConfig the cost prices
// tiers with, and whether each tier is priced at all.
func (c *CostConfig) offload() (o OffloadConfig, cpu, disk bool) {
	o = DefaultOffloadConfig()
	if c.CPULoadTokensPerSecond > 0 {
		o.CPULoadTokensPerSecond = c.CPULoadTokensPerSecond
	}
	if c.DiskLoadTokensPerSecond > 0 {
		o.DiskLoadTokensPerSecond = c.DiskLoadTokensPerSecond
	}
	return o, c.CPULoadTokensPerSecond >= 0, c.DiskLoadTokensPerSecond >= 0
}

// DefaultCostConfig returns the defaults documented on CostConfig.
func DefaultCostConfig() CostConfig {
	return CostConfig{
		PriorPrefillTokensPerSecond: 3000,
		PriorDecodeStepSeconds:      0.03,
		PriorOutputTokens:           256,
		PrefillOverheadSeconds:      0.02,
		ChunkTokens:                 2048,
		MaxRunning:                  0,
		KVSaturation:                0.98,
		Alpha:                       0.2,
		MinSampleTokens:             256,
	}
}

func positiveFinite(v float64) bool { return v > 0 && !math.IsInf(v, 0) }

// Validate reports a parameter out of range.
func (c CostConfig) Validate() error {
	switch {
	case !positiveFinite(c.PriorPrefillTokensPerSecond):
		return fmt.Errorf("%w: cost PriorPrefillTokensPerSecond %v must be > 0", ErrInvalidConfig, c.PriorPrefillTokensPerSecond)
	case !positiveFinite(c.PriorDecodeStepSeconds):
		return fmt.Errorf("%w: cost PriorDecodeStepSeconds %v must be > 0", ErrInvalidConfig, c.PriorDecodeStepSeconds)
	case !positiveFinite(c.PriorOutputTokens):
		return fmt.Errorf("%w: cost PriorOutputTokens %v must be > 0", ErrInvalidConfig, c.PriorOutputTokens)
	case !(c.PrefillOverheadSeconds >= 0) || math.IsInf(c.PrefillOverheadSeconds, 0):
		return fmt.Errorf("%w: cost PrefillOverheadSeconds %v must be ≥ 0", ErrInvalidConfig, c.PrefillOverheadSeconds)
	case c.ChunkTokens < 1:
		return fmt.Errorf("%w: cost ChunkTokens %d must be ≥ 1", ErrInvalidConfig, c.ChunkTokens)
	case c.MaxRunning < 0:
		return fmt.Errorf("%w: cost MaxRunning %d must be ≥ 0", ErrInvalidConfig, c.MaxRunning)
	case !(c.KVSaturation > 0 && c.KVSaturation <= 1):
		return fmt.Errorf("%w: cost KVSaturation %v must be in (0, 1]", ErrInvalidConfig, c.KVSaturation)
	case !(c.Alpha > 0 && c.Alpha <= 1):
		return fmt.Errorf("%w: cost Alpha %v must be in (0, 1]", ErrInvalidConfig, c.Alpha)
	case c.MinSampleTokens < 1:
		return fmt.Errorf("%w: cost MinSampleTokens %d must be ≥ 1", ErrInvalidConfig, c.MinSampleTokens)
	case !(c.TTFTTargetSeconds >= 0) || math.IsInf(c.TTFTTargetSeconds, 0):
		return fmt.Errorf("%w: cost TTFTTargetSeconds %v must be ≥ 0 and finite", ErrInvalidConfig, c.TTFTTargetSeconds)
	case !(c.TargetMissCharge >= 0) || math.IsInf(c.TargetMissCharge, 0):
		return fmt.Errorf("%w: cost TargetMissCharge %v must be ≥ 0 and finite", ErrInvalidConfig, c.TargetMissCharge)
	case math.IsNaN(c.CPULoadTokensPerSecond) || math.IsInf(c.CPULoadTokensPerSecond, 0) ||
		math.IsNaN(c.DiskLoadTokensPerSecond) || math.IsInf(c.DiskLoadTokensPerSecond, 0):
		return fmt.Errorf("%w: cost offload load rates %v and %v tokens/s must be finite",
			ErrInvalidConfig, c.CPULoadTokensPerSecond, c.DiskLoadTokensPerSecond)
	case !(c.ShareTauSeconds >= 0) || math.IsInf(c.ShareTauSeconds, 0):
		return fmt.Errorf("%w: cost ShareTauSeconds %v must be ≥ 0 and finite", ErrInvalidConfig, c.ShareTauSeconds)
	}
	return nil
}

// Observation is what the gateway saw of one finished (or first-token)
// request on a replica.
type Observation struct {
	// UncachedTokens is the prompt work the engine had to prefill: the
	// engine's own figure (prompt − usage.prompt_tokens_details.cached_tokens)
	// when it reports one, else the estimate made at routing time.
	UncachedTokens int
	// TTFT is the time from dispatch to first token, in seconds; 0 if none.
	TTFT float64
	// QueueSeconds is the part of TTFT spent waiting before this request's
	// prefill ran (Decision.EstimatedQueue, or a better figure if known).
	QueueSeconds float64
	// QueueEstimated says QueueSeconds is the queue the routing decision
	// expected (the cost strategy's estimate, made with this model). When
	// false (a strategy that estimates nothing, such as least-request),
	// the TTFT holds an unknown queue, and the observation only bounds the
	// prefill time from above: Observe lets it lower the prefill estimate,
	// never raise it, so one strategy's queueing is not learned as slow
	// prefill by the model another strategy routes with.
	QueueEstimated bool
	// TPOT is the mean time per output token after the first, in seconds;
	// 0 if unknown (e.g. a single output token).
	TPOT float64
	// OutputTokens is the number of tokens generated; 0 if unknown.
	OutputTokens int
	// PromptUnits is the prompt's length in the keys' units where those
	// are not engine tokens (characters: Request.UnitsPerToken ≠ 1), 0
	// where they are (the routing core sets it); PromptTokens the
	// engine's own count of the same prompt (usage.prompt_tokens: Prompt),
	// 0 if unknown. Together they teach the model the prompts' units per
	// token (Model.UnitsPerToken).
	PromptUnits  int
	PromptTokens int
}

// Rates is the model's current belief about one replica.
type Rates struct {
	PrefillTokensPerSecond float64 `json:"prefill_tokens_per_second"`
	DecodeStepSeconds      float64 `json:"decode_step_seconds"`
	OutputTokens           float64 `json:"output_tokens"`
	PrefillSamples         uint32  `json:"prefill_samples"`
	DecodeSamples          uint32  `json:"decode_samples"`
}

type replicaRates struct {
	prefillSecPerToken float64
	decodeStep         float64
	outputTokens       float64
	prefillSamples     uint32
	decodeSamples      uint32
	known              bool
}

// Model learns per-replica prefill and decode speed online from
// observations, starting from the priors in its CostConfig.
//
// Model is safe for concurrent use: Observe and Forget take a write lock;
// the cost strategy reads all candidates' rates under one read lock per
// Pick. It is pure: no goroutines, no clock.
type Model struct {
	cfg   CostConfig
	mu    sync.RWMutex
	rates []replicaRates // indexed by ReplicaID, grown on Observe
	slots []slotView     // indexed by ReplicaID, grown on Observe
	// poolFull is the largest running-set size learned on any replica:
	// the assumption for a replica not yet seen full (replicas of one
	// pool usually run one engine configuration).
	poolFull atomic.Int32
	// recent counts the cost strategy's own decisions, decayed with time
	// constant Config.PeerLoadDelaySeconds and isolatedEventsWindow times
	// that (see Cost.Pick).
	recent decayed
	// poolPrefill is the prefill time per uncached token learned from
	// every replica's samples (an EWMA like a replica's own), and
	// poolPrefillSamples their number: the estimate for a replica with no
	// prefill sample of its own, and where its own EWMA starts (see
	// Observe). Guarded by mu.
	poolPrefill        float64
	poolPrefillSamples uint32
	// unitsPerToken is the learned ratio of prompt units (characters) to
	// engine tokens (float64 bits; 0: no sample yet), written under mu and
	// read without it on every routing call; unitsSamples counts its
	// samples (guarded by mu).
	unitsPerToken atomic.Uint64
	unitsSamples  uint32
	// shares is each prefix's share of the cost strategy's recent
	// decisions (see Cost, duplicate prefill).
	shares shareTable
}

// decayed is a count of events that decays exponentially, kept with two
// time constants at once: tau and isolatedEventsWindow·tau (see
// Cost.unseenPeerRequests). With time constant T an event t seconds ago
// counts e^(−t/T), and the expected count under a steady rate λ is λ·T,
// the number of events in the last T seconds. Safe for concurrent use.
type decayed struct {
	mu        sync.Mutex
	at        int64 // time of the last update, ns
	val, long float64
}

// value returns the counts at now (ns), with time constant tau and
// isolatedEventsWindow·tau, and, when add, counts one more event at now.
// A now before the last update counts as the same time.
func (d *decayed) value(now int64, tau float64, add bool) (v, long float64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.val = decay(d.val, d.at, now, tau)
	d.long = decay(d.long, d.at, now, isolatedEventsWindow*tau)
	d.at = max(d.at, now)
	v, long = d.val, d.long
	if add {
		d.val++
		d.long++
	}
	return v, long
}

// decay returns a count v last updated at (ns) as seen at now (ns),
// decayed with time constant tau seconds; a now before at counts as the
// same time.
func decay(v float64, at, now int64, tau float64) float64 {
	if now <= at || v == 0 {
		return v
	}
	return v * math.Exp(-float64(now-at)/1e9/tau)
}

// slotView is what Pick has learned of a replica's running set from the
// engine-scraped load (see Cost.capacity). Its fields are atomics so that
// Pick can update them under the model's read lock without allocating; the
// slice holding them is replaced only under the write lock.
type slotView struct {
	// peak is the largest Running ever scraped.
	peak atomic.Int32
	// full is the largest Running scraped while the replica was seen
	// saturated (requests waiting for a slot, not for prefill budget); 0
	// until then.
	full atomic.Int32
}

// slot returns id's slot view, or nil before the first Observe of id; the
// caller holds m.mu (read or write).
func (m *Model) slot(id index.ReplicaID) *slotView {
	if int(id) < len(m.slots) {
		return &m.slots[id]
	}
	return nil
}

// NewModel returns a model with cfg, which must be valid.
func NewModel(cfg CostConfig) (*Model, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m := &Model{cfg: cfg}
	m.shares.tau = cfg.shareTau()
	return m, nil
}

// Config returns the model's configuration.
func (m *Model) Config() CostConfig { return m.cfg }

// TTFTTarget is CostConfig.TTFTTargetSeconds (0: none).
func (m *Model) TTFTTarget() float64 { return m.cfg.TTFTTargetSeconds }

func (m *Model) prior() replicaRates {
	return replicaRates{
		prefillSecPerToken: 1 / m.cfg.PriorPrefillTokensPerSecond,
		decodeStep:         m.cfg.PriorDecodeStepSeconds,
		outputTokens:       m.cfg.PriorOutputTokens,
	}
}

// rate returns id's rates; the caller holds m.mu (read or write). A
// replica with no prefill sample of its own takes the pool's prefill
// rate (see Observe).
func (m *Model) rate(id index.ReplicaID) replicaRates {
	r := m.prior()
	if int(id) < len(m.rates) && m.rates[id].known {
		r = m.rates[id]
	}
	if r.prefillSamples == 0 && m.poolPrefillSamples > 0 {
		r.prefillSecPerToken = m.poolPrefill
	}
	return r
}

// Observe folds one observation of replica id into its rates:
//   - prefill: seconds per uncached token, from
//     (TTFT − QueueSeconds − PrefillOverheadSeconds) / UncachedTokens, when
//     UncachedTokens ≥ MinSampleTokens and the remainder is positive; an
//     observation without QueueEstimated is a bound: it counts only when
//     faster than the estimate it would update (the replica's, and
//     separately the pool's). So is one whose estimated queue is larger
//     than the prefill time that remainder implies: the remainder is then
//     more the queue estimate's error than prefill (the estimate counts a
//     queued prefill in full until its first token, however far the
//     engine got, and the slot wait by an even spread of completions), and
//     only the whole TTFT (less overhead) bounds the prefill time;
//   - decode step seconds, from TPOT when > 0;
//   - output length, from OutputTokens when > 0.
//
// Each is an EWMA with weight Alpha; a prefill sample more than 4× away
// from the current estimate is clipped to 4×, so one outlier (a request
// that queued behind a peer's burst) cannot swing the estimate, while a
// genuinely different replica still converges geometrically.
//
// Prefill samples also feed a pool-wide EWMA over all replicas (replicas
// of one pool usually run one engine configuration), with a longer memory
// (see poolAlphaDivisor). A replica with no
// prefill sample of its own is estimated at the pool's rate, and its own
// EWMA starts there. Prefill samples are rare per replica (only requests
// with MinSampleTokens uncached count, and a locality-keeping strategy
// sends few), so without the pool a large pool stays at the prior per
// replica for long: wrong by the ratio of the prior to the truth, which
// is large when prompts are keyed by characters rather than tokens
// (Request.PromptTokens then counts characters, and the prior, per
// token, overstates a cold prefill several times over), and a
// recompute that would meet the SLO looks worse than a long queue.
func (m *Model) Observe(id index.ReplicaID, obs Observation) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if int(id) >= len(m.rates) {
		m.rates = append(m.rates, make([]replicaRates, int(id)+1-len(m.rates))...)
	}
	if int(id) >= len(m.slots) {
		grown := make([]slotView, int(id)+1)
		for i := range m.slots {
			grown[i].peak.Store(m.slots[i].peak.Load())
			grown[i].full.Store(m.slots[i].full.Load())
		}
		m.slots = grown
	}
	r := m.rate(id)
	a := m.cfg.Alpha
	if obs.UncachedTokens >= m.cfg.MinSampleTokens && obs.TTFT > 0 {
		t := obs.TTFT - obs.QueueSeconds - m.cfg.PrefillOverheadSeconds
		exact := obs.QueueEstimated
		if exact && t < obs.QueueSeconds {
			// The estimated queue is most of the TTFT: the remainder is
			// more the queue estimate's error than prefill. Only the
			// whole TTFT bounds the prefill time.
			t, exact = obs.TTFT-m.cfg.PrefillOverheadSeconds, false
		}
		if t > 0 && !math.IsInf(t, 0) {
			s := t / float64(obs.UncachedTokens)
			pool := m.poolPrefill
			if m.poolPrefillSamples == 0 {
				pool = 1 / m.cfg.PriorPrefillTokensPerSecond
			}
			if exact || s < pool {
				m.poolPrefill = m.poolStep(pool, s, m.poolPrefillSamples)
				m.poolPrefillSamples++
			}
			if exact || s < r.prefillSecPerToken {
				s = min(max(s, r.prefillSecPerToken/4), r.prefillSecPerToken*4)
				r.prefillSecPerToken += a * (s - r.prefillSecPerToken)
				r.prefillSamples++
			}
		}
	}
	if obs.PromptUnits > 0 && obs.PromptTokens > 0 {
		m.learnUnits(float64(obs.PromptUnits) / float64(obs.PromptTokens))
	}
	if obs.TPOT > 0 && !math.IsInf(obs.TPOT, 0) {
		s := min(max(obs.TPOT, r.decodeStep/4), r.decodeStep*4)
		r.decodeStep += a * (s - r.decodeStep)
		r.decodeSamples++
	}
	if obs.OutputTokens > 0 {
		r.outputTokens += a * (float64(obs.OutputTokens) - r.outputTokens)
	}
	r.known = true
	m.rates[id] = r
}

// poolStep is one step of a pool-wide EWMA at cur with samples samples
// so far, towards sample s clamped to a quarter and four times cur: the
// plain mean with the prior counted as one sample, until the weight
// reaches Alpha/poolAlphaDivisor.
func (m *Model) poolStep(cur, s float64, samples uint32) float64 {
	w := max(m.cfg.Alpha/poolAlphaDivisor, 1/float64(samples+2))
	return cur + w*(min(max(s, cur/4), cur*4)-cur)
}

// learnUnits folds one prompt's units-per-token ratio into the learned
// one, as the pool's prefill rate learns (poolStep). Called under mu.
func (m *Model) learnUnits(s float64) {
	if !(s > 0) || math.IsInf(s, 0) {
		return
	}
	m.unitsPerToken.Store(math.Float64bits(m.poolStep(m.UnitsPerToken(), s, m.unitsSamples)))
	m.unitsSamples++
}

// UnitsPerToken is how many characters make one engine token in the
// prompts this model has seen, learned from the engine's usage
// (Observation.PromptUnits, PromptTokens); CharsPerToken until a stream
// reported usage. A gateway that keys prompts by characters sets it as
// Request.UnitsPerToken, so that the cost strategy's token counts (own
// and queued prefill, chunks) are in the engine tokens its prefill rates
// are learned in: those rates are learned from the engine's token counts
// (Observation.Engine), and a fixed ratio that does not fit the
// prompts' text misprices every prefill by the misfit.
func (m *Model) UnitsPerToken() float64 {
	if v := math.Float64frombits(m.unitsPerToken.Load()); v > 0 {
		return v
	}
	return CharsPerToken
}

// Forget drops what the model learned about id (replica replaced or
// removed); it returns to the priors.
func (m *Model) Forget(id index.ReplicaID) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if int(id) < len(m.rates) {
		m.rates[id] = replicaRates{} // back to the pool's prefill rate
	}
	if int(id) < len(m.slots) {
		m.slots[id].peak.Store(0)
		m.slots[id].full.Store(0)
	}
}

// Rates returns the model's current belief about id.
func (m *Model) Rates(id index.ReplicaID) Rates {
	m.mu.RLock()
	r := m.rate(id)
	m.mu.RUnlock()
	return Rates{
		PrefillTokensPerSecond: 1 / r.prefillSecPerToken,
		DecodeStepSeconds:      r.decodeStep,
		OutputTokens:           r.outputTokens,
		PrefillSamples:         r.prefillSamples,
		DecodeSamples:          r.decodeSamples,
	}
}

// poolAlphaDivisor: the pool's prefill EWMA weighs a new sample
// Alpha/poolAlphaDivisor once it has that many samples (before, the
// plain mean with the prior counted as one sample). The pool hears every
// replica's samples, so it can afford the longer memory, and a noisy
// sample (a queue the estimate missed: peers' unseen requests, another
// strategy's decision observed with no queue estimate) moves every
// replica without its own samples at once.
const poolAlphaDivisor = 4
