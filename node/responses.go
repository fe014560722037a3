package node

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/index"
)

// The Responses API (/v1/responses). vLLM keeps stored responses in the
// process that made them (VLLM_ENABLE_RESPONSES_API_STORE), so a follow-up
// naming previous_response_id, and GET, DELETE and cancel of
// /v1/responses/{id}, must reach that replica. The gateway learns
// id → replica from the responses it relays (the first "id" of the body,
// or of the stream's response.created event), remembers it for
// Config.ResponseTTL, and shares it with the cluster through the decision
// path: the owner is recorded as a history entry of one synthetic block
// key per id (responseKey), which the peers apply and a joining gateway's
// index snapshot carries, so any gateway finds the owner by matching that
// key (within HistoryTTL). When neither knows an id (expired, or learned by
// a gateway whose decision did not arrive yet) the gateway asks the pool's
// replicas (GET /v1/responses/{id}) which one has it. A pool whose engines
// share a store (ModelConfig.SharedResponseStore) has no affinity.

// parseResponses reads a Responses API create request. The input is keyed
// as the chat vLLM renders from it (instructions as a system message, then
// the input items) up to its first item or part that is not text; a
// follow-up (previous_response_id) is not keyed, since the engine prepends
// the stored conversation the gateway cannot see, and it goes to the
// owner anyway.
func parseResponses(body []byte) (*inferenceRequest, *apiError) {
	f, isObject, err := scanBody(body)
	if err != nil || !isObject {
		return nil, errBadRequest(CodeInvalidJSON, "request body must be a JSON object")
	}
	req := &inferenceRequest{kind: kindChat}
	model, ok, err := f.model.string()
	if err != nil {
		return nil, errBadRequest(CodeInvalidField, `field "model" must be a string`)
	}
	if ok && model == "" {
		return nil, errBadRequest(CodeMissingModel, `"model" must not be empty`)
	}
	req.model = model
	if req.stream, err = f.stream.bool(); err != nil {
		return nil, errBadRequest(CodeInvalidField, `field "stream" must be a boolean`)
	}
	if req.user, _, err = f.user.string(); err != nil {
		return nil, errBadRequest(CodeInvalidField, `field "user" must be a string`)
	}
	// The other fields in one pass of the fast scanner (the body is valid
	// JSON: scanBody said so): an input image is skipped, never decoded.
	var rb struct {
		Input, Instructions, PreviousResponseID, MaxOutputTokens, CacheSalt json.RawMessage
	}
	if !scanObject(body, func(key string, v []byte) {
		switch key {
		case "input":
			rb.Input = v
		case "instructions":
			rb.Instructions = v
		case "previous_response_id":
			rb.PreviousResponseID = v
		case "max_output_tokens":
			rb.MaxOutputTokens = v
		case "cache_salt":
			rb.CacheSalt = v
		}
	}) {
		return nil, errBadRequest(CodeInvalidJSON, "request body must be a JSON object")
	}
	if !isNull(rb.PreviousResponseID) {
		if json.Unmarshal(rb.PreviousResponseID, &req.previousResponseID) != nil {
			return nil, errBadRequest(CodeInvalidField, `field "previous_response_id" must be a string`)
		}
	}
	if !isNull(rb.MaxOutputTokens) {
		if json.Unmarshal(rb.MaxOutputTokens, &req.maxTokens) != nil {
			return nil, errBadRequest(CodeInvalidField, `field "max_output_tokens" must be an integer`)
		}
	}
	if !isNull(rb.CacheSalt) {
		if json.Unmarshal(rb.CacheSalt, &req.cacheSalt) != nil {
			return nil, errBadRequest(CodeInvalidField, `field "cache_salt" must be a string`)
		}
	}
	req.tmpl = templateOptions{addGenerationPrompt: true}
	if req.previousResponseID != "" {
		req.partial = true
		return req, nil
	}
	msgs, cut, aerr := responsesMessages(rb.Instructions, rb.Input)
	if aerr != nil {
		return nil, aerr
	}
	req.partial = cut
	if string(msgs) == "[]" {
		req.partial = true
		return req, nil
	}
	if e := parseMessages(req, msgs); e != nil {
		return nil, e
	}
	req.partial = req.partial || cut
	return req, nil
}

// scanObject calls fn with each key and raw value of the JSON object b
// (already validated), in one pass of the fast scanner; false when b is
// not an object.
func scanObject(b []byte, fn func(key string, v []byte)) bool {
	s := jscan{b: b}
	s.ws()
	if s.i >= len(b) || b[s.i] != '{' {
		return false
	}
	s.i++
	for {
		s.ws()
		if s.i >= len(b) {
			return false
		}
		switch b[s.i] {
		case '}':
			return true
		case ',':
			s.i++
			continue
		}
		ks := s.i
		esc, err := s.str()
		if err != nil {
			return false
		}
		key := string(b[ks+1 : s.i-1])
		if esc && json.Unmarshal(b[ks:s.i], &key) != nil {
			return false
		}
		s.ws()
		if s.i >= len(b) || b[s.i] != ':' {
			return false
		}
		s.i++
		s.ws()
		vs := s.i
		if s.value(1) != nil {
			return false
		}
		fn(key, b[vs:s.i])
	}
}

// chatPart and chatMsg are the chat form a Responses input is keyed as.
type chatPart struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

type chatMsg struct {
	Role    string     `json:"role"`
	Content []chatPart `json:"content"`
}

// responsesMessages converts instructions and input to chat messages,
// stopping at the first item or content part that is not text (cut).
func responsesMessages(instructions, input json.RawMessage) (json.RawMessage, bool, *apiError) {
	var msgs []chatMsg
	if !isNull(instructions) {
		var s string
		if json.Unmarshal(instructions, &s) != nil {
			return nil, false, errBadRequest(CodeInvalidField, `field "instructions" must be a string`)
		}
		msgs = append(msgs, chatMsg{Role: "system", Content: []chatPart{{Type: "text", Text: s}}})
	}
	input = bytes.TrimSpace(input)
	cut := false
	switch {
	case isNull(input):
		return nil, false, errBadRequest(CodeMissingPrompt, `"input" is required`)
	case input[0] == '"':
		var s string
		if json.Unmarshal(input, &s) != nil {
			return nil, false, errBadRequest(CodeInvalidPrompt, `"input" must be a string or an array of input items`)
		}
		msgs = append(msgs, chatMsg{Role: "user", Content: []chatPart{{Type: "text", Text: s}}})
	case input[0] == '[':
		type item struct {
			Type, Role string
			Content    json.RawMessage
		}
		var items []item
		for _, e := range arrayElems(input) {
			var it item
			good := e[0] == '{' && scanObject(e, func(key string, v []byte) {
				switch key {
				case "type":
					_ = json.Unmarshal(v, &it.Type)
				case "role":
					_ = json.Unmarshal(v, &it.Role)
				case "content":
					it.Content = v
				}
			})
			if !good {
				return nil, false, errBadRequest(CodeInvalidPrompt, `"input" must be a string or an array of input items`)
			}
			items = append(items, it)
		}
	items:
		for _, it := range items {
			if (it.Type != "" && it.Type != "message") || it.Role == "" {
				cut = true // function calls, their outputs, reasoning: rendered by the engine's own rules
				break
			}
			m := chatMsg{Role: it.Role}
			c := bytes.TrimSpace(it.Content)
			switch {
			case len(c) > 0 && c[0] == '"':
				var s string
				if json.Unmarshal(c, &s) != nil {
					return nil, false, errBadRequest(CodeInvalidPrompt, "an input message's content must be a string or a list of parts")
				}
				m.Content = []chatPart{{Type: "text", Text: s}}
			case len(c) > 0 && c[0] == '[':
				for _, raw := range arrayElems(c) {
					// A part's type first (cheaply: an image part is not
					// decoded), then a text part whole.
					var p chatPart
					typ, ok := partType(raw)
					if !ok && (raw[0] != '{' || !scanObject(raw, func(key string, v []byte) {
						if key == "type" {
							_ = json.Unmarshal(v, &typ)
						}
					})) {
						return nil, false, errBadRequest(CodeInvalidPrompt, "an input message's content must be a string or a list of parts")
					}
					p.Type = typ
					switch typ {
					case "input_text", "output_text", "text":
						if json.Unmarshal(raw, &p) != nil {
							return nil, false, errBadRequest(CodeInvalidPrompt, "a text part must be an object with a string \"text\"")
						}
					}
					switch p.Type {
					case "input_text", "output_text", "text":
						m.Content = append(m.Content, chatPart{Type: "text", Text: p.Text})
					default: // input_image, input_file, input_audio, refusal, ...
						if len(m.Content) > 0 {
							msgs = append(msgs, m)
						}
						cut = true
						break items
					}
				}
			default:
				return nil, false, errBadRequest(CodeInvalidPrompt, "an input message's content must be a string or a list of parts")
			}
			msgs = append(msgs, m)
		}
	default:
		return nil, false, errBadRequest(CodeInvalidPrompt, `"input" must be a string or an array of input items`)
	}
	if msgs == nil {
		return json.RawMessage("[]"), cut, nil
	}
	out, err := json.Marshal(msgs)
	if err != nil {
		return nil, false, errBadRequest(CodeInvalidPrompt, "cannot convert the input")
	}
	return out, cut, nil
}

// responseOwners maps response ids to the replica name that stored them.
// Safe for concurrent use.
type responseOwners struct {
	mu    sync.Mutex
	ttl   time.Duration
	max   int
	m     map[string]ownerEntry
	order []ownerID // insertion order, for expiry and the size bound
	// discover bounds the concurrent owner discoveries (a semaphore).
	discover chan struct{}
}

// maxDiscoveries bounds concurrent owner discoveries per gateway.
const maxDiscoveries = 16

type ownerEntry struct {
	replica string
	at      int64
}

type ownerID struct {
	id string
	at int64
}

func newResponseOwners(max int, ttl time.Duration) *responseOwners {
	return &responseOwners{ttl: ttl, max: max, m: map[string]ownerEntry{}, discover: make(chan struct{}, maxDiscoveries)}
}

// put remembers that replica stored id at now (unix nanos).
func (o *responseOwners) put(id, replica string, now int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.m[id] = ownerEntry{replica: replica, at: now}
	o.order = append(o.order, ownerID{id: id, at: now})
	o.trim(now)
}

// get returns id's replica, if known and not expired.
func (o *responseOwners) get(id string, now int64) (string, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.trim(now)
	e, ok := o.m[id]
	return e.replica, ok
}

func (o *responseOwners) forget(id string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.m, id)
}

func (o *responseOwners) len() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.m)
}

// trim drops expired entries and the oldest beyond max. Called with mu.
func (o *responseOwners) trim(now int64) {
	cutoff := now - int64(o.ttl)
	i := 0
	for ; i < len(o.order); i++ {
		oi := o.order[i]
		if oi.at > cutoff && len(o.m) <= o.max {
			break
		}
		if e, ok := o.m[oi.id]; ok && e.at == oi.at {
			delete(o.m, oi.id)
		}
	}
	if i > 0 {
		o.order = append(o.order[:0], o.order[i:]...)
	}
}

// replicaByName finds a replica of table t.
func (t *table) replicaByName(name string) (*pool, *replica) {
	for _, p := range t.pools {
		for _, r := range p.replicas {
			if r.name == name {
				return p, r
			}
		}
	}
	return nil, nil
}

// errOwnerGone is the answer for an id whose replica left the table.
func (n *Node) errOwnerGone(id, replica string) *apiError {
	n.m.responseAffinity.WithLabelValues("owner_gone").Inc()
	return &apiError{status: http.StatusNotFound, code: CodeResponseOwnerGone,
		message: fmt.Sprintf("response %q was stored by replica %s, which no longer serves: the response is lost", truncatePath(id), replica)}
}

// errOwnerUndiscovered is the answer, counted under result, for an id
// whose owner a lookup could not find or rule out: 503, retry in a second.
func (n *Node) errOwnerUndiscovered(result, msg string) *apiError {
	n.m.responseAffinity.WithLabelValues(result).Inc()
	return &apiError{status: http.StatusServiceUnavailable, code: CodeResponseOwnerUndiscovered, message: msg, retryAfter: 1}
}

// responseOwnerIn resolves previous_response_id for a request to pool p:
// the owning replica, nil to route as usual (shared store, or no replica
// knows the id: the engine then answers its own 404), or an error when the
// owner is gone.
func (n *Node) responseOwnerIn(ctx context.Context, t *table, p *pool, id string) (*replica, *apiError) {
	if p.sharedStore {
		n.m.responseAffinity.WithLabelValues("shared_store").Inc()
		return nil, nil
	}
	if name, ok := n.owners.get(id, nowNanos()); ok {
		op, rep := t.replicaByName(name)
		if rep == nil {
			n.owners.forget(id)
			return nil, n.errOwnerGone(id, name)
		}
		if op == p {
			n.m.responseAffinity.WithLabelValues("known").Inc()
			return rep, nil
		}
	}
	if rep := n.sharedOwner([]*pool{p}, id); rep != nil {
		n.m.responseAffinity.WithLabelValues("shared").Inc()
		return rep, nil
	}
	rep, aerr := n.discoverOwner(ctx, []*pool{p}, id)
	if rep != nil {
		n.m.responseAffinity.WithLabelValues("discovered").Inc()
		return rep, nil
	}
	if aerr != nil {
		return nil, aerr
	}
	n.m.responseAffinity.WithLabelValues("unknown").Inc()
	return nil, nil
}

// responseTarget resolves /v1/responses/{id}: the pool and the owning
// replica (nil: route by load within the pool).
func (n *Node) responseTarget(ctx context.Context, t *table, id string) (*pool, *replica, *apiError) {
	if name, ok := n.owners.get(id, nowNanos()); ok {
		p, rep := t.replicaByName(name)
		if rep == nil {
			n.owners.forget(id)
			return nil, nil, n.errOwnerGone(id, name)
		}
		if p.sharedStore {
			n.m.responseAffinity.WithLabelValues("shared_store").Inc()
			return p, nil, nil
		}
		n.m.responseAffinity.WithLabelValues("known").Inc()
		return p, rep, nil
	}
	var own []*pool
	var shared *pool
	for _, p := range t.pools {
		if p.sharedStore {
			shared = p
		} else {
			own = append(own, p)
		}
	}
	if rep := n.sharedOwner(own, id); rep != nil {
		n.m.responseAffinity.WithLabelValues("shared").Inc()
		p, _ := t.replicaByName(rep.name)
		return p, rep, nil
	}
	rep, aerr := n.discoverOwner(ctx, own, id)
	if rep != nil {
		n.m.responseAffinity.WithLabelValues("discovered").Inc()
		p, _ := t.replicaByName(rep.name)
		return p, rep, nil
	}
	if aerr != nil {
		return nil, nil, aerr
	}
	switch {
	case shared != nil && len(t.pools) == 1:
		n.m.responseAffinity.WithLabelValues("shared_store").Inc()
		return shared, nil, nil
	case len(t.pools) == 1:
		// One pool: let an engine answer (its own 404 for an unknown id).
		n.m.responseAffinity.WithLabelValues("unknown").Inc()
		return t.pools[0], nil, nil
	}
	n.m.responseAffinity.WithLabelValues("unknown").Inc()
	return nil, nil, &apiError{status: http.StatusNotFound, code: CodeResponseNotFound,
		message: fmt.Sprintf("no replica has response %q", truncatePath(id))}
}

// discoverOwner asks every available replica of pools, concurrently and
// within HealthTimeout, for GET /v1/responses/{id}; the first that answers
// 200 owns it (and is remembered). When none does, the id is unknown only
// if every replica asked said so (404, or another 4xx): a replica that did
// not answer in time, or failed, may be the owner, and routing the request
// elsewhere would earn the client a 404 for a response that exists. That
// case is a 503 the client can retry (CodeResponseOwnerUndiscovered).
//
// At most maxDiscoveries run at once: beyond, the request is answered the
// same 503, so requests naming made-up ids cannot multiply into a GET per
// replica each without bound.
func (n *Node) discoverOwner(ctx context.Context, pools []*pool, id string) (*replica, *apiError) {
	select {
	case n.owners.discover <- struct{}{}:
		defer func() { <-n.owners.discover }()
	default:
		return nil, n.errOwnerUndiscovered("discovery_busy",
			fmt.Sprintf("cannot look for the replica that stored response %q now: %d owner lookups are running; retry", truncatePath(id), maxDiscoveries))
	}
	ctx, cancel := context.WithTimeout(ctx, n.cfg.HealthTimeout)
	defer cancel()
	now := nowNanos()
	found := make(chan *replica, 1)
	asked := 0
	var unanswered atomic.Int32
	var wg sync.WaitGroup
	for _, p := range pools {
		for _, rep := range p.replicas {
			if !rep.available(now) {
				continue
			}
			asked++
			wg.Add(1)
			go func() {
				defer wg.Done()
				switch n.askOwner(ctx, rep, id) {
				case ownerNo:
					return
				case ownerNoAnswer:
					unanswered.Add(1)
					return
				}
				select {
				case found <- rep:
					cancel()
				default:
				}
			}()
		}
	}
	wg.Wait()
	select {
	case rep := <-found:
		n.owners.put(id, rep.name, nowNanos())
		return rep, nil
	default:
	}
	if u := unanswered.Load(); u > 0 && ctx.Err() != context.Canceled {
		return nil, n.errOwnerUndiscovered("undiscovered",
			fmt.Sprintf("could not tell which replica stored response %q: %d of %d replicas gave no answer within %s (a timeout, an error or a 5xx); retry",
				truncatePath(id), u, asked, n.cfg.HealthTimeout))
	}
	return nil, nil
}

// ownerAnswer is a replica's answer to an owner lookup.
type ownerAnswer int

const (
	ownerNoAnswer ownerAnswer = iota // an error, a timeout, 429 or 5xx: it may own the response
	ownerYes                         // 200: it owns it
	ownerNo                          // another 4xx (404): it does not
)

// askOwner asks rep for GET /v1/responses/{id}.
func (n *Node) askOwner(ctx context.Context, rep *replica, id string) ownerAnswer {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, rep.endpoint("/v1/responses/"+url.PathEscape(id)), nil)
	if err != nil {
		return ownerNoAnswer
	}
	resp, err := n.client.Do(req)
	if err != nil {
		return ownerNoAnswer
	}
	resp.Body.Close()
	switch c := resp.StatusCode; {
	case c == http.StatusOK:
		return ownerYes
	case c >= 400 && c < 500 && c != http.StatusTooManyRequests && c != http.StatusRequestTimeout:
		return ownerNo
	}
	return ownerNoAnswer
}

// responseLearner returns the capture's callbacks that update the owners
// from a relayed Responses API answer. They run before the bytes reach the
// client, so a client that has read a response id can use it at once on
// any gateway.
func (n *Node) responseLearner(p *pool, rep *replica, req *inferenceRequest) *headCapture {
	c := &headCapture{}
	if p.sharedStore {
		return c
	}
	if req.method == http.MethodDelete {
		c.onStatus = func(code int) {
			if code >= 200 && code <= 299 {
				n.owners.forget(req.responseID)
			}
		}
		return c
	}
	c.onID = func(id string) {
		now := nowNanos()
		n.owners.put(id, rep.name, now)
		n.shareOwner(rep, id, now)
	}
	return c
}

// responseKey is the synthetic block key under which a response id's
// owner is recorded in the index (and so shared with the cluster). It is
// not a chain key of any prompt (those are seeded with the model root).
func responseKey(id string) index.BlockKey {
	return index.BlockKey(xxh3.HashString("kvmesh/response-owner\x00" + id))
}

// shareOwner records rep as id's owner in the index and publishes it to
// the cluster like a routing decision.
func (n *Node) shareOwner(rep *replica, id string, now int64) {
	keys := []index.BlockKey{responseKey(id)}
	if err := n.index.Record(keys, rep.id, index.History, now); err != nil {
		n.log.Warn("recording a response owner failed", "replica", rep.name, "err", err)
		return
	}
	if h := n.recorder.Load(); h != nil {
		h.l.Recorded(rep.model, rep.name, index.History, keys, now)
	}
}

// sharedOwner finds id's owner among pools' replicas in the index (an
// owner this or another gateway recorded), or nil.
func (n *Node) sharedOwner(pools []*pool, id string) *replica {
	keys := []index.BlockKey{responseKey(id)}
	now := nowNanos()
	var out [1]int32
	for _, p := range pools {
		for _, r := range p.replicas {
			n.index.Match(keys, []index.ReplicaID{r.id}, index.ModeHistory, now, out[:])
			if out[0] > 0 {
				return r
			}
		}
	}
	return nil
}

// firstID returns the value of the first "id" key in b (a JSON object or
// an SSE stream, possibly truncated): vLLM's response object and its
// response.created event carry the response's id before any other "id".
func firstID(b []byte) string {
	for {
		i := bytes.Index(b, []byte(`"id"`))
		if i < 0 {
			return ""
		}
		b = b[i+4:]
		j := 0
		for j < len(b) && (b[j] == ' ' || b[j] == '\t' || b[j] == '\n' || b[j] == '\r') {
			j++
		}
		if j >= len(b) || b[j] != ':' {
			continue
		}
		j++
		for j < len(b) && (b[j] == ' ' || b[j] == '\t' || b[j] == '\n' || b[j] == '\r') {
			j++
		}
		if j >= len(b) || b[j] != '"' {
			continue
		}
		end := bytes.IndexByte(b[j+1:], '"')
		if end <= 0 || end > 256 || bytes.IndexByte(b[j+1:j+1+end], '\\') >= 0 {
			return ""
		}
		return string(b[j+1 : j+1+end])
	}
}

// headCapture is a ResponseWriter that watches the status and the first
// bytes of a 2xx body: onStatus sees the status, onID the body's first
// "id" (firstID), each before the bytes are passed on.
type headCapture struct {
	http.ResponseWriter
	status   int
	head     []byte
	done     bool
	onStatus func(int)
	onID     func(string)
}

const headCaptureBytes = 4 << 10

func (c *headCapture) WriteHeader(code int) {
	if c.status == 0 {
		c.status = code
		if c.onStatus != nil {
			c.onStatus(code)
		}
	}
	c.ResponseWriter.WriteHeader(code)
}

func (c *headCapture) Write(b []byte) (int, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	if !c.done && c.onID != nil && c.status >= 200 && c.status <= 299 {
		room := headCaptureBytes - len(c.head)
		c.head = append(c.head, b[:min(room, len(b))]...)
		if id := firstID(c.head); id != "" {
			c.done = true
			c.onID(id)
		} else if len(c.head) >= headCaptureBytes {
			c.done = true
		}
	}
	return c.ResponseWriter.Write(b)
}

func (c *headCapture) Flush() {
	if f, ok := c.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (c *headCapture) Unwrap() http.ResponseWriter { return c.ResponseWriter }
