package main

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/node"
)

func TestServeDiscoveryAndEPPFlags(t *testing.T) {
	cfg, err := parseServe(t, strings.Fields("--model M --discovery dns:vllm.inference.svc.cluster.local:8000 "+
		"--discovery-kv tcp://{ip}:5557 --discovery-replay tcp://{ip}:5558 --epp-addr :9002 --epp-fallbacks 1")...)
	require.NoError(t, err)
	assert.Equal(t, node.DiscoveryConfig{Source: "dns:vllm.inference.svc.cluster.local:8000", Model: "M",
		KV: "tcp://{ip}:5557", Replay: "tcp://{ip}:5558"}, cfg.Discovery)
	require.Len(t, cfg.Models, 1)
	assert.Equal(t, "M", cfg.Models[0].Name)
	assert.Empty(t, cfg.Models[0].Replicas, "discovery owns the replicas")
	assert.Equal(t, node.EPPConfig{Addr: ":9002", Fallbacks: 1}, cfg.EPP)

	cfg, err = parseServe(t, strings.Fields("--model M --discovery kubernetes --k8s-inference-pool qwen --k8s-namespace inference")...)
	require.NoError(t, err)
	assert.Equal(t, node.KubernetesDiscovery{Namespace: "inference", InferencePool: "qwen"}, cfg.Discovery.Kubernetes)

	for _, bad := range []string{
		"--model M --discovery kubernetes",                                             // no pool, no selector
		"--model M --discovery kubernetes --k8s-selector app=vllm",                     // no port
		"--model M --discovery dns:vllm",                                               // no port
		"--model M --discovery dns:vllm:8000 --discovery-kv tcp://10.0.0.1:5557",       // every engine would share it
		"--model M --replica a=http://127.0.0.1:1 --epp-addr :9002 --epp-fallbacks -1", // out of range
	} {
		_, err := parseServe(t, strings.Fields(bad)...)
		assert.ErrorIs(t, err, node.ErrInvalidConfig, bad)
	}
}

// TestIndexAndPeerLoadFlags: the index TTLs and the peers' load delay,
// settable in the YAML file and the cluster document, have flags too.
func TestIndexAndPeerLoadFlags(t *testing.T) {
	cfg, err := parseServe(t, strings.Fields("--model M --replica a=http://127.0.0.1:1 --history-ttl 1h --speculative-ttl 5s --peer-load-delay-seconds 0.3")...)
	require.NoError(t, err)
	assert.Equal(t, time.Hour, cfg.HistoryTTL)
	assert.Equal(t, 5*time.Second, cfg.SpeculativeTTL)
	assert.Equal(t, 0.3, cfg.Route.PeerLoadDelaySeconds)
}
