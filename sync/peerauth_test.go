package sync

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"

	peerv1 "github.com/kvmesh/kvmesh/proto/peer/v1"
	"github.com/kvmesh/kvmesh/sync/config"
)

// testCert writes a self-signed certificate valid for 127.0.0.1 (it is
// its own CA, for server and client use) and its key under a new
// directory, and returns the files.
func testCert(t *testing.T) config.TLSFiles {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: "kvmesh sync test"},
		NotBefore:    time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true,
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	kb, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	dir := t.TempDir()
	f := config.TLSFiles{CertFile: filepath.Join(dir, "cert.pem"), KeyFile: filepath.Join(dir, "key.pem"),
		CAFile: filepath.Join(dir, "cert.pem")}
	require.NoError(t, os.WriteFile(f.CertFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	require.NoError(t, os.WriteFile(f.KeyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kb}), 0o600))
	return f
}

// TestPeerServiceTokenAndTLS: gateways with a token and mutual TLS
// bootstrap from each other; pulls without the token, with another one,
// in plaintext or with a certificate of another CA are refused.
func TestPeerServiceTokenAndTLS(t *testing.T) {
	certs, foreign := testCert(t), testCert(t)
	secure := func(c *Config) { c.PeerToken, c.PeerTLS = "s3cret", certs }
	gws := startCluster(t, 2, nil, secure)
	require.Equal(t, 1.0, metricValue(t, gws[1].reg, "kvmesh_sync_snapshot_pulls_total", map[string]string{"result": "ok"}),
		"the joiner bootstraps over TLS with the token")
	addr := gws[0].c.PeerAddr()

	pull := func(mutate func(*Config)) error {
		g := newGW(t, "puller", nil, mutate)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		data, err := g.c.pullSnapshot(ctx, addr)
		if err == nil {
			require.NotEmpty(t, data)
		}
		return err
	}
	require.NoError(t, pull(secure))
	require.ErrorIs(t, pull(func(c *Config) { c.PeerTLS = certs }), ErrUnauthenticated, "no token")
	require.ErrorIs(t, pull(func(c *Config) { c.PeerToken, c.PeerTLS = "guess", certs }), ErrUnauthenticated, "wrong token")
	require.Equal(t, 2.0, metricValue(t, gws[0].reg, "kvmesh_sync_peer_unauthenticated_total", nil))

	err := pull(func(c *Config) { c.PeerToken = "s3cret" })
	require.Error(t, err, "plaintext client against a TLS server")
	require.NotErrorIs(t, err, ErrUnauthenticated)
	require.Error(t, pull(func(c *Config) { c.PeerToken, c.PeerTLS = "s3cret", foreign }), "certificate of another CA")
	rejected := func(reason string) float64 {
		return metricValue(t, gws[0].reg, "kvmesh_sync_peer_rejected_total", map[string]string{"reason": reason})
	}
	require.Equal(t, 2.0, rejected(config.RejectUnauthenticated))
	require.Eventually(t, func() bool { return rejected(config.RejectHandshake) >= 2 }, converge, 5*time.Millisecond,
		"the plaintext client and the foreign certificate fail the server's handshake")
}

// TestPeerServiceBadInputCounted: junk connections and undecodable
// snapshot requests on the peer port are refused and counted in
// kvmesh_sync_peer_rejected_total; the peer still serves snapshots.
func TestPeerServiceBadInputCounted(t *testing.T) {
	plain := func(c *Config) { c.Trust, c.Insecure, c.PeerToken = nil, true, "s3cret" }
	gws := startCluster(t, 1, nil, plain)
	addr := gws[0].c.PeerAddr()
	rejected := func(reason string) float64 {
		return metricValue(t, gws[0].reg, "kvmesh_sync_peer_rejected_total", map[string]string{"reason": reason})
	}
	for _, b := range [][]byte{
		[]byte("junk junk junk junk junk junk junk junk"),
		[]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + "not a settings frame"),
	} {
		conn, err := net.Dial("tcp", addr)
		require.NoError(t, err)
		// The server may close (or reset) the connection before reading
		// it all: write and half-close errors are expected.
		_, _ = conn.Write(b)
		_ = conn.(*net.TCPConn).CloseWrite()
		require.NoError(t, conn.SetReadDeadline(time.Now().Add(5*time.Second)))
		_, err = io.Copy(io.Discard, conn)
		require.False(t, os.IsTimeout(err), "the server closes the connection")
		require.NoError(t, conn.Close())
	}
	require.Eventually(t, func() bool { return rejected(config.RejectBadPreface) == 2 }, converge, 5*time.Millisecond)

	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithPerRPCCredentials(peerBearer("s3cret")))
	require.NoError(t, err)
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	desc := &grpc.StreamDesc{StreamName: "Snapshot", ServerStreams: true}
	for _, b := range [][]byte{{0xff, 0xff}, {0x0a, 0x40, 'x'}} {
		st, err := conn.NewStream(ctx, desc, peerv1.Peer_Snapshot_FullMethodName, grpc.ForceCodecV2(rawCodec{}))
		require.NoError(t, err)
		require.NoError(t, st.SendMsg(&b))
		require.NoError(t, st.CloseSend())
		require.Error(t, st.RecvMsg(new([]byte)), "an undecodable request is refused")
	}
	require.Equal(t, 2.0, rejected(config.RejectMalformed))
	g := newGW(t, "puller", nil, plain)
	data, err := g.c.pullSnapshot(ctx, addr)
	require.NoError(t, err, "the peer still serves snapshots")
	require.NotEmpty(t, data)
}

// rawCodec sends a []byte message as it is (a malformed protobuf body).
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*v.(*[]byte))}, nil
}
func (rawCodec) Unmarshal(mem.BufferSlice, any) error { return nil }
func (rawCodec) Name() string                         { return "proto" }

func TestPeerTLSConfigErrors(t *testing.T) {
	cfg := LocalConfig("g")
	cfg.Insecure = true
	cfg.PeerTLS = config.TLSFiles{CAFile: "ca.pem"}
	require.ErrorIs(t, cfg.Validate(), ErrInvalidConfig, "TLS without a certificate")

	cfg.PeerTLS = config.TLSFiles{CertFile: filepath.Join(t.TempDir(), "missing.pem"), KeyFile: "missing.key"}
	require.NoError(t, cfg.Validate())
	_, err := New(cfg, Deps{Index: newIndex(t), Replicas: newReplicaTable(testReplicas)})
	require.ErrorIs(t, err, ErrInvalidConfig, "unreadable certificate")
}
