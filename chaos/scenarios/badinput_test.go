package scenarios

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/chaos/faultproxy"
	"github.com/kvmesh/kvmesh/chaos/truth"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/node"
)

// badBodies are malformed or hostile request bodies for the gateway's
// OpenAI endpoints. Each must get a response with an error the client can
// read (never a dropped connection or a 5xx of the gateway's own).
func badBodies() map[string]string {
	deep := strings.Repeat("[", 100000) + strings.Repeat("]", 100000)
	return map[string]string{
		"truncated json":        `{"model":"m","prompt":"x"`,
		"not json":              `model=m&prompt=x`,
		"array":                 `[]`,
		"string":                `"hello"`,
		"null":                  `null`,
		"number":                `42`,
		"empty":                 ``,
		"missing model":         `{"prompt":"x"}`,
		"missing prompt":        `{"model":"m"}`,
		"unknown model":         `{"model":"nope","prompt":"x"}`,
		"empty prompt":          `{"model":"m","prompt":""}`,
		"batch prompt":          `{"model":"m","prompt":["a","b"]}`,
		"numeric prompt":        `{"model":"m","prompt":123}`,
		"object prompt":         `{"model":"m","prompt":{"a":1}}`,
		"negative tokens":       `{"model":"m","prompt":[1,2,-5]}`,
		"huge token id":         `{"model":"m","prompt":[99999999999999999999]}`,
		"model is number":       `{"model":7,"prompt":"x"}`,
		"max_tokens string":     `{"model":"m","prompt":"x","max_tokens":"many"}`,
		"stream string":         `{"model":"m","prompt":"x","stream":"yes"}`,
		"deep nesting":          `{"model":"m","prompt":"x","extra":` + deep + `}`,
		"invalid utf8":          "{\"model\":\"m\",\"prompt\":\"\xff\xfe\xfd\"}",
		"nul bytes":             "{\"model\":\"m\",\"prompt\":\"a\x00b\"}",
		"duplicate keys":        `{"model":"m","model":"other","prompt":"x"}`,
		"chat messages string":  `{"model":"m","messages":"hi"}`,
		"chat empty messages":   `{"model":"m","messages":[]}`,
		"chat bad content part": `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`,
		"chat role missing":     `{"model":"m","messages":[{"content":"hi"}]}`,
		"trailing garbage":      `{"model":"m","prompt":"x"} trailing`,
		"over max body":         `{"model":"m","prompt":"` + strings.Repeat("a", 2<<20) + `"}`,
	}
}

// postRaw posts body and returns status, error code and transport error.
func postRaw(hc *http.Client, url, path, ctype string, body []byte) (int, string, error) {
	resp, err := hc.Post(url+path, ctype, bytes.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return resp.StatusCode, "", err
	}
	var e struct {
		Error struct {
			Code any `json:"code"`
		} `json:"error"`
	}
	code := ""
	if json.Unmarshal(raw, &e) == nil && e.Error.Code != nil {
		code = fmt.Sprint(e.Error.Code)
	}
	return resp.StatusCode, code, nil
}

// TestBadInput (scenario 8): malformed input on every port kvmesh and the
// engine simulator expose: HTTP bodies and raw bytes to the gateway,
// garbled KV-event payloads to the gateway's subscribers, raw bytes and
// malformed requests on the engine's replay ROUTER, and non-ZMTP bytes and
// wrong-shaped messages to a bound Subscriber. Everything is rejected and
// counted; nothing crashes; the cluster keeps serving and converges.
func TestBadInput(t *testing.T) {
	cfg := cluster.DefaultConfig()
	cfg.Gateways, cfg.Engines = 1, 2
	cfg.KVLink = cluster.KVRelay
	cfg.Node = func(_ int, nc *node.Config) { nc.MaxBodyBytes = 1 << 20 }
	c := startCluster(t, cfg)
	g := c.Gateways()[0]
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	rng := rand.New(rand.NewPCG(8, 8))
	var total cluster.LoadResult
	var notes []string

	// HTTP bodies: the table on both endpoints, then random bytes.
	rejected, forwarded := 0, 0
	before := cluster.CounterSum(g.Node.Registry(), "kvmesh_http_client_errors_total", nil)
	send := func(name, path, ctype string, body []byte) {
		status, code, err := postRaw(hc, g.URL(), path, ctype, body)
		total.Sent++
		require.NoError(t, err, "%s: the gateway answers", name)
		require.Less(t, status, 500, "%s: no server error (code %q)", name, code)
		if status >= 400 {
			require.NotEmpty(t, code, "%s: an error body with a code", name)
			total.Failed++
			rejected++
		} else {
			total.OK++
			forwarded++
		}
	}
	for name, body := range badBodies() {
		send(name, "/v1/completions", "application/json", []byte(body))
		send(name, "/v1/chat/completions", "application/json", []byte(body))
	}
	for i := range scale(200, 3000) {
		b := make([]byte, rng.IntN(2048))
		for j := range b {
			b[j] = byte(rng.Uint32())
		}
		if i%2 == 0 && len(b) > 2 { // half look like JSON at first
			b[0] = '{'
		}
		send(fmt.Sprintf("random %d", i), "/v1/completions", "application/json", b)
	}
	counted := cluster.CounterSum(g.Node.Registry(), "kvmesh_http_client_errors_total", nil) - before
	require.Positive(t, counted)
	notes = append(notes, fmt.Sprintf("http: %d rejected (%.0f counted by the gateway), %d forwarded", rejected, counted, forwarded))

	// Raw bytes on the gateway's HTTP port: the connection is answered or
	// closed once the client ends its side; the gateway keeps serving.
	for i := range scale(20, 200) {
		conn, err := net.Dial("tcp", g.Node.HTTPAddr())
		require.NoError(t, err)
		b := make([]byte, 1+rng.IntN(4096))
		for j := range b {
			b[j] = byte(rng.Uint32())
		}
		if i%3 == 0 {
			copy(b, "POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n")
		}
		_, _ = conn.Write(b)
		// End the client's side, as a client that sent its garbage and
		// left does; a server still waiting for the rest of a header is
		// then told there is none.
		require.NoError(t, conn.(*net.TCPConn).CloseWrite())
		require.NoError(t, conn.SetReadDeadline(time.Now().Add(5*time.Second)))
		_, err = io.Copy(io.Discard, conn)
		require.False(t, isTimeout(err), "raw bytes %d: the gateway closes or answers", i)
		_ = conn.Close()
	}

	// Garbled KV-event payloads: every batch for a while. The subscribers
	// count them as malformed and skip them.
	for _, e := range c.Engines() {
		e.Relay.SetFault(func(uint64, uint64) faultproxy.Action { return faultproxy.Garble })
	}
	res, err := cluster.RunLoad(context.Background(), loadConfig(c, "garbled", scale(40, 300)))
	require.NoError(t, err)
	total.Add(res)
	for _, e := range c.Engines() {
		e.Relay.SetFault(nil)
	}
	malformed := cluster.CounterSum(g.Node.Registry(), "kvmesh_kvevents_malformed_total", nil)
	require.Positive(t, malformed)
	ps, err := c.Compare()
	require.NoError(t, err)
	afterGarble := cluster.Summarize(ps)
	notes = append(notes, fmt.Sprintf("zmq: %.0f garbled batches counted malformed (right after: precision %.4f recall %.4f)",
		malformed, afterGarble.MinPrecision, afterGarble.MinRecall))

	// Garbage on each engine's replay ROUTER: raw TCP bytes and malformed
	// ZMQ requests. Replay must still work afterwards.
	for _, e := range c.Engines() {
		addr := strings.TrimPrefix(e.Server().KVReplayAddr(), "tcp://")
		for range scale(5, 50) {
			conn, err := net.Dial("tcp", addr)
			require.NoError(t, err)
			b := make([]byte, 1+rng.IntN(1024))
			for j := range b {
				b[j] = byte(rng.Uint32())
			}
			_, _ = conn.Write(b)
			_ = conn.Close()
		}
		badReplayRequests(t, e.Server().KVReplayAddr())
	}
	// A reset makes truth and index comparable again after the garbling;
	// then lost batches force replays through the abused ROUTERs.
	for _, e := range c.Engines() {
		rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		require.NoError(t, e.ResetCache(rctx))
		cancel()
		e.Relay.SetFault(func(seq, _ uint64) faultproxy.Action {
			if seq%3 == 0 {
				return faultproxy.Drop
			}
			return faultproxy.Forward
		})
	}
	replaysBefore := cluster.CounterSum(g.Node.Registry(), "kvmesh_kvevents_replays_total", map[string]string{"result": "complete"})
	res, err = cluster.RunLoad(context.Background(), loadConfig(c, "after-garbage", scale(40, 300)))
	require.NoError(t, err)
	total.Add(res)
	for _, e := range c.Engines() {
		e.Relay.SetFault(nil)
	}
	final, took := settle(t, c, "after bad input")
	replays := cluster.CounterSum(g.Node.Registry(), "kvmesh_kvevents_replays_total", map[string]string{"result": "complete"}) - replaysBefore
	require.Positive(t, replays, "replay works after garbage on the ROUTER")
	notes = append(notes, fmt.Sprintf("replay port: raw bytes + malformed requests, then %.0f complete replays", replays))

	// Non-ZMTP bytes and wrong-shaped messages to a bound Subscriber.
	notes = append(notes, boundSubscriberGarbage(t, rng))

	row(t, cluster.Row{
		Scenario: "8 bad-input", Load: total, Precision: final.MinPrecision, Recall: final.MinRecall, Converge: took,
		Note: strings.Join(notes, "; "),
	})
}

// badReplayRequests sends a DEALER's worth of malformed replay requests.
func badReplayRequests(t *testing.T, endpoint string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d := zmq4.NewDealer(ctx, zmq4.WithDialerMaxRetries(0))
	defer d.Close()
	require.NoError(t, d.Dial(endpoint))
	for _, m := range []zmq4.Msg{
		zmq4.NewMsgFrom([]byte{}),                                   // no seq
		zmq4.NewMsgFrom([]byte{}, []byte{1, 2, 3}),                  // short seq
		zmq4.NewMsgFrom([]byte("x"), []byte("y"), []byte("z")),      // extra frames
		zmq4.NewMsgFrom([]byte{}, bytes.Repeat([]byte{0xff}, 4096)), // long seq
		zmq4.NewMsgFrom([]byte{}, binary.BigEndian.AppendUint64(nil, 1<<63)),
	} {
		require.NoError(t, d.SendMulti(m))
	}
}

// boundSubscriberGarbage aims raw bytes and wrong-shaped ZMQ messages at a
// Subscriber listening in bind mode (kv_bind), then checks a real
// publisher's batch still gets through and the malformed ones were counted.
func boundSubscriberGarbage(t *testing.T, rng *rand.Rand) string {
	t.Helper()
	ix, err := index.New(index.DefaultConfig())
	require.NoError(t, err)
	const rid = index.ReplicaID(1)
	ix.SetReplicaRoot(rid, ix.Hasher().Root("m", "", ""))
	ap := truth.NewApplier(ix, map[string]index.ReplicaID{"bound": rid})
	m := kvevents.NewMetrics()
	sc := kvevents.DefaultSubscriberConfig()
	sc.Replica, sc.Endpoint, sc.Bind = "bound", "tcp://127.0.0.1:0", true
	sub, err := kvevents.NewSubscriber(sc, ap, m, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	require.NoError(t, sub.Start(context.Background()))
	defer func() { require.NoError(t, sub.Close()) }()
	addr := strings.TrimPrefix(sub.Addr(), "tcp://")

	for range scale(10, 100) {
		conn, err := net.Dial("tcp", addr)
		require.NoError(t, err)
		b := make([]byte, 1+rng.IntN(2048))
		for j := range b {
			b[j] = byte(rng.Uint32())
		}
		_, _ = conn.Write(b)
		_ = conn.Close()
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub := zmq4.NewPub(ctx)
	defer pub.Close()
	require.NoError(t, pub.Dial(sub.Addr()))
	wrong := []zmq4.Msg{
		zmq4.NewMsgFrom([]byte("only one frame")),
		zmq4.NewMsgFrom([]byte(""), []byte{1, 2}, []byte("short seq")),
		zmq4.NewMsgFrom([]byte(""), make([]byte, 8), []byte("not msgpack")),
		zmq4.NewMsgFrom([]byte(""), make([]byte, 8), []byte{0x93, 0xcb}),
	}
	// PUB drops messages until the subscription arrives: repeat the
	// wrong-shaped messages until some are counted.
	mreg := prometheusRegistry(t, m)
	require.Eventually(t, func() bool {
		for _, w := range wrong {
			require.NoError(t, pub.Send(w))
		}
		return cluster.CounterSum(mreg, "kvmesh_kvevents_malformed_total", nil) >= float64(len(wrong))
	}, 10*time.Second, 10*time.Millisecond)
	malformed := cluster.CounterSum(mreg, "kvmesh_kvevents_malformed_total", nil)

	// A real batch still gets through.
	tokens := make([]uint32, 16)
	for i := range tokens {
		tokens[i] = uint32('a' + i)
	}
	enc := kvevents.NewEncoder(kvevents.EncodingMap)
	payload, err := enc.Append(nil, &kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.KindBlockStored,
		Stored: &kvevents.BlockStored{BlockHashes: []kvevents.EngineHash{42}, TokenIDs: tokens, BlockSize: 16}}}})
	require.NoError(t, err)
	seq := uint64(1000)
	require.Eventually(t, func() bool {
		seq++
		require.NoError(t, pub.Send(zmq4.NewMsgFrom([]byte(""), binary.BigEndian.AppendUint64(nil, seq), payload)))
		return len(ix.AppendEngineHashes(nil, rid)) == 1
	}, 10*time.Second, 10*time.Millisecond)
	return fmt.Sprintf("bound SUB: raw bytes + %.0f malformed messages counted, valid batch applied after", malformed)
}
