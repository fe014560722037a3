package sim

import (
	"bytes"
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"mime"
	"mime/multipart"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// The endpoints of vLLM's server beyond completions and chat, in vLLM's
// shapes, so that a gateway in front of simulated engines is tested end to
// end: pooling (embeddings, pooling, classify, score, rerank) with
// deterministic outputs derived from the input's tokens, /detokenize, the
// Responses API with an in-process store (create, streamed or not, with
// previous_response_id; retrieve, delete, cancel), and audio transcription
// and translation that return a text describing the uploaded audio. None
// of them models a GPU: pooling is answered at once, responses run through
// the engine like a chat.

func (s *Server) routeEndpoints(mux *http.ServeMux) {
	mux.HandleFunc("POST /v1/embeddings", s.handleEmbeddings)
	mux.HandleFunc("POST /pooling", s.handlePooling)
	mux.HandleFunc("POST /classify", s.handleClassify)
	mux.HandleFunc("POST /score", s.handleScore)
	mux.HandleFunc("POST /v1/score", s.handleScore)
	mux.HandleFunc("POST /rerank", s.handleRerank)
	mux.HandleFunc("POST /v1/rerank", s.handleRerank)
	mux.HandleFunc("POST /v2/rerank", s.handleRerank)
	mux.HandleFunc("POST /detokenize", s.handleDetokenize)
	mux.HandleFunc("POST /v1/responses", s.handleResponsesCreate)
	mux.HandleFunc("GET /v1/responses/{id}", s.handleResponsesGet)
	mux.HandleFunc("DELETE /v1/responses/{id}", s.handleResponsesDelete)
	mux.HandleFunc("POST /v1/responses/{id}/cancel", s.handleResponsesCancel)
	mux.HandleFunc("POST /v1/audio/transcriptions", s.handleAudio)
	mux.HandleFunc("POST /v1/audio/translations", s.handleAudio)
}

// flattenMedia replaces each non-text content part of chat messages with a
// text part naming a hash of the part, so that the same image or clip
// yields the same prompt tokens (and prefix-cache hits) and different ones
// differ, as vLLM's multimodal extra_keys do. Bodies that are not a list
// of messages are returned unchanged (the caller reports the error).
func flattenMedia(raw json.RawMessage) json.RawMessage {
	if !bytes.Contains(raw, []byte(`"type"`)) {
		return raw
	}
	var msgs []map[string]json.RawMessage
	if json.Unmarshal(raw, &msgs) != nil {
		return raw
	}
	changed := false
	for _, m := range msgs {
		c := bytes.TrimSpace(m["content"])
		if len(c) == 0 || c[0] != '[' {
			continue
		}
		var parts []json.RawMessage
		if json.Unmarshal(c, &parts) != nil {
			return raw
		}
		for j, p := range parts {
			var pt struct {
				Type string `json:"type"`
			}
			if json.Unmarshal(p, &pt) != nil || pt.Type == "text" || pt.Type == "" {
				continue
			}
			placeholder, _ := json.Marshal(map[string]string{"type": "text", "text": fmt.Sprintf("<%s:%016x>", pt.Type, xxh3.Hash(p))})
			parts[j] = placeholder
			changed = true
		}
		m["content"], _ = json.Marshal(parts)
	}
	if !changed {
		return raw
	}
	out, err := json.Marshal(msgs)
	if err != nil {
		return raw
	}
	return out
}

// promptBatch returns the prompts of a completions prompt list of several
// prompts (nil otherwise).
func (s *Server) promptBatch(raw json.RawMessage, addSpecial bool) [][]uint32 {
	var strs []string
	if json.Unmarshal(raw, &strs) == nil && len(strs) > 1 {
		out := make([][]uint32, len(strs))
		for i, t := range strs {
			out[i] = s.encodeText(t, addSpecial)
		}
		return out
	}
	var tokss [][]uint32
	if json.Unmarshal(raw, &tokss) == nil && len(tokss) > 1 {
		return tokss
	}
	return nil
}

// generateBatch serves a completions request with several prompts as vLLM
// does: one choice per prompt (index = the prompt's position), the usage
// summed; a stream carries every prompt's chunks, each with its index.
func (s *Server) generateBatch(w http.ResponseWriter, r *http.Request, p *genParams, batch [][]uint32) {
	if err := p.validate(); err != nil {
		writeError(w, errorStatus(err), err.Error())
		return
	}
	type sub struct {
		id RequestID
		ch <-chan reqEvent
		mt int
	}
	subs := make([]sub, 0, len(batch))
	defer func() {
		for _, sb := range subs {
			s.abort(sb.id)
		}
	}()
	for _, prompt := range batch {
		mt, err := s.maxTokens(p, len(prompt))
		if err == nil {
			err = s.eng.Check(len(prompt), mt)
		}
		if err != nil {
			writeError(w, errorStatus(err), err.Error())
			return
		}
		id, ch, err := s.submit("cmpl", prompt, mt)
		if err != nil {
			writeError(w, errorStatus(err), err.Error())
			return
		}
		subs = append(subs, sub{id, ch, mt})
	}
	id := string(subs[0].id)
	created := time.Now().Unix()
	model := s.cfg.ServedModelName
	ctx := r.Context()
	var total usage
	var fl http.Flusher
	if p.Stream {
		fl, _ = w.(http.Flusher)
		w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
		w.WriteHeader(http.StatusOK)
	}
	choices := make([]completionChoice, len(subs))
	for i, sb := range subs {
		var text strings.Builder
	events:
		for {
			select {
			case <-ctx.Done():
				return
			case ev, ok := <-sb.ch:
				if !ok {
					if !p.Stream {
						writeError(w, http.StatusServiceUnavailable, "server shutting down")
					}
					return
				}
				if ev.fin != nil {
					u := finUsage(ev.fin)
					total.PromptTokens += u.PromptTokens
					total.CompletionTokens += u.CompletionTokens
					total.TotalTokens += u.TotalTokens
					total.PromptTokensDetails.CachedTokens += u.PromptTokensDetails.CachedTokens
					reason := string(ev.fin.Reason)
					choices[i] = completionChoice{Index: i, Text: text.String(), FinishReason: &reason}
					break events
				}
				t := OutputTokenText(ev.out.Index)
				if !p.Stream {
					text.WriteString(t)
					continue
				}
				var fr *string
				if ev.out.Index == sb.mt-1 {
					reason := string(FinishLength)
					fr = &reason
				}
				b, _ := json.Marshal(response{ID: id, Object: "text_completion", Created: created, Model: model,
					Choices: []completionChoice{{Index: i, Text: t, FinishReason: fr}}})
				if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
					return
				}
				if fl != nil {
					fl.Flush()
				}
			}
		}
	}
	if !p.Stream {
		writeJSON(w, http.StatusOK, response{ID: id, Object: "text_completion", Created: created, Model: model, Choices: choices, Usage: &total})
		return
	}
	if p.StreamOptions != nil && p.StreamOptions.IncludeUsage {
		b, _ := json.Marshal(response{ID: id, Object: "text_completion", Created: created, Model: model, Choices: []completionChoice{}, Usage: &total})
		_, _ = fmt.Fprintf(w, "data: %s\n\n", b)
	}
	_, _ = io.WriteString(w, "data: [DONE]\n\n")
}

// poolingUsage is a pooling endpoint's usage.
type poolingUsage struct {
	PromptTokens     int `json:"prompt_tokens"`
	TotalTokens      int `json:"total_tokens"`
	CompletionTokens int `json:"completion_tokens"`
}

// poolInputs reads an embeddings/pooling/classify "input": a string, a
// list of strings, a token list or a list of token lists.
func (s *Server) poolInputs(raw json.RawMessage) ([][]uint32, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, fmt.Errorf("%w: input is required", ErrBadRequest)
	}
	var str string
	if json.Unmarshal(raw, &str) == nil {
		return [][]uint32{s.encodeText(str, true)}, nil
	}
	var strs []string
	if json.Unmarshal(raw, &strs) == nil && len(strs) > 0 {
		out := make([][]uint32, len(strs))
		for i, t := range strs {
			out[i] = s.encodeText(t, true)
		}
		return out, nil
	}
	var toks []uint32
	if json.Unmarshal(raw, &toks) == nil && len(toks) > 0 {
		return [][]uint32{toks}, nil
	}
	var tokss [][]uint32
	if json.Unmarshal(raw, &tokss) == nil && len(tokss) > 0 {
		return tokss, nil
	}
	return nil, fmt.Errorf("%w: input must be a string, a list of strings, or token ids", ErrBadRequest)
}

// vector is a deterministic unit vector of dim floats derived from toks.
func vector(toks []uint32, dim int) []float32 {
	b := make([]byte, 4*len(toks))
	for i, t := range toks {
		binary.LittleEndian.PutUint32(b[4*i:], t)
	}
	seed := xxh3.Hash(b)
	v := make([]float32, dim)
	var norm float64
	for i := range v {
		seed = seed*6364136223846793005 + 1442695040888963407
		x := float64(int64(seed>>11))/float64(1<<52) - 1
		v[i] = float32(x)
		norm += x * x
	}
	norm = math.Sqrt(norm)
	if norm > 0 {
		for i := range v {
			v[i] = float32(float64(v[i]) / norm)
		}
	}
	return v
}

// embeddingDim is the simulated model's hidden size.
const embeddingDim = 16

func (s *Server) checkLen(toks []uint32) error {
	if len(toks) > s.cfg.MaxModelLen {
		return fmt.Errorf("%w: this model's maximum context length is %d tokens, however the input has %d tokens",
			ErrPromptTooLong, s.cfg.MaxModelLen, len(toks))
	}
	return nil
}

type poolParams struct {
	Model          string          `json:"model"`
	Input          json.RawMessage `json:"input"`
	EncodingFormat string          `json:"encoding_format"`
	Dimensions     *int            `json:"dimensions"`
}

func (s *Server) readPool(w http.ResponseWriter, r *http.Request) (*poolParams, [][]uint32, int, bool) {
	var p poolParams
	if !decodeBody(w, r, &p) || !s.checkModel(w, p.Model) {
		return nil, nil, 0, false
	}
	inputs, err := s.poolInputs(p.Input)
	n := 0
	for _, in := range inputs {
		if err == nil {
			err = s.checkLen(in)
		}
		n += len(in)
	}
	if err == nil && p.Dimensions != nil && (*p.Dimensions < 1 || *p.Dimensions > embeddingDim) {
		err = fmt.Errorf("%w: dimensions must be between 1 and %d", ErrBadRequest, embeddingDim)
	}
	if err == nil && p.EncodingFormat != "" && p.EncodingFormat != "float" && p.EncodingFormat != "base64" {
		err = fmt.Errorf("%w: encoding_format must be float or base64", ErrBadRequest)
	}
	if err != nil {
		writeError(w, errorStatus(err), err.Error())
		return nil, nil, 0, false
	}
	return &p, inputs, n, true
}

func (s *Server) handleEmbeddings(w http.ResponseWriter, r *http.Request) {
	p, inputs, n, ok := s.readPool(w, r)
	if !ok {
		return
	}
	dim := embeddingDim
	if p.Dimensions != nil {
		dim = *p.Dimensions
	}
	data := make([]map[string]any, len(inputs))
	for i, in := range inputs {
		v := vector(in, dim)
		var emb any = v
		if p.EncodingFormat == "base64" {
			b := make([]byte, 4*len(v))
			for j, x := range v {
				binary.LittleEndian.PutUint32(b[4*j:], math.Float32bits(x))
			}
			emb = base64.StdEncoding.EncodeToString(b)
		}
		data[i] = map[string]any{"index": i, "object": "embedding", "embedding": emb}
	}
	writeJSON(w, http.StatusOK, map[string]any{"id": s.poolID("embd"), "object": "list", "created": time.Now().Unix(),
		"model": s.cfg.ServedModelName, "data": data, "usage": poolingUsage{PromptTokens: n, TotalTokens: n}})
}

func (s *Server) poolID(prefix string) string {
	s.mu.Lock()
	s.nextID++
	id := s.nextID
	s.mu.Unlock()
	return fmt.Sprintf("%s-%016x", prefix, id)
}

func (s *Server) handlePooling(w http.ResponseWriter, r *http.Request) {
	_, inputs, n, ok := s.readPool(w, r)
	if !ok {
		return
	}
	data := make([]map[string]any, len(inputs))
	for i, in := range inputs {
		data[i] = map[string]any{"index": i, "object": "pooling", "data": vector(in, embeddingDim)}
	}
	writeJSON(w, http.StatusOK, map[string]any{"id": s.poolID("pool"), "object": "list", "created": time.Now().Unix(),
		"model": s.cfg.ServedModelName, "data": data, "usage": poolingUsage{PromptTokens: n, TotalTokens: n}})
}

func (s *Server) handleClassify(w http.ResponseWriter, r *http.Request) {
	_, inputs, n, ok := s.readPool(w, r)
	if !ok {
		return
	}
	data := make([]map[string]any, len(inputs))
	for i, in := range inputs {
		v := vector(in, 2)
		p0 := (float64(v[0]) + 1) / 2
		probs := []float64{p0, 1 - p0}
		label := "LABEL_0"
		if p0 < 0.5 {
			label = "LABEL_1"
		}
		data[i] = map[string]any{"index": i, "label": label, "probs": probs, "num_classes": 2}
	}
	writeJSON(w, http.StatusOK, map[string]any{"id": s.poolID("classify"), "object": "list", "created": time.Now().Unix(),
		"model": s.cfg.ServedModelName, "data": data, "usage": poolingUsage{PromptTokens: n, TotalTokens: n}})
}

// pairScore is the cosine of the two texts' vectors mapped to [0, 1].
func (s *Server) pairScore(a, b []uint32) float64 {
	va, vb := vector(a, embeddingDim), vector(b, embeddingDim)
	var dot float64
	for i := range va {
		dot += float64(va[i]) * float64(vb[i])
	}
	return (dot + 1) / 2
}

// textList reads a string or a non-empty list of strings.
func textList(raw json.RawMessage) ([]string, bool) {
	var one string
	if json.Unmarshal(raw, &one) == nil {
		return []string{one}, true
	}
	var many []string
	if json.Unmarshal(raw, &many) == nil && len(many) > 0 {
		return many, true
	}
	return nil, false
}

func (s *Server) handleScore(w http.ResponseWriter, r *http.Request) {
	var p struct {
		Model string          `json:"model"`
		Text1 json.RawMessage `json:"text_1"`
		Text2 json.RawMessage `json:"text_2"`
	}
	if !decodeBody(w, r, &p) || !s.checkModel(w, p.Model) {
		return
	}
	t1, ok1 := textList(p.Text1)
	t2, ok2 := textList(p.Text2)
	if !ok1 || !ok2 || (len(t1) != 1 && len(t1) != len(t2)) {
		writeError(w, http.StatusBadRequest, "text_1 and text_2 must be strings or lists of strings (text_1 of one or of text_2's length)")
		return
	}
	n := 0
	data := make([]map[string]any, len(t2))
	for i, b := range t2 {
		a := t1[0]
		if len(t1) > 1 {
			a = t1[i]
		}
		ta, tb := s.encodeText(a, true), s.encodeText(b, true)
		n += len(ta) + len(tb)
		data[i] = map[string]any{"index": i, "object": "score", "score": s.pairScore(ta, tb)}
	}
	writeJSON(w, http.StatusOK, map[string]any{"id": s.poolID("score"), "object": "list", "created": time.Now().Unix(),
		"model": s.cfg.ServedModelName, "data": data, "usage": poolingUsage{PromptTokens: n, TotalTokens: n}})
}

func (s *Server) handleRerank(w http.ResponseWriter, r *http.Request) {
	var p struct {
		Model     string          `json:"model"`
		Query     *string         `json:"query"`
		Documents json.RawMessage `json:"documents"`
		TopN      int             `json:"top_n"`
	}
	if !decodeBody(w, r, &p) || !s.checkModel(w, p.Model) {
		return
	}
	docs, ok := textList(p.Documents)
	if p.Query == nil || !ok {
		writeError(w, http.StatusBadRequest, "query (a string) and documents (a list of strings) are required")
		return
	}
	q := s.encodeText(*p.Query, true)
	n := 0
	type result struct {
		Index    int               `json:"index"`
		Document map[string]string `json:"document"`
		Score    float64           `json:"relevance_score"`
	}
	results := make([]result, len(docs))
	for i, d := range docs {
		td := s.encodeText(d, true)
		n += len(q) + len(td)
		results[i] = result{Index: i, Document: map[string]string{"text": d}, Score: s.pairScore(q, td)}
	}
	sort.SliceStable(results, func(i, j int) bool { return results[i].Score > results[j].Score })
	if p.TopN > 0 && p.TopN < len(results) {
		results = results[:p.TopN]
	}
	writeJSON(w, http.StatusOK, map[string]any{"id": s.poolID("rerank"), "model": s.cfg.ServedModelName,
		"usage": map[string]int{"total_tokens": n}, "results": results})
}

func (s *Server) handleDetokenize(w http.ResponseWriter, r *http.Request) {
	var p struct {
		Model  string   `json:"model"`
		Tokens []uint32 `json:"tokens"`
	}
	if !decodeBody(w, r, &p) || !s.checkModel(w, p.Model) {
		return
	}
	dec, ok := s.tok.(tokenizer.Decoder)
	if !ok {
		writeError(w, http.StatusBadRequest, "this tokenizer cannot detokenize")
		return
	}
	b, err := dec.Decode(nil, p.Tokens)
	if err != nil {
		writeError(w, http.StatusBadRequest, "token id out of vocabulary")
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"prompt": string(b)})
}

// handleAudio answers a transcription or translation: the text says how
// long the uploaded audio is (from a WAV header, else its size), which
// proves the file arrived whole.
func (s *Server) handleAudio(w http.ResponseWriter, r *http.Request) {
	mt, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mt != "multipart/form-data" {
		writeError(w, http.StatusBadRequest, "the body must be multipart/form-data")
		return
	}
	mr := multipart.NewReader(http.MaxBytesReader(w, r.Body, maxBodyBytes), params["boundary"])
	var model, format string
	var audio []byte
	for {
		part, err := mr.NextPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			writeError(w, http.StatusBadRequest, "cannot read the multipart body")
			return
		}
		v, err := io.ReadAll(part)
		if err != nil {
			writeError(w, http.StatusBadRequest, "cannot read the multipart body")
			return
		}
		switch part.FormName() {
		case "model":
			model = string(v)
		case "response_format":
			format = string(v)
		case "file":
			audio = v
		}
	}
	if !s.checkModel(w, model) {
		return
	}
	if audio == nil {
		writeError(w, http.StatusBadRequest, "file is required")
		return
	}
	text := fmt.Sprintf("%d bytes of audio", len(audio))
	if secs, ok := wavSeconds(audio); ok {
		text = fmt.Sprintf("%.2f seconds of audio", secs)
	}
	switch format {
	case "", "json":
		writeJSON(w, http.StatusOK, map[string]any{"text": text})
	case "text":
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = io.WriteString(w, text)
	case "verbose_json":
		writeJSON(w, http.StatusOK, map[string]any{"text": text, "language": "en", "duration": 0, "segments": []any{}})
	default:
		writeError(w, http.StatusBadRequest, "response_format must be json, text or verbose_json")
	}
}

// wavSeconds reads a canonical RIFF/WAVE header's duration.
func wavSeconds(b []byte) (float64, bool) {
	if len(b) < 44 || string(b[0:4]) != "RIFF" || string(b[8:12]) != "WAVE" {
		return 0, false
	}
	byteRate := binary.LittleEndian.Uint32(b[28:32])
	// Find the data chunk.
	for i := 12; i+8 <= len(b); {
		id := string(b[i : i+4])
		size := binary.LittleEndian.Uint32(b[i+4 : i+8])
		if id == "data" && byteRate > 0 {
			return float64(size) / float64(byteRate), true
		}
		i += 8 + int(size)
	}
	return 0, false
}

// Responses API.

// responseStore is the in-process store of responses (vLLM's default:
// kept until the process exits). The zero value is ready.
type responseStore struct {
	mu sync.Mutex
	m  map[string]*storedResponse
}

type storedResponse struct {
	obj map[string]any
	// messages is the conversation so far (input and output), for a
	// follow-up's previous_response_id.
	messages []map[string]any
}

func (st *responseStore) get(id string) (*storedResponse, bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	r, ok := st.m[id]
	return r, ok
}

func (st *responseStore) put(id string, r *storedResponse) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.m == nil {
		st.m = map[string]*storedResponse{}
	}
	st.m[id] = r
}

func (st *responseStore) del(id string) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	_, ok := st.m[id]
	delete(st.m, id)
	return ok
}

// StoredResponses is the number of responses in the Responses API store.
func (s *Server) StoredResponses() int {
	s.responses.mu.Lock()
	defer s.responses.mu.Unlock()
	return len(s.responses.m)
}

type responsesParams struct {
	Model              string          `json:"model"`
	Input              json.RawMessage `json:"input"`
	Instructions       *string         `json:"instructions"`
	PreviousResponseID *string         `json:"previous_response_id"`
	Stream             bool            `json:"stream"`
	Store              *bool           `json:"store"`
	MaxOutputTokens    *int            `json:"max_output_tokens"`
	Background         bool            `json:"background"`
}

// responsesInput turns input into chat messages (text parts; media parts
// flattened as in chat).
func responsesInput(raw json.RawMessage) ([]map[string]any, error) {
	raw = bytes.TrimSpace(raw)
	var str string
	if json.Unmarshal(raw, &str) == nil {
		return []map[string]any{{"role": "user", "content": str}}, nil
	}
	var items []map[string]json.RawMessage
	if json.Unmarshal(raw, &items) != nil || len(items) == 0 {
		return nil, fmt.Errorf("%w: input must be a string or a non-empty list of input items", ErrBadRequest)
	}
	var out []map[string]any
	for i, it := range items {
		var role string
		if json.Unmarshal(it["role"], &role) != nil || role == "" {
			return nil, fmt.Errorf("%w: input[%d]: only message items are supported", ErrBadRequest, i)
		}
		c := bytes.TrimSpace(it["content"])
		if json.Unmarshal(c, &str) == nil {
			out = append(out, map[string]any{"role": role, "content": str})
			continue
		}
		var parts []map[string]json.RawMessage
		if json.Unmarshal(c, &parts) != nil {
			return nil, fmt.Errorf("%w: input[%d].content must be a string or a list of parts", ErrBadRequest, i)
		}
		var text strings.Builder
		for _, p := range parts {
			var typ, t string
			_ = json.Unmarshal(p["type"], &typ)
			switch typ {
			case "input_text", "output_text", "text":
				_ = json.Unmarshal(p["text"], &t)
				text.WriteString(t)
			default:
				b, _ := json.Marshal(p)
				fmt.Fprintf(&text, "<%s:%016x>", typ, xxh3.Hash(b))
			}
		}
		out = append(out, map[string]any{"role": role, "content": text.String()})
	}
	return out, nil
}

func (s *Server) handleResponsesCreate(w http.ResponseWriter, r *http.Request) {
	var p responsesParams
	if !decodeBody(w, r, &p) || !s.checkModel(w, p.Model) {
		return
	}
	input, err := responsesInput(p.Input)
	if err != nil {
		writeError(w, errorStatus(err), err.Error())
		return
	}
	var msgs []map[string]any
	if p.PreviousResponseID != nil {
		prev, ok := s.responses.get(*p.PreviousResponseID)
		if !ok {
			writeError(w, http.StatusNotFound, fmt.Sprintf("Response with id '%s' not found.", *p.PreviousResponseID))
			return
		}
		msgs = append(msgs, prev.messages...)
	}
	if p.Instructions != nil {
		msgs = append([]map[string]any{{"role": "system", "content": *p.Instructions}}, msgs...)
	}
	msgs = append(msgs, input...)
	rawMsgs, _ := json.Marshal(msgs)
	prompt, err := s.parseChat(&genParams{Messages: rawMsgs})
	if err != nil {
		writeError(w, errorStatus(err), err.Error())
		return
	}
	gp := genParams{Model: p.Model, MaxTokens: p.MaxOutputTokens, Stream: p.Stream}
	mt, err := s.maxTokens(&gp, len(prompt))
	if err == nil {
		err = s.eng.Check(len(prompt), mt)
	}
	if err != nil {
		writeError(w, errorStatus(err), err.Error())
		return
	}
	rid, ch, err := s.submit("resp", prompt, mt)
	if err != nil {
		writeError(w, errorStatus(err), err.Error())
		return
	}
	defer s.abort(rid)
	// Random like vLLM's (resp_<uuid hex>): ids are unique across replicas.
	id, msgID := "resp_"+randomHex(), "msg_"+randomHex()
	obj := map[string]any{
		"id": id, "object": "response", "created_at": time.Now().Unix(), "model": s.cfg.ServedModelName,
		"status": "in_progress", "output": []any{}, "instructions": p.Instructions,
		"previous_response_id": p.PreviousResponseID, "max_output_tokens": p.MaxOutputTokens,
		"parallel_tool_calls": true, "tool_choice": "auto", "tools": []any{}, "temperature": 1.0, "top_p": 1.0,
		"background": p.Background, "truncation": "disabled", "metadata": nil, "error": nil,
		"incomplete_details": nil, "usage": nil, "text": map[string]any{"format": map[string]string{"type": "text"}},
	}
	store := p.Store == nil || *p.Store
	ctx := r.Context()
	seq := 0
	var fl http.Flusher
	emit := func(typ string, fields map[string]any) bool {
		if !p.Stream {
			return true
		}
		fields["type"] = typ
		fields["sequence_number"] = seq
		seq++
		b, _ := json.Marshal(fields)
		if _, err := fmt.Fprintf(w, "event: %s\ndata: %s\n\n", typ, b); err != nil {
			return false
		}
		if fl != nil {
			fl.Flush()
		}
		return true
	}
	if p.Stream {
		fl, _ = w.(http.Flusher)
		w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
		w.Header().Set("Cache-Control", "no-cache")
		w.WriteHeader(http.StatusOK)
		if !emit("response.created", map[string]any{"response": obj}) || !emit("response.in_progress", map[string]any{"response": obj}) {
			return
		}
		item := map[string]any{"type": "message", "id": msgID, "status": "in_progress", "role": "assistant", "content": []any{}}
		if !emit("response.output_item.added", map[string]any{"output_index": 0, "item": item}) ||
			!emit("response.content_part.added", map[string]any{"item_id": msgID, "output_index": 0, "content_index": 0,
				"part": map[string]any{"type": "output_text", "text": "", "annotations": []any{}}}) {
			return
		}
	}
	var text strings.Builder
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-ch:
			if !ok {
				if !p.Stream {
					writeError(w, http.StatusServiceUnavailable, "server shutting down")
				}
				return
			}
			if ev.fin == nil {
				t := OutputTokenText(ev.out.Index)
				text.WriteString(t)
				if !emit("response.output_text.delta", map[string]any{"item_id": msgID, "output_index": 0, "content_index": 0, "delta": t, "logprobs": []any{}}) {
					return
				}
				continue
			}
			part := map[string]any{"type": "output_text", "text": text.String(), "annotations": []any{}, "logprobs": []any{}}
			item := map[string]any{"type": "message", "id": msgID, "status": "completed", "role": "assistant", "content": []any{part}}
			obj["status"] = "completed"
			obj["output"] = []any{item}
			obj["usage"] = map[string]any{
				"input_tokens": ev.fin.PromptTokens, "input_tokens_details": map[string]int{"cached_tokens": ev.fin.CachedTokens},
				"output_tokens": ev.fin.OutputTokens, "output_tokens_details": map[string]int{"reasoning_tokens": 0},
				"total_tokens": ev.fin.PromptTokens + ev.fin.OutputTokens,
			}
			if store {
				conv := append(append([]map[string]any{}, msgs...), map[string]any{"role": "assistant", "content": text.String()})
				if p.Instructions != nil {
					conv = conv[1:] // instructions do not carry over (OpenAI's rule)
				}
				s.responses.put(id, &storedResponse{obj: obj, messages: conv})
			}
			if !p.Stream {
				writeJSON(w, http.StatusOK, obj)
				return
			}
			_ = emit("response.output_text.done", map[string]any{"item_id": msgID, "output_index": 0, "content_index": 0, "text": text.String(), "logprobs": []any{}}) &&
				emit("response.content_part.done", map[string]any{"item_id": msgID, "output_index": 0, "content_index": 0, "part": part}) &&
				emit("response.output_item.done", map[string]any{"output_index": 0, "item": item}) &&
				emit("response.completed", map[string]any{"response": obj})
			return
		}
	}
}

func randomHex() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func (s *Server) notFoundResponse(w http.ResponseWriter, id string) {
	writeError(w, http.StatusNotFound, fmt.Sprintf("Response with id '%s' not found.", id))
}

func (s *Server) handleResponsesGet(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	st, ok := s.responses.get(id)
	if !ok {
		s.notFoundResponse(w, id)
		return
	}
	writeJSON(w, http.StatusOK, st.obj)
}

func (s *Server) handleResponsesDelete(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if !s.responses.del(id) {
		s.notFoundResponse(w, id)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"id": id, "object": "response", "deleted": true})
}

// handleResponsesCancel: only a background response can be cancelled;
// the simulator runs none, so a stored response answers vLLM's 400.
func (s *Server) handleResponsesCancel(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	if _, ok := s.responses.get(id); !ok {
		s.notFoundResponse(w, id)
		return
	}
	writeError(w, http.StatusBadRequest, "Cannot cancel a synchronous response.")
}
