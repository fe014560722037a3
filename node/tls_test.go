package node

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/sync/config"
)

// testPKI writes a CA and one certificate for 127.0.0.1 (server and
// client use) into dir and returns the files.
func testPKI(t testing.TB, dir string) config.TLSFiles {
	t.Helper()
	write := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600))
		return p
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvmesh test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true,
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	ca, err := x509.ParseCertificate(caDER)
	require.NoError(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "gateway"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	require.NoError(t, err)
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	return config.TLSFiles{CertFile: write("gw.pem", "CERTIFICATE", der), KeyFile: write("gw-key.pem", "PRIVATE KEY", keyDER),
		CAFile: write("ca.pem", "CERTIFICATE", caDER)}
}

// counterValue sums counter name in n's registry over the series whose
// labels include want (0 when absent).
func counterValue(t testing.TB, n *Node, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := n.Registry().Gather()
	require.NoError(t, err)
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for k, v := range want {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == k && lp.GetValue() == v {
						found = true
					}
				}
				if !found {
					continue series
				}
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}

// TestClusterTLS runs a two-voter cluster with mutual TLS on raft, the
// admin gRPC API and the peer snapshot service: the joining gateway
// bootstraps its index from the first over TLS with the admin token, and
// a write through the follower's HTTP admin API is forwarded to the
// leader over TLS and applied on both.
func TestClusterTLS(t *testing.T) {
	if testing.Short() {
		t.Skip("starts raft, memberlist and NATS: skipped with -short")
	}
	pki := testPKI(t, t.TempDir())
	e := newFakeEngine(t, "a")
	cfgA := gwConfig("gw-a", t.TempDir(), nil, 2, rc("a", e.url()))
	cfgA.Cluster.AdminTLS, cfgA.Cluster.RaftTLS, cfgA.Cluster.PeerTLS = pki, pki, pki
	a, _ := startGateway(t, cfgA)
	cfgB := gwConfig("gw-b", t.TempDir(), []string{a.Cluster().GossipAddr()}, 2, rc("a", e.url()))
	cfgB.Cluster.AdminTLS, cfgB.Cluster.RaftTLS, cfgB.Cluster.PeerTLS = pki, pki, pki
	b, _ := startGateway(t, cfgB)
	waitReady(t, a, b)
	// b joined a live a: its bootstrap pulled a's snapshot over mutual TLS,
	// authenticated with the admin token.
	assert.GreaterOrEqual(t, counterValue(t, b, "kvmesh_sync_snapshot_pulls_total", map[string]string{"result": "ok"}), 1.0)
	assert.Zero(t, counterValue(t, b, "kvmesh_sync_snapshot_pulls_total", map[string]string{"result": "error"}))
	assert.Zero(t, counterValue(t, a, "kvmesh_sync_peer_unauthenticated_total", nil))
	follower := a
	if a.ConfigStore().IsLeader() {
		follower = b
	}
	code, out := admin(t, follower, http.MethodPatch, "/admin/v1/config", `{"strategy":"random"}`)
	require.Equal(t, http.StatusOK, code, out)
	for _, g := range []*Node{a, b} {
		require.Eventually(t, func() bool { return g.tbl.Load().strategy == "random" }, 10*time.Second, time.Millisecond)
	}

	// The admin gRPC API refuses plaintext and serves TLS clients.
	plain, err := config.Dial(follower.AdminAddr(), config.ClientOptions{Token: testToken})
	require.NoError(t, err)
	defer plain.Close()
	_, err = plain.GetConfig(t.Context())
	require.Error(t, err)
	tc, err := pki.ClientConfig()
	require.NoError(t, err)
	secure, err := config.Dial(follower.AdminAddr(), config.ClientOptions{Token: testToken, TLS: tc})
	require.NoError(t, err)
	defer secure.Close()
	v, err := secure.GetConfig(t.Context())
	require.NoError(t, err)
	require.Equal(t, "random", v.Config.Strategy)
}
