package config

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	require.NoError(t, c.Write(&m))
	return m.GetCounter().GetValue()
}

func (nd *testNode) rejected(t *testing.T, api, reason string) float64 {
	return counterValue(t, nd.store.metrics.adminRejected.WithLabelValues(api, reason))
}

// rawCodec sends a []byte request as it is (a malformed protobuf body)
// and discards the answer.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*v.(*[]byte))}, nil
}
func (rawCodec) Unmarshal(mem.BufferSlice, any) error { return nil }
func (rawCodec) Name() string                         { return "proto" }

// sendRaw writes b to addr, ends the write side and waits (bounded) for
// the server to close the connection.
func sendRaw(t *testing.T, addr string, b []byte) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer conn.Close()
	_, _ = conn.Write(b)
	_ = conn.(*net.TCPConn).CloseWrite()
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err = io.Copy(io.Discard, conn)
	var ne net.Error
	require.False(t, errors.As(err, &ne) && ne.Timeout(), "the server closes the connection")
}

// settingsFrame is an empty SETTINGS frame (length 0, type 4, stream 0).
var settingsFrame = []byte{0, 0, 0, 4, 0, 0, 0, 0, 0}

func TestPrefaceByteOK(t *testing.T) {
	good := append([]byte(http2Preface), settingsFrame...)
	for i, b := range good {
		require.True(t, prefaceByteOK(i, b), "byte %d", i)
	}
	require.False(t, prefaceByteOK(0, 'G'), "an HTTP/1 request")
	require.False(t, prefaceByteOK(len(http2Preface)+3, 0x0), "a DATA frame first")
	require.False(t, prefaceByteOK(len(http2Preface)+8, 1), "a SETTINGS frame on a stream")
}

// TestAdminRejectedInputCounted: every kind of bad input on the admin
// gRPC port and the admin HTTP API is refused and counted in
// kvmesh_config_admin_rejected_total; the node keeps serving and the config
// version does not move.
func TestAdminRejectedInputCounted(t *testing.T) {
	_, nd := singleNode(t, nil)
	ctx := ctxT(t, 20*time.Second)
	v0, err := nd.client(t, testToken).SetConfig(ctx, ptr(testConfig()), nil)
	require.NoError(t, err)

	// Raw junk, an HTTP/1 request, a cut preface, the magic followed by
	// something other than SETTINGS.
	for _, b := range [][]byte{
		bytes.Repeat([]byte{0xde, 0xad}, 300),
		[]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
		[]byte(http2Preface[:10]),
		append([]byte(http2Preface), 0, 0, 4, 0, 0, 0, 0, 0, 1, 'j', 'u', 'n', 'k'),
	} {
		sendRaw(t, nd.admin, b)
	}
	require.Eventually(t, func() bool { return nd.rejected(t, "grpc", RejectBadPreface) == 4 }, 5*time.Second, 5*time.Millisecond)
	// A probe that connects and leaves is not bad input.
	sendRaw(t, nd.admin, nil)
	// A valid preface and SETTINGS, then junk frames: gRPC answers with a
	// GOAWAY; this layer passes the preface, so nothing more is counted.
	sendRaw(t, nd.admin, append(append([]byte(http2Preface), settingsFrame...), bytes.Repeat([]byte{0xff}, 64)...))
	require.Equal(t, 4.0, nd.rejected(t, "grpc", RejectBadPreface))

	// Calls without or with a wrong token.
	for _, tok := range []string{"", "wrong"} {
		_, err := nd.client(t, tok).SetConfig(ctx, ptr(testConfig()), nil)
		require.ErrorIs(t, err, ErrUnauthenticated)
	}
	require.Equal(t, 2.0, nd.rejected(t, "grpc", "unauthenticated"))

	// Malformed protobuf bodies, with the right token.
	conn, err := grpc.NewClient(nd.admin, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	defer conn.Close()
	for _, b := range [][]byte{{0xff, 0xff, 0xff}, {0x0a, 0x7f, 'x'}, binary.AppendUvarint([]byte{0x12}, 1<<40)} {
		err := conn.Invoke(withToken(ctx), adminService+"SetConfig", &b, new(struct{}), grpc.ForceCodecV2(rawCodec{}))
		require.Error(t, err)
		require.NotEqual(t, codes.OK, status.Code(err))
	}
	require.Equal(t, 3.0, nd.rejected(t, "grpc", RejectMalformed))

	// Well-formed calls the store refuses: junk JSON, an invalid config, a
	// junk forwarded command.
	cl := nd.client(t, testToken)
	bad := testConfig()
	bad.Models["chat"] = ModelConfig{Replicas: []ReplicaConfig{{Name: "r0", URL: "ftp://nope"}}}
	_, err = cl.SetConfig(ctx, &bad, nil)
	require.ErrorIs(t, err, ErrInvalidConfig)
	_, err = cl.PatchConfig(ctx, []byte(`{"models":`), nil)
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Equal(t, 2.0, nd.rejected(t, "grpc", "invalid_config"))

	// The HTTP API.
	hs := httptest.NewServer(nd.srv.Handler())
	defer hs.Close()
	require.Equal(t, http.StatusUnauthorized, do(t, hs.URL, "", "PUT", "/admin/v1/config", `{}`, nil).code)
	require.Equal(t, http.StatusUnauthorized, do(t, hs.URL, "nope", "GET", "/admin/v1/config", ``, nil).code)
	require.Equal(t, http.StatusBadRequest, do(t, hs.URL, testToken, "PUT", "/admin/v1/config", `{"models":[`, nil).code)
	r := do(t, hs.URL, testToken, "PATCH", "/admin/v1/config", `{"models":{"chat":{"replicas":[{"name":"r0","url":"ftp://x"}]}}}`, nil)
	require.Equal(t, http.StatusBadRequest, r.code)
	require.Equal(t, "invalid_config", errCode(t, r))
	require.Equal(t, http.StatusBadRequest, do(t, hs.URL, testToken, "POST", "/admin/v1/models/chat/replicas", `{"name":1}`, nil).code)
	require.Equal(t, 2.0, nd.rejected(t, "http", "unauthenticated"))
	require.Positive(t, nd.rejected(t, "http", "invalid_config")+nd.rejected(t, "http", "bad_request"))

	require.Equal(t, v0, nd.store.Current().Version, "no bad input changed the config")
	v1, err := cl.AddReplica(ctx, "chat", ReplicaConfig{Name: "r9", URL: "http://127.0.0.1:8009"})
	require.NoError(t, err, "the node still takes a valid write")
	require.Greater(t, v1, v0)
}

func ptr[T any](v T) *T { return &v }

func withToken(ctx context.Context) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+testToken)
}

// TestRaftPortGarbageCounted: junk on the raft port (random bytes, an
// unknown RPC type, a valid type followed by junk, a truncated message,
// length prefixes of gigabytes) is counted in
// kvmesh_config_raft_transport_errors_total (kind decode or truncated) and
// changes nothing: the node stays leader and takes writes.
func TestRaftPortGarbageCounted(t *testing.T) {
	_, nd := singleNode(t, nil)
	addr := nd.store.RaftAddr()
	kinds := func() (decode, truncated float64) {
		return counterValue(t, nd.store.metrics.raftTransportErrors.WithLabelValues("decode")),
			counterValue(t, nd.store.metrics.raftTransportErrors.WithLabelValues("truncated"))
	}
	for _, c := range []struct {
		name string
		b    []byte
		kind string
	}{
		{"unknown rpc type", append([]byte{0x7f}, bytes.Repeat([]byte{0xab}, 100)...), "decode"},
		{"append entries, junk", []byte{0, 0xc1, 0xc1, 0xc1}, "decode"},
		{"request vote, junk", []byte{1, 0xc1}, "decode"},
		{"truncated header", []byte{0, 0x8f, 0xa4, 'T', 'e'}, "truncated"},
		{"type byte only", []byte{1}, "truncated"},
		{"huge string", []byte{0, 0x81, 0xdb, 0xff, 0xff, 0xff, 0xff, 'x'}, "truncated"},
		{"huge array", []byte{0, 0x81, 0xa7, 'E', 'n', 't', 'r', 'i', 'e', 's', 0xdd, 0xff, 0xff, 0xff, 0xff, 0x80}, "truncated"},
		{"huge map", []byte{2, 0xdf, 0x7f, 0xff, 0xff, 0xff, 0xa1, 'x'}, "truncated"},
	} {
		d0, t0 := kinds()
		sendRaw(t, addr, c.b)
		require.Eventually(t, func() bool {
			d, tr := kinds()
			if c.kind == "decode" {
				return d == d0+1 && tr == t0
			}
			return tr == t0+1 && d == d0
		}, 5*time.Second, 5*time.Millisecond, c.name)
	}
	// A connection that closes without sending anything is not counted.
	d0, t0 := kinds()
	sendRaw(t, addr, nil)
	require.True(t, nd.store.IsLeader())
	_, err := nd.client(t, testToken).SetConfig(ctxT(t, 10*time.Second), ptr(testConfig()), nil)
	require.NoError(t, err, "raft still commits")
	d, tr := kinds()
	require.Equal(t, d0, d)
	require.Equal(t, t0, tr)
}
