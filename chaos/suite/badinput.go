package suite

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"runtime"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/chaos/faultproxy"
	"github.com/kvmesh/kvmesh/chaos/truth"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/node"
	"github.com/kvmesh/kvmesh/proto/adminpb"
	peerv1 "github.com/kvmesh/kvmesh/proto/peer/v1"
	kvsync "github.com/kvmesh/kvmesh/sync"
	"github.com/kvmesh/kvmesh/sync/config"
	"github.com/kvmesh/kvmesh/sync/trust"
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

// BadInput (scenario 8): malformed input on every port kvmesh and the
// engine simulator expose: HTTP bodies and raw bytes to the gateway,
// garbled KV-event payloads to the gateway's subscribers, raw bytes and
// malformed requests on the engine's replay ROUTER, and non-ZMTP bytes and
// wrong-shaped messages to a bound Subscriber. Everything is rejected and
// counted; nothing crashes; the cluster keeps serving and converges.
func badInput(t *R) {
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
	for i := range t.Scale(200, 3000) {
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
	for i := range t.Scale(20, 200) {
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
	res, err := cluster.RunLoad(context.Background(), loadConfig(c, "garbled", t.Scale(40, 300)))
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
		for range t.Scale(5, 50) {
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
	res, err = cluster.RunLoad(context.Background(), loadConfig(c, "after-garbage", t.Scale(40, 300)))
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

	t.Row(cluster.Row{
		Scenario: "8 bad-input", Load: total, Precision: final.MinPrecision, Recall: final.MinRecall, Converge: took,
		Note: strings.Join(notes, "; "),
	})
}

// badReplayRequests sends a DEALER's worth of malformed replay requests.
func badReplayRequests(t *R, endpoint string) {
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
func boundSubscriberGarbage(t *R, rng *rand.Rand) string {
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
	defer func() {
		// zmq4's socket Close closes every peer connection and reports the
		// first error; a junk peer's connection that zmq4's reader already
		// closed (its reaper not having removed it yet) answers
		// net.ErrClosed, which says nothing about the subscriber.
		if err := sub.Close(); err != nil {
			require.ErrorIs(t, err, net.ErrClosed)
		}
	}()
	addr := strings.TrimPrefix(sub.Addr(), "tcp://")

	for range t.Scale(10, 100) {
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

// BadInputClusterPorts (scenario 8, the cluster's ports): three
// clustered gateways take a barrage on every port a gateway opens besides
// the OpenAI API and the KV subscribers (TestBadInput): the peer-sync gRPC
// port, the admin gRPC port, the admin HTTP API, the raft port, and the
// NATS subjects the gateways subscribe to. Every rejected input is counted
// in a metric, and after each barrage every gateway still serves, raft has
// a leader and commits a valid config write, and the index still matches
// the engines, and the goroutines of the junk connections are gone.
func badInputClusterPorts(t *R) {
	cfg := cluster.DefaultConfig()
	cfg.Gateways, cfg.Engines = 3, 2
	cfg.ClusterMode, cfg.ExternalNATS = true, true
	cfg.DataDir = t.TempDir()
	c := startCluster(t, cfg)
	rng := rand.New(rand.NewPCG(8, 9))
	var total cluster.LoadResult
	var notes []string
	var converge time.Duration
	var last cluster.Summary

	// healthy checks the cluster after a barrage: a load through every
	// gateway completes, raft commits a write every gateway applies, and
	// every gateway's index matches every engine.
	healthy := func(step string) {
		t.Helper()
		res, err := cluster.RunLoad(context.Background(), loadConfig(c, "bad-"+step, t.Scale(30, 300)))
		require.NoError(t, err)
		total.Add(res)
		require.Equal(t, res.Sent, res.OK, "%s: every gateway serves: %s", step, res)
		v := rewriteConfig(t, c)
		awaitVersion(t, c, v)
		s, took := settle(t, c, "after "+step)
		converge, last = max(converge, took), s
	}
	healthy("baseline")
	// Every connection a barrage opened is closed by the end of the next
	// check: the goroutines serving them (gRPC transports, raft's
	// connection handlers, NATS clients) are gone. HTTP keep-alive
	// connections are left out of the count: the gateways' pools towards
	// the engines grow with the loads' concurrency peaks, legitimately. The
	// margin covers what grows without any leak, from the goroutines of
	// a run of this test counted by stack:
	//   - the config store's cached forwarding clients: a follower that
	//     forwards a write keeps one gRPC connection to the leader, 16
	//     goroutines on both ends (6 callback serializers, 4 control
	//     buffers, 2 frame readers, 2 keepalives, 2 guarded reads), and
	//     every follower may have one;
	//   - raft's pooled peer connections, one handler goroutine each:
	//     from one per peer pair at rest up to MaxPool (3) under load;
	//   - 5 for the rest (a probe or a load fetch in flight, a replication
	//     or NATS ping goroutine).
	// ci623 (five .ci/run at once) counted +40 after 10 s against the old
	// flat margin of 30; beside five CI runs (load 23) 4 of 6 runs of
	// this test failed that margin, none of 9 a margin of 42 (load 28).
	// A leaked junk connection costs 1 to 4 goroutines and the barrages
	// open hundreds.
	n := len(c.Gateways())
	margin := 16*(n-1) + 2*n*(n-1) + 5
	goroutines := countGoroutines()
	noLeak := func(step string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for countGoroutines() > goroutines+margin {
			if time.Now().After(deadline) {
				var dump strings.Builder
				_ = pprof.Lookup("goroutine").WriteTo(&dump, 1)
				t.Fatalf("after %s: goroutines (keep-alive connections aside): %d before the barrages, %d now (margin %d):\n%s",
					step, goroutines, countGoroutines(), margin, dump.String())
			}
			select {
			case <-time.After(10 * time.Millisecond):
			case <-t.Context().Done():
			}
		}
	}

	barrages := []struct {
		name string
		run  func() string
	}{
		{"peer-grpc", func() string { return peerPortBarrage(t, c, rng) }},
		{"admin-grpc", func() string { return adminGRPCBarrage(t, c, rng) }},
		{"admin-http", func() string { return adminHTTPBarrage(t, c, rng) }},
		{"raft", func() string { return raftPortBarrage(t, c, rng) }},
		{"nats", func() string { return natsBarrage(t, c, rng) }},
	}
	for _, b := range barrages {
		notes = append(notes, b.name+": "+b.run())
		healthy(b.name)
		noLeak(b.name)
	}
	notes = append(notes, fmt.Sprintf("goroutines (keep-alive connections aside) %d before, %d after", goroutines, countGoroutines()))

	t.Row(cluster.Row{
		Scenario: "8 bad-input cluster ports", Load: total, Precision: last.MinPrecision, Recall: last.MinRecall,
		Converge: converge, ConfigVersions: c.ConfigVersions(), Note: strings.Join(notes, "; "),
	})
}

// countGoroutines counts the process's goroutines except those of HTTP
// keep-alive connections (client persistConn loops, server conn.serve).
func countGoroutines() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	count := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "net/http.(*persistConn)") || strings.Contains(g, "net/http.(*conn).serve") {
			continue
		}
		count++
	}
	return count
}

// junk returns n random bytes; callers patch the bytes that matter.
func junk(rng *rand.Rand, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

// sendAndClose writes b to addr, ends the write side and waits until the
// server closes the connection (bounded): a server that keeps a junk
// connection open fails the test.
func sendAndClose(t *R, addr string, b []byte) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer conn.Close()
	// The server may have closed (or reset) the connection before reading
	// everything: write and half-close errors are expected.
	_, _ = conn.Write(b)
	_ = conn.(*net.TCPConn).CloseWrite()
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err = io.Copy(io.Discard, conn)
	require.False(t, isTimeout(err), "%s closes a junk connection", addr)
}

// http2Preface is the HTTP/2 client connection preface's magic.
const http2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// grpcJunkConns sends n connections of random bytes and n of the HTTP/2
// magic followed by a frame other than SETTINGS (both counted
// bad_preface), and n of a valid preface and SETTINGS followed by junk
// frames (refused by gRPC's framer; not counted). It returns how many
// should be counted.
func grpcJunkConns(t *R, addr string, rng *rand.Rand, n int) int {
	t.Helper()
	for range n {
		b := junk(rng, 1+rng.IntN(2048))
		if b[0] == 'P' {
			b[0] = 'X'
		}
		sendAndClose(t, addr, b)
		b = append([]byte(http2Preface), junk(rng, rng.IntN(512))...)
		if len(b) > len(http2Preface)+3 && b[len(http2Preface)+3] == 4 {
			b[len(http2Preface)+3] = 0 // DATA, not SETTINGS
		}
		sendAndClose(t, addr, b)
		b = append([]byte(http2Preface), 0, 0, 0, 4, 0, 0, 0, 0, 0)
		sendAndClose(t, addr, append(b, junk(rng, 1+rng.IntN(512))...))
	}
	return 2 * n
}

// rawCodec sends a []byte message as it is (a malformed protobuf body)
// and ignores answers.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*v.(*[]byte))}, nil
}
func (rawCodec) Unmarshal(mem.BufferSlice, any) error { return nil }
func (rawCodec) Name() string                         { return "proto" }

// badProto returns a protobuf body that cannot decode: an invalid wire
// type, or a length running past the end.
func badProto(rng *rand.Rand, i int) []byte {
	if i%2 == 0 {
		return append([]byte{0x0f}, junk(rng, rng.IntN(64))...) // field 1, wire type 7
	}
	return append([]byte{0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f}, junk(rng, rng.IntN(64))...)
}

type bearer string

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}
func (bearer) RequireTransportSecurity() bool { return false }

// grpcConn dials addr in plaintext, with token when non-empty.
func grpcConn(t *R, addr, token string) *grpc.ClientConn {
	t.Helper()
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(bearer(token)))
	}
	conn, err := grpc.NewClient(addr, opts...)
	require.NoError(t, err)
	return conn
}

// awaitCounter waits until the gateways' sum of name{match} reaches want
// and returns it.
func awaitCounter(t *R, c *cluster.Cluster, name string, match map[string]string, want float64) float64 {
	t.Helper()
	require.Eventually(t, func() bool { return c.GatewayCounter(name, match) >= want }, 10*time.Second, 5*time.Millisecond,
		"%s%v: %.0f, want >= %.0f", name, match, c.GatewayCounter(name, match), want)
	return c.GatewayCounter(name, match)
}

// peerPortBarrage: junk connections and calls without the cluster key
// (plaintext, with or without a token) on every gateway's peer-sync port,
// all refused in the mutual-TLS handshake, and undecodable snapshot
// requests from a holder of the key.
func peerPortBarrage(t *R, c *cluster.Cluster, rng *rand.Rand) string {
	t.Helper()
	const metric = "kvmesh_sync_peer_rejected_total"
	reason := func(r string) map[string]string { return map[string]string{"reason": r} }
	hs, unauth, bad := c.GatewayCounter(metric, reason(config.RejectHandshake)),
		c.GatewayCounter("kvmesh_sync_peer_unauthenticated_total", nil), c.GatewayCounter(metric, reason(config.RejectMalformed))
	n := t.Scale(4, 40)
	wantHS, wantBad := 0, 0
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	desc := &grpc.StreamDesc{StreamName: "Snapshot", ServerStreams: true}
	for _, g := range c.Gateways() {
		addr := g.Node.Cluster().PeerAddr()
		grpcJunkConns(t, addr, rng, n)
		wantHS += 3 * n // none of them is a TLS client hello
		for _, tok := range []string{"", "not-the-token", cluster.AdminToken} {
			conn := grpcConn(t, addr, tok)
			st, err := peerv1.NewPeerClient(conn).Snapshot(ctx, &peerv1.SnapshotRequest{Cluster: "kvmesh", Requester: "intruder"})
			if err == nil {
				_, err = st.Recv()
			}
			require.Equal(t, codes.Unavailable, status.Code(err), "token %q: refused before any call: %v", tok, err)
			require.NoError(t, conn.Close())
			wantHS++
		}
		conn := memberConn(t, c, addr)
		for i := range n {
			b := badProto(rng, i)
			st, err := conn.NewStream(ctx, desc, peerv1.Peer_Snapshot_FullMethodName, grpc.ForceCodecV2(rawCodec{}))
			require.NoError(t, err)
			require.NoError(t, st.SendMsg(&b))
			require.NoError(t, st.CloseSend())
			err = st.RecvMsg(new([]byte))
			require.Error(t, err, "an undecodable snapshot request is refused")
			require.NotEqual(t, codes.Unauthenticated, status.Code(err))
			wantBad++
		}
		require.NoError(t, conn.Close())
	}
	gotHS := awaitCounter(t, c, metric, reason(config.RejectHandshake), hs+float64(wantHS)) - hs
	gotUnauth := awaitCounter(t, c, "kvmesh_sync_peer_unauthenticated_total", nil, unauth+float64(wantHS)) - unauth
	gotBad := awaitCounter(t, c, metric, reason(config.RejectMalformed), bad+float64(wantBad)) - bad
	return fmt.Sprintf("%d junk or keyless connections -> counted handshake %.0f (unauthenticated %.0f); %d malformed requests from a key holder -> counted malformed %.0f",
		wantHS, gotHS, gotUnauth, wantBad, gotBad)
}

// memberConn dials addr's peer port as a holder of the cluster key would.
func memberConn(t *R, c *cluster.Cluster, addr string) *grpc.ClientConn {
	t.Helper()
	keys, err := trust.ParseKeys(c.ClusterKey())
	require.NoError(t, err)
	ring, err := trust.New(keys, "barrage")
	require.NoError(t, err)
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(ring.TLSConfig())))
	require.NoError(t, err)
	return conn
}

// versions lists every gateway's applied config version and its store's.
func versions(c *cluster.Cluster) []uint64 {
	var out []uint64
	for _, g := range c.Gateways() {
		out = append(out, g.Node.ConfigVersion(), g.Node.ConfigStore().Current().Version)
	}
	return out
}

// invalidDoc is the current config with one replica URL no gateway can
// use: it fails validation, naming the field.
func invalidDoc(t *R, c *cluster.Cluster) []byte {
	t.Helper()
	cur := c.Gateways()[0].Node.ConfigStore().Current()
	raw, err := json.Marshal(cur.Config)
	require.NoError(t, err)
	var doc config.RoutingConfig
	require.NoError(t, json.Unmarshal(raw, &doc))
	m := doc.Models[c.Config().Model]
	m.Replicas = append([]config.ReplicaConfig(nil), m.Replicas...)
	m.Replicas[0].URL = "ftp://not-an-engine"
	doc.Models[c.Config().Model] = m
	out, err := json.Marshal(&doc)
	require.NoError(t, err)
	return out
}

// adminGRPCBarrage: junk connections, bad tokens, undecodable requests
// and refused writes on every gateway's admin gRPC port.
func adminGRPCBarrage(t *R, c *cluster.Cluster, rng *rand.Rand) string {
	t.Helper()
	const metric = "kvmesh_config_admin_rejected_total"
	grpcAPI := map[string]string{"api": "grpc"}
	before := c.GatewayCounter(metric, grpcAPI)
	v0 := versions(c)
	n := t.Scale(4, 40)
	want := 0
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	bad := invalidDoc(t, c)
	model := c.Config().Model
	for _, g := range c.Gateways() {
		addr := g.Node.AdminAddr()
		want += grpcJunkConns(t, addr, rng, n)
		for _, tok := range []string{"", "not-the-token"} {
			cl, err := config.Dial(addr, config.ClientOptions{Token: tok})
			require.NoError(t, err)
			_, err = cl.SetConfigJSON(ctx, bad, nil)
			require.ErrorIs(t, err, config.ErrUnauthenticated)
			_, err = cl.GetConfig(ctx)
			require.ErrorIs(t, err, config.ErrUnauthenticated, "reads need the token too")
			require.NoError(t, cl.Close())
			want += 2
		}
		conn := grpcConn(t, addr, cluster.AdminToken)
		for i := range n {
			b := badProto(rng, i)
			err := conn.Invoke(ctx, adminpb.Admin_SetConfig_FullMethodName, &b, new([]byte), grpc.ForceCodecV2(rawCodec{}))
			require.Error(t, err)
			want++
		}
		require.NoError(t, conn.Close())

		cl, err := config.Dial(addr, config.ClientOptions{Token: cluster.AdminToken})
		require.NoError(t, err)
		_, err = cl.SetConfigJSON(ctx, bad, nil)
		require.ErrorIs(t, err, config.ErrInvalidConfig)
		require.Contains(t, err.Error(), "url", "the refusal names the field")
		_, err = cl.SetConfigJSON(ctx, []byte(`{"models":`), nil)
		require.ErrorIs(t, err, config.ErrInvalidConfig)
		_, err = cl.PatchConfig(ctx, []byte(`[1,2,3]`), nil)
		require.ErrorIs(t, err, config.ErrInvalidConfig)
		_, err = cl.AddReplica(ctx, model, config.ReplicaConfig{Name: "bad replica", URL: "gopher://x"})
		require.ErrorIs(t, err, config.ErrInvalidConfig)
		_, err = cl.RemoveReplica(ctx, model, "no-such-replica")
		require.ErrorIs(t, err, config.ErrNotFound)
		_, err = cl.API().Forward(ctx, &adminpb.ForwardRequest{Command: junk(rng, 64)})
		require.Equal(t, codes.InvalidArgument, status.Code(err), "a junk forwarded command: %v", err)
		require.NoError(t, cl.Close())
		want += 6
	}
	got := awaitCounter(t, c, metric, grpcAPI, before+float64(want)) - before
	require.Equal(t, v0, versions(c), "no refused write changed a config version")
	return fmt.Sprintf("%d inputs (junk connections, bad tokens, malformed protobuf, invalid configs) -> %.0f counted (a refused write a follower forwards counts on the leader too); config version unchanged", want, got)
}

// adminHTTPBarrage: the admin HTTP API on every gateway's HTTP port.
func adminHTTPBarrage(t *R, c *cluster.Cluster, rng *rand.Rand) string {
	t.Helper()
	const metric = "kvmesh_config_admin_rejected_total"
	httpAPI := map[string]string{"api": "http"}
	before := c.GatewayCounter(metric, httpAPI)
	v0 := versions(c)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	bad := invalidDoc(t, c)
	model := c.Config().Model
	want := 0
	for _, g := range c.Gateways() {
		cases := []struct {
			method, path, token string
			body                []byte
			status              int
			code                string
		}{
			{"GET", "/admin/v1/config", "", nil, 401, "unauthenticated"},
			{"PUT", "/admin/v1/config", "wrong", bad, 401, "unauthenticated"},
			{"DELETE", "/admin/v1/models/" + model + "/replicas/e0", "also-wrong", nil, 401, "unauthenticated"},
			{"PUT", "/admin/v1/config", cluster.AdminToken, bad, 400, "invalid_config"},
			{"PUT", "/admin/v1/config", cluster.AdminToken, []byte(`{"models":{`), 400, ""},
			{"PUT", "/admin/v1/config", cluster.AdminToken, junk(rng, 512), 400, ""},
			{"PATCH", "/admin/v1/config", cluster.AdminToken, []byte(`"not an object"`), 400, "invalid_config"},
			{"POST", "/admin/v1/models/" + model + "/replicas", cluster.AdminToken, []byte(`{"name":1,"url":[]}`), 400, "bad_request"},
			{"POST", "/admin/v1/models/" + model + "/replicas", cluster.AdminToken, []byte(`{"name":"x","url":"http://127.0.0.1:1","evil":true}`), 400, "bad_request"},
			{"DELETE", "/admin/v1/models/" + model + "/replicas/no-such-replica", cluster.AdminToken, nil, 404, "not_found"},
			{"PUT", "/admin/v1/config", cluster.AdminToken, bytes.Repeat([]byte(" "), 4<<20+1024), 413, "body_too_large"},
		}
		for _, k := range cases {
			req, err := http.NewRequest(k.method, g.URL()+k.path, bytes.NewReader(k.body))
			require.NoError(t, err)
			if k.token != "" {
				req.Header.Set("Authorization", "Bearer "+k.token)
			}
			resp, err := hc.Do(req)
			require.NoError(t, err, "%s %s", k.method, k.path)
			raw, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			require.NoError(t, resp.Body.Close())
			require.Equal(t, k.status, resp.StatusCode, "%s %s: %s", k.method, k.path, raw)
			var e struct {
				Error struct{ Message, Code string } `json:"error"`
			}
			require.NoError(t, json.Unmarshal(raw, &e), "%s %s: an error body: %s", k.method, k.path, raw)
			require.NotEmpty(t, e.Error.Message)
			if k.code != "" {
				require.Equal(t, k.code, e.Error.Code, "%s %s", k.method, k.path)
			}
			want++
		}
	}
	got := awaitCounter(t, c, metric, httpAPI, before+float64(want)) - before
	require.Equal(t, v0, versions(c), "no refused write changed a config version")
	return fmt.Sprintf("%d requests (no or wrong token, malformed JSON, invalid config, unknown fields, oversized body) -> %.0f counted; config version unchanged", want, got)
}

// raftPortBarrage: random bytes (an unknown RPC type), a valid RPC type
// byte followed by junk, and truncated RPC headers on every gateway's raft
// port. None proves the cluster key: each is closed in the TLS handshake
// and counted "unauthenticated", and raft's decoder never sees a byte of
// it. The legitimate raft traffic before it must not have counted any
// transport error.
func raftPortBarrage(t *R, c *cluster.Cluster, rng *rand.Rand) string {
	t.Helper()
	const metric = "kvmesh_config_raft_transport_errors_total"
	kind := func(k string) map[string]string { return map[string]string{"kind": k} }
	require.Zero(t, c.GatewayCounter(metric, nil), "elections, heartbeats and config writes count no transport error")
	n := t.Scale(5, 50)
	for _, g := range c.Gateways() {
		addr := g.Node.ConfigStore().RaftAddr()
		for range n {
			b := junk(rng, 1+rng.IntN(1024))
			b[0] = byte(4 + rng.IntN(252)) // raft v1.8 knows RPC types 0-3
			sendAndClose(t, addr, b)
			b = junk(rng, 2+rng.IntN(256))
			b[0], b[1] = byte(rng.IntN(4)), 0xc1 // 0xc1 is never valid msgpack
			sendAndClose(t, addr, b)
			// A map header announcing fields that never come.
			sendAndClose(t, addr, []byte{byte(rng.IntN(4)), 0x8f, 0xa4, 'T', 'e'})
		}
	}
	unauth := awaitCounter(t, c, metric, kind("unauthenticated"), float64(3*n*3))
	require.Zero(t, c.GatewayCounter(metric, kind("decode"))+c.GatewayCounter(metric, kind("truncated")),
		"raft read none of the junk")
	return fmt.Sprintf("%d junk connections -> counted unauthenticated %.0f, decode+truncated 0", 3*n*3, unauth)
}

// natsBarrage publishes undecodable and forged messages on every subject
// the gateways subscribe to.
func natsBarrage(t *R, c *cluster.Cluster, rng *rand.Rand) string {
	t.Helper()
	nc, err := nats.Connect("nats://"+c.NATS.Addr(), nats.Name("intruder"))
	require.NoError(t, err)
	defer nc.Close()
	const prefix = "kvmesh.kvmesh" // kvmesh.<cluster name>
	subjects := []string{prefix + ".delta.decisions", prefix + ".kv.e0", prefix + ".kv.ghost", prefix + ".load.g0", prefix + ".digest"}
	malformed := map[string]string{"source": "nats"}
	before := c.GatewayCounter("kvmesh_sync_messages_malformed_total", malformed)
	notOwner := map[string]string{"source": "nats", "reason": "not_owner"}
	notOwnerBefore := c.GatewayCounter("kvmesh_sync_kv_rejected_total", notOwner)
	n := t.Scale(20, 200)
	sent := 0
	for _, s := range subjects {
		for i := range n {
			b := junk(rng, rng.IntN(1024))
			if i%4 == 1 && len(b) > 4 { // right header, junk after it
				copy(b, []byte{'K', 'M', 1}) // magic and version of sync's wire format
			}
			require.NoError(t, nc.Publish(s, b))
			sent++
		}
	}
	// Well-formed messages that break the protocol: decision batches with
	// sequence number 0 (counted malformed), and KV resets for a replica
	// without a name from a sender that owns no engine (refused as
	// not_owner: only an engine's owner may reset its view).
	for i := range n {
		now := time.Now().UnixNano()
		d, err := kvsync.AppendDecisions(nil, &kvsync.DecisionBatch{Origin: "intruder#1", Seq: 0, SentAt: now,
			Entries: []kvsync.Decision{{Replica: "e0", Ledger: index.History, At: now, Keys: []index.BlockKey{1, 2, 3}}}})
		require.NoError(t, err)
		require.NoError(t, nc.Publish(prefix+".delta.decisions", d))
		k, err := kvsync.AppendKV(nil, &kvsync.KVBatch{Origin: "intruder#1", Replica: "", Seq: uint64(i + 1), SentAt: now, Reset: true})
		require.NoError(t, err)
		require.NoError(t, nc.Publish(prefix+".kv._", k))
		sent++
	}
	require.NoError(t, nc.Flush())
	// Every gateway receives every message.
	got := awaitCounter(t, c, "kvmesh_sync_messages_malformed_total", malformed, before+float64(3*sent)) - before
	refused := awaitCounter(t, c, "kvmesh_sync_kv_rejected_total", notOwner, notOwnerBefore+float64(3*n)) - notOwnerBefore
	return fmt.Sprintf("%d junk or seq-0 messages on %d subjects -> %.0f counted malformed over 3 gateways; %d KV resets from a non-owner -> %.0f refused not_owner",
		sent, len(subjects), got, n, refused)
}

// rewriteConfig writes the current config again (compare-and-set on its
// version) through gateway g0's admin API, retrying while raft has no
// leader, and returns the new version: raft has a leader and commits.
func rewriteConfig(t *R, c *cluster.Cluster) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl, err := config.Dial(c.Gateways()[0].Node.AdminAddr(), config.ClientOptions{Token: cluster.AdminToken})
	require.NoError(t, err)
	defer cl.Close()
	for {
		cur, err := cl.GetConfig(ctx)
		require.NoError(t, err)
		doc, err := json.Marshal(cur.Config)
		require.NoError(t, err)
		v, err := cl.SetConfigJSON(ctx, doc, &cur.Version)
		if err == nil {
			require.Greater(t, v, cur.Version)
			return v
		}
		require.Truef(t, errors.Is(err, config.ErrNoQuorum) || errors.Is(err, config.ErrVersionConflict), "config write: %v", err)
		require.NoError(t, ctx.Err(), "raft commits a valid write within 20 s: %v", err)
	}
}
