package node

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/route"
)

// RouteReport is the answer of GET/POST /debug/route: how the gateway would
// route a prompt right now, without sending it anywhere.
type RouteReport struct {
	Model        string `json:"model"`
	Strategy     string `json:"strategy"`
	Tokenizer    string `json:"tokenizer"`
	IndexMode    string `json:"index_mode"`
	BlockSize    int    `json:"block_size"`
	PromptTokens int    `json:"prompt_tokens"`
	TotalBlocks  int    `json:"total_blocks"`
	// PromptHash identifies the prompt (xxh3 of the request body's prompt
	// source) without revealing it.
	PromptHash string `json:"prompt_hash"`
	// Pick is the replica the strategy chose ("" when none is available).
	Pick      string `json:"pick"`
	Selection string `json:"selection"`
	// EstimatedTTFT is cost's estimate for the pick, in seconds.
	EstimatedTTFT float64 `json:"estimated_ttft_seconds,omitempty"`
	// Explanation is the strategy's per-candidate reasoning: match, load,
	// score and filters.
	Explanation *route.Explanation `json:"explanation,omitempty"`
	// Unavailable lists replicas that got no say: ejected or failing health.
	Unavailable []UnavailableReplica `json:"unavailable,omitempty"`
}

// UnavailableReplica is a replica left out of a decision.
type UnavailableReplica struct {
	Name  string    `json:"name"`
	Until time.Time `json:"until,omitempty"`
	Down  bool      `json:"health_check_failing,omitempty"`
}

// serveDebugRoute explains a routing decision. GET takes model, prompt and
// optionally strategy as query parameters; POST takes a completions or chat
// request body (the routing-strategy header or a strategy query parameter
// selects the strategy).
func (n *Node) serveDebugRoute(w http.ResponseWriter, r *http.Request) {
	var req *inferenceRequest
	var src []byte
	switch r.Method {
	case http.MethodGet:
		q := r.URL.Query()
		body, err := json.Marshal(map[string]string{"model": q.Get("model"), "prompt": q.Get("prompt")})
		if err != nil {
			n.refuse(w, errBadRequest(CodeInvalidPrompt, "cannot encode the query"))
			return
		}
		var aerr *apiError
		if req, aerr = parseInference(kindCompletions, body); aerr != nil {
			n.refuse(w, aerr)
			return
		}
		src = []byte(q.Get("prompt"))
	case http.MethodPost:
		body, aerr := readBody(w, r, n.cfg.MaxBodyBytes, n.cfg.BodyReadTimeout)
		if aerr != nil {
			n.refuse(w, aerr)
			return
		}
		var probe struct {
			Messages json.RawMessage `json:"messages"`
		}
		kind := kindCompletions
		if json.Unmarshal(body, &probe) == nil && !isNull(probe.Messages) {
			kind = kindChat
		}
		if req, aerr = parseInference(kind, body); aerr != nil {
			n.refuse(w, aerr)
			return
		}
		src = body
	default:
		w.Header().Set("Allow", "GET, POST")
		n.refuse(w, &apiError{status: http.StatusMethodNotAllowed, code: CodeMethodNotAllowed, message: "use GET or POST"})
		return
	}
	if sid := r.Header.Get(HeaderSession); sid != "" {
		req.user = sid
	}
	t := n.tbl.Load()
	p, lora, aerr := t.lookupModel(req.model)
	if aerr != nil {
		n.refuse(w, aerr)
		return
	}
	name := r.Header.Get(HeaderStrategy)
	if q := r.URL.Query().Get("strategy"); q != "" {
		name = q
	}
	strat, aerr := t.strategyFor(p, name)
	if aerr != nil {
		n.refuse(w, aerr)
		return
	}
	s := getScratch()
	defer putScratch(s)
	rr, keys := n.prepare(r.Context(), p, lora, req, s)
	rr.Now = nowNanos()
	s.rng = n.newRand()
	rep := RouteReport{
		Model: req.model, Strategy: strat.Name(), Tokenizer: n.tokName, IndexMode: p.mode.String(),
		BlockSize: rr.BlockTokens, PromptTokens: rr.PromptTokens, TotalBlocks: rr.TotalBlocks,
		PromptHash: fmt.Sprintf("%016x", xxh3.Hash(src)),
	}
	for _, r := range p.replicas {
		if !r.available(rr.Now) {
			u := UnavailableReplica{Name: r.name, Down: r.activeDown.Load()}
			if t := r.ejectedUntil.Load(); t > rr.Now {
				u.Until = time.Unix(0, t).UTC()
			}
			rep.Unavailable = append(rep.Unavailable, u)
		}
	}
	explain := new(route.Explanation)
	dec, _, err := n.routeOnce(p, strat, keys, &rr, s, nil, explain)
	if err == nil {
		rep.Pick = dec.rep.name
		rep.Selection = dec.d.Selection.String()
		rep.EstimatedTTFT = dec.d.EstimatedTTFT
		rep.Explanation = explain
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(rep)
}
