package target_test

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/chaos/study/httpenv"
	"github.com/kvmesh/kvmesh/chaos/study/live"
	"github.com/kvmesh/kvmesh/chaos/study/target"
	"github.com/kvmesh/kvmesh/internal/admintest"
	"github.com/kvmesh/kvmesh/node"
)

func TestConfigValidate(t *testing.T) {
	ok := target.DefaultConfig()
	ok.Gateways = []string{"http://127.0.0.1:1"}
	require.NoError(t, ok.Validate())
	for name, mut := range map[string]func(*target.Config){
		"nothing to target": func(c *target.Config) { c.Gateways = nil },
		"not a URL":         func(c *target.Config) { c.Gateways = []string{"127.0.0.1:8080"} },
		"isolation":         func(c *target.Config) { c.Isolation = "flush" },
		"speed":             func(c *target.Config) { c.Speed = 0 },
		"poll":              func(c *target.Config) { c.Poll = 0 },
	} {
		c := ok
		mut(&c)
		assert.ErrorIs(t, c.Validate(), target.ErrInvalidConfig, name)
	}
}

// deployment starts two simulated engines behind two clustered gateways in
// history mode (package live, real HTTP, gossip, raft, NATS on loopback)
// with a known admin token.
func deployment(t *testing.T) *live.World {
	t.Helper()
	lc := live.DefaultConfig()
	lc.Gateways = 2
	lc.Profile = "fast"
	lc.Model = "M"
	lc.TuneNode = func(c *node.Config) { c.Cluster.AdminToken, c.DebugPublic = "tok", false }
	w, err := live.Start(context.Background(), lc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = w.Close() })
	return w
}

func gatewayURLs(w *live.World) []string {
	var out []string
	for _, n := range w.Nodes() {
		out = append(out, "http://"+n.HTTPAddr())
	}
	return out
}

func routeMode(t *testing.T, gw string) string {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, gw+"/debug/route?model=M&prompt=x", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer tok")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	var rep struct {
		IndexMode string `json:"index_mode"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&rep))
	return rep.IndexMode
}

// TestProbeAndModeSwitch: Probe finds the model, the cluster, the engines
// (from /debug/replicas) and that they allow a reset; SetMode switches
// both gateways through the HTTP admin API and verifies each.
func TestProbeAndModeSwitch(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a two-gateway cluster")
	}
	w := deployment(t)
	ctx := context.Background()
	tc := target.DefaultConfig()
	tc.Gateways = gatewayURLs(w)

	_, err := target.Probe(ctx, tc, false)
	require.ErrorIs(t, err, target.ErrProbe, "without the admin token /debug/route is refused")

	tc.AdminToken = "tok"
	d, err := target.Probe(ctx, tc, false)
	require.NoError(t, err)
	defer d.Close()
	info := d.Info()
	assert.Equal(t, "M", info.Model)
	assert.True(t, info.Clustered)
	assert.Equal(t, study.IsolationReset, info.Isolation)
	assert.Equal(t, []string{"A=" + w.Sims()[0].URL(), "B=" + w.Sims()[1].URL()}, info.Engines)
	assert.Equal(t, []string{"history", "history"}, d.Modes())
	assert.Len(t, info.GatewayVersions, 2)

	require.NoError(t, d.SetMode(ctx, "history"))
	require.NoError(t, d.SetMode(ctx, "hybrid"))
	require.Len(t, info.ModeSwitches, 2)
	assert.Equal(t, uint64(0), info.ModeSwitches[0].ConfigVersion, "already in history: no write")
	sw := info.ModeSwitches[1]
	assert.Equal(t, "hybrid", sw.Mode)
	assert.Positive(t, sw.ConfigVersion)
	assert.Equal(t, 2, sw.Verified)
	for _, g := range tc.Gateways {
		assert.Equal(t, "hybrid", routeMode(t, g), g)
	}
}

// TestNoGatewayBaselines: without gateways, round-robin alternates the
// engines, random uses both, and requests that share a document salt (the
// scenarios' initialisation) land together.
func TestNoGatewayBaselines(t *testing.T) {
	if testing.Short() {
		t.Skip("starts simulated engines")
	}
	lc := live.DefaultConfig()
	lc.Profile = "fast"
	lc.Model = "M"
	w, err := live.Start(context.Background(), lc)
	require.NoError(t, err)
	defer w.Close()
	ctx := context.Background()
	tc := target.DefaultConfig()
	tc.Engines = []httpenv.Endpoint{{Name: "A", URL: w.Sims()[0].URL()}, {Name: "B", URL: w.Sims()[1].URL()}}
	d, err := target.Probe(ctx, tc, false)
	require.NoError(t, err)
	defer d.Close()
	e, err := target.Factory(d)(ctx, study.Cell{Mode: study.ModeNone, Gateways: 1, Replicas: 2})
	require.NoError(t, err)
	defer e.Close()

	send := func(strategy string, prompts ...string) []string {
		var reqs []study.Request
		for _, p := range prompts {
			reqs = append(reqs, study.Request{Prompt: p, MaxTokens: 2, Target: study.Target{Strategy: strategy}})
		}
		outs, err := study.Do(ctx, e, reqs...)
		require.NoError(t, err)
		var got []string
		for _, o := range outs {
			require.Equal(t, 200, o.Status, o.Err)
			got = append(got, o.Replica)
		}
		return got
	}
	assert.Equal(t, []string{"A", "B", "A", "B"}, send("round-robin", "p1", "p2", "p3", "p4"))
	var many []string
	for i := range 24 {
		many = append(many, strings.Repeat("x", i+1))
	}
	rnd := send("random", many...)
	assert.Contains(t, rnd, "A")
	assert.Contains(t, rnd, "B")
	salt := study.Salt(1, "phase", 0, 0)
	same := send("prefix-cache", salt+" question one", salt+" question two", salt+" question three")
	assert.Equal(t, same[0], same[1])
	assert.Equal(t, same[0], same[2])
	require.NoError(t, e.WaitIdle(ctx))
}

// adminJSON sends an admin API call with the test token and decodes a
// JSON answer into v (nil: ignored). A write answered 503 (no leader yet,
// or a leadership lost under load: the gateways' raft is as young as the
// test) is sent again (admintest.Call).
func adminJSON(t *testing.T, method, url, body string, v any) {
	t.Helper()
	code, b, _ := admintest.Call(t, method, url, "tok", body)
	require.Equal(t, http.StatusOK, code, "%s %s: %s", method, url, b)
	if v != nil {
		require.NoError(t, json.Unmarshal(b, v))
	}
}

// TestModeSwitchRespectsModelOverride: when the cluster document gives
// the model its own index_mode, --mode-scope auto switches that entry
// (the default stays), cluster refuses before writing anything, and model
// writes the model's entry even without an override.
func TestModeSwitchRespectsModelOverride(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a two-gateway cluster")
	}
	w := deployment(t)
	ctx := context.Background()
	gws := gatewayURLs(w)
	adminJSON(t, http.MethodPatch, gws[0]+"/admin/v1/config", `{"models":{"M":{"index_mode":"kv-events"}}}`, nil)
	probe := func(scope, want string) *target.Deployment {
		tc := target.DefaultConfig()
		tc.Gateways = gws
		tc.AdminToken = "tok"
		tc.ModeScope = scope
		var d *target.Deployment
		// A config change reaches every gateway through raft: probe
		// until both route in want.
		deadline := time.Now().Add(20 * time.Second)
		for {
			var err error
			d, err = target.Probe(ctx, tc, true)
			require.NoError(t, err)
			if m := d.Modes(); m[0] == want && m[1] == want {
				break
			}
			d.Close()
			require.True(t, time.Now().Before(deadline), "gateways did not agree on the mode")
			time.Sleep(20 * time.Millisecond) // polling the cluster, with a deadline
		}
		t.Cleanup(d.Close)
		assert.True(t, d.Info().Clustered)
		assert.Equal(t, 1, d.Info().Clusters)
		return d
	}
	defaultMode := func() (string, string) {
		var v struct {
			Config struct {
				IndexMode string `json:"index_mode"`
				Models    map[string]struct {
					IndexMode string `json:"index_mode"`
				} `json:"models"`
			} `json:"config"`
		}
		adminJSON(t, http.MethodGet, gws[1]+"/admin/v1/config", "", &v)
		return v.Config.IndexMode, v.Config.Models["M"].IndexMode
	}

	d := probe(target.ScopeCluster, "kv-events")
	err := d.SetMode(ctx, "hybrid")
	require.ErrorIs(t, err, target.ErrMode)
	assert.Contains(t, err.Error(), `models.M.index_mode is "kv-events"`)
	def, own := defaultMode()
	assert.Equal(t, [2]string{"history", "kv-events"}, [2]string{def, own}, "nothing written")

	d = probe(target.ScopeAuto, "kv-events")
	require.NoError(t, d.SetMode(ctx, "hybrid"))
	sw := d.Info().ModeSwitches[0]
	assert.Equal(t, "model", sw.Scope)
	assert.Positive(t, sw.ConfigVersion)
	assert.Equal(t, 2, sw.Verified)
	def, own = defaultMode()
	assert.Equal(t, [2]string{"history", "hybrid"}, [2]string{def, own}, "the model's entry switched, the default kept")
	for _, g := range gws {
		assert.Equal(t, "hybrid", routeMode(t, g), g)
	}

	// Without an override, model scope still writes the model's entry.
	adminJSON(t, http.MethodPatch, gws[0]+"/admin/v1/config", `{"models":{"M":{"index_mode":null}}}`, nil)
	d = probe(target.ScopeModel, "history")
	require.NoError(t, d.SetMode(ctx, "kv-events"))
	assert.Equal(t, "model", d.Info().ModeSwitches[0].Scope)
	def, own = defaultMode()
	assert.Equal(t, [2]string{"history", "kv-events"}, [2]string{def, own})
}
