package node

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/sync/trust"
)

// TestClusterKeyRequired: a cluster-mode gateway without a key and
// without Insecure does not start, and says how to make a key; a key from
// the file, the environment or the embedder's field is taken; Insecure
// starts, moves default all-interface binds to loopback and exports
// kvmesh_insecure 1.
func TestClusterKeyRequired(t *testing.T) {
	cfg := gwConfig("gw", t.TempDir(), nil, 1, rc("a", "http://127.0.0.1:1"))
	cfg.Cluster.ClusterKey = ""
	t.Setenv(ClusterKeyEnv, "")
	_, err := New(cfg, nil)
	require.ErrorIs(t, err, ErrNoClusterKey)
	for _, want := range []string{"kvmesh keygen", "--cluster-key-file", "KVMESH_CLUSTER_KEY", "--insecure"} {
		assert.Contains(t, err.Error(), want)
	}

	key, err := trust.Generate()
	require.NoError(t, err)
	file := filepath.Join(t.TempDir(), "cluster.key")
	require.NoError(t, os.WriteFile(file, []byte(key+"\n"), 0o600))
	withFile := cfg
	withFile.Cluster.ClusterKeyFile = file
	n, err := New(withFile, nil)
	require.NoError(t, err)
	assert.NotNil(t, n.cl.ring)
	assert.Equal(t, 0.0, gaugeValue(t, n, "kvmesh_insecure"))

	t.Setenv(ClusterKeyEnv, key)
	n, err = New(cfg, nil)
	require.NoError(t, err)
	assert.NotNil(t, n.cl.ring, "the key from KVMESH_CLUSTER_KEY")

	bad := cfg
	bad.Cluster.ClusterKey = "not a key"
	_, err = New(bad, nil)
	require.ErrorIs(t, err, ErrInvalidConfig)

	t.Setenv(ClusterKeyEnv, "")
	insecure := cfg
	insecure.Cluster.Insecure = true
	n, err = New(insecure, nil)
	require.NoError(t, err)
	assert.Equal(t, 1.0, gaugeValue(t, n, "kvmesh_insecure"))

	standalone := testConfig()
	standalone.Models = cfg.Models
	n, err = New(standalone, nil)
	require.NoError(t, err)
	assert.Equal(t, 0.0, gaugeValue(t, n, "kvmesh_insecure"))

	d := DefaultClusterConfig()
	moved := d.insecureBinds()
	assert.ElementsMatch(t, []string{"gossip_addr", "peer_addr", "raft_addr", "nats_cluster_addr"}, moved)
	for _, a := range []string{d.GossipAddr, d.PeerAddr, d.RaftAddr, d.NATSClusterAddr, d.NATSClientAddr} {
		assert.True(t, strings.HasPrefix(a, "127.0.0.1:"), a)
	}
	named := DefaultClusterConfig()
	named.RaftAddr = "0.0.0.0:9999" // the operator's explicit choice stays
	named.insecureBinds()
	assert.Equal(t, "0.0.0.0:9999", named.RaftAddr)
}

// TestInsecureClusterRuns: an insecure single gateway starts, logs and
// serves; its cluster ports bound where the config said.
func TestInsecureClusterRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("starts raft, memberlist and NATS: skipped with -short")
	}
	e := newFakeEngine(t, "a")
	cfg := gwConfig("solo", t.TempDir(), nil, 1, rc("a", e.url()))
	cfg.Cluster.ClusterKey = ""
	cfg.Cluster.Insecure = true
	t.Setenv(ClusterKeyEnv, "")
	n, stop := startGateway(t, cfg)
	waitReady(t, n)
	assert.Equal(t, 1.0, gaugeValue(t, n, "kvmesh_insecure"))
	stop()
}
