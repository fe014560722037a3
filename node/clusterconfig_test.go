package node

import (
	"encoding/base64"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/sync/config"
)

func TestClusterConfigYAML(t *testing.T) {
	cfg, err := ParseConfigYAML([]byte(`
models: [{name: m, replicas: [{name: a, url: "http://127.0.0.1:1", kv: "tcp://127.0.0.1:5557"}]}]
cluster:
  enabled: true
  name: prod-1
  node_id: gw-1
  join: ["10.0.0.1:7946"]
  data_dir: /var/lib/kvmesh
  bootstrap_expect: 5
  admin_token_file: /etc/kvmesh/token
  raft_tls: {cert_file: c.pem, key_file: k.pem, ca_file: ca.pem}
  peer_tls: {cert_file: pc.pem, key_file: pk.pem, ca_file: pca.pem}
  peer_tls_server_name: gateways.internal
`), DefaultConfig())
	require.NoError(t, err)
	require.NoError(t, cfg.Validate())
	c := cfg.Cluster
	assert.True(t, c.Active())
	assert.Equal(t, "prod-1", c.Name)
	assert.Equal(t, []string{"10.0.0.1:7946"}, c.Join)
	assert.Equal(t, 5, c.BootstrapExpect)
	assert.Equal(t, "0.0.0.0:7946", c.GossipAddr, "defaults kept for absent keys")
	assert.Equal(t, "ca.pem", c.RaftTLS.CAFile)
	kc, err := c.syncConfig("gw-1")
	require.NoError(t, err)
	assert.Equal(t, config.TLSFiles{CertFile: "pc.pem", KeyFile: "pk.pem", CAFile: "pca.pem"}, kc.PeerTLS)
	assert.Equal(t, "gateways.internal", kc.PeerTLSServerName)
	sc := c.storeConfig()
	assert.NotEmpty(t, sc.RaftAdvertiseAddr, "an unspecified raft host is advertised with a usable one")
	assert.NotContains(t, sc.RaftAdvertiseAddr, "0.0.0.0")
	c.AdvertiseAddr = "10.1.2.3:7946"
	assert.Equal(t, "10.1.2.3:7949", c.storeConfig().RaftAdvertiseAddr)
	assert.Equal(t, 5, sc.BootstrapExpect)
}

func TestClusterConfigValidate(t *testing.T) {
	base := testConfig()
	base.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", "http://127.0.0.1:1")}}}
	require.NoError(t, base.Validate())

	c := base
	c.Cluster.Name = "bad name" // not validated while cluster mode is off
	require.NoError(t, c.Validate())
	c.Cluster.Enabled = true
	c.Cluster.BootstrapExpect = 0
	c.Cluster.DataDir = ""
	err := c.Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	for _, f := range []string{"cluster.name", "cluster.bootstrap_expect", "cluster.data_dir"} {
		assert.ErrorContains(t, err, f)
	}
	c.Cluster.NoSync = true
	require.NoError(t, c.Validate(), "--no-sync: the cluster section is not used")
}

func TestClusterSecrets(t *testing.T) {
	cfg := testConfig()
	cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", "http://127.0.0.1:1")}}}
	cfg.Cluster.Enabled = true
	cfg.Cluster.NodeID = "gw"
	cfg.Cluster.DataDir = t.TempDir()
	t.Setenv(config.TokenEnv, "")
	t.Setenv(GossipKeyEnv, "")
	cfg.Cluster.Insecure = true
	_, err := New(cfg, nil)
	require.ErrorIs(t, err, ErrInvalidConfig, "cluster mode refuses to run without an admin token")

	file := filepath.Join(t.TempDir(), "token")
	require.NoError(t, os.WriteFile(file, []byte("from-file\n"), 0o600))
	cfg.Cluster.AdminTokenFile = file
	tok, err := cfg.Cluster.adminToken()
	require.NoError(t, err)
	assert.Equal(t, "from-file", tok)
	t.Setenv(config.TokenEnv, "from-env")
	tok, _ = cfg.Cluster.adminToken()
	assert.Equal(t, "from-env", tok, "the environment wins over the file")

	key, err := cfg.Cluster.gossipKey()
	require.NoError(t, err)
	assert.Nil(t, key, "no key: gossip unencrypted")
	t.Setenv(GossipKeyEnv, base64.StdEncoding.EncodeToString([]byte("0123456789abcdef")))
	key, err = cfg.Cluster.gossipKey()
	require.NoError(t, err)
	assert.Len(t, key, 16)
	t.Setenv(GossipKeyEnv, base64.StdEncoding.EncodeToString([]byte("short")))
	_, err = cfg.Cluster.gossipKey()
	assert.ErrorIs(t, err, ErrInvalidConfig)
	_, err = New(cfg, nil)
	assert.ErrorIs(t, err, ErrInvalidConfig, "a bad key fails New, not Start")
}

func TestRoutingDocumentRoundTrip(t *testing.T) {
	cfg := testConfig()
	cfg.Strategy = "cost"
	cfg.IndexMode = "hybrid"
	cfg.Models = []ModelConfig{
		{Name: "m2", IndexMode: "history", Replicas: []ReplicaConfig{rc("z", "http://127.0.0.1:2")}},
		{Name: "m1", Strategy: "random", Adapters: []string{"lora1"}, Tokenizer: "hf:/models/m1", Replicas: []ReplicaConfig{
			{Name: "a", URL: "http://127.0.0.1:1", KVEndpoint: "tcp://127.0.0.1:5557", ReplayEndpoint: "tcp://127.0.0.1:5558"}}},
	}
	doc, err := routingDocument(&cfg)
	require.NoError(t, err)
	spec := specFromDocument(9, &doc)
	assert.EqualValues(t, 9, spec.version)
	assert.Equal(t, "cost", spec.strategy)
	assert.Equal(t, "hybrid", spec.mode)
	assert.Equal(t, cfg.Route, spec.route)
	require.Len(t, spec.models, 2)
	assert.Equal(t, cfg.Models[1], spec.models[0], "models in name order")
	assert.Equal(t, cfg.Models[0], spec.models[1])
}
