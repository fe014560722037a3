package sync

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

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
}

func TestPeerTLSConfigErrors(t *testing.T) {
	cfg := LocalConfig("g")
	cfg.PeerTLS = config.TLSFiles{CAFile: "ca.pem"}
	require.ErrorIs(t, cfg.Validate(), ErrInvalidConfig, "TLS without a certificate")

	cfg.PeerTLS = config.TLSFiles{CertFile: filepath.Join(t.TempDir(), "missing.pem"), KeyFile: "missing.key"}
	require.NoError(t, cfg.Validate())
	_, err := New(cfg, Deps{Index: newIndex(t), Replicas: NewReplicaTable(testReplicas)})
	require.ErrorIs(t, err, ErrInvalidConfig, "unreadable certificate")
}
