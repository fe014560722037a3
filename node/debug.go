package node

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/index"
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
	Pick string `json:"pick"`
	// Path is the endpoint explained (absent: completions or chat).
	Path string `json:"path,omitempty"`
	// ResponseOwner is the replica holding the stored response the
	// request names (previous_response_id, /v1/responses/{id}); the
	// request goes there.
	ResponseOwner string `json:"response_owner,omitempty"`
	// Replicas says where the pool's replica list comes from: "config"
	// (flags, YAML or the raft routing config), or "discovery <source>"
	// when discovery owns the model's replicas (DiscoveryConfig).
	Replicas string `json:"replicas"`
	// Batch is the number of prompts of a prompt list (keyed by its
	// longest); KeyedInPart says only a prefix of the prompt is keyed
	// (a batch, media parts, non-text Responses input, or no prompt).
	Batch       int    `json:"batch,omitempty"`
	KeyedInPart bool   `json:"keyed_in_part,omitempty"`
	Selection   string `json:"selection"`
	// EstimatedTTFT is cost's estimate for the pick, in seconds.
	EstimatedTTFT float64 `json:"estimated_ttft_seconds,omitempty"`
	// FailOpen is set when no replica passes its health checks and the
	// pick is among those failing them (Config.HealthFailOpen).
	FailOpen bool `json:"fail_open,omitempty"`
	// Explanation is the strategy's per-candidate reasoning: match, load,
	// score and filters.
	Explanation *route.Explanation `json:"explanation,omitempty"`
	// Unavailable lists replicas that got no say: ejected or failing health.
	Unavailable []UnavailableReplica `json:"unavailable,omitempty"`
	// Confirmed is, per replica of the model, how many leading blocks of
	// the prompt its engine's own KV events confirm (no speculation, no
	// history): what kvmesh doctor's KV-stream identity probe reads.
	Confirmed []ReplicaBlocks `json:"confirmed_blocks,omitempty"`
	// Tiers is, per replica of the model, the prompt's blocks by where the
	// engine holds them, as the model's index mode reads them
	// (index.MatchTiers): the GPU match (what routing uses), then the run
	// after it in the CPU and disk offload tiers (engine events only).
	Tiers []ReplicaTiers `json:"tiers,omitempty"`
	// Suspect lists the model's replicas whose predictions disagree with
	// their engine (selfcheck.go).
	Suspect []SuspectReport `json:"suspect,omitempty"`
	// Agreement is the last tokenizer probe of the model's replicas
	// (agreement.go); EngineTokenizes is true when this prompt was
	// tokenized by the engine's /tokenize for that reason.
	Agreement       []AgreementReport `json:"tokenizer_agreement,omitempty"`
	EngineTokenizes bool              `json:"engine_tokenizes,omitempty"`
}

// ReplicaBlocks is a block count of one replica.
type ReplicaBlocks struct {
	Name   string `json:"name"`
	Blocks int    `json:"blocks"`
}

// ReplicaTiers is one replica's matched blocks per tier.
type ReplicaTiers struct {
	Name string `json:"name"`
	GPU  int    `json:"gpu_blocks"`
	CPU  int    `json:"cpu_blocks"`
	Disk int    `json:"disk_blocks"`
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
		if path := r.URL.Query().Get("path"); path != "" && path != "/v1/completions" && path != "/v1/chat/completions" {
			n.debugEndpoint(w, r, path, body)
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
	n.explainRoute(w, r, p, lora, req, strat, src, RouteReport{})
}

// explainRoute answers /debug/route for req on pool p with strat; rep
// holds what the caller already knows (path, owner).
func (n *Node) explainRoute(w http.ResponseWriter, r *http.Request, p *pool, lora string, req *inferenceRequest,
	strat route.Strategy, src []byte, rep RouteReport) {
	s := getScratch()
	defer putScratch(s)
	rr, keys := n.prepare(r.Context(), p, lora, req, s)
	rr.Now = nowNanos()
	s.rng = n.newRand()
	rep.Model, rep.Strategy, rep.Tokenizer, rep.IndexMode = req.model, strat.Name(), n.tokName, p.mode.String()
	rep.Replicas = "config"
	if n.cfg.Discovery.owns(p.model) {
		rep.Replicas = "discovery " + n.disc.src.String()
	}
	if rep.Model == "" {
		rep.Model = p.model
	}
	rep.BlockSize, rep.PromptTokens, rep.TotalBlocks = rr.BlockTokens, rr.PromptTokens, rr.TotalBlocks
	rep.PromptHash = fmt.Sprintf("%016x", xxh3.Hash(src))
	rep.Batch, rep.KeyedInPart = req.batch, req.partial
	for _, r := range p.replicas {
		if !r.available(rr.Now) {
			u := UnavailableReplica{Name: r.name, Down: r.activeDown.Load()}
			if t := r.ejectedUntil.Load(); t > rr.Now {
				u.Until = time.Unix(0, t).UTC()
			}
			rep.Unavailable = append(rep.Unavailable, u)
		}
	}
	var gpu, cpu, disk [1]int32
	for _, r := range p.replicas {
		rep.Confirmed = append(rep.Confirmed, ReplicaBlocks{Name: r.name, Blocks: n.index.ConfirmedRun(keys, r.id)})
		rep.Suspect = r.check.appendSuspects(rep.Suspect, r.name)
		n.index.MatchTiers(keys, []index.ReplicaID{r.id}, p.mode, rr.Now, gpu[:], cpu[:], disk[:])
		rep.Tiers = append(rep.Tiers, ReplicaTiers{Name: r.name, GPU: int(gpu[0]), CPU: int(cpu[0]), Disk: int(disk[0])})
	}
	for _, a := range n.Agreement() {
		if a.Model == p.model {
			rep.Agreement = append(rep.Agreement, a)
		}
	}
	rep.EngineTokenizes = n.engineTokenizes(r.Context(), p)
	explain := new(route.Explanation)
	dec, _, err := n.routeOnce(p, strat, keys, &rr, s, nil, explain)
	if err == nil {
		rep.Pick = dec.rep.name
		rep.Selection = dec.Decision.Selection.String()
		rep.EstimatedTTFT = dec.Decision.EstimatedTTFT
		rep.FailOpen = dec.failOpen
		rep.Explanation = explain
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(rep)
}

// ReplicaReport is one replica in GET /debug/replicas.
type ReplicaReport struct {
	Name              string `json:"name"`
	Model             string `json:"model"`
	URL               string `json:"url"`
	PublishesKVEvents bool   `json:"publishes_kv_events"`
	// IngestedHere is true when this gateway subscribes to the replica's
	// KV events itself (standalone, kv-bind, or a cluster's late source);
	// in cluster mode the owning gateway ingests the others.
	IngestedHere bool `json:"ingested_here"`
	// JudgedByEvents is true when the index predicts the replica's cache
	// from KV events, so the self-check judges it.
	JudgedByEvents bool `json:"judged_by_events"`
	Available      bool `json:"available"`
	HealthFailing  bool `json:"health_check_failing"`
	// ConfirmedEntries is the replica's confirmed (block) entries in the
	// index.
	ConfirmedEntries int               `json:"confirmed_entries"`
	Prediction       []PredictionStats `json:"prediction"`
	Agreement        *AgreementReport  `json:"tokenizer_agreement,omitempty"`
}

// ReplicasReport is GET /debug/replicas: the gateway's view of every
// replica, for kvmesh doctor.
type ReplicasReport struct {
	ConfigVersion uint64          `json:"config_version"`
	ConfigDigest  string          `json:"config_digest"`
	Tokenizer     string          `json:"tokenizer"`
	BlockSize     int             `json:"block_size"`
	Replicas      []ReplicaReport `json:"replicas"`
}

// serveDebugReplicas answers GET /debug/replicas.
func (n *Node) serveDebugReplicas(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		w.Header().Set("Allow", http.MethodGet)
		n.refuse(w, &apiError{status: http.StatusMethodNotAllowed, code: CodeMethodNotAllowed, message: "use GET"})
		return
	}
	t := n.tbl.Load()
	agree := map[string]AgreementReport{}
	for _, a := range n.Agreement() {
		agree[a.Replica] = a
	}
	out := ReplicasReport{ConfigVersion: n.tableVersion.Load(), ConfigDigest: t.digest, Tokenizer: n.tokName, BlockSize: n.hasher.BlockTokens()}
	now := nowNanos()
	var keys []index.BlockKey
	for _, rep := range t.replicas {
		p := t.models[rep.model].pool
		keys = n.index.AppendReplicaKeys(keys[:0], rep.id, index.Confirmed)
		st := rep.check.stats()
		rr := ReplicaReport{
			Name: rep.name, Model: rep.model, URL: rep.cfg.URL, PublishesKVEvents: rep.cfg.PublishesKVEvents(),
			IngestedHere: rep.sub != nil, JudgedByEvents: p != nil && judgesPrediction(p, rep),
			Available: rep.available(now), HealthFailing: rep.activeDown.Load(),
			ConfirmedEntries: len(keys), Prediction: st[:],
		}
		if a, ok := agree[rep.name]; ok {
			rr.Agreement = &a
		}
		out.Replicas = append(out.Replicas, rr)
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(out)
}
