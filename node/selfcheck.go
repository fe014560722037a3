package node

import (
	"bytes"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/index"
)

// The index checks itself against the engines (DESIGN §10): every response
// that carries usage.prompt_tokens_details.cached_tokens (vLLM with
// --enable-prompt-tokens-details; vllmsim always) and usage.prompt_tokens
// is compared with what the index predicted for the replica when the
// request was routed. Three symptoms are judged, each over its own window
// of recent eligible responses, and only for replicas whose predictions
// come from KV events (kv-events or hybrid mode, and the replica
// publishes): history predictions are guesses by design, so their error is
// exported as a histogram but never makes a replica suspect.
//
//   - over_prediction: the confirmed ledger alone (the engine's own
//     BlockStored claims, no speculation) predicted more than one block
//     beyond what the engine reported cached. Eligible: the confirmed run
//     is longer than one block. The one-block slack is vLLM's rule that a
//     fully cached prompt still recomputes its last token (so its last
//     block). Signature of a crossed event stream: another engine's blocks
//     credited to this replica.
//   - under_prediction: the engine reported more than one block more cached
//     than the whole routing prediction (confirmed and speculative).
//     Eligible: the engine reported more than one block cached. Signature
//     of events that never reach this gateway (this replica's kv= points
//     elsewhere, events lost) or keys that cannot match (tokenizer, block
//     size).
//   - prompt_tokens_mismatch: the gateway counted a different number of
//     prompt tokens than the engine (usage.prompt_tokens). Eligible: every
//     response with usage. Signature of a tokenizer that disagrees with the
//     engine's: its block keys can never equal the confirmed entries.
//
// A symptom becomes suspect when at least suspectMinFailures of the last
// (up to) suspectWindow eligible responses showed it and they are at least
// half; it clears when the window holds at least suspectClearMin responses
// and at most a fifth of them showed it. The thresholds absorb normal
// noise: an eviction racing its BlockRemoved event, a burst that reuses a
// prefix before its BlockStored arrived (speculative entries cover that for
// under_prediction), a remote tokenize that fell back to the local
// tokenizer. A suspect replica keeps its traffic: the gauge, one WARN log
// per episode, /ready's detail, /debug/route and `kvmesh explain` say so.

// Suspect reasons: the reason label of kvmesh_index_suspect.
const (
	SuspectOverPrediction  = "over_prediction"
	SuspectUnderPrediction = "under_prediction"
	SuspectPromptTokens    = "prompt_tokens_mismatch"
)

var suspectReasons = [numSuspect]string{SuspectOverPrediction, SuspectUnderPrediction, SuspectPromptTokens}

// likelyCause is the WARN log's and the reports' explanation of a reason.
var likelyCause = [numSuspect]string{
	"the index credits this replica with blocks its engine does not hold: its kv= endpoint probably carries another engine's KV events (crossed stream); otherwise the engine evicts faster than its BlockRemoved events arrive",
	"the engine reuses cached blocks this gateway never saw stored: its KV events do not reach the gateway (kv= points at another engine, or events are lost), or block keys cannot match (tokenizer or --block-size differs from the engine's)",
	"the gateway's tokenizer counts prompts differently from the engine, so its block keys never equal the engine's confirmed blocks: set --tokenizer hf:<dir> with the model's tokenizer files, or --tokenizer remote",
}

const (
	idxOver = iota
	idxUnder
	idxTokens
	numSuspect
)

const (
	suspectWindow      = 20 // eligible responses remembered per symptom
	suspectMinFailures = 4  // and at least this many failures to suspect
	suspectClearMin    = 10 // responses needed before a suspect clears
)

// predictionSample is what one response showed against its prediction.
type predictionSample struct {
	judged          bool // the prediction came from KV events
	blockTokens     int
	confirmedTokens int // confirmed run × block size, at routing time
	routedTokens    int // the routing match (all trusted ledgers) × block size
	cachedTokens    int // usage.prompt_tokens_details.cached_tokens
	gatewayPrompt   int // the gateway's prompt token count
	enginePrompt    int // usage.prompt_tokens; -1 when absent
}

// symptomWindow is a ring of the last eligible outcomes of one symptom.
type symptomWindow struct {
	fail     [suspectWindow]bool
	n, next  int
	failures int
	suspect  bool
	since    time.Time
}

func (w *symptomWindow) add(fail bool) {
	if w.n == suspectWindow {
		if w.fail[w.next] {
			w.failures--
		}
	} else {
		w.n++
	}
	w.fail[w.next] = fail
	w.next = (w.next + 1) % suspectWindow
	if fail {
		w.failures++
	}
}

// update applies the thresholds and reports a transition (+1 suspect, -1
// cleared, 0 none).
func (w *symptomWindow) update(now time.Time) int {
	switch {
	case !w.suspect && w.failures >= suspectMinFailures && 2*w.failures >= w.n:
		w.suspect, w.since = true, now
		return 1
	case w.suspect && w.n >= suspectClearMin && 5*w.failures <= w.n:
		w.suspect = false
		return -1
	}
	return 0
}

// predictionCheck is one replica's self-check state. Safe for concurrent
// use; observe takes its lock once per response.
type predictionCheck struct {
	mu   sync.Mutex
	w    [numSuspect]symptomWindow
	last predictionSample // the last judged sample, for the WARN log
}

// observe judges s and returns the transitions it caused, per symptom.
func (c *predictionCheck) observe(s predictionSample, now time.Time) (tr [numSuspect]int, fails [numSuspect]bool) {
	if !s.judged {
		return tr, fails
	}
	b := s.blockTokens
	c.mu.Lock()
	defer c.mu.Unlock()
	c.last = s
	if s.confirmedTokens > b {
		fails[idxOver] = s.confirmedTokens-s.cachedTokens > b
		c.w[idxOver].add(fails[idxOver])
	}
	if s.cachedTokens > b {
		fails[idxUnder] = s.cachedTokens-s.routedTokens > b
		c.w[idxUnder].add(fails[idxUnder])
	}
	if s.enginePrompt >= 0 && s.gatewayPrompt > 0 {
		fails[idxTokens] = s.gatewayPrompt != s.enginePrompt
		c.w[idxTokens].add(fails[idxTokens])
	}
	for i := range c.w {
		tr[i] = c.w[i].update(now)
	}
	return tr, fails
}

// SuspectReport is one symptom a replica shows now (see selfcheck.go).
type SuspectReport struct {
	Replica string `json:"replica"`
	Reason  string `json:"reason"`
	// LikelyCause names what usually produces the symptom.
	LikelyCause string `json:"likely_cause"`
	// Failures of Samples recent eligible responses showed the symptom.
	Failures int       `json:"failures"`
	Samples  int       `json:"samples"`
	Since    time.Time `json:"since"`
}

// PredictionStats is one replica's self-check window, suspect or not.
type PredictionStats struct {
	Reason   string `json:"reason"`
	Failures int    `json:"failures"`
	Samples  int    `json:"samples"`
	Suspect  bool   `json:"suspect"`
}

func (c *predictionCheck) stats() [numSuspect]PredictionStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out [numSuspect]PredictionStats
	for i := range c.w {
		out[i] = PredictionStats{Reason: suspectReasons[i], Failures: c.w[i].failures, Samples: c.w[i].n, Suspect: c.w[i].suspect}
	}
	return out
}

func (c *predictionCheck) appendSuspects(dst []SuspectReport, replica string) []SuspectReport {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := range c.w {
		if w := &c.w[i]; w.suspect {
			dst = append(dst, SuspectReport{Replica: replica, Reason: suspectReasons[i], LikelyCause: likelyCause[i],
				Failures: w.failures, Samples: w.n, Since: w.since.UTC()})
		}
	}
	return dst
}

// Suspects lists the symptoms the replicas of the current routing table
// show now, in table order (nil when none).
func (n *Node) Suspects() []SuspectReport {
	var out []SuspectReport
	for _, r := range n.tbl.Load().replicas {
		out = r.check.appendSuspects(out, r.name)
	}
	return out
}

// judgesPrediction reports whether p's predictions for r come from KV
// events (the index trusts them and the replica publishes them), the only
// ones the self-check judges.
func judgesPrediction(p *pool, r *replica) bool {
	return (p.mode == index.ModeKVEvents || p.mode == index.ModeHybrid) && r.cfg.PublishesKVEvents()
}

// confirmedPrediction is the confirmed run of dec's pick at routing time
// (0 when the prediction is not judged or nothing matched). Confirmed
// entries are a subset of what Match trusts, so only the matched prefix
// is walked.
func (n *Node) confirmedPrediction(dec decision, keys []index.BlockKey) int {
	if dec.Matched <= 0 || !judgesPrediction(dec.pool, dec.rep) {
		return 0
	}
	return n.index.ConfirmedRun(keys[:min(dec.Matched, len(keys))], dec.rep.id)
}

// checkPrediction compares a response's usage with its prediction.
func (n *Node) checkPrediction(dec decision, confirmedBlocks int, u usageFigures) {
	if !u.cachedOK {
		return
	}
	rep := dec.rep
	b := dec.req.BlockTokens
	s := predictionSample{
		judged:          judgesPrediction(dec.pool, rep),
		blockTokens:     b,
		confirmedTokens: confirmedBlocks * b,
		routedTokens:    dec.Matched * b,
		cachedTokens:    u.cached,
		gatewayPrompt:   dec.req.PromptTokens,
		enginePrompt:    -1,
	}
	if dec.keyCut {
		// A prompt keyed in part (MaxKeyTokens): the index can know only
		// its keyed blocks, and the gateway has no exact prompt count.
		s.cachedTokens = min(s.cachedTokens, dec.req.TotalBlocks*b)
	} else if u.promptOK {
		s.enginePrompt = u.prompt
	}
	basis := "routed"
	if s.judged {
		basis = "confirmed"
		n.m.predictionError.WithLabelValues(rep.name, basis).Observe(float64(s.confirmedTokens - s.cachedTokens))
	}
	n.m.predictionError.WithLabelValues(rep.name, "routed").Observe(float64(s.routedTokens - s.cachedTokens))
	now := time.Now()
	tr, fails := rep.check.observe(s, now)
	if !s.judged {
		n.m.predictionChecks.WithLabelValues(rep.name, "unjudged").Inc()
		return
	}
	outcome := "ok"
	for i, f := range fails {
		if f {
			outcome = suspectReasons[i]
			break
		}
	}
	n.m.predictionChecks.WithLabelValues(rep.name, outcome).Inc()
	for i, t := range tr {
		switch t {
		case 1:
			n.m.suspect.WithLabelValues(rep.name, suspectReasons[i]).Set(1)
			st := rep.check.stats()[i]
			n.log.Warn("index suspect: predictions for this replica disagree with the engine's reported cache use",
				"replica", rep.name, "model", rep.model, "reason", suspectReasons[i], "likely_cause", likelyCause[i],
				"failures", st.Failures, "samples", st.Samples,
				"last_predicted_confirmed_tokens", s.confirmedTokens, "last_predicted_tokens", s.routedTokens,
				"last_cached_tokens", s.cachedTokens, "last_gateway_prompt_tokens", s.gatewayPrompt,
				"last_engine_prompt_tokens", s.enginePrompt)
		case -1:
			n.m.suspect.WithLabelValues(rep.name, suspectReasons[i]).Set(0)
			n.log.Info("index suspect cleared", "replica", rep.name, "reason", suspectReasons[i])
		}
	}
}

// usageFigures are the usage fields the self-check reads from a response.
type usageFigures struct {
	prompt, cached     int
	promptOK, cachedOK bool
}

var (
	jsonUsage        = []byte(`"usage"`)
	jsonPromptTokens = []byte(`"prompt_tokens"`)
	jsonCachedTokens = []byte(`"cached_tokens"`)
)

// parseUsage reads prompt_tokens and cached_tokens from b, which holds a
// "usage" object (an SSE usage event, or the tail of a JSON body). Inside a
// JSON string every quote is escaped, so the quoted key names cannot match
// prompt text.
func parseUsage(b []byte) (u usageFigures) {
	i := bytes.Index(b, jsonUsage)
	if i < 0 {
		return u
	}
	b = b[i+len(jsonUsage):]
	u.prompt, u.promptOK = jsonUintAfter(b, jsonPromptTokens)
	u.cached, u.cachedOK = jsonUintAfter(b, jsonCachedTokens)
	return u
}

// bodyTailCap is how much of a non-streaming response's end is kept for
// parseUsage: vLLM puts usage after the choices, followed by a few short
// fields.
const bodyTailCap = 1024

// bodyTail keeps the last bodyTailCap bytes of a relayed body, so that
// usage is read without parsing (or holding) the whole body.
type bodyTail struct {
	b [bodyTailCap]byte
	n int
}

func (t *bodyTail) feed(chunk []byte) {
	if len(chunk) >= bodyTailCap {
		t.n = copy(t.b[:], chunk[len(chunk)-bodyTailCap:])
		return
	}
	if keep := bodyTailCap - len(chunk); t.n > keep {
		copy(t.b[:], t.b[t.n-keep:t.n])
		t.n = keep
	}
	t.n += copy(t.b[t.n:], chunk)
}

func (t *bodyTail) bytes() []byte { return t.b[:t.n] }

// selfCheckMetrics registers the self-check's series on m.
func (m *metrics) registerSelfCheck() {
	m.predictionError = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kvmesh_index_prediction_error_tokens",
		Help: "Predicted cached prompt tokens minus the engine's reported cached_tokens, per response with usage " +
			"(positive: over-prediction). basis=confirmed: the confirmed ledger alone (KV-event replicas); basis=routed: the match routing used.",
		Buckets: []float64{-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096},
	}, []string{"replica", "basis"})
	m.predictionChecks = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_index_prediction_checks_total",
		Help: "Responses whose usage was compared with the index's prediction, by outcome: ok, over_prediction, under_prediction, prompt_tokens_mismatch, or unjudged (history predictions).",
	}, []string{"replica", "outcome"})
	m.suspect = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvmesh_index_suspect",
		Help: "1 while the replica's index predictions persistently disagree with the engine's reported cache use, by reason (over_prediction, under_prediction, prompt_tokens_mismatch).",
	}, []string{"replica", "reason"})
	m.reg.MustRegister(m.predictionError, m.predictionChecks, m.suspect)
}
