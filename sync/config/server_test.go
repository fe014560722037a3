package config

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/proto/adminpb"
)

// fakeProviders stand in for node's index, explainer and snapshotter.
type fakeProviders struct{}

func (fakeProviders) IndexStats(context.Context) ([]IndexStat, error) {
	var st index.Stats
	st.Entries[index.History] = 7
	st.Entries[index.Confirmed] = 3
	st.Blocks = 5
	return []IndexStat{{Name: "chat", Mode: "hybrid", Capacity: 100, Stats: st}}, nil
}

func (fakeProviders) ExplainRoute(_ context.Context, req ExplainRequest) ([]byte, error) {
	if req.Model != "chat" && len(req.Body) == 0 {
		return nil, ErrNotFound
	}
	return json.Marshal(map[string]string{"model": req.Model, "pick": "r1", "strategy": req.Strategy})
}

func (fakeProviders) WriteIndexSnapshot(_ context.Context, w io.Writer) error {
	_, err := w.Write(bytes.Repeat([]byte("kvmesh"), 1000)) // 6000 bytes: several chunks
	return err
}

func singleNode(t *testing.T, tune func(*ServerConfig)) (*testCluster, *testNode) {
	c := &testCluster{expect: 1, srvTune: func(sc *ServerConfig) {
		sc.Index, sc.Explainer, sc.Snapshotter = fakeProviders{}, fakeProviders{}, fakeProviders{}
		sc.SnapshotChunkBytes = 1024
		if tune != nil {
			tune(sc)
		}
	}}
	newClusterWith(t, c, 1)
	return c, c.waitLeader(10 * time.Second)
}

func TestAuthGRPC(t *testing.T) {
	_, nd := singleNode(t, nil)
	cfg := testConfig()
	for name, tok := range map[string]string{"no token": "", "wrong token": "guess", "prefix": testToken[:4]} {
		cl := nd.client(t, tok)
		_, err := cl.SetConfig(ctxT(t, 5*time.Second), &cfg, nil)
		require.ErrorIs(t, err, ErrUnauthenticated, name)
		require.Equal(t, codes.Unauthenticated, status.Code(err), name)
		_, err = cl.GetConfig(ctxT(t, 5*time.Second))
		require.ErrorIs(t, err, ErrUnauthenticated, name)
		_, err = cl.Snapshot(ctxT(t, 5*time.Second), io.Discard)
		require.ErrorIs(t, err, ErrUnauthenticated, name+": streams are checked too")
	}
	require.Zero(t, nd.store.Current().Version, "nothing was written")
	v, err := nd.client(t, testToken).SetConfig(ctxT(t, 5*time.Second), &cfg, nil)
	require.NoError(t, err)
	require.NotZero(t, v)
}

func TestAuthOpenReads(t *testing.T) {
	_, nd := singleNode(t, func(sc *ServerConfig) { sc.AllowUnauthenticatedReads = true })
	cl := nd.client(t, "")
	_, err := cl.GetConfig(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	_, err = cl.Members(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	_, err = cl.PatchConfig(ctxT(t, 5*time.Second), []byte(`{"strategy":"cost"}`), nil)
	require.ErrorIs(t, err, ErrUnauthenticated, "writes always need the token")
	_, err = cl.API().Forward(ctxT(t, 5*time.Second), &adminpb.ForwardRequest{Command: []byte{1}})
	require.Equal(t, codes.Unauthenticated, status.Code(err), "forwarding is a write")

	h := httptest.NewServer(nd.srv.Handler())
	defer h.Close()
	resp := do(t, h.URL, "", "GET", "/admin/v1/config", "", nil)
	require.Equal(t, http.StatusOK, resp.code)
	resp = do(t, h.URL, "", "PUT", "/admin/v1/config", `{}`, nil)
	require.Equal(t, http.StatusUnauthorized, resp.code)
}

func TestServerConfigNeedsToken(t *testing.T) {
	sc := ServerConfig{}
	require.ErrorIs(t, sc.Validate(), ErrInvalidStoreConfig)
}

type httpResp struct {
	code int
	hdr  http.Header
	body []byte
}

func do(t *testing.T, base, token, method, path, body string, hdr map[string]string) httpResp {
	t.Helper()
	req, err := http.NewRequestWithContext(ctxT(t, 10*time.Second), method, base+path, strings.NewReader(body))
	require.NoError(t, err)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return httpResp{code: resp.StatusCode, hdr: resp.Header, body: b}
}

func errCode(t *testing.T, r httpResp) string {
	t.Helper()
	var e struct {
		Error struct{ Message, Type, Code string } `json:"error"`
	}
	require.NoError(t, json.Unmarshal(r.body, &e), string(r.body))
	return e.Error.Code
}

func TestHTTPAPI(t *testing.T) {
	_, nd := singleNode(t, nil)
	h := httptest.NewServer(nd.srv.Handler())
	defer h.Close()

	r := do(t, h.URL, "", "GET", "/admin/v1/config", "", nil)
	require.Equal(t, http.StatusUnauthorized, r.code)
	require.Equal(t, "unauthenticated", errCode(t, r))
	r = do(t, h.URL, "", "PUT", "/admin/v1/config", `{}`, nil)
	require.Equal(t, http.StatusUnauthorized, r.code)

	cfg := testConfig()
	doc, _ := json.Marshal(&cfg)
	r = do(t, h.URL, testToken, "PUT", "/admin/v1/config", string(doc), map[string]string{"If-Match": `"0"`})
	require.Equal(t, http.StatusOK, r.code, string(r.body))
	var ver struct{ Version uint64 }
	require.NoError(t, json.Unmarshal(r.body, &ver))
	require.NotZero(t, ver.Version)

	r = do(t, h.URL, testToken, "GET", "/admin/v1/config", "", nil)
	require.Equal(t, http.StatusOK, r.code)
	require.Equal(t, `"`+itoa64(ver.Version)+`"`, r.hdr.Get("ETag"))
	var got Versioned
	require.NoError(t, json.Unmarshal(r.body, &got))
	require.Equal(t, cfg, *got.Config)

	// Stale If-Match: 409 version_conflict.
	r = do(t, h.URL, testToken, "PATCH", "/admin/v1/config", `{"strategy":"cost"}`, map[string]string{"If-Match": `"` + itoa64(ver.Version-1) + `"`})
	require.Equal(t, http.StatusConflict, r.code)
	require.Equal(t, "version_conflict", errCode(t, r))
	// Invalid document: 400 with the field named.
	r = do(t, h.URL, testToken, "PATCH", "/admin/v1/config", `{"models":{"chat":{"replicas":[{"name":"x","url":"mailto:a"}]}}}`, nil)
	require.Equal(t, http.StatusBadRequest, r.code)
	require.Equal(t, "invalid_config", errCode(t, r))
	require.Contains(t, string(r.body), `models[\"chat\"].replicas[0].url`)
	r = do(t, h.URL, testToken, "PUT", "/admin/v1/config", `{"bogus":1}`, nil)
	require.Equal(t, http.StatusBadRequest, r.code)

	r = do(t, h.URL, testToken, "POST", "/admin/v1/models/chat/replicas", `{"name":"r5","url":"http://127.0.0.1:8005"}`, nil)
	require.Equal(t, http.StatusOK, r.code, string(r.body))
	require.Len(t, nd.store.Current().Config.Models["chat"].Replicas, 3)
	r = do(t, h.URL, testToken, "DELETE", "/admin/v1/models/chat/replicas/r5", "", nil)
	require.Equal(t, http.StatusOK, r.code)
	r = do(t, h.URL, testToken, "DELETE", "/admin/v1/models/chat/replicas/r5", "", nil)
	require.Equal(t, http.StatusNotFound, r.code)
	require.Equal(t, "not_found", errCode(t, r))
	r = do(t, h.URL, testToken, "POST", "/admin/v1/models/nope/replicas", `{"name":"r6","url":"http://h:1"}`, nil)
	require.Equal(t, http.StatusNotFound, r.code)

	r = do(t, h.URL, testToken, "GET", "/admin/v1/members", "", nil)
	require.Equal(t, http.StatusOK, r.code)
	require.Contains(t, string(r.body), `"suffrage": "voter"`)
	require.Contains(t, string(r.body), `"leader": true`)
	r = do(t, h.URL, testToken, "GET", "/admin/v1/status", "", nil)
	require.Contains(t, string(r.body), `"state": "Leader"`)
	r = do(t, h.URL, testToken, "GET", "/admin/v1/index/stats", "", nil)
	require.Equal(t, http.StatusOK, r.code)
	require.Contains(t, string(r.body), `"history_entries": 7`)
	r = do(t, h.URL, testToken, "GET", "/admin/v1/explain?model=chat&prompt=hi&strategy=cost", "", nil)
	require.Equal(t, http.StatusOK, r.code)
	require.JSONEq(t, `{"model":"chat","pick":"r1","strategy":"cost"}`, string(r.body))
	r = do(t, h.URL, testToken, "GET", "/admin/v1/explain?model=other", "", nil)
	require.Equal(t, http.StatusNotFound, r.code)
	r = do(t, h.URL, testToken, "GET", "/admin/v1/snapshot", "", nil)
	require.Equal(t, 6000, len(r.body))
}

func itoa64(v uint64) string { b, _ := json.Marshal(v); return string(b) }

func TestGRPCDiagnostics(t *testing.T) {
	_, nd := singleNode(t, nil)
	cl := nd.client(t, testToken)
	st, err := cl.IndexStats(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	require.Len(t, st.Indexes, 1)
	require.Equal(t, int64(3), st.Indexes[0].ConfirmedEntries)
	rep, err := cl.ExplainRoute(ctxT(t, 5*time.Second), &adminpb.ExplainRouteRequest{Model: "chat", Prompt: "hello"})
	require.NoError(t, err)
	require.Contains(t, string(rep), `"pick":"r1"`)
	_, err = cl.ExplainRoute(ctxT(t, 5*time.Second), &adminpb.ExplainRouteRequest{Model: "gone"})
	require.ErrorIs(t, err, ErrNotFound)
	var buf bytes.Buffer
	n, err := cl.Snapshot(ctxT(t, 5*time.Second), &buf)
	require.NoError(t, err)
	require.Equal(t, int64(6000), n)
	require.Equal(t, bytes.Repeat([]byte("kvmesh"), 1000), buf.Bytes())
	ms, err := cl.Members(ctxT(t, 5*time.Second))
	require.NoError(t, err)
	require.Equal(t, nd.id, ms.LeaderId)
	require.Equal(t, adminpb.Suffrage_SUFFRAGE_VOTER, ms.Members[0].Suffrage)
}

func TestDiagnosticsNotWired(t *testing.T) {
	c := &testCluster{expect: 1}
	newClusterWith(t, c, 1)
	nd := c.waitLeader(10 * time.Second)
	cl := nd.client(t, testToken)
	_, err := cl.IndexStats(ctxT(t, 5*time.Second))
	require.ErrorIs(t, err, ErrUnavailable)
	_, err = cl.Snapshot(ctxT(t, 5*time.Second), io.Discard)
	require.ErrorIs(t, err, ErrUnavailable)
}

// writeSelfSigned writes a self-signed certificate for 127.0.0.1 (its own
// CA) and its key into dir.
func writeSelfSigned(t *testing.T, dir string) TLSFiles {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "kvmesh-test"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	f := TLSFiles{CertFile: filepath.Join(dir, "cert.pem"), KeyFile: filepath.Join(dir, "key.pem"), CAFile: filepath.Join(dir, "cert.pem")}
	require.NoError(t, os.WriteFile(f.CertFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	require.NoError(t, os.WriteFile(f.KeyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600))
	return f
}

func TestTLSCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("TLS cluster; run without -short")
	}
	files := writeSelfSigned(t, t.TempDir())
	cli, err := files.ClientConfig()
	require.NoError(t, err)
	c := &testCluster{expect: 3, grpcTLS: files, tune: func(sc *StoreConfig) {
		steadyRaft(sc) // the write must commit in one go
		sc.RaftTLS = files
		sc.Forward.TLS = cli
	}}
	newClusterWith(t, c, 3)
	c.waitLeader(10 * time.Second)
	f := c.follower()

	tcl, err := Dial(f.admin, ClientOptions{Token: testToken, TLS: cli.Clone()})
	require.NoError(t, err)
	defer tcl.Close()
	cfg := testConfig()
	v, err := tcl.SetConfig(ctxT(t, 5*time.Second), &cfg, nil)
	require.NoError(t, err, "write over TLS gRPC, forwarded over TLS gRPC, replicated over TLS raft")
	c.waitVersion(v, c.nodes...)

	// A plaintext client cannot talk to the TLS admin port.
	plain := f.client(t, testToken)
	_, err = plain.GetConfig(ctxT(t, 2*time.Second))
	require.Error(t, err)
}
