package node

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/discovery"
	"github.com/kvmesh/kvmesh/discovery/dnstest"
	"github.com/kvmesh/kvmesh/internal/freeport"
)

// TestDNSDiscoveryFollowsPods runs two simulated engines on their own
// loopback IPs (same HTTP, KV-event and replay ports, as pods of one
// Deployment) behind a headless-Service-like DNS name. An engine added to
// the records joins the pool, with its KV events subscribed from the
// template, within 2 s; an engine removed from them leaves the pool
// within 2 s while its in-flight stream completes.
func TestDNSDiscoveryFollowsPods(t *testing.T) {
	ipA, ipB := "127.0.0.2", "127.0.0.3"
	ports := freeport.Ports(t, 3, ipA, ipB)
	http_, kv, replay := ports[0], ports[1], ports[2]
	engine := func(ip string, speed float64) *sim.Server {
		return startSimWith(t, func(c *sim.Config) {
			c.Host, c.Port = ip, http_
			c.Speed = speed
			c.KVEvents.EnableKVCacheEvents = true
			c.KVEvents.Endpoint = fmt.Sprintf("tcp://%s:%d", ip, kv)
			c.KVEvents.ReplayEndpoint = fmt.Sprintf("tcp://%s:%d", ip, replay)
		})
	}
	// b decodes 100× slower: its stream outlives its removal.
	a, b := engine(ipA, 1), engine(ipB, 0.01)
	nameA, nameB := fmt.Sprintf("127.0.0.2-%d", http_), fmt.Sprintf("127.0.0.3-%d", http_)

	d := dnstest.Start(t, "vllm.inference.test", ipA)
	n := startNode(t, func(c *Config) {
		c.Models = []ModelConfig{{Name: "m"}} // no replicas: discovery owns them
		c.IndexMode = "hybrid"
		c.Tokenizer = TokenizerCharacter
		c.BlockSize = 16
		c.Discovery = DiscoveryConfig{Source: fmt.Sprintf("dns:vllm.inference.test:%d", http_), Model: "m",
			KV: fmt.Sprintf("tcp://{ip}:%d", kv), Replay: fmt.Sprintf("tcp://{ip}:%d", replay),
			Interval: 50 * time.Millisecond, DNSServer: d.Addr}
	})
	require.Eventually(t, n.Ready, 10*time.Second, 5*time.Millisecond, "ready once the first snapshot arrived")
	assert.Equal(t, []string{nameA}, n.Replicas())
	assert.Equal(t, fmt.Sprintf("discovery dns:vllm.inference.test:%d", http_), debugRoute(t, n, "cost", "x").Replicas,
		"explain says discovery owns the replica list")
	waitSubscribed(t, n, a, nameA) // the KV template connected to the engine's publisher

	added := time.Now()
	d.Set(ipA, ipB)
	require.Eventually(t, func() bool { return len(n.Replicas()) == 2 }, 2*time.Second, time.Millisecond, "an added pod joins within 2 s")
	t.Logf("added pod joined after %s", time.Since(added).Round(time.Millisecond))
	waitSubscribed(t, n, b, nameB)

	// A stream on b, read up to its first chunk.
	body := `{"model":"m","prompt":"a stream that outlives its pod","max_tokens":100,"stream":true}`
	resp := post(t, n, "/v1/completions", body, map[string]string{HeaderStrategy: "consistent-hash", HeaderSession: "s"})
	for i := 0; resp.Header.Get(HeaderReplica) != nameB; i++ {
		readAll(t, resp)
		require.Less(t, i, 64, "consistent-hash never placed a session on b")
		resp = post(t, n, "/v1/completions", body, map[string]string{HeaderStrategy: "consistent-hash", HeaderSession: fmt.Sprintf("s%d", i)})
	}
	require.Equal(t, http.StatusOK, resp.StatusCode)
	br := bufio.NewReader(resp.Body)
	first, err := br.ReadString('\n')
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(first, "data: "), first)
	repB := n.tbl.Load().byName[nameB]

	removed := time.Now()
	d.Set(ipA)
	require.Eventually(t, func() bool { return len(n.Replicas()) == 1 }, 2*time.Second, time.Millisecond, "a removed pod leaves within 2 s")
	t.Logf("removed pod left after %s", time.Since(removed).Round(time.Millisecond))
	assert.Equal(t, int64(1), repB.inflight.Load(), "the stream was still running when its pod left the pool")
	rest, err := io.ReadAll(br)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	assert.True(t, strings.HasSuffix(strings.TrimSpace(string(rest)), "data: [DONE]"), "the stream on the removed pod completes")

	// New requests go to the pods that remain.
	for i := range 4 {
		resp := post(t, n, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"after %d","max_tokens":1}`, i), nil)
		readAll(t, resp)
		assert.Equal(t, nameA, resp.Header.Get(HeaderReplica))
	}
	// A snapshot is counted just after the table it made is in place:
	// wait for the third count rather than read it once.
	require.Eventually(t, func() bool { return counterValue(t, n, "kvmesh_discovery_updates_total", nil) >= 3 },
		2*time.Second, time.Millisecond)
	assert.Equal(t, 3.0, counterValue(t, n, "kvmesh_discovery_updates_total", nil), "three snapshots: a, a+b, a")
	assert.Equal(t, 1.0, gaugeValue(t, n, "kvmesh_discovery_endpoints"))
}

func TestDiscoveryConfig(t *testing.T) {
	base := func() Config {
		c := LocalConfig()
		c.Models = []ModelConfig{{Name: "m"}}
		c.Discovery = DiscoveryConfig{Source: "dns:vllm:8000", Model: "m", KV: "tcp://{ip}:5557"}
		return c
	}
	c := base()
	require.NoError(t, c.Validate(), "a discovered model needs no configured replicas")
	for name, tune := range map[string]func(*Config){
		"no model":         func(c *Config) { c.Discovery.Model = "" },
		"bad source":       func(c *Config) { c.Discovery.Source = "consul:x" },
		"fixed kv":         func(c *Config) { c.Discovery.KV = "tcp://10.0.0.1:5557" },
		"other model bare": func(c *Config) { c.Models = append(c.Models, ModelConfig{Name: "other"}) },
	} {
		c := base()
		tune(&c)
		assert.ErrorIs(t, c.Validate(), ErrInvalidConfig, name)
	}
	// "kubernetes" needs its source wired before Start.
	c = base()
	c.Discovery.Source = DiscoverySourceKubernetes
	c.Discovery.Kubernetes.InferencePool = "qwen"
	n, err := New(c, nil)
	require.NoError(t, err)
	assert.ErrorIs(t, n.Start(t.Context()), ErrInvalidConfig)
	require.NoError(t, n.Shutdown(t.Context()))
	var _ discovery.Source = (*discovery.DNS)(nil)
}
