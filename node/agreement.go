package node

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// Tokenizer agreement: a KV-event index only works when the gateway's block
// keys equal the engine's, that is when the gateway tokenizes every prompt
// exactly as the engine does. So whenever a replica whose predictions come
// from KV events becomes available (at start, after a health-check outage
// or an ejection, when a config change adds it), the gateway tokenizes a
// small fixed probe set (completions prompts in several scripts, code,
// whitespace runs, and a chat) both through its own request path and
// through that engine's /tokenize, and compares token counts and block
// keys. kvmesh_tokenizer_agreement{model,replica} is 1 or 0. On
// disagreement, with Config.TokenizerAgreement "switch" (the default), the
// model's prompts are tokenized by the engine's /tokenize (the remote
// tokenizer of keys.go, cached, with the local tokenizer as the fallback)
// until every replica agrees again, and one WARN says what to set.

// Config.TokenizerAgreement values.
const (
	// AgreementSwitch probes and, on disagreement, tokenizes the model's
	// prompts with the engine's /tokenize.
	AgreementSwitch = "switch"
	// AgreementProbe probes and reports, and keeps the gateway's tokenizer.
	AgreementProbe = "probe"
	// AgreementOff does not probe.
	AgreementOff = "off"
)

// AgreementReport verdicts.
const (
	AgreementAgree    = "agree"
	AgreementDisagree = "disagree"
)

// AgreementReport is the last tokenizer probe of one replica.
type AgreementReport struct {
	Model   string `json:"model"`
	Replica string `json:"replica"`
	// Verdict is agree or disagree.
	Verdict string `json:"verdict"`
	// Probe names the first probe that disagreed, with both token counts.
	Probe         string `json:"probe,omitempty"`
	GatewayTokens int    `json:"gateway_tokens,omitempty"`
	EngineTokens  int    `json:"engine_tokens,omitempty"`
	// Tokenizer is the gateway's own tokenizer.
	Tokenizer string `json:"tokenizer"`
	// EngineTokenizes is true while the model's prompts are tokenized by
	// the engine's /tokenize because a replica disagreed.
	EngineTokenizes bool      `json:"engine_tokenizes"`
	At              time.Time `json:"at"`
}

// agreementProbe is one fixed request the probe tokenizes both ways.
type agreementProbe struct {
	name string
	kind apiKind
	body string // a request body with model "%s"
}

// agreementProbes cover the usual ways two tokenizers part: prose in
// several scripts, emoji, code with whitespace runs and digits, and a chat
// (which also compares the chat template). Each spans several blocks.
var agreementProbes = func() []agreementProbe {
	js := func(s string) string { b, _ := json.Marshal(s); return string(b) }
	prose := "The service tracks request latency across healthy replicas and reports a summary every minute. " +
		"Operators read it to decide when to add capacity, and the gateway reads it to route around slow engines."
	multi := "Größe und Ähnlichkeit — 東京の天気は晴れです。서울은 맑음. Привет, мир! 🙂👩‍💻 مرحبا بالعالم. नमस्ते दुनिया."
	code := "func main() {\n\tfor i := 0; i < 1024; i++ {\n\t\tfmt.Println(i * 31337)\n\t}\n}\n\n\n    return   x  // 2026-12-01\n" +
		strings.Repeat("0123456789", 4)
	chat := `[{"role":"system","content":"You are a careful assistant. Answer briefly."},` +
		`{"role":"user","content":"Summarise the latency report for the last hour and name the slowest replica."}]`
	return []agreementProbe{
		{name: "prose", kind: kindCompletions, body: `{"model":%s,"prompt":` + js(prose) + `}`},
		{name: "multilingual", kind: kindCompletions, body: `{"model":%s,"prompt":` + js(multi) + `}`},
		{name: "code", kind: kindCompletions, body: `{"model":%s,"prompt":` + js(code) + `}`},
		{name: "chat", kind: kindChat, body: `{"model":%s,"messages":` + chat + `}`},
	}
}()

// agreementState is the Node's agreement bookkeeping.
type agreementState struct {
	mu      sync.Mutex
	reports map[string]AgreementReport // by replica name
	warned  map[string]bool            // replica names warned about in this disagreement
	// engine is the set of models whose prompts the engine tokenizes,
	// replaced as a whole (read on the hot path without a lock).
	engine atomicSet
}

// atomicSet is a copy-on-write set of strings: reads are lock-free.
type atomicSet struct {
	mu sync.Mutex // serialises writers
	v  atomic.Pointer[map[string]bool]
}

// has reports whether s holds k; lock-free.
func (s *atomicSet) has(k string) bool {
	m := s.v.Load()
	return m != nil && (*m)[k]
}

func (s *atomicSet) set(k string, on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	next := map[string]bool{}
	if m := s.v.Load(); m != nil {
		for kk := range *m {
			next[kk] = true
		}
	}
	if on {
		next[k] = true
	} else {
		delete(next, k)
	}
	s.v.Store(&next)
}

// agreementProbeKey marks a context in which prepare must use the
// gateway's own tokenizer even for a model the engine tokenizes.
type agreementProbeKey struct{}

// engineTokenizes reports whether p's prompts go to the engine's /tokenize
// because the gateway's tokenizer disagreed with a replica. It is called
// on the request path: one atomic load and a map lookup.
func (n *Node) engineTokenizes(ctx context.Context, p *pool) bool {
	return n.agree.engine.has(p.model) && ctx.Value(agreementProbeKey{}) == nil
}

// engineTokens tokenizes req with the engine's /tokenize for a switched
// model, falling back to the gateway's own tokenizer when that fails.
func (n *Node) engineTokens(ctx context.Context, p *pool, req *inferenceRequest, dst []uint32) []uint32 {
	toks, rep, err := n.engineRemote.tokens(ctx, n, p, req)
	if err == nil {
		return append(dst, toks...)
	}
	if ctx.Err() == nil {
		n.m.tokenizeCache.WithLabelValues("fallback").Inc()
		if rep != nil {
			n.m.upstreamErrors.WithLabelValues(rep.name, reasonRemoteTokenize).Inc()
		}
	}
	if n.tokName == TokenizerCharacter {
		text := req.text
		if req.kind == kindChat {
			text = tokenizer.RenderChat(req.messages)
		}
		for i := 0; i < len(text); i++ {
			dst = append(dst, uint32(text[i]))
		}
		return dst
	}
	toks, _ = n.tokenize(ctx, p, req, dst)
	return toks
}

// Agreement lists the last tokenizer probe of every replica probed, by
// replica name.
func (n *Node) Agreement() []AgreementReport {
	n.agree.mu.Lock()
	defer n.agree.mu.Unlock()
	out := make([]AgreementReport, 0, len(n.agree.reports))
	for _, r := range n.agree.reports {
		out = append(out, r)
	}
	slices.SortFunc(out, func(a, b AgreementReport) int { return strings.Compare(a.Replica, b.Replica) })
	return out
}

// wantsAgreement reports whether r's tokenizer should be probed: its
// predictions come from KV events and probing is on.
func (n *Node) wantsAgreement(r *replica) (*pool, bool) {
	if n.cfg.TokenizerAgreement == AgreementOff {
		return nil, false
	}
	ref, ok := n.tbl.Load().models[r.model]
	if !ok || !judgesPrediction(ref.pool, r) {
		return nil, false
	}
	return ref.pool, true
}

// checkAgreement probes r's /tokenize against the gateway's tokenizer and
// records the verdict. It reports whether a verdict was reached (false
// when the engine could not be asked: the caller tries again later).
// Called from r's probe loop.
func (n *Node) checkAgreement(ctx context.Context, r *replica) bool {
	p, ok := n.wantsAgreement(r)
	if !ok {
		return true
	}
	rep := AgreementReport{Model: p.model, Replica: r.name, Verdict: AgreementAgree, Tokenizer: n.tokName}
	for _, pr := range agreementProbes {
		gw, gwCount, eng, engCount, err := n.probeOnce(ctx, p, r, pr)
		if err != nil {
			if ctx.Err() == nil {
				n.log.Debug("tokenizer agreement probe failed, retrying later", "replica", r.name, "probe", pr.name, "err", err)
			}
			return false
		}
		if gwCount < 0 && len(eng) >= len(gw) {
			// The gateway keyed the probe in part (MaxKeyTokens): its
			// keys must be the engine's leading keys; no count to compare.
			gwCount, engCount, eng = len(gw), len(gw), eng[:len(gw)]
		}
		if gwCount != engCount || !slices.Equal(gw, eng) {
			rep.Verdict, rep.Probe, rep.GatewayTokens, rep.EngineTokens = AgreementDisagree, pr.name, gwCount, engCount
			break
		}
	}
	n.recordAgreement(ctx, p, r, rep)
	return true
}

// probeOnce tokenizes one probe through the gateway's request path and the
// replica's /tokenize, returning both block-key lists and token counts
// (gwCount -1 when the gateway keyed the probe in part).
func (n *Node) probeOnce(ctx context.Context, p *pool, r *replica, pr agreementProbe) (gw []index.BlockKey, gwCount int, eng []index.BlockKey, engCount int, err error) {
	model, _ := json.Marshal(p.model)
	body := fmt.Sprintf(pr.body, model)
	req, aerr := parseInference(pr.kind, []byte(body))
	if aerr != nil {
		return nil, 0, nil, 0, fmt.Errorf("%w: probe %s: %s", ErrRemoteTokenize, pr.name, aerr.message)
	}
	s := getScratch()
	rr, keys := n.prepare(context.WithValue(ctx, agreementProbeKey{}, true), p, "", req, s)
	gw, gwCount = slices.Clone(keys), rr.PromptTokens
	if s.keyCut {
		gwCount = -1
	}
	putScratch(s)

	treq := tokenizeRequest{Model: p.model}
	if pr.kind == kindChat {
		treq.Messages = req.rawMessages
	} else {
		treq.Prompt = req.text
	}
	data, err := json.Marshal(treq)
	if err != nil {
		return nil, 0, nil, 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, max(n.cfg.RemoteTokenizeTimeout, time.Second))
	defer cancel()
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, r.endpoint("/tokenize"), bytes.NewReader(data))
	if err != nil {
		return nil, 0, nil, 0, err
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := n.client.Do(hr)
	if err != nil {
		return nil, 0, nil, 0, fmt.Errorf("%w: %s: %w", ErrRemoteTokenize, r.name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return nil, 0, nil, 0, fmt.Errorf("%w: %s: status %d", ErrRemoteTokenize, r.name, resp.StatusCode)
	}
	var tr tokenizeResponse
	if err := json.NewDecoder(io.LimitReader(resp.Body, 4<<20)).Decode(&tr); err != nil {
		return nil, 0, nil, 0, fmt.Errorf("%w: %s: %w", ErrRemoteTokenize, r.name, err)
	}
	root := n.hasher.Root(p.model, "", "")
	eng = n.hasher.AppendKeys(nil, root, tr.Tokens)
	return gw, gwCount, eng, len(tr.Tokens), nil
}

// recordAgreement stores r's verdict, exports it, switches the model's
// tokenization when allowed and warns once per disagreement. ctx is r's
// probe loop's: once it has ended (r left the routing table, and
// forgetChecks ran or will run) the verdict is dropped. The state and its
// gauges change under one lock with forgetChecks, so a verdict reached
// while r is being removed cannot outlive the removal in either.
func (n *Node) recordAgreement(ctx context.Context, p *pool, r *replica, rep AgreementReport) {
	a := &n.agree
	a.mu.Lock()
	if ctx.Err() != nil {
		a.mu.Unlock()
		return
	}
	rep.At = time.Now().UTC()
	a.reports[r.name] = rep
	// The model's prompts go to the engine while any of its replicas
	// disagrees (and switching is allowed).
	disagree := false
	for _, o := range p.replicas {
		if or, ok := a.reports[o.name]; ok && or.Verdict == AgreementDisagree {
			disagree = true
		}
	}
	switched := disagree && n.cfg.TokenizerAgreement == AgreementSwitch
	was := a.engine.has(p.model)
	a.engine.set(p.model, switched)
	for name, or := range a.reports {
		if or.Model == p.model {
			or.EngineTokenizes = switched
			a.reports[name] = or
		}
	}
	warn := rep.Verdict == AgreementDisagree && !a.warned[r.name]
	if rep.Verdict == AgreementDisagree {
		a.warned[r.name] = true
	} else {
		delete(a.warned, r.name)
	}
	v := 0.0
	if rep.Verdict == AgreementAgree {
		v = 1
	}
	n.m.agreement.WithLabelValues(p.model, r.name).Set(v)
	sw := 0.0
	if switched {
		sw = 1
	}
	n.m.engineTokenizes.WithLabelValues(p.model).Set(sw)
	a.mu.Unlock()

	if warn {
		action := "the model's prompts are now tokenized by the engine's /tokenize (remote, cached; the local tokenizer is the fallback)"
		if !switched {
			action = "the gateway keeps its own tokenizer (--tokenizer-agreement " + n.cfg.TokenizerAgreement + "), so KV-event matches for this model will miss"
		}
		n.log.Warn("gateway tokenizer disagrees with the engine's /tokenize: "+action+
			"; set --tokenizer hf:<dir> with the model's tokenizer.json and tokenizer_config.json (or --tokenizer remote) to make this explicit",
			"model", p.model, "replica", r.name, "tokenizer", n.tokName, "probe", rep.Probe,
			"gateway_tokens", rep.GatewayTokens, "engine_tokens", rep.EngineTokens)
	}
	if was && !switched && rep.Verdict == AgreementAgree {
		n.log.Info("every replica agrees with the gateway's tokenizer again; the gateway tokenizes the model itself", "model", p.model)
	}
}

// registerAgreement registers the agreement series on m.
func (m *metrics) registerAgreement() {
	m.agreement = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvmesh_tokenizer_agreement",
		Help: "1 when the gateway's tokenizer produced the same tokens and block keys as the replica's /tokenize on the probe set at its last (re)join, else 0.",
	}, []string{"model", "replica"})
	m.engineTokenizes = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvmesh_tokenizer_engine_tokenizes",
		Help: "1 while the model's prompts are tokenized by the engine's /tokenize because a replica disagreed with the gateway's tokenizer.",
	}, []string{"model"})
	m.reg.MustRegister(m.agreement, m.engineTokenizes)
}

// forgetChecks drops a removed replica's agreement series and verdict
// (which no longer holds its model's switch); its self-check series go
// with the others in forgetSeries.
func (n *Node) forgetChecks(r *replica) {
	l := prometheus.Labels{"replica": r.name}
	a := &n.agree
	a.mu.Lock()
	n.m.agreement.DeletePartialMatch(l) // under the lock: see recordAgreement
	rep, ok := a.reports[r.name]
	delete(a.reports, r.name)
	delete(a.warned, r.name)
	still := false
	for _, o := range a.reports {
		if ok && o.Model == rep.Model && o.Verdict == AgreementDisagree {
			still = true
		}
	}
	if ok && !still && a.engine.has(rep.Model) {
		a.engine.set(rep.Model, false)
		n.m.engineTokenizes.WithLabelValues(rep.Model).Set(0)
	}
	a.mu.Unlock()
}
