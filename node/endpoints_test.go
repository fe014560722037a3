package node

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/node/tokenizer"
)

// echoEngine records what reaches it (method, path, query, body) and
// answers 200 with a JSON object naming itself.
type echoEngine struct {
	name   string
	srv    *httptest.Server
	health atomic.Int32 // /health's status when non-zero
	mu     sync.Mutex
	got    []echoed
}

type echoed struct {
	method, path, query, contentType string
	body                             []byte
}

func newEchoEngine(t testing.TB, name string) *echoEngine {
	e := &echoEngine{name: name}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
			if st := e.health.Load(); st != 0 {
				w.WriteHeader(int(st))
			}
			return
		case "/metrics":
			w.Header().Set("Content-Type", "text/plain")
			return
		}
		b, _ := io.ReadAll(r.Body)
		e.mu.Lock()
		e.got = append(e.got, echoed{r.Method, r.URL.Path, r.URL.RawQuery, r.Header.Get("Content-Type"), b})
		e.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"replica":%q,"path":%q}`, name, r.URL.Path)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *echoEngine) last() echoed {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.got) == 0 {
		return echoed{}
	}
	return e.got[len(e.got)-1]
}

func (e *echoEngine) count() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.got)
}

// Every JSON endpoint reaches an engine at the same path, with the same
// method, query and body bytes, and the engine's answer comes back.
func TestEndpointsPassThroughByteForByte(t *testing.T) {
	e := newEchoEngine(t, "a")
	n := startNode(t, nil, rc("a", e.srv.URL))
	for _, ep := range endpoints {
		if ep.shape != shapeJSON && ep.shape != shapeResponses {
			continue
		}
		t.Run(ep.pattern, func(t *testing.T) {
			body := `{"model":"m",  "input":"x\u00e9", "text_1":"a","text_2":["b"],"query":"q","documents":["d"],"tokens":[1,2],"extra":{"k":[1,2.5e3,null]}}`
			resp := post(t, n, ep.pattern+"?trace=1", body, nil)
			out := readAll(t, resp)
			require.Equal(t, http.StatusOK, resp.StatusCode, out)
			assert.Equal(t, "a", resp.Header.Get(HeaderReplica))
			assert.JSONEq(t, fmt.Sprintf(`{"replica":"a","path":%q}`, ep.pattern), out)
			got := e.last()
			assert.Equal(t, http.MethodPost, got.method)
			assert.Equal(t, ep.pattern, got.path)
			assert.Equal(t, "trace=1", got.query)
			assert.Equal(t, body, string(got.body), "body forwarded byte for byte")
			rep := debugEndpointReport(t, n, ep.pattern, body, "")
			assert.Equal(t, "a", rep.Pick, "explain has a decision for %s", ep.pattern)
			assert.Equal(t, ep.pattern, rep.Path)
		})
	}
}

// Endpoints without a prompt prefix are routed by load: least-request
// unless the header names a strategy; an unknown model is the gateway's
// 404, a missing one the only pool's.
func TestLoadRoutedEndpointsSpreadAndResolveModel(t *testing.T) {
	a, b := newEchoEngine(t, "a"), newEchoEngine(t, "b")
	n := startNode(t, nil, rc("a", a.srv.URL), rc("b", b.srv.URL))
	rep := debugEndpointReport(t, n, "/v1/embeddings", `{"model":"m","input":"hello"}`, "")
	assert.Equal(t, "least-request", rep.Strategy)
	assert.NotEmpty(t, rep.Pick)
	assert.True(t, rep.KeyedInPart)
	assert.Zero(t, rep.TotalBlocks)

	for i := 0; i < 20; i++ {
		resp := post(t, n, "/v1/embeddings", `{"input":"hello"}`, nil) // no model: the only pool's
		readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	assert.Positive(t, a.count())
	assert.Positive(t, b.count())

	resp := post(t, n, "/v1/embeddings", `{"model":"other","input":"hello"}`, nil)
	er := decodeErr(t, readAll(t, resp))
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)
	assert.Equal(t, CodeModelNotFound, er.Error.Code)

	resp = post(t, n, "/v1/embeddings", `{"model":"m","input":"hello"}`, map[string]string{HeaderStrategy: "nope"})
	er = decodeErr(t, readAll(t, resp))
	assert.Equal(t, CodeUnknownStrategy, er.Error.Code)

	req, _ := http.NewRequest(http.MethodGet, "http://"+n.HTTPAddr()+"/v1/embeddings", nil)
	r2, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	er = decodeErr(t, readAll(t, r2))
	assert.Equal(t, http.StatusMethodNotAllowed, r2.StatusCode)
	assert.Equal(t, CodeMethodNotAllowed, er.Error.Code)
}

func TestNotFoundListsServedPaths(t *testing.T) {
	e := newEchoEngine(t, "a")
	n := startNode(t, nil, rc("a", e.srv.URL))
	resp := post(t, n, "/v1/nope", `{}`, nil)
	er := decodeErr(t, readAll(t, resp))
	require.Equal(t, http.StatusNotFound, resp.StatusCode)
	for _, p := range []string{"/v1/embeddings", "/v1/responses/{id}", "/v1/audio/transcriptions", "/v2/rerank", "/detokenize", "GET /v1/models"} {
		assert.Contains(t, er.Error.Message, p)
	}
	assert.Zero(t, e.count())
}

func debugEndpointReport(t testing.TB, n *Node, path, body, query string) debugReport {
	t.Helper()
	resp := post(t, n, "/debug/route?path="+path+query, body, nil)
	raw := readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, raw)
	var rep debugReport
	require.NoError(t, json.Unmarshal([]byte(raw), &rep))
	return rep
}

// A prompt list is keyed by its longest prompt.
func TestBatchKeyedByLongestPrompt(t *testing.T) {
	long := strings.Repeat("the longest prompt of the batch ", 20)
	req, aerr := parseInference(kindCompletions, []byte(`{"model":"m","prompt":["short",`+jsonString(long)+`,"mid prompt"]}`))
	require.Nil(t, aerr)
	assert.Equal(t, long, req.text)
	assert.Equal(t, 3, req.batch)
	assert.True(t, req.partial)
	req, aerr = parseInference(kindCompletions, []byte(`{"model":"m","prompt":[[1,2],[3,4,5,6],[7]]}`))
	require.Nil(t, aerr)
	assert.Equal(t, []uint32{3, 4, 5, 6}, req.tokens)
	_, aerr = parseInference(kindCompletions, []byte(`{"model":"m","prompt":["a",""]}`))
	require.Nil(t, aerr, "an empty prompt among others is the engine's business")
	_, aerr = parseInference(kindCompletions, []byte(`{"model":"m","prompt":["",""]}`))
	require.NotNil(t, aerr)
	assert.Equal(t, CodeEmptyPrompt, aerr.code)
}

func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// A chat with media parts is keyed up to its first media part: its keys
// are those of the chat cut there.
func TestMediaChatKeyedUpToFirstMediaPart(t *testing.T) {
	sys := strings.Repeat("You are a careful assistant that describes pictures. ", 10)
	full := `{"model":"m","messages":[{"role":"system","content":` + jsonString(sys) + `},` +
		`{"role":"user","content":[{"type":"text","text":"look at this:"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},{"type":"text","text":"and tell me"}]}]}`
	cut := `{"model":"m","messages":[{"role":"system","content":` + jsonString(sys) + `},` +
		`{"role":"user","content":[{"type":"text","text":"look at this:"}]}]}`
	fr, aerr := parseInference(kindChat, []byte(full))
	require.Nil(t, aerr)
	cr, aerr := parseInference(kindChat, []byte(cut))
	require.Nil(t, aerr)
	assert.True(t, fr.partial)
	assert.Equal(t, cr.messages, fr.messages)

	mediaFirst := `{"model":"m","messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}}]}]}`
	mr, aerr := parseInference(kindChat, []byte(mediaFirst))
	require.Nil(t, aerr)
	assert.Empty(t, mr.messages)

	e := newEchoEngine(t, "a")
	n := startNode(t, nil, rc("a", e.srv.URL))
	for _, body := range []string{full, mediaFirst} {
		resp := post(t, n, "/v1/chat/completions", body, nil)
		readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		assert.Equal(t, body, string(e.last().body))
	}
	rf := debugRouteBody(t, n, map[string]any{"model": "m", "messages": json.RawMessage(mustField(t, full, "messages"))})
	rc := debugRouteBody(t, n, map[string]any{"model": "m", "messages": json.RawMessage(mustField(t, cut, "messages"))})
	assert.Equal(t, rc.TotalBlocks, rf.TotalBlocks)
	assert.Positive(t, rf.TotalBlocks)
}

func mustField(t testing.TB, body, field string) string {
	var m map[string]json.RawMessage
	require.NoError(t, json.Unmarshal([]byte(body), &m))
	return string(m[field])
}

func startSimNamed(t testing.TB) *sim.Server { return startSim(t, false) }

// The Responses API through two gateways sharing replicas: the follow-up
// and retrieve/delete reach the replica that stored the response, on the
// gateway that relayed it (learned) and on the other (discovered).
func TestResponsesAffinityAcrossGateways(t *testing.T) {
	s1, s2, s3 := startSimNamed(t), startSimNamed(t), startSimNamed(t)
	reps := []ReplicaConfig{rc("r1", s1.URL()), rc("r2", s2.URL()), rc("r3", s3.URL())}
	// g2 finds the owner by asking every available replica within
	// HealthTimeout. LocalConfig's 250 ms is a health poll's budget on a
	// quiet machine: under load a poll or the owner's answer to the
	// discovery can take longer, and the follow-up then goes to a replica
	// that answers 404 (ci674, five .ci/run at once, -race). What is under
	// test is where the follow-up goes, not how fast the replicas answer.
	slowOK := func(c *Config) { c.HealthTimeout = 2 * time.Second }
	g1 := startNode(t, slowOK, reps...)
	g2 := startNode(t, slowOK, reps...)

	for _, stream := range []bool{false, true} {
		body := fmt.Sprintf(`{"model":"m","input":"tell me a story","max_output_tokens":4,"stream":%v}`, stream)
		resp := post(t, g1, "/v1/responses", body, nil)
		out := readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode, out)
		owner := resp.Header.Get(HeaderReplica)
		id := firstID([]byte(out))
		require.True(t, strings.HasPrefix(id, "resp_"), out)
		got, ok := g1.owners.get(id, nowNanos())
		require.True(t, ok, "g1 learned the id from the relayed response")
		assert.Equal(t, owner, got)

		// A follow-up on the other gateway, several times: always the owner
		// (one replica in three: chance would miss it).
		for i := 0; i < 4; i++ {
			fu := fmt.Sprintf(`{"model":"m","input":"go on","previous_response_id":%q,"max_output_tokens":2}`, id)
			resp = post(t, g2, "/v1/responses", fu, map[string]string{HeaderStrategy: "random"})
			out = readAll(t, resp)
			require.Equal(t, http.StatusOK, resp.StatusCode, out)
			assert.Equal(t, owner, resp.Header.Get(HeaderReplica))
		}
		rep := debugEndpointReport(t, g2, "/v1/responses/"+id, "", "")
		assert.Equal(t, owner, rep.ResponseOwner)
		assert.Equal(t, owner, rep.Pick)
		// The explanation shows the one candidate a pin leaves: the owner.
		require.NotNil(t, rep.Explanation)
		require.Len(t, rep.Explanation.Replicas, 1)
		assert.Equal(t, owner, rep.Explanation.Replicas[0].Name)

		get := func(n *Node, method string) (int, string, string) {
			req, _ := http.NewRequest(method, "http://"+n.HTTPAddr()+"/v1/responses/"+id, nil)
			resp, err := http.DefaultClient.Do(req)
			require.NoError(t, err)
			b := readAll(t, resp)
			return resp.StatusCode, resp.Header.Get(HeaderReplica), b
		}
		code, by, b := get(g2, http.MethodGet)
		require.Equal(t, http.StatusOK, code, b)
		assert.Equal(t, owner, by)
		assert.Equal(t, id, firstID([]byte(b)))
		code, by, b = get(g1, http.MethodDelete)
		require.Equal(t, http.StatusOK, code, b)
		assert.Equal(t, owner, by)
		_, ok = g1.owners.get(id, nowNanos())
		assert.False(t, ok, "a deleted response is forgotten")
		code, _, b = get(g1, http.MethodGet)
		assert.Equal(t, http.StatusNotFound, code, b)
	}
	// The owner left the pool: a clear error and a metric.
	g1.owners.put("resp_gone", "r9", nowNanos())
	resp := post(t, g1, "/v1/responses", `{"model":"m","input":"x","previous_response_id":"resp_gone"}`, nil)
	er := decodeErr(t, readAll(t, resp))
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)
	assert.Equal(t, CodeResponseOwnerGone, er.Error.Code)
	assert.Contains(t, er.Error.Message, "r9")
	assert.Equal(t, 1.0, counterValue(t, g1, "kvmesh_proxy_response_affinity_total", map[string]string{"result": "owner_gone"}))
}

func TestResponseOwnersExpireAndBound(t *testing.T) {
	o := newResponseOwners(2, time.Minute)
	t0 := time.Now().UnixNano()
	o.put("a", "r1", t0)
	o.put("b", "r2", t0+1)
	o.put("c", "r3", t0+2)
	_, ok := o.get("a", t0+3)
	assert.False(t, ok, "the oldest goes beyond the bound")
	r, ok := o.get("c", t0+3)
	assert.True(t, ok)
	assert.Equal(t, "r3", r)
	_, ok = o.get("b", t0+int64(time.Minute)+2)
	assert.False(t, ok, "expired")
	assert.Equal(t, 0, o.len())
}

func TestFirstID(t *testing.T) {
	assert.Equal(t, "resp_1", firstID([]byte(`{"id":"resp_1","object":"response"}`)))
	assert.Equal(t, "resp_2", firstID([]byte("event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\" : \"resp_2\",")))
	assert.Equal(t, "", firstID([]byte(`{"object":"response","id":5}`)))
	assert.Equal(t, "", firstID([]byte(`{"id":"unterminated`)))
}

// wav is a mono 16-bit PCM WAV file of secs seconds at 8 kHz.
func wav(secs float64) []byte {
	const rate = 8000
	n := int(secs * rate)
	var b bytes.Buffer
	le := binary.LittleEndian
	b.WriteString("RIFF")
	_ = binary.Write(&b, le, uint32(36+2*n))
	b.WriteString("WAVEfmt ")
	_ = binary.Write(&b, le, uint32(16))
	_ = binary.Write(&b, le, uint16(1))
	_ = binary.Write(&b, le, uint16(1))
	_ = binary.Write(&b, le, uint32(rate))
	_ = binary.Write(&b, le, uint32(2*rate))
	_ = binary.Write(&b, le, uint16(2))
	_ = binary.Write(&b, le, uint16(16))
	b.WriteString("data")
	_ = binary.Write(&b, le, uint32(2*n))
	b.Write(make([]byte, 2*n))
	return b.Bytes()
}

// A transcription (file part first, as the openai clients send it) reaches
// the engine whole and is answered by it.
func TestTranscriptionThroughGateway(t *testing.T) {
	s := startSimNamed(t)
	n := startNode(t, nil, rc("a", s.URL()))
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	fw, _ := mw.CreateFormFile("file", "a.wav")
	_, _ = fw.Write(wav(1))
	_ = mw.WriteField("model", "m")
	_ = mw.Close()
	for _, path := range []string{"/v1/audio/transcriptions", "/v1/audio/translations"} {
		resp, err := http.Post("http://"+n.HTTPAddr()+path, mw.FormDataContentType(), bytes.NewReader(body.Bytes()))
		require.NoError(t, err)
		out := readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode, out)
		assert.JSONEq(t, `{"text":"1.00 seconds of audio"}`, out)
		rep := debugEndpointReport(t, n, path, "", "&model=m")
		assert.Equal(t, "a", rep.Pick)
	}
	// Unknown model: the gateway's 404 before anything reaches an engine.
	var bad bytes.Buffer
	mw = multipart.NewWriter(&bad)
	_ = mw.WriteField("model", "other")
	_ = mw.Close()
	resp, err := http.Post("http://"+n.HTTPAddr()+"/v1/audio/transcriptions", mw.FormDataContentType(), &bad)
	require.NoError(t, err)
	er := decodeErr(t, readAll(t, resp))
	assert.Equal(t, CodeModelNotFound, er.Error.Code)
}

// The gateway starts the upstream request once it has read the model
// field: the rest of the form is not buffered first.
func TestMultipartStreamsAfterModelField(t *testing.T) {
	started := make(chan struct{})
	var once sync.Once
	var got []byte
	done := make(chan struct{})
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/audio/transcriptions" {
			return
		}
		once.Do(func() { close(started) })
		got, _ = io.ReadAll(r.Body)
		close(done)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"text":"ok"}`)
	}))
	t.Cleanup(eng.Close)
	n := startNode(t, nil, rc("a", eng.URL))
	pr, pw := io.Pipe()
	mw := multipart.NewWriter(pw)
	go func() {
		_ = mw.WriteField("model", "m")
		fw, _ := mw.CreateFormFile("file", "a.wav")
		_, _ = fw.Write(wav(0.5))
		// The engine must have the request before the form is finished.
		select {
		case <-started:
		case <-time.After(10 * time.Second):
			_ = pw.CloseWithError(fmt.Errorf("the engine did not see the request before the body ended"))
			return
		}
		_, _ = fw.Write([]byte("tail"))
		_ = mw.Close()
		_ = pw.Close()
	}()
	resp, err := http.Post("http://"+n.HTTPAddr()+"/v1/audio/transcriptions", mw.FormDataContentType(), pr)
	require.NoError(t, err)
	out := readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, out)
	<-done
	assert.True(t, bytes.HasSuffix(got, []byte("tail\r\n--"+mw.Boundary()+"--\r\n")), "the whole form arrived")
}

// Every endpoint answers through the gateway against vllmsim, and a bad
// request gets the engine's own error.
func TestSimEndpointsThroughGateway(t *testing.T) {
	s := startSimNamed(t)
	n := startNode(t, nil, rc("a", s.URL()))
	ok := []struct{ path, body, want string }{
		{"/v1/embeddings", `{"model":"m","input":["a","b"]}`, `"object":"embedding"`},
		{"/pooling", `{"model":"m","input":"a"}`, `"object":"pooling"`},
		{"/classify", `{"model":"m","input":"a"}`, `"num_classes":2`},
		{"/score", `{"model":"m","text_1":"a","text_2":["b","c"]}`, `"object":"score"`},
		{"/v1/score", `{"model":"m","text_1":"a","text_2":"b"}`, `"object":"score"`},
		{"/rerank", `{"model":"m","query":"q","documents":["a","b"]}`, `"relevance_score"`},
		{"/v1/rerank", `{"model":"m","query":"q","documents":["a","b"]}`, `"relevance_score"`},
		{"/v2/rerank", `{"model":"m","query":"q","documents":["a","b"],"top_n":1}`, `"relevance_score"`},
		{"/tokenize", `{"model":"m","prompt":"hello"}`, `"tokens"`},
		{"/detokenize", `{"model":"m","tokens":[104,105]}`, `"prompt":"hi"`},
		{"/v1/completions", `{"model":"m","prompt":["one","two prompts"],"max_tokens":2}`, `"index":1`},
		{"/v1/chat/completions", `{"model":"m","max_tokens":2,"messages":[{"role":"user","content":[{"type":"text","text":"what is this"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}`, `"chat.completion"`},
	}
	for _, c := range ok {
		resp := post(t, n, c.path, c.body, nil)
		out := readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode, c.path+": "+out)
		assert.Contains(t, out, c.want, c.path)
	}
	bad := []struct{ path, body string }{
		{"/v1/embeddings", `{"model":"m"}`},
		{"/v1/embeddings", `{"model":"m","input":"a","encoding_format":"hex"}`},
		{"/score", `{"model":"m","text_1":"a"}`},
		{"/rerank", `{"model":"m","documents":["a"]}`},
		{"/v1/responses", `{"model":"m","input":[{"type":"function_call"}]}`},
	}
	for _, c := range bad {
		resp := post(t, n, c.path, c.body, nil)
		out := readAll(t, resp)
		assert.Equal(t, http.StatusBadRequest, resp.StatusCode, c.path+": "+out)
		assert.Equal(t, "a", resp.Header.Get(HeaderReplica), "the engine's own error: "+out)
	}
}

// A response id's owner learned by one gateway reaches the other through
// the cluster's decision stream (no engine is asked), and a follow-up there
// goes to the owner.
func TestResponseOwnerSharedAcrossCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("two-gateway cluster: skipped with -short")
	}
	e1, e2, e3 := startSimM(t), startSimM(t), startSimM(t)
	reps := []ReplicaConfig{simReplica("e1", e1), simReplica("e2", e2), simReplica("e3", e3)}
	g1, _ := startGateway(t, gwConfig("gw-a", t.TempDir(), nil, 2, reps...))
	g2, _ := startGateway(t, gwConfig("gw-b", t.TempDir(), []string{g1.Cluster().GossipAddr()}, 2, reps...))
	waitReady(t, g1, g2)
	resp := post(t, g1, "/v1/responses", `{"model":"m","input":"shared owner","max_output_tokens":2}`, nil)
	out := readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, out)
	owner, id := resp.Header.Get(HeaderReplica), firstID([]byte(out))
	require.Eventually(t, func() bool {
		p := g2.tbl.Load().pools
		r := g2.sharedOwner(p, id)
		return r != nil && r.name == owner
	}, 10*time.Second, 5*time.Millisecond, "g2 never learned the owner from g1's decision")
	_, known := g2.owners.get(id, nowNanos())
	assert.False(t, known, "g2 did not relay it")
	fu := fmt.Sprintf(`{"model":"m","input":"more","previous_response_id":%q,"max_output_tokens":2}`, id)
	resp = post(t, g2, "/v1/responses", fu, map[string]string{HeaderStrategy: "random"})
	out = readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, out)
	assert.Equal(t, owner, resp.Header.Get(HeaderReplica))
	assert.Equal(t, 1.0, counterValue(t, g2, "kvmesh_proxy_response_affinity_total", map[string]string{"result": "shared"}))
	assert.Zero(t, counterValue(t, g2, "kvmesh_proxy_response_affinity_total", map[string]string{"result": "discovered"}))
}

// A form that never reaches its model field in time is a clear 408, not
// a hang; an owner that is ejected is a 503 naming it.
func TestMultipartSlowBodyAndOwnerUnavailable(t *testing.T) {
	e := newEchoEngine(t, "a")
	n := startNode(t, func(c *Config) { c.BodyReadTimeout = 200 * time.Millisecond }, rc("a", e.srv.URL), rc("b", e.srv.URL))
	pr, pw := io.Pipe()
	t.Cleanup(func() { _ = pw.Close() })
	mw := multipart.NewWriter(pw)
	go func() {
		fw, _ := mw.CreateFormFile("file", "a.wav")
		_, _ = fw.Write([]byte("RIFF")) // then nothing: no model field
	}()
	resp, err := http.Post("http://"+n.HTTPAddr()+"/v1/audio/transcriptions", mw.FormDataContentType(), pr)
	require.NoError(t, err)
	er := decodeErr(t, readAll(t, resp))
	assert.Equal(t, http.StatusRequestTimeout, resp.StatusCode)
	assert.Equal(t, CodeBodyTimeout, er.Error.Code)
	assert.Zero(t, e.count())

	_, rep := n.tbl.Load().replicaByName("b")
	n.owners.put("resp_b", "b", nowNanos())
	rep.ejectedUntil.Store(time.Now().Add(time.Minute).UnixNano())
	resp = post(t, n, "/v1/responses", `{"model":"m","input":"x","previous_response_id":"resp_b"}`, nil)
	er = decodeErr(t, readAll(t, resp))
	assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	assert.Equal(t, CodeResponseOwnerUnavailable, er.Error.Code)
	assert.Contains(t, er.Error.Message, "replica b")
	assert.NotEmpty(t, resp.Header.Get("Retry-After"))
	req, _ := http.NewRequest(http.MethodGet, "http://"+n.HTTPAddr()+"/v1/responses/resp_b", nil)
	resp, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	er = decodeErr(t, readAll(t, resp))
	assert.Equal(t, CodeResponseOwnerUnavailable, er.Error.Code)
	assert.Zero(t, e.count())
}

// A pool whose engines share a store routes stored-response requests like
// any other: no pinning to the replica that made the response.
func TestSharedResponseStoreTurnsAffinityOff(t *testing.T) {
	a, b := newEchoEngine(t, "a"), newEchoEngine(t, "b")
	n := startNode(t, func(c *Config) { c.Models[0].SharedResponseStore = true }, rc("a", a.srv.URL), rc("b", b.srv.URL))
	n.owners.put("resp_x", "b", nowNanos())
	for i := 0; i < 20; i++ {
		resp := post(t, n, "/v1/responses", `{"model":"m","input":"x","previous_response_id":"resp_x"}`, map[string]string{HeaderStrategy: "random"})
		readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	assert.Positive(t, a.count(), "not pinned to b")
	assert.Positive(t, b.count())
	assert.Equal(t, 20.0, counterValue(t, n, "kvmesh_proxy_response_affinity_total", map[string]string{"result": "shared_store"}))
}

// BenchmarkParseEndpoints measures reading the new request shapes: a
// Responses request (converted to chat), a chat cut at an image, and an
// embeddings request (model only).
func BenchmarkParseEndpoints(b *testing.B) {
	long := strings.Repeat("You are a careful assistant. ", 200)
	resp := []byte(`{"model":"m","instructions":` + jsonString(long) + `,"input":[{"role":"user","content":[{"type":"input_text","text":"hello"},{"type":"input_image","image_url":"data:image/png;base64,AAAA"}]}],"max_output_tokens":8}`)
	chat := []byte(`{"model":"m","messages":[{"role":"system","content":` + jsonString(long) + `},{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}]}]}`)
	emb := []byte(`{"model":"m","input":` + jsonString(long) + `}`)
	img := strings.Repeat("QUJD", 256<<10) // 1 MiB of base64
	bigImage := []byte(`{"model":"m","messages":[{"role":"system","content":` + jsonString(long) + `},{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"data:image/png;base64,` + img + `"}}]}]}`)
	bigResp := []byte(`{"model":"m","instructions":` + jsonString(long) + `,"input":[{"role":"user","content":[{"type":"input_text","text":"hello"},{"type":"input_image","image_url":"data:image/png;base64,` + img + `"}]}]}`)
	plain := []byte(`{"model":"m","messages":[{"role":"system","content":` + jsonString(long) + `},{"role":"user","content":[{"type":"text","text":"look"}]}]}`)
	for _, c := range []struct {
		name string
		ep   *endpoint
		body []byte
	}{
		{"responses", findEndpoint("/v1/responses"), resp},
		{"chat-media", findEndpoint("/v1/chat/completions"), chat},
		{"chat-1MiB-image", findEndpoint("/v1/chat/completions"), bigImage},
		{"responses-1MiB-image", findEndpoint("/v1/responses"), bigResp},
		{"chat-text (reference)", findEndpoint("/v1/chat/completions"), plain},
		{"embeddings", findEndpoint("/v1/embeddings"), emb},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(c.body)))
			for b.Loop() {
				if _, aerr := parseEndpoint(c.ep, c.ep.pattern, c.body); aerr != nil {
					b.Fatal(aerr)
				}
			}
		})
	}
}

// Owner discovery asks the engines, but never more than maxDiscoveries at
// once: beyond, the client is told to retry (503), as it is when a lookup
// goes unanswered, and the engines are not asked.
func TestDiscoveryIsBounded(t *testing.T) {
	a := newEchoEngine(t, "a")
	// The discovery GET has HealthTimeout: a loaded machine's answer may
	// take longer than LocalConfig's 250 ms (see
	// TestResponsesAffinityAcrossGateways).
	n := startNode(t, func(c *Config) { c.HealthTimeout = 2 * time.Second }, rc("a", a.srv.URL))
	for i := 0; i < maxDiscoveries; i++ {
		n.owners.discover <- struct{}{}
	}
	get := func() (int, http.Header, string) {
		resp, err := http.Get("http://" + n.HTTPAddr() + "/v1/responses/resp_z")
		require.NoError(t, err)
		return resp.StatusCode, resp.Header, readAll(t, resp)
	}
	code, h, body := get()
	requireRetryable(t, code, h, body)
	assert.Equal(t, 1.0, counterValue(t, n, "kvmesh_proxy_response_affinity_total", map[string]string{"result": "discovery_busy"}))
	assert.Equal(t, 0, a.count(), "no discovery GET, and no request")
	for i := 0; i < maxDiscoveries; i++ {
		<-n.owners.discover
	}
	code, _, body = get()
	require.Equal(t, http.StatusOK, code, "%s", body)
	assert.Equal(t, 1.0, counterValue(t, n, "kvmesh_proxy_response_affinity_total", map[string]string{"result": "discovered"}))
	assert.Equal(t, 2, a.count(), "a discovery GET, then the request")
	owner, ok := n.owners.get("resp_z", nowNanos())
	assert.True(t, ok)
	assert.Equal(t, "a", owner)
}

// A response's owner is unknown only when every replica asked says it
// does not hold it. While one has not answered the lookup (here: it
// answers 503), the gateway does not send the request to another, which
// would answer 404 for a response that exists: the client gets a 503 to
// retry. Once every replica answers 404, the request is routed and the
// engine's own 404 comes back.
func TestDiscoveryUnansweredIsRetryable(t *testing.T) {
	var lookupStatus atomic.Int32
	lookupStatus.Store(http.StatusServiceUnavailable)
	var posts atomic.Int32
	engine := func(lookup bool) *httptest.Server {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch {
			case r.URL.Path == "/health" || r.URL.Path == "/metrics":
				return
			case r.Method == http.MethodGet && strings.HasPrefix(r.URL.Path, "/v1/responses/"):
				if lookup {
					w.WriteHeader(int(lookupStatus.Load()))
				} else {
					w.WriteHeader(http.StatusNotFound)
				}
				return
			}
			posts.Add(1)
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprint(w, `{"error":{"message":"previous response not found"}}`)
		}))
		t.Cleanup(srv.Close)
		return srv
	}
	a, b := engine(false), engine(true)
	n := startNode(t, func(c *Config) { c.HealthTimeout = 2 * time.Second }, rc("a", a.URL), rc("b", b.URL))
	post := func() (int, http.Header, string) {
		resp, err := http.Post("http://"+n.HTTPAddr()+"/v1/responses", "application/json",
			strings.NewReader(`{"model":"m","input":"next","previous_response_id":"resp_q"}`))
		require.NoError(t, err)
		return resp.StatusCode, resp.Header, readAll(t, resp)
	}
	code, h, body := post()
	requireRetryable(t, code, h, body)
	assert.Contains(t, body, "1 of 2 replicas gave no answer")
	assert.Equal(t, int32(0), posts.Load(), "nothing was routed")
	assert.Equal(t, 1.0, counterValue(t, n, "kvmesh_proxy_response_affinity_total", map[string]string{"result": "undiscovered"}))

	lookupStatus.Store(http.StatusNotFound)
	code, _, body = post()
	require.Equal(t, http.StatusNotFound, code, "%s", body)
	assert.Contains(t, body, "previous response not found", "the engine's own answer")
	assert.Equal(t, int32(1), posts.Load())
	assert.Equal(t, 1.0, counterValue(t, n, "kvmesh_proxy_response_affinity_total", map[string]string{"result": "unknown"}))
}

// requireRetryable checks an answer of 503 response_owner_undiscovered
// that tells the client to retry in a second.
func requireRetryable(t *testing.T, code int, h http.Header, body string) {
	t.Helper()
	require.Equal(t, http.StatusServiceUnavailable, code, "%s", body)
	assert.Equal(t, "1", h.Get("Retry-After"))
	assert.Contains(t, body, CodeResponseOwnerUndiscovered)
}

// mediaScan (one pass of the fast scanner) cuts where mediaCut (the
// encoding/json reference) does.
func TestMediaScanMatchesMediaCut(t *testing.T) {
	img := `{"type":"image_url","image_url":{"url":"data:image/png;base64,QUJD"}}`
	cases := []string{
		`[{"role":"user","content":[{"type":"text","text":"a"},` + img + `,{"type":"text","text":"b"}]}]`,
		`[{"role":"system","content":"sys"},{"role":"user","content":[` + img + `]}]`,
		`[{"content":[{"type":"text","text":"a"},` + img + `],"role":"user"}]`,
		`[{"role":"user","content":[{"text":"first key is not type","type":"text"},{"image_url":{"url":"x"},"type":"image_url"}]}]`,
		`[{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"user","content":[{"type":"text","text":"q"},{"type":"input_audio","input_audio":{"data":"AA","format":"wav"}}]}]`,
		`[ { "role" : "user" , "content" : [ { "type" : "text" , "text" : "spaced" } , { "type" : "video_url" , "video_url" : { "url" : "v" } } ] } ]`,
		`[{"role":"user","content":"plain \"type\": \"image\" in text"}]`,
	}
	for i, c := range cases {
		want, ok := mediaCut(json.RawMessage(c))
		require.True(t, ok, i)
		got, media, ok := mediaScan([]byte(c))
		require.True(t, ok, i)
		wantMsgs, werr := tokenizerParse(want)
		gotMsgs, gerr := tokenizerParse(got)
		require.Equal(t, werr == nil, gerr == nil, "case %d: %s vs %s", i, want, got)
		assert.Equal(t, wantMsgs, gotMsgs, "case %d", i)
		hasMedia := strings.Contains(c, "image_url\"") || strings.Contains(c, "input_audio\"") || strings.Contains(c, "video_url\"")
		assert.Equal(t, hasMedia, media, "case %d", i)
	}
	assert.False(t, maybeMedia([]byte(`[{"role":"user","content":"say \"type\":\"image\""}]`)))
	assert.True(t, maybeMedia([]byte(`[{"role":"user","content":[{"type" : "image_url"}]}]`)))
}

func tokenizerParse(raw json.RawMessage) (any, error) {
	if len(raw) == 0 {
		return nil, nil
	}
	return tokenizer.ParseMessages(raw)
}

// FuzzMediaScan: on any valid JSON, mediaScan never panics, and when it
// reads the messages it agrees with mediaCut.
func FuzzMediaScan(f *testing.F) {
	f.Add(`[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}}]}]`)
	f.Add(`[{"content":[{"type":"input_audio"}],"role":"user"}]`)
	f.Add(`[{"role":"user","content":"x"},{"role":"user","content":[]}]`)
	f.Add(`[1,{"role":"u"}]`)
	f.Fuzz(func(t *testing.T, s string) {
		if !json.Valid([]byte(s)) {
			return
		}
		got, media, ok := mediaScan([]byte(s))
		if !ok || !media {
			return
		}
		want, wok := mediaCut(json.RawMessage(s))
		if !wok {
			return // mediaCut's stricter shapes; the caller would fall back
		}
		gm, gerr := tokenizerParse(got)
		wm, werr := tokenizerParse(want)
		if (gerr == nil) != (werr == nil) || (gerr == nil && !assert.ObjectsAreEqual(gm, wm)) {
			t.Fatalf("input %s: mediaScan %s, mediaCut %s", s, got, want)
		}
	})
}

// A Responses input is keyed as the chat vLLM renders from it, up to its
// first item or part that is not text.
func TestResponsesInputKeyedAsChat(t *testing.T) {
	asChat := func(body string) (*inferenceRequest, []tokenizer.Message) {
		req, aerr := parseResponses([]byte(body))
		require.Nil(t, aerr, body)
		return req, req.messages
	}
	req, msgs := asChat(`{"model":"m","instructions":"sys","input":"hi"}`)
	assert.False(t, req.partial)
	assert.Equal(t, []tokenizer.Message{{Role: "system", Content: "sys"}, {Role: "user", Content: "hi"}}, msgs)
	req, msgs = asChat(`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_image","image_url":"data:x"},{"type":"input_text","text":"b"}]}]}`)
	assert.True(t, req.partial)
	assert.Equal(t, []tokenizer.Message{{Role: "user", Content: "a"}}, msgs)
	req, msgs = asChat(`{"model":"m","input":[{"type":"message","role":"user","content":"q"},{"type":"function_call_output","call_id":"c","output":"o"}]}`)
	assert.True(t, req.partial)
	assert.Equal(t, []tokenizer.Message{{Role: "user", Content: "q"}}, msgs)
	req, _ = asChat(`{"model":"m","input":"x","previous_response_id":"resp_1"}`)
	assert.Equal(t, "resp_1", req.previousResponseID)
	assert.Empty(t, req.messages, "a follow-up is not keyed")
	_, aerr := parseResponses([]byte(`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":5}]}]}`))
	require.NotNil(t, aerr)
	assert.Equal(t, CodeInvalidPrompt, aerr.code)
}

// A request pinned to one replica (the owner of a stored response, or the
// admin pin header) has no other replica to go to, so when that replica
// fails only its /health polls it is tried (health fail-open) rather than
// refused; the decision counts as fail-open, but it does not put the model,
// whose other replica serves, into the fail-open state. With fail-open off
// it is refused as before, and an ejected owner is refused either way.
func TestPinnedReplicaFailingHealthFailsOpen(t *testing.T) {
	for _, open := range []bool{true, false} {
		t.Run(fmt.Sprintf("fail_open=%v", open), func(t *testing.T) {
			a, b := newEchoEngine(t, "a"), newEchoEngine(t, "b")
			n := startNode(t, func(c *Config) { c.HealthFailOpen = open; c.AdminToken = "s3cret" },
				rc("a", a.srv.URL), rc("b", b.srv.URL))
			_, rb := n.tbl.Load().replicaByName("b")
			n.owners.put("resp_b", "b", nowNanos())
			b.health.Store(http.StatusServiceUnavailable)
			require.Eventually(t, rb.activeDown.Load, 10*time.Second, 5*time.Millisecond)

			follow := `{"model":"m","input":"x","previous_response_id":"resp_b"}`
			resp := post(t, n, "/v1/responses", follow, nil)
			out := readAll(t, resp)
			pinned := post(t, n, "/v1/completions", `{"model":"m","prompt":"hi","max_tokens":1}`,
				map[string]string{HeaderPinReplica: "b", HeaderAdminToken: "s3cret"})
			pinnedOut := readAll(t, pinned)
			if !open {
				assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, out)
				assert.Equal(t, CodeResponseOwnerUnavailable, decodeErr(t, out).Error.Code)
				assert.Equal(t, http.StatusServiceUnavailable, pinned.StatusCode, pinnedOut)
				assert.Zero(t, b.count())
				return
			}
			require.Equal(t, http.StatusOK, resp.StatusCode, out)
			assert.Equal(t, "b", resp.Header.Get(HeaderReplica))
			require.Equal(t, http.StatusOK, pinned.StatusCode, pinnedOut)
			assert.Equal(t, "b", pinned.Header.Get(HeaderReplica))
			assert.Equal(t, 2.0, value(n.m.failOpen.WithLabelValues("m")), "pinned fail-open decisions are counted")
			assert.False(t, n.tbl.Load().pools[0].failingOpen.Load(), "a serves: the model is not failing open")
			assert.Empty(t, readyReport(t, n).FailOpen)
			// Unpinned requests keep away from b.
			for range 6 {
				resp := post(t, n, "/v1/responses", `{"model":"m","input":"y"}`, map[string]string{HeaderStrategy: "random"})
				readAll(t, resp)
				assert.Equal(t, "a", resp.Header.Get(HeaderReplica))
			}

			// Ejected for failing requests: refused, fail-open or not.
			rb.ejectedUntil.Store(time.Now().Add(time.Minute).UnixNano())
			resp = post(t, n, "/v1/responses", follow, nil)
			out = readAll(t, resp)
			assert.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, out)
			assert.Equal(t, CodeResponseOwnerUnavailable, decodeErr(t, out).Error.Code)
		})
	}
}
