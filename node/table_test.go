package node

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/route"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestReloadDrainsRemovedReplica swaps the routing table while a stream
// runs on a replica the new table removes: the stream finishes, new
// requests go to the replica the table added, and the removed replica's
// probes stop.
func TestReloadDrainsRemovedReplica(t *testing.T) {
	slow := newFakeEngine(t, "slow")
	slow.chunks.Store(10)
	slow.chunkDelay.Store(int64(30 * time.Millisecond))
	fresh := newFakeEngine(t, "fresh")
	n := startNode(t, nil, rc("slow", slow.url()))
	before := n.tbl.Load()

	done := make(chan string, 1)
	go func() {
		req, err := http.NewRequest(http.MethodPost, "http://"+n.HTTPAddr()+"/v1/completions", strings.NewReader(streamReq))
		if err != nil {
			done <- err.Error()
			return
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			done <- err.Error()
			return
		}
		defer resp.Body.Close()
		var b strings.Builder
		buf := make([]byte, 4096)
		for {
			k, err := resp.Body.Read(buf)
			b.Write(buf[:k])
			if err != nil {
				break
			}
		}
		done <- resp.Header.Get(HeaderReplica) + "|" + b.String()
	}()
	<-slow.started

	spec := specFromConfig(&n.cfg)
	spec.version = 7
	spec.strategy = "least-request"
	spec.models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("fresh", fresh.url())}}}
	require.NoError(t, n.applySpec(spec))
	assert.EqualValues(t, 7, n.ConfigVersion())
	assert.Equal(t, []string{"fresh"}, n.Replicas())
	require.NotNil(t, before.byName["slow"].cancel)

	for i := 0; i < 5; i++ {
		resp := post(t, n, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"after %d","max_tokens":1}`, i), nil)
		assert.Equal(t, "fresh", resp.Header.Get(HeaderReplica), "no new traffic to a removed replica")
		readAll(t, resp)
	}
	select {
	case out := <-done:
		assert.True(t, strings.HasPrefix(out, "slow|"), out)
		assert.True(t, strings.HasSuffix(out, "data: [DONE]\n\n"), "the in-flight stream finished: %q", out)
	case <-time.After(10 * time.Second):
		t.Fatal("the stream to the removed replica did not finish")
	}
	assert.Zero(t, before.byName["slow"].inflight.Load())
	require.Eventually(t, func() bool { return fresh.requests.Load() >= 5 }, 5*time.Second, time.Millisecond)
}

// TestReloadCarriesReplicasOver checks that a rebuild keeps the *replica of
// an unchanged definition (its counters and health), replaces a changed
// one under the same ID, and keeps the strategy set (the cost model's
// learned rates) while the route parameters are equal.
func TestReloadCarriesReplicasOver(t *testing.T) {
	a, b := newFakeEngine(t, "a"), newFakeEngine(t, "b")
	n := startNode(t, nil, rc("a", a.url()), rc("b", b.url()))
	t0 := n.tbl.Load()
	ra, rb := t0.byName["a"], t0.byName["b"]
	ra.inflight.Store(3) // stands for requests in flight across the reload

	spec := specFromConfig(&n.cfg)
	spec.models = []ModelConfig{{Name: "m", Strategy: "cost", Replicas: []ReplicaConfig{
		rc("a", a.url()), {Name: "b", URL: b.url() + "/"}}}}
	require.NoError(t, n.applySpec(spec))
	t1 := n.tbl.Load()
	assert.Same(t, ra, t1.byName["a"], "unchanged replica carried over")
	assert.EqualValues(t, 3, t1.byName["a"].inflight.Load())
	assert.NotSame(t, rb, t1.byName["b"], "changed definition: a new replica")
	assert.Equal(t, rb.id, t1.byName["b"].id, "same name, same index ID")
	assert.Same(t, t0.pools[0].set, t1.pools[0].set, "route parameters unchanged: strategies kept")
	assert.Equal(t, "cost", t1.pools[0].strategy)
	ra.inflight.Store(0)

	spec.route.PrefixCache.ImbalanceAbsCount++
	require.NoError(t, n.applySpec(spec))
	assert.NotSame(t, t1.pools[0].set, n.tbl.Load().pools[0].set, "new route parameters: new strategies")

	bad := spec
	bad.models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", a.url()), rc("a", b.url())}}}
	require.ErrorIs(t, n.applySpec(bad), ErrInvalidConfig)
	assert.Len(t, n.tbl.Load().replicas, 2, "a rejected table leaves the current one in force")
}

func TestReadyStandalone(t *testing.T) {
	a := newFakeEngine(t, "a")
	n := startNode(t, nil, rc("a", a.url()))
	resp, err := http.Get("http://" + n.HTTPAddr() + "/ready")
	require.NoError(t, err)
	body := readAll(t, resp)
	assert.Equal(t, http.StatusOK, resp.StatusCode, body)
	assert.Contains(t, body, `"config_version":0`)
	resp, err = http.Get("http://" + n.HTTPAddr() + "/admin/v1/config")
	require.NoError(t, err)
	readAll(t, resp)
	assert.Equal(t, http.StatusNotFound, resp.StatusCode, "no admin API standalone")
	assert.Empty(t, n.AdminAddr())
	assert.Nil(t, n.Cluster())
}

func TestReplicaIDsForeignNames(t *testing.T) {
	m := newReplicaIDs()
	a, err := m.assign("a")
	require.NoError(t, err)
	x, ok := m.ReplicaID("x")
	require.True(t, ok, "a name a peer mentions first gets an ID")
	assert.NotEqual(t, a, x)
	x2, err := m.assign("x")
	require.NoError(t, err)
	assert.Equal(t, x, x2, "the config adding it later finds the same ID")
	name, ok := m.ReplicaName(x)
	require.True(t, ok)
	assert.Equal(t, "x", name)
	for i := 1; i < maxForeignReplicas; i++ {
		_, ok := m.ReplicaID(fmt.Sprintf("f%d", i))
		require.True(t, ok)
	}
	_, ok = m.ReplicaID("one-too-many")
	assert.False(t, ok, "foreign names are bounded")
	_, err = m.assign("configured")
	assert.NoError(t, err, "configured names are not")
	_, ok = m.ReplicaID("")
	assert.False(t, ok)
}

// TestStandaloneTakesScrapeIntervalAsPeerDelay: outside a cluster other
// senders show only in the engines' scrapes, so an unset peer load delay
// is the scrape interval; a set one (or a cluster gateway's) is kept.
func TestStandaloneTakesScrapeIntervalAsPeerDelay(t *testing.T) {
	cfg := testConfig()
	cfg.ScrapeInterval = 250 * time.Millisecond
	cfg.SharedScrapeInterval = 0
	cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{{Name: "r0", URL: "http://127.0.0.1:10000"}}}}
	n, err := New(cfg, nil)
	require.NoError(t, err)
	var rc route.Config
	require.Equal(t, 0.25, n.routeConfig(rc).PeerLoadDelaySeconds)
	// The replicas other senders share are scraped at the shared
	// interval: that is how stale their load is.
	n.cfg.SharedScrapeInterval = 100 * time.Millisecond
	require.Equal(t, 0.1, n.routeConfig(rc).PeerLoadDelaySeconds)
	n.cfg.SharedScrapeInterval = time.Second
	require.Equal(t, 0.25, n.routeConfig(rc).PeerLoadDelaySeconds, "a shared interval not below the scrape interval changes nothing")
	rc.PeerLoadDelaySeconds = 0.05
	require.Equal(t, 0.05, n.routeConfig(rc).PeerLoadDelaySeconds, "an operator's value stands")
	n.cl = &clusterParts{}
	require.Zero(t, n.routeConfig(route.Config{}).PeerLoadDelaySeconds, "a cluster gateway's peers report load")
}

// TestDroppedReplicaLeavesNoSeries: a replica whose name leaves the
// routing table takes every series labelled with it along, in the
// gateway's metrics and in the KV-event counters; the replica that stays
// keeps its own. Pods that come and go under new names must not grow the
// gateway's series for as long as it runs.
func TestDroppedReplicaLeavesNoSeries(t *testing.T) {
	old := newFakeEngine(t, "old")
	stay := newFakeEngine(t, "stay")
	n := startNode(t, nil, rc("old", old.url()), rc("stay", stay.url()))
	// Until both replicas served one: the strategy may send several in a
	// row to one of them (ci1091 sent all of six to "stay", on a machine
	// running five CI runs at once).
	for i := 0; i < 64 && (old.requests.Load() == 0 || stay.requests.Load() == 0); i++ {
		resp := post(t, n, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"series %d","max_tokens":2,"stream":true}`, i), nil)
		readAll(t, resp)
	}
	require.Positive(t, old.requests.Load(), "the test needs traffic on the replica it drops")
	require.Positive(t, stay.requests.Load(), "the test needs traffic on the replica that stays")
	// The series traffic alone does not make here (failures, ejections,
	// KV events) are made directly: what matters is that they go.
	for _, name := range []string{"old", "stay"} {
		n.m.upstreamErrors.WithLabelValues(name, "connect").Inc()
		n.m.ejections.WithLabelValues(name).Inc()
		n.m.kvApplyErrors.WithLabelValues(name, "unknown_parent").Inc()
		n.kvMetrics.Batches.WithLabelValues(name).Inc()
		n.kvMetrics.Resets.WithLabelValues(name, "gap_unrecoverable").Inc()
	}
	series := func(replica string) []string {
		mfs, err := n.m.reg.Gather()
		require.NoError(t, err)
		var out []string
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				for _, lp := range m.GetLabel() {
					if lp.GetName() == "replica" && lp.GetValue() == replica {
						out = append(out, mf.GetName())
					}
				}
			}
		}
		return out
	}
	for _, want := range []string{"kvmesh_proxy_inflight", "kvmesh_proxy_replica_healthy", "kvmesh_proxy_scrape_interval_seconds", "kvmesh_proxy_ttft_seconds",
		"kvmesh_route_replica_decisions_total", "kvmesh_route_estimated_past_target_total", "kvmesh_proxy_upstream_errors_total", "kvmesh_proxy_ejections_total",
		"kvmesh_index_kv_apply_errors_total", "kvmesh_kvevents_batches_total", "kvmesh_kvevents_resets_total"} {
		require.Contains(t, series("old"), want)
	}

	spec := specFromConfig(&n.cfg)
	spec.version = 2
	spec.models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("stay", stay.url())}}}
	require.NoError(t, n.applySpec(spec))
	assert.Empty(t, series("old"), "series of the dropped replica")
	assert.Contains(t, series("stay"), "kvmesh_proxy_ttft_seconds")
	assert.Contains(t, series("stay"), "kvmesh_kvevents_batches_total")
}

// TestDroppedReplicasCancelledProbeCountsNothing: a replica dropped while
// its probe loop waits on a scrape cancels that scrape; the cancelled
// scrape is not the engine's failure, and counting it brought the dropped
// replica's series back right after they were deleted (ci1134).
func TestDroppedReplicasCancelledProbeCountsNothing(t *testing.T) {
	scraping := make(chan struct{}, 1)
	eng := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			select {
			case scraping <- struct{}{}:
			default:
			}
			<-r.Context().Done() // until the gateway gives up
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(eng.Close)
	stay := newFakeEngine(t, "stay")
	n := startNode(t, func(c *Config) {
		c.ScrapeTimeout = time.Hour // only the drop ends the scrape
		c.HealthInterval = 0
	}, rc("old", eng.URL), rc("stay", stay.url()))
	select {
	case <-scraping:
	case <-time.After(30 * time.Second):
		t.Fatal("the gateway never scraped the replica")
	}
	n.reloadMu.Lock()
	var done chan struct{}
	for r, ch := range n.probeDone {
		if r.name == "old" {
			done = ch
		}
	}
	n.reloadMu.Unlock()
	require.NotNil(t, done)

	spec := specFromConfig(&n.cfg)
	spec.version = 2
	spec.models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("stay", stay.url())}}}
	require.NoError(t, n.applySpec(spec))
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the dropped replica's probe loop did not return")
	}
	assert.Zero(t, counterValue(t, n, "kvmesh_proxy_upstream_errors_total", map[string]string{"replica": "old"}),
		"the cancelled scrape counted as the engine's failure")
}

// TestReloadWithNewAddressForgetsHistory: a replica whose name now points
// at another address (a pod replaced under a stable name) is another
// engine with an empty cache, so the history of where prompts went goes
// with the reload; the replica that kept its address keeps its history,
// and so does one whose URL changed only in its path.
func TestReloadWithNewAddressForgetsHistory(t *testing.T) {
	a, b, c := newFakeEngine(t, "a"), newFakeEngine(t, "b"), newFakeEngine(t, "c")
	n := startNode(t, func(c *Config) { c.Tokenizer = TokenizerCharacter; c.BlockSize = 16 }, rc("a", a.url()), rc("b", b.url()))
	prompts := map[string]string{}
	for i := 0; len(prompts) < 2 && i < 64; i++ {
		p := fmt.Sprintf("history %d %s", i, strings.Repeat("of where the prompt went. ", 4))
		resp := post(t, n, "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":1}`, p), nil)
		readAll(t, resp)
		if r := resp.Header.Get(HeaderReplica); prompts[r] == "" {
			prompts[r] = p
		}
	}
	require.Len(t, prompts, 2, "the test needs a prompt on each replica")
	for r, p := range prompts {
		require.Positive(t, matchedOf(debugRoute(t, n, "prefix-cache", p), r), "replica %s", r)
	}

	spec := specFromConfig(&n.cfg)
	spec.version = 2
	spec.models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("a", a.url()+"/"), rc("b", c.url())}}}
	require.NoError(t, n.applySpec(spec))
	assert.Positive(t, matchedOf(debugRoute(t, n, "prefix-cache", prompts["a"]), "a"), "a path change is the same engine")
	assert.Zero(t, matchedOf(debugRoute(t, n, "prefix-cache", prompts["b"]), "b"), "b's old engine's history outlived the reload")
}

// TestSharedEnginesScrapedFaster: outside a cluster, once a scrape shows
// an engine running requests this gateway did not send (another
// gateway's, a client's going straight to the engine), every replica is
// scraped at SharedScrapeInterval, and the gauge says so; sharedMemory
// intervals after the last such scrape the gateway returns to
// ScrapeInterval. A gateway whose engines run only its own requests, or
// whose peers report their load (a cluster gateway), keeps
// ScrapeInterval.
func TestSharedEnginesScrapedFaster(t *testing.T) {
	tune := func(c *Config) {
		c.ScrapeInterval = time.Minute
		c.SharedScrapeInterval = 10 * time.Millisecond // remembered for 1 s
	}
	interval := func(n *Node, replica string) float64 {
		return gaugeOf(n.m.scrapeInterval.WithLabelValues(replica))
	}
	idle := newFakeEngine(t, "idle")
	busy := newFakeEngine(t, "busy")
	busy.running.Store(3) // requests of a sender this gateway cannot see
	n := startNode(t, tune, rc("idle", idle.url()), rc("busy", busy.url()))
	solo := newFakeEngine(t, "solo")
	alone := startNode(t, tune, rc("solo", solo.url()))
	// Peers that report their load cover the other senders.
	other := newFakeEngine(t, "other")
	other.running.Store(3)
	cfg := testConfig()
	cfg.Models = []ModelConfig{{Name: "m", Replicas: []ReplicaConfig{rc("other", other.url())}}}
	tune(&cfg)
	member, err := New(cfg, nil)
	require.NoError(t, err)
	member.SetPeerLoad(fixedPeers{})
	require.NoError(t, member.Start(context.Background()))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		require.NoError(t, member.Shutdown(ctx))
	})

	require.Eventually(t, func() bool { return idle.scrapes.Load() >= 10 && busy.scrapes.Load() >= 10 }, 10*time.Second, 5*time.Millisecond,
		"every replica of a gateway that shares its engines is scraped at shared_scrape_interval")
	require.Equal(t, 0.01, interval(n, "idle"))
	require.Equal(t, 0.01, interval(n, "busy"))
	require.EqualValues(t, 1, solo.scrapes.Load(), "a gateway alone on its engines: its first scrape only")
	require.Equal(t, 60.0, interval(alone, "solo"))
	require.Eventually(t, func() bool { return other.scrapes.Load() >= 1 }, 10*time.Second, 5*time.Millisecond)
	require.EqualValues(t, 1, other.scrapes.Load(), "a gateway whose peers report load: its first scrape only")
	require.Equal(t, 60.0, interval(member, "other"))

	// The other sender leaves: a second later, scrape_interval again.
	busy.running.Store(0)
	require.Eventually(t, func() bool { return interval(n, "idle") == 60 && interval(n, "busy") == 60 }, 10*time.Second, 5*time.Millisecond,
		"back at scrape_interval once no scrape showed other senders for 100 shared intervals")
}
