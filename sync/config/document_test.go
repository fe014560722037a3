package config

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/route"
)

func testConfig() RoutingConfig {
	c := DefaultRoutingConfig()
	c.HashSeed = 0xfedcba9876543210 // above 2^53: must survive JSON round trips
	c.Models["chat"] = ModelConfig{Replicas: []ReplicaConfig{
		{Name: "r0", URL: "http://127.0.0.1:8000"},
		{Name: "r1", URL: "http://127.0.0.1:8001", KV: "tcp://127.0.0.1:5557", Replay: "tcp://127.0.0.1:5558"},
	}}
	return c
}

func TestDefaultWithModelValidates(t *testing.T) {
	c := testConfig()
	require.NoError(t, c.Validate())
	require.Equal(t, route.DefaultConfig(), c.Route(), "the document's defaults are route's defaults")
}

func TestValidateNamesFields(t *testing.T) {
	c := testConfig()
	m := c.Models["chat"]
	m.Replicas[1].URL = "ftp://x"
	m.Strategy = "fastest"
	m.Replicas = append(m.Replicas, ReplicaConfig{Name: "r0", URL: "http://h:1"})
	c.Models["chat"] = m
	c.PrefixCache.StdDevFactor = -1
	c.PrefixCache.Tokenizer = "sentencepiece"
	c.Index.Capacity = 0
	c.Cost.Alpha = 2
	err := c.Validate()
	require.ErrorIs(t, err, ErrInvalidConfig)
	msg := err.Error()
	for _, path := range []string{
		`models["chat"].replicas[1].url`,
		`models["chat"].strategy`,
		`models["chat"].replicas[2].name`,
		`prefix_cache:`,
		`prefix_cache.tokenizer`,
		`index:`,
		`cost:`,
	} {
		require.Contains(t, msg, path)
	}
	// The cause stays reachable: route's own sentinel.
	require.ErrorIs(t, err, route.ErrInvalidConfig)
	var fe *FieldError
	require.True(t, errors.As(err, &fe))
}

func TestValidateStructure(t *testing.T) {
	for name, mutate := range map[string]func(*RoutingConfig){
		"no models":   func(c *RoutingConfig) { c.Models = nil },
		"no replicas": func(c *RoutingConfig) { c.Models["chat"] = ModelConfig{} },
		"kv and kv_bind": func(c *RoutingConfig) {
			m := c.Models["chat"]
			m.Replicas[0].KVBind = "tcp://*:1"
			m.Replicas[0].KV = "tcp://h:1"
		},
		"bad endpoint":    func(c *RoutingConfig) { m := c.Models["chat"]; m.Replicas[0].KV = "h:1" },
		"bad index mode":  func(c *RoutingConfig) { c.IndexMode = "magic" },
		"negative slo":    func(c *RoutingConfig) { c.SLO.TTFT = -1 },
		"huge block size": func(c *RoutingConfig) { c.PrefixCache.BlockSize = 1 << 20 },
	} {
		t.Run(name, func(t *testing.T) {
			c := testConfig()
			mutate(&c)
			require.ErrorIs(t, c.Validate(), ErrInvalidConfig)
		})
	}
}

func TestDocumentRoundTrip(t *testing.T) {
	c := testConfig()
	doc, err := MarshalDocument(&c)
	require.NoError(t, err)
	require.Contains(t, string(doc), `"history_ttl": "2h0m0s"`)
	got, err := ParseDocument(doc)
	require.NoError(t, err)
	require.Equal(t, c, got)
}

func TestParseDocumentStrict(t *testing.T) {
	_, err := ParseDocument([]byte(`{"models":{"m":{"replicas":[{"name":"a","url":"http://h:1"}]}},"prefix_cache":{"imbalance":3}}`))
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), "imbalance")
	_, err = ParseDocument([]byte(`{"index":{"capacity":"many"}}`))
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), "index.capacity")
	// Absent fields keep defaults.
	c, err := ParseDocument([]byte(`{"models":{"m":{"replicas":[{"name":"a","url":"http://h:1"}]}}}`))
	require.NoError(t, err)
	require.Equal(t, DefaultRoutingConfig().Cost, c.Cost)
}

func TestMergePatch(t *testing.T) {
	for _, tc := range []struct{ doc, patch, want string }{
		{`{"a":"b"}`, `{"a":"c"}`, `{"a":"c"}`},
		{`{"a":"b"}`, `{"b":"c"}`, `{"a":"b","b":"c"}`},
		{`{"a":"b"}`, `{"a":null}`, `{}`},
		{`{"a":{"b":"c"}}`, `{"a":{"b":"d","c":null}}`, `{"a":{"b":"d"}}`},
		{`{"a":[{"b":"c"}]}`, `{"a":[1]}`, `{"a":[1]}`},
		{`{"n":18364758544493064720}`, `{"m":1}`, `{"m":1,"n":18364758544493064720}`},
		{`{"a":"b"}`, `["c"]`, `["c"]`},
	} {
		got, err := MergePatch([]byte(tc.doc), []byte(tc.patch))
		require.NoError(t, err)
		require.JSONEq(t, tc.want, string(got), "%s + %s", tc.doc, tc.patch)
	}
}

func TestMakeMergePatchInverts(t *testing.T) {
	a := testConfig()
	b := a.Clone()
	b.PrefixCache.ImbalanceAbsCount = 4
	delete(b.Models, "chat")
	b.Models["code"] = ModelConfig{Strategy: "cost", Replicas: []ReplicaConfig{{Name: "c0", URL: "http://h:2"}}}
	b.HashSeed = 1<<64 - 1
	from, _ := json.Marshal(&a)
	to, _ := json.Marshal(&b)
	p, err := MakeMergePatch(from, to)
	require.NoError(t, err)
	require.NotContains(t, string(p), "cost\":{", "unchanged sections are not in the patch")
	got, err := MergePatch(from, p)
	require.NoError(t, err)
	require.JSONEq(t, string(to), string(got))
	empty, err := MakeMergePatch(from, from)
	require.NoError(t, err)
	require.Equal(t, "{}", string(empty))
}

func TestDurationJSON(t *testing.T) {
	var d Duration
	require.NoError(t, json.Unmarshal([]byte(`"150ms"`), &d))
	require.Equal(t, "150ms", strings.Trim(mustJSON(t, d), `"`))
	require.NoError(t, json.Unmarshal([]byte(`1000`), &d))
	require.Equal(t, Duration(1000), d)
	require.Error(t, json.Unmarshal([]byte(`"soon"`), &d))
}

func mustJSON(t *testing.T, v any) string {
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return string(b)
}

func TestKeysCompatible(t *testing.T) {
	a := testConfig()
	b := a.Clone()
	b.PrefixCache.ImbalanceAbsCount = 1
	b.Models["chat"] = ModelConfig{Replicas: []ReplicaConfig{{Name: "x", URL: "http://h:1"}}}
	require.True(t, a.KeysCompatible(&b), "thresholds and pools do not change keys")
	for _, mutate := range []func(*RoutingConfig){
		func(c *RoutingConfig) { c.HashSeed++ },
		func(c *RoutingConfig) { c.PrefixCache.BlockSize = 32 },
		func(c *RoutingConfig) { c.PrefixCache.Tokenizer = TokenizerTiktoken },
	} {
		c := a.Clone()
		mutate(&c)
		require.False(t, a.KeysCompatible(&c))
	}
}

// TestModelTokenizer checks a model's own tokenizer: tiktoken and hf:<dir>
// validate (syntax only: the directory need not exist), survive a JSON
// round trip and a merge patch, and anything else, or a per-model
// tokenizer under a character global one, is refused naming the field.
func TestModelTokenizer(t *testing.T) {
	c := testConfig()
	m := c.Models["chat"]
	m.Tokenizer = "hf:/nonexistent/qwen3"
	c.Models["chat"] = m
	require.NoError(t, c.Validate())
	doc, err := MarshalDocument(&c)
	require.NoError(t, err)
	require.Contains(t, string(doc), `"tokenizer": "hf:/nonexistent/qwen3"`)
	got, err := ParseDocument(doc)
	require.NoError(t, err)
	require.Equal(t, c, got)

	doc, err = MergePatch(doc, []byte(`{"models":{"chat":{"tokenizer":null}}}`))
	require.NoError(t, err)
	patched, err := ParseDocument(doc)
	require.NoError(t, err)
	require.Empty(t, patched.Models["chat"].Tokenizer)
	doc, err = MarshalDocument(&patched)
	require.NoError(t, err)
	require.NotContains(t, string(doc), `"tokenizer": "hf:`, "an empty per-model tokenizer is omitted")

	for _, tc := range []struct{ global, model, want string }{
		{TokenizerAuto, TokenizerTiktoken, ""},
		{TokenizerTiktoken, "hf:", `models["chat"].tokenizer`},
		{TokenizerTiktoken, "sentencepiece", `models["chat"].tokenizer`},
		{TokenizerTiktoken, TokenizerAuto, `models["chat"].tokenizer`},
		{TokenizerTiktoken, TokenizerCharacter, `models["chat"].tokenizer`},
		{TokenizerCharacter, "hf:/m", `models["chat"].tokenizer`},
		{"hf:/global", "hf:/m", ""},
		{"hf:", "", `prefix_cache.tokenizer`},
	} {
		c := testConfig()
		c.PrefixCache.Tokenizer = tc.global
		m := c.Models["chat"]
		m.Tokenizer = tc.model
		c.Models["chat"] = m
		err := c.Validate()
		if tc.want == "" {
			require.NoError(t, err, "%+v", tc)
			continue
		}
		require.ErrorIs(t, err, ErrInvalidConfig, "%+v", tc)
		require.Contains(t, err.Error(), tc.want, "%+v", tc)
	}
}
