package node

import (
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func mustURL(s string) *url.URL {
	u, err := url.Parse(s)
	if err != nil {
		panic(err)
	}
	return u
}

func TestParseReplicaSpec(t *testing.T) {
	r, model, err := ParseReplicaSpec("b=http://127.0.0.1:8002,kv=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558")
	require.NoError(t, err)
	assert.Equal(t, ReplicaConfig{Name: "b", URL: "http://127.0.0.1:8002", KVEndpoint: "tcp://127.0.0.1:5557", ReplayEndpoint: "tcp://127.0.0.1:5558"}, r)
	assert.Empty(t, model)

	r, model, err = ParseReplicaSpec("c=http://h:1,kv-bind=tcp://*:5557,model=other")
	require.NoError(t, err)
	assert.Equal(t, "tcp://*:5557", r.KVBind)
	assert.Equal(t, "other", model)

	for _, bad := range []string{"", "a", "=http://x", "a=", "a=http://x,kv", "a=http://x,foo=1", "a=http://x,kv="} {
		_, _, err := ParseReplicaSpec(bad)
		assert.ErrorIs(t, err, ErrBadReplicaSpec, bad)
	}
}

func TestConfigValidate(t *testing.T) {
	good := DefaultConfig()
	good.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{{Name: "a", URL: "http://127.0.0.1:8001"}}}}
	require.NoError(t, good.Validate())
	lc := LocalConfig()
	lc.Models = good.Models
	require.NoError(t, lc.Validate())

	cases := map[string]func(*Config){
		"no models":        func(c *Config) { c.Models = nil },
		"bad strategy":     func(c *Config) { c.Strategy = "fastest" },
		"bad mode":         func(c *Config) { c.IndexMode = "both" },
		"bad tokenizer":    func(c *Config) { c.Tokenizer = "sentencepiece" },
		"zero timeout":     func(c *Config) { c.ConnectTimeout = 0 },
		"zero body":        func(c *Config) { c.MaxBodyBytes = 0 },
		"backoff inverted": func(c *Config) { c.EjectMaxBackoff = time.Millisecond },
		"dup replica": func(c *Config) {
			c.Models[0].Replicas = append(c.Models[0].Replicas, ReplicaConfig{Name: "a", URL: "http://h:1"})
		},
		"dup model": func(c *Config) {
			c.Models = append(c.Models, ModelConfig{Name: "m", Replicas: []ReplicaConfig{{Name: "b", URL: "http://h:1"}}})
		},
		"bad url": func(c *Config) { c.Models[0].Replicas[0].URL = "127.0.0.1:8001" },
		"kv and kv_bind": func(c *Config) {
			c.Models[0].Replicas[0].KVEndpoint, c.Models[0].Replicas[0].KVBind = "tcp://a:1", "tcp://*:2"
		},
		"replay alone":    func(c *Config) { c.Models[0].Replicas[0].ReplayEndpoint = "tcp://a:1" },
		"no replicas":     func(c *Config) { c.Models[0].Replicas = nil },
		"model strategy":  func(c *Config) { c.Models[0].Strategy = "x" },
		"model mode":      func(c *Config) { c.Models[0].IndexMode = "x" },
		"bad route param": func(c *Config) { c.Route.Cost.Alpha = 2 },
	}
	for name, mut := range cases {
		c := good
		c.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{{Name: "a", URL: "http://127.0.0.1:8001"}}}}
		mut(&c)
		assert.ErrorIs(t, c.Validate(), ErrInvalidConfig, name)
	}
}

func TestEffectiveTokenizerAndBlockSize(t *testing.T) {
	c := DefaultConfig()
	assert.Equal(t, TokenizerCharacter, c.EffectiveTokenizer())
	assert.Equal(t, 128, c.EffectiveBlockSize())
	c.IndexMode = "hybrid"
	assert.Equal(t, TokenizerTiktoken, c.EffectiveTokenizer())
	assert.Equal(t, 16, c.EffectiveBlockSize())
	c.Tokenizer, c.BlockSize = TokenizerCharacter, 64
	assert.Equal(t, 64, c.EffectiveBlockSize())
}

func TestParseConfigYAML(t *testing.T) {
	y := `
http_addr: 127.0.0.1:9000
strategy: cost
index_mode: hybrid
idle_timeout: 5s
models:
  - name: m
    adapters: [m-lora]
    replicas:
      - {name: a, url: "http://127.0.0.1:8001"}
      - {name: b, url: "http://127.0.0.1:8002", kv: "tcp://127.0.0.1:5557", replay: "tcp://127.0.0.1:5558"}
prefix_cache:
  imbalance_abs_count: 8
`
	c, err := ParseConfigYAML([]byte(y), DefaultConfig())
	require.NoError(t, err)
	require.NoError(t, c.Validate())
	assert.Equal(t, "127.0.0.1:9000", c.HTTPAddr)
	assert.Equal(t, 5*time.Second, c.IdleTimeout)
	assert.Equal(t, 2*time.Second, c.ConnectTimeout, "absent keys keep the base value")
	assert.Equal(t, "tcp://127.0.0.1:5557", c.Models[0].Replicas[1].KVEndpoint)
	assert.Equal(t, []string{"m-lora"}, c.Models[0].Adapters)

	_, err = ParseConfigYAML([]byte("no_such_key: 1\n"), DefaultConfig())
	assert.ErrorIs(t, err, ErrInvalidConfig)
	c, err = ParseConfigYAML(nil, DefaultConfig())
	require.NoError(t, err)
	assert.Equal(t, DefaultConfig().HTTPAddr, c.HTTPAddr)
}

// TestDefaultIndexModeFollowsKVEvents: the default mode is hybrid as soon
// as one replica publishes KV events, history otherwise; an explicit mode
// stays; New resolves auto once.
func TestDefaultIndexModeFollowsKVEvents(t *testing.T) {
	c := DefaultConfig()
	require.Equal(t, "cost", c.Strategy)
	require.Equal(t, IndexModeAuto, c.IndexMode)
	c.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{{Name: "a", URL: "http://127.0.0.1:1"}}}}
	require.Equal(t, "history", c.EffectiveIndexMode())
	require.Equal(t, TokenizerCharacter, c.EffectiveTokenizer())
	c.Models = append(c.Models, ModelConfig{Name: "n", Replicas: []ReplicaConfig{
		{Name: "b", URL: "http://127.0.0.1:2", KVEndpoint: "tcp://127.0.0.1:5557"}}})
	require.Equal(t, "hybrid", c.EffectiveIndexMode())
	require.Equal(t, TokenizerTiktoken, c.EffectiveTokenizer())
	require.NoError(t, c.Validate())
	c.IndexMode = "history"
	require.Equal(t, "history", c.EffectiveIndexMode())
	c.IndexMode = "bogus"
	require.ErrorIs(t, c.Validate(), ErrInvalidConfig)

	lc := LocalConfig()
	lc.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{{Name: "a", URL: "http://127.0.0.1:1", KVBind: "tcp://127.0.0.1:0"}}}}
	n, err := New(lc, nil)
	require.NoError(t, err)
	require.Equal(t, "hybrid", n.cfg.IndexMode, "New resolves auto")
}
