// Package target is kvbench's engine for a running deployment (kvbench
// --target): the study's requests go to gateways the operator started
// (arrivals round-robin over them, the strategy per request in the
// routing-strategy header) and the engines behind them are read through
// their Prometheus /metrics, all over package httpenv. Nothing is started.
//
// Per cell (index mode) the engine switches the gateways' index mode through
// the cluster admin API (gRPC at Config.AdminAddr, else the HTTP admin API
// of the cluster's first gateway; bearer Config.AdminToken) and then polls every
// gateway's /debug/route until each routes the model in that mode: a phase
// never starts on a gateway still in the previous mode. Gateways that form
// several separate clusters are switched through each cluster's admin API;
// the switch writes the cluster default, or the model's own index_mode
// when the cluster document overrides it (Config.ModeScope). Gateways
// without the admin API can only be measured in the mode they run.
//
// Phases are isolated by POST /reset_prefix_cache on every engine when all
// of them allow it (Probe tries it once), otherwise by a fresh cache_salt
// per phase and per initialisation retry: vLLM never shares cached blocks
// across salts. The study's prompts carry a per-phase text salt as well, so
// the seed's scenarios are isolated either way; the cache_salt matters for
// a user's workload, whose prompts repeat across phases.
//
// Synced gateways are settled after each initialisation (study.Settler):
// Settle polls every gateway's /admin/v1/index/stats until its history and
// confirmed entry counts equal the first gateway's.
package target

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/chaos/study/httpenv"
	"github.com/kvmesh/kvmesh/sync/config"
)

var (
	// ErrInvalidConfig is returned by Config.Validate.
	ErrInvalidConfig = errors.New("target: invalid config")
	// ErrProbe is returned when the deployment cannot be inspected.
	ErrProbe = errors.New("target: probe failed")
	// ErrMode is returned when an index mode cannot be set or a gateway
	// does not apply it in time.
	ErrMode = errors.New("target: index mode not applied")
	// ErrNotSettled is returned when synced gateways' indexes do not
	// agree within Config.SettleTimeout.
	ErrNotSettled = errors.New("target: gateways did not converge")
)

// Isolation settings (Config.Isolation).
const (
	// IsolationAuto resets the engines' caches when every engine allows
	// it, else uses cache_salt.
	IsolationAuto = "auto"
)

// Mode switch scopes (Config.ModeScope, study.ModeSwitch.Scope).
const (
	ScopeAuto    = "auto"
	ScopeCluster = "cluster"
	ScopeModel   = "model"
)

// Config configures a target run.
type Config struct {
	// Gateways are the gateways' base URLs (http://host:port). Empty: the
	// requests go straight to the engines (client-side baselines).
	Gateways []string
	// Engines are the engine replicas, named as the gateways' x-kvmesh-
	// replica header names them. Empty with gateways: discovered from
	// the first gateway's /debug/replicas (admin token needed).
	Engines []httpenv.Endpoint
	// AdminAddr is a gateway's admin gRPC address (host:port) for index
	// mode changes; "" uses the HTTP admin API of Gateways[0].
	AdminAddr string
	// AdminToken is the admin bearer token ($KVMESH_ADMIN_TOKEN).
	AdminToken string
	// Model is the model to request; "" takes the first id of
	// /v1/models (gateway 0, else engine 0).
	Model string
	// Speed is the engines' time compression (vllmsim --speed); 1 for
	// real engines.
	Speed float64
	// Isolation is IsolationAuto, study.IsolationReset or
	// study.IsolationSalt.
	Isolation string
	// ModeScope says what an index-mode switch writes: ScopeAuto (the
	// model's own models.<model>.index_mode when the cluster document
	// sets one, else the cluster default), ScopeCluster (the default
	// index_mode; refused when the model overrides it) or ScopeModel
	// (always the model's own entry, leaving other models alone).
	ModeScope string
	// ModeTimeout bounds an index-mode switch and its verification (wall
	// time). Default 30 s.
	ModeTimeout time.Duration
	// SettleTimeout bounds Settle (wall time). Default 30 s.
	SettleTimeout time.Duration
	// Poll is the polling period of mode verification and Settle.
	// Default 20 ms.
	Poll time.Duration
	// ControlTimeout bounds one control call (wall time). Default 5 s.
	ControlTimeout time.Duration
	// IdleTimeout bounds waiting for idle engines. Default 2 min.
	IdleTimeout time.Duration
	// Seed seeds the client-side random strategy (no gateways).
	Seed uint64
}

// DefaultConfig returns the defaults for everything but the endpoints.
func DefaultConfig() Config {
	return Config{
		Speed:          1,
		Isolation:      IsolationAuto,
		ModeScope:      ScopeAuto,
		ModeTimeout:    30 * time.Second,
		SettleTimeout:  30 * time.Second,
		Poll:           20 * time.Millisecond,
		ControlTimeout: 5 * time.Second,
		IdleTimeout:    2 * time.Minute,
	}
}

// Validate reports the first problem with c.
func (c *Config) Validate() error {
	switch {
	case len(c.Gateways) == 0 && len(c.Engines) == 0:
		return fmt.Errorf("%w: need --target gateways or --engines", ErrInvalidConfig)
	case !(c.Speed > 0):
		return fmt.Errorf("%w: speed must be > 0", ErrInvalidConfig)
	case c.ModeTimeout <= 0 || c.SettleTimeout <= 0 || c.Poll <= 0 || c.ControlTimeout <= 0 || c.IdleTimeout <= 0:
		return fmt.Errorf("%w: timeouts must be > 0", ErrInvalidConfig)
	}
	switch c.Isolation {
	case IsolationAuto, study.IsolationReset, study.IsolationSalt:
	default:
		return fmt.Errorf("%w: isolation %q (want %s, %s or %s)", ErrInvalidConfig, c.Isolation,
			IsolationAuto, study.IsolationReset, study.IsolationSalt)
	}
	switch c.ModeScope {
	case ScopeAuto, ScopeCluster, ScopeModel:
	default:
		return fmt.Errorf("%w: mode scope %q (want %s, %s or %s)", ErrInvalidConfig, c.ModeScope, ScopeAuto, ScopeCluster, ScopeModel)
	}
	for _, g := range c.Gateways {
		if !strings.HasPrefix(g, "http://") && !strings.HasPrefix(g, "https://") {
			return fmt.Errorf("%w: gateway %q is not an http(s) URL", ErrInvalidConfig, g)
		}
	}
	return nil
}

// Deployment is what Probe found, and the control plane the engines use.
type Deployment struct {
	cfg  Config
	hc   *http.Client
	info *study.TargetInfo
	// modes are the modes the gateways were found in, by gateway.
	modes []string
	// cluster is each gateway's cluster number (clusters in order of
	// their first gateway), -1 for a gateway without the admin API.
	cluster []int
	seed    uint64
}

// Probe inspects the deployment without sending a completion: the model
// (/v1/models), the gateways' versions (kvmesh_build_info) and index modes
// (/debug/route), whether they form a cluster (the admin API answers), the
// engines (given, or from /debug/replicas), and how phases will be isolated
// (with IsolationAuto it tries POST /reset_prefix_cache once on every
// engine, unless noReset, which assumes the reset is allowed and sends
// nothing: --plan).
func Probe(ctx context.Context, c Config, noReset bool) (*Deployment, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	d := &Deployment{cfg: c, hc: &http.Client{Transport: &http.Transport{Proxy: nil, DisableCompression: true}},
		info: &study.TargetInfo{Gateways: c.Gateways}, seed: c.Seed}
	if err := d.probe(ctx, noReset); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

func (d *Deployment) probe(ctx context.Context, noReset bool) error {
	c := d.cfg
	var err error
	base := ""
	if len(c.Gateways) > 0 {
		base = c.Gateways[0]
	} else {
		base = c.Engines[0].URL
	}
	if d.info.Models, err = d.models(ctx, base); err != nil {
		return err
	}
	d.info.Model = c.Model
	if d.info.Model == "" {
		if len(d.info.Models) == 0 {
			return fmt.Errorf("%w: %s/v1/models lists no model; give --model", ErrProbe, base)
		}
		d.info.Model = d.info.Models[0]
	}
	d.cfg.Model = d.info.Model
	if len(c.Gateways) > 0 {
		if err := d.clusters(ctx); err != nil {
			return err
		}
		for _, g := range c.Gateways {
			d.info.GatewayVersions = append(d.info.GatewayVersions, d.version(ctx, g))
			m, err := d.mode(ctx, g)
			if err != nil {
				return err
			}
			d.modes = append(d.modes, m)
		}
		if len(c.Engines) == 0 {
			if d.cfg.Engines, err = d.replicas(ctx, c.Gateways[0]); err != nil {
				return err
			}
		}
	}
	for _, e := range d.cfg.Engines {
		d.info.Engines = append(d.info.Engines, e.Name+"="+e.URL)
	}
	d.info.Isolation = c.Isolation
	if c.Isolation == IsolationAuto {
		d.info.Isolation = study.IsolationReset
		if !noReset {
			for _, e := range d.cfg.Engines {
				if err := d.reset(ctx, e.URL); err != nil {
					d.info.Isolation = study.IsolationSalt
					break
				}
			}
		}
	}
	return nil
}

// Close releases the control connections; the Worlds it made close
// themselves (the Runner closes each).
func (d *Deployment) Close() { d.hc.CloseIdleConnections() }

// Info returns the deployment's description; the same pointer goes into
// study.Config.Target, and the engine factory appends mode switches to it.
func (d *Deployment) Info() *study.TargetInfo { return d.info }

// Engines returns the engine replicas (given or discovered).
func (d *Deployment) Engines() []httpenv.Endpoint { return d.cfg.Engines }

// Modes returns the index mode each gateway routed the model in when
// probed.
func (d *Deployment) Modes() []string { return d.modes }

// ModeScope returns Config.ModeScope.
func (d *Deployment) ModeScope() string { return d.cfg.ModeScope }

func (d *Deployment) ctl(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d.cfg.ControlTimeout)
}

// do sends one control request (with the admin token when auth) and
// decodes a 2xx JSON answer into v (nil: ignored).
func (d *Deployment) do(ctx context.Context, method, url string, auth bool, body []byte, v any) (int, error) {
	ctx, cancel := d.ctl(ctx)
	defer cancel()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		return 0, err
	}
	if auth && d.cfg.AdminToken != "" {
		req.Header.Set("Authorization", "Bearer "+d.cfg.AdminToken)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := d.hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return resp.StatusCode, err
	}
	if resp.StatusCode/100 != 2 {
		return resp.StatusCode, fmt.Errorf("%s %s: HTTP %d: %s", method, url, resp.StatusCode, strings.TrimSpace(string(b[:min(len(b), 200)])))
	}
	if v != nil {
		if err := json.Unmarshal(b, v); err != nil {
			return resp.StatusCode, fmt.Errorf("%s %s: %w", method, url, err)
		}
	}
	return resp.StatusCode, nil
}

func trim(u string) string { return strings.TrimRight(u, "/") }

func (d *Deployment) models(ctx context.Context, base string) ([]string, error) {
	var out struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if _, err := d.do(ctx, http.MethodGet, trim(base)+"/v1/models", false, nil, &out); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrProbe, err)
	}
	var ids []string
	for _, m := range out.Data {
		ids = append(ids, m.ID)
	}
	return ids, nil
}

// clusters finds which gateways serve the cluster admin API and which of
// them belong to one cluster: gateways i and j do when either lists the
// other (node id and raft address) among its members (/admin/v1/status,
// /admin/v1/members).
// Clustered is set when every gateway is in one cluster.
func (d *Deployment) clusters(ctx context.Context) error {
	gws := d.cfg.Gateways
	ids := make([]string, len(gws))
	members := make([]map[string]bool, len(gws))
	for i, g := range gws {
		var st struct {
			NodeID string `json:"node_id"`
		}
		if _, err := d.do(ctx, http.MethodGet, trim(g)+"/admin/v1/status", true, nil, &st); err != nil {
			continue // no admin API: not a cluster member (or not ours)
		}
		var ms struct {
			Members []struct {
				ID       string `json:"id"`
				RaftAddr string `json:"raft_addr"`
			} `json:"members"`
		}
		// A member is its id and raft address: two separate clusters
		// may well both have a node called gw-0.
		ids[i] = st.NodeID
		members[i] = map[string]bool{}
		if _, err := d.do(ctx, http.MethodGet, trim(g)+"/admin/v1/members", true, nil, &ms); err == nil {
			for _, m := range ms.Members {
				key := m.ID + "@" + m.RaftAddr
				members[i][key] = true
				if m.ID == st.NodeID {
					ids[i] = key
				}
			}
		}
		members[i][ids[i]] = true
	}
	d.cluster = make([]int, len(gws))
	n := 0
	for i := range gws {
		d.cluster[i] = -1
		if members[i] == nil {
			continue
		}
		for j := range i {
			if d.cluster[j] >= 0 && (members[i][ids[j]] || members[j][ids[i]]) {
				d.cluster[i] = d.cluster[j]
				break
			}
		}
		if d.cluster[i] < 0 {
			d.cluster[i] = n
			n++
		}
	}
	d.info.Clusters = n
	d.info.Clustered = n == 1 && !slices.Contains(d.cluster, -1)
	if d.cfg.AdminAddr != "" && n > 1 {
		return fmt.Errorf("%w: the gateways form %d separate clusters and --admin-addr names one; leave it out to switch each through its gateways' HTTP admin API",
			ErrProbe, n)
	}
	return nil
}

// version reads kvmesh_build_info's version label ("?" when absent).
func (d *Deployment) version(ctx context.Context, gw string) string {
	ctx, cancel := d.ctl(ctx)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, trim(gw)+"/metrics", nil)
	if err != nil {
		return "?"
	}
	resp, err := d.hc.Do(req)
	if err != nil {
		return "?"
	}
	defer func() { _ = resp.Body.Close() }()
	s, err := httpenv.ParseMetrics(resp.Body)
	if err != nil {
		return "?"
	}
	for _, x := range s {
		if x.Name == "kvmesh_build_info" && x.Labels["version"] != "" {
			return x.Labels["version"]
		}
	}
	return "?"
}

// mode returns the index mode gw routes the model in (/debug/route).
func (d *Deployment) mode(ctx context.Context, gw string) (string, error) {
	var rep struct {
		IndexMode string `json:"index_mode"`
	}
	u := trim(gw) + "/debug/route?model=" + urlQuery(d.cfg.Model) + "&prompt=kvbench-mode-probe"
	if _, err := d.do(ctx, http.MethodGet, u, true, nil, &rep); err != nil {
		return "", fmt.Errorf("%w: %w (is $KVMESH_ADMIN_TOKEN the gateways' admin token?)", ErrProbe, err)
	}
	return rep.IndexMode, nil
}

func urlQuery(s string) string {
	r := strings.NewReplacer("%", "%25", "&", "%26", "+", "%2B", " ", "%20", "#", "%23", "?", "%3F", "=", "%3D")
	return r.Replace(s)
}

// replicas lists the model's replicas from gw's /debug/replicas.
func (d *Deployment) replicas(ctx context.Context, gw string) ([]httpenv.Endpoint, error) {
	var rep struct {
		Replicas []struct {
			Name  string `json:"name"`
			Model string `json:"model"`
			URL   string `json:"url"`
		} `json:"replicas"`
	}
	if _, err := d.do(ctx, http.MethodGet, trim(gw)+"/debug/replicas", true, nil, &rep); err != nil {
		return nil, fmt.Errorf("%w: discover engines (or give --engines): %w", ErrProbe, err)
	}
	var out []httpenv.Endpoint
	for _, r := range rep.Replicas {
		if r.Model == d.cfg.Model {
			out = append(out, httpenv.Endpoint{Name: r.Name, URL: r.URL})
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: %s lists no replica of %q", ErrProbe, gw, d.cfg.Model)
	}
	return out, nil
}

func (d *Deployment) reset(ctx context.Context, engine string) error {
	// A refusal is a non-2xx answer (vLLM without VLLM_SERVER_DEV_MODE
	// answers 404); success=false bodies are caught by the first phase's
	// httpenv reset, which fails the run rather than measuring unisolated.
	_, err := d.do(ctx, http.MethodPost, trim(engine)+"/reset_prefix_cache", false, nil, nil)
	return err
}

// SetMode switches every gateway to mode and waits until each routes the
// model in it; it records the switch in Info. Each cluster among the
// gateways is written once through its admin API (Config.AdminAddr's gRPC
// when there is one cluster and it is given, else the HTTP admin API of
// the cluster's first gateway): the cluster default index_mode, or the
// model's own models.<model>.index_mode (Config.ModeScope). A gateway
// without the admin API that routes in another mode cannot be switched.
func (d *Deployment) SetMode(ctx context.Context, mode string) error {
	if len(d.cfg.Gateways) == 0 {
		return nil
	}
	t0 := time.Now()
	if !slices.ContainsFunc(d.modes, func(m string) bool { return m != mode }) {
		d.info.ModeSwitches = append(d.info.ModeSwitches, study.ModeSwitch{Mode: mode, Verified: len(d.modes)})
		return nil // already there
	}
	for i, g := range d.cfg.Gateways {
		if d.cluster[i] < 0 && d.modes[i] != mode {
			return fmt.Errorf("%w: gateway %s routes in %s and has no cluster admin API: cannot switch it to %s; run --modes %s",
				ErrMode, g, d.modes[i], mode, d.modes[i])
		}
	}
	ctx, cancel := context.WithTimeout(ctx, d.cfg.ModeTimeout)
	defer cancel()
	sw := study.ModeSwitch{Mode: mode}
	for c := range d.info.Clusters {
		first := slices.Index(d.cluster, c)
		stale := false
		for i := range d.cfg.Gateways {
			stale = stale || (d.cluster[i] == c && d.modes[i] != mode)
		}
		if !stale {
			continue
		}
		scope, err := d.scope(ctx, first, mode)
		if err != nil {
			return err
		}
		patch := map[string]any{"index_mode": mode}
		if scope == ScopeModel {
			patch = map[string]any{"models": map[string]any{d.cfg.Model: map[string]any{"index_mode": mode}}}
		}
		body, _ := json.Marshal(patch)
		version, err := d.patchThroughElection(ctx, first, body)
		if err != nil {
			return fmt.Errorf("%w: %s: %w", ErrMode, mode, err)
		}
		if sw.ConfigVersion == 0 {
			sw.ConfigVersion = version
		}
		sw.ConfigVersions = append(sw.ConfigVersions, version)
		if sw.Scope != "" && sw.Scope != scope {
			sw.Scope = "mixed"
		} else {
			sw.Scope = scope
		}
	}
	if len(sw.ConfigVersions) < 2 {
		sw.ConfigVersions = nil
	}
	for i, g := range d.cfg.Gateways {
		last := ""
		for {
			m, err := d.mode(ctx, g)
			if err == nil && m == mode {
				break
			}
			last = m
			if err != nil {
				last = err.Error()
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("%w: gateway %s still routes in %q %v after config version %d (does models.%s.index_mode override the default? --mode-scope model writes it)",
					ErrMode, g, last, d.cfg.ModeTimeout, sw.ConfigVersion, d.cfg.Model)
			case <-time.After(d.cfg.Poll):
			}
		}
		d.modes[i] = mode
		sw.Verified++
	}
	sw.WaitMS = float64(time.Since(t0).Microseconds()) / 1000
	d.info.ModeSwitches = append(d.info.ModeSwitches, sw)
	return nil
}

// scope decides what a switch of the cluster holding gateway gw writes:
// the model's own index_mode (ScopeModel, or ScopeAuto when the cluster
// document sets one) or the cluster default.
func (d *Deployment) scope(ctx context.Context, gw int, mode string) (string, error) {
	doc, err := d.config(ctx, gw)
	if err != nil {
		return "", fmt.Errorf("%w: read the cluster config: %w", ErrMode, err)
	}
	mc, listed := doc.Models[d.cfg.Model]
	switch d.cfg.ModeScope {
	case ScopeModel:
		if !listed {
			return "", fmt.Errorf("%w: --mode-scope model: the cluster document of %s has no models.%s entry to set index_mode on",
				ErrMode, d.cfg.Gateways[gw], d.cfg.Model)
		}
		return ScopeModel, nil
	case ScopeCluster:
		if mc.IndexMode != "" && mc.IndexMode != mode {
			return "", fmt.Errorf("%w: models.%s.index_mode is %q in the cluster of %s and overrides the default: use --mode-scope model or auto",
				ErrMode, d.cfg.Model, mc.IndexMode, d.cfg.Gateways[gw])
		}
		return ScopeCluster, nil
	}
	if mc.IndexMode != "" {
		return ScopeModel, nil
	}
	return ScopeCluster, nil
}

// config reads the routing config of the cluster holding gateway gw.
func (d *Deployment) config(ctx context.Context, gw int) (*config.RoutingConfig, error) {
	if d.cfg.AdminAddr != "" {
		c, err := config.Dial(d.cfg.AdminAddr, config.ClientOptions{Token: d.cfg.AdminToken})
		if err != nil {
			return nil, err
		}
		defer func() { _ = c.Close() }()
		v, err := c.GetConfig(ctx)
		if err != nil {
			return nil, err
		}
		if v.Config == nil {
			return &config.RoutingConfig{}, nil
		}
		return v.Config, nil
	}
	var v config.Versioned
	if _, err := d.do(ctx, http.MethodGet, trim(d.cfg.Gateways[gw])+"/admin/v1/config", true, nil, &v); err != nil {
		return nil, err
	}
	if v.Config == nil {
		return &config.RoutingConfig{}, nil
	}
	return v.Config, nil
}

// errNoLeader marks a config write refused because the cluster has no raft
// leader at the moment (admin HTTP 503, gRPC NO_QUORUM or NOT_LEADER).
var errNoLeader = errors.New("no raft leader")

// patchThroughElection is patch, tried again every Poll while the cluster
// has no raft leader (an election under way), until ctx (the mode switch's
// ModeTimeout) ends. A leader election takes seconds on a loaded machine,
// longer than the gateway's own wait for one (its ApplyTimeout), and a
// study should not fail on it. The patch only sets values, so a write that
// was reported lost but committed does no harm when sent again.
func (d *Deployment) patchThroughElection(ctx context.Context, gw int, patch []byte) (uint64, error) {
	for {
		v, err := d.patch(ctx, gw, patch)
		if err == nil || !errors.Is(err, errNoLeader) {
			return v, err
		}
		select {
		case <-ctx.Done():
			return 0, err
		case <-time.After(d.cfg.Poll):
		}
	}
}

// patch applies a merge patch to the routing config of the cluster
// holding gateway gw.
func (d *Deployment) patch(ctx context.Context, gw int, patch []byte) (uint64, error) {
	if d.cfg.AdminAddr != "" {
		c, err := config.Dial(d.cfg.AdminAddr, config.ClientOptions{Token: d.cfg.AdminToken})
		if err != nil {
			return 0, err
		}
		defer func() { _ = c.Close() }()
		v, err := c.PatchConfig(ctx, patch, nil)
		if errors.Is(err, config.ErrNoQuorum) || errors.Is(err, config.ErrNotLeader) {
			// (A gateway without sync/config's wire fix of this change
			// reports such a write as NOT_LEADER.)
			err = fmt.Errorf("%w: %w", errNoLeader, err)
		}
		return v, err
	}
	var out struct {
		Version uint64 `json:"version"`
	}
	code, err := d.do(ctx, http.MethodPatch, trim(d.cfg.Gateways[gw])+"/admin/v1/config", true, patch, &out)
	if code == http.StatusServiceUnavailable {
		err = fmt.Errorf("%w: %w", errNoLeader, err)
	}
	return out.Version, err
}

// World is one cell of a target run: an httpenv.Env over the deployment.
type World struct {
	*httpenv.Env
	d     *Deployment
	salts int
	// rng and next pick replicas client-side when there is no gateway.
	rng  *rand.Rand
	next int
}

// Send implements study.Engine. Without gateways a routed request goes
// straight to a replica kvbench picks: uniformly at random for "random",
// in turn for "round-robin", and for any other strategy (the scenarios'
// initialisation steps, which need a document's requests to land together)
// by a hash of the prompt's first affinityBytes bytes, the document's salt.
func (w *World) Send(req study.Request, done func(study.Outcome)) {
	if len(w.d.cfg.Gateways) == 0 && !req.Target.Direct {
		n := len(w.d.cfg.Engines)
		var r int
		switch req.Target.Strategy {
		case "random":
			r = w.rng.IntN(n)
		case "round-robin":
			r = w.next % n
			w.next++
		default:
			h := fnv.New64a()
			_, _ = h.Write([]byte(req.Prompt[:min(len(req.Prompt), affinityBytes)]))
			r = int(h.Sum64() % uint64(n))
		}
		req.Target = study.Target{Direct: true, Replica: r}
	}
	w.Env.Send(req, done)
}

// affinityBytes is the prompt prefix that pins a request to a replica in
// a run without gateways: a document's salt (study.SaltHexLen).
const affinityBytes = study.SaltHexLen

// Factory returns a study.EngineFactory over d: per cell it sets the index
// mode (verified on every gateway) and returns a World. The cell's gateway
// count must be the deployment's.
func Factory(d *Deployment) study.EngineFactory {
	return func(ctx context.Context, cell study.Cell) (study.Engine, error) {
		if n := len(d.cfg.Gateways); cell.Gateways != max(n, 1) {
			return nil, fmt.Errorf("%w: cell %s has %d gateways, the deployment %d", ErrInvalidConfig, cell.Name(), cell.Gateways, n)
		}
		if err := d.SetMode(ctx, cell.Mode); err != nil {
			return nil, err
		}
		ec := httpenv.DefaultConfig()
		ec.Engines = d.cfg.Engines
		ec.Gateways = d.cfg.Gateways
		if len(ec.Gateways) == 0 {
			ec.Gateways = []string{d.cfg.Engines[0].URL} // never used: every request is direct
		}
		ec.Model = d.cfg.Model
		ec.Speed = d.cfg.Speed
		ec.ControlTimeout = d.cfg.ControlTimeout
		ec.IdleTimeout = d.cfg.IdleTimeout
		env, err := httpenv.New(ec)
		if err != nil {
			return nil, err
		}
		w := &World{Env: env, d: d, rng: rand.New(rand.NewPCG(d.seed, 17))}
		return w, nil
	}
}

// ResetCaches implements study.Engine: the engines' reset endpoint, or a
// fresh cache_salt (study.IsolationSalt).
func (w *World) ResetCaches(ctx context.Context) error {
	if w.d.info.Isolation == study.IsolationSalt {
		w.salts++
		w.SetCacheSalt(fmt.Sprintf("kvbench-%d-%d", time.Now().UnixNano(), w.salts))
		return nil
	}
	return w.Env.ResetCaches(ctx)
}

// Settle implements study.Settler: it waits until every gateway's index
// holds as many history and confirmed entries as the first gateway's.
func (w *World) Settle(ctx context.Context) error {
	gws := w.d.cfg.Gateways
	if len(gws) < 2 || !w.d.info.Clustered {
		return nil
	}
	deadline := time.Now().Add(w.d.cfg.SettleTimeout)
	for {
		why, err := w.disagreement(ctx)
		if err == nil && why == "" {
			return nil
		}
		if err != nil {
			why = err.Error()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w within %v: %s", ErrNotSettled, w.d.cfg.SettleTimeout, why)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(w.d.cfg.Poll):
		}
	}
}

type indexStats struct {
	Indexes []struct {
		Name      string `json:"name"`
		History   int64  `json:"history_entries"`
		Confirmed int64  `json:"confirmed_entries"`
	} `json:"indexes"`
}

func (w *World) disagreement(ctx context.Context) (string, error) {
	var ref indexStats
	for i, g := range w.d.cfg.Gateways {
		var s indexStats
		if _, err := w.d.do(ctx, http.MethodGet, trim(g)+"/admin/v1/index/stats", true, nil, &s); err != nil {
			return "", err
		}
		if i == 0 {
			ref = s
			continue
		}
		if len(s.Indexes) != len(ref.Indexes) {
			return fmt.Sprintf("%s has %d indexes, %s %d", g, len(s.Indexes), w.d.cfg.Gateways[0], len(ref.Indexes)), nil
		}
		for j := range s.Indexes {
			a, b := ref.Indexes[j], s.Indexes[j]
			if a.History != b.History || a.Confirmed != b.Confirmed {
				return fmt.Sprintf("%s holds %d history/%d confirmed entries, %s %d/%d", g, b.History, b.Confirmed,
					w.d.cfg.Gateways[0], a.History, a.Confirmed), nil
			}
		}
	}
	return "", nil
}
