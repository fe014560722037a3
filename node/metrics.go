package node

import (
	"regexp"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvmesh/kvmesh/internal/buildinfo"
)

// Upstream error reasons, the `reason` label of
// kvmesh_proxy_upstream_errors_total.
const (
	reasonConnect        = "connect" // dial failed or timed out
	reasonFirstByte      = "first_byte_timeout"
	reasonIdle           = "idle_timeout"    // silence between chunks
	reasonStatus5xx      = "status_5xx"      // the engine answered 5xx
	reasonReset          = "reset"           // connection broke before the response
	reasonMidStream      = "mid_stream"      // body broke after bytes were relayed
	reasonHealthCheck    = "health_check"    // active /health poll failed
	reasonScrape         = "scrape"          // /metrics scrape failed
	reasonRemoteTokenize = "remote_tokenize" // /tokenize failed, local fallback used
)

// schedLatencies adds the Go runtime's scheduling latency histogram to
// the default Go metrics, as go_sched_latencies_seconds: how long
// goroutines that were ready to run (a socket became readable, a lock was
// released) waited for a thread. A proxy's latency past its own work is
// mostly this wait when its cores are short (issue 21): on the 2-core
// proxybench machine at 200 streams, a runtime trace put 6 s of such
// waits in 2 s, against about 11 ms waiting on mutexes and 12 ms in
// net/http's condition wait.
var schedLatencies = collectors.GoRuntimeMetricsRule{Matcher: regexp.MustCompile(`^/sched/latencies:seconds$`)}

// metrics are one Node's series, registered on the Node's private registry.
type metrics struct {
	reg *prometheus.Registry

	decisions      *prometheus.CounterVec   // model, strategy, selection
	matchFraction  *prometheus.HistogramVec // model
	decisionTime   *prometheus.HistogramVec // strategy
	inflight       *prometheus.GaugeVec     // replica
	upstreamErrors *prometheus.CounterVec   // replica, reason
	ttft           *prometheus.HistogramVec // replica
	ttftEstimate   *prometheus.HistogramVec // replica: observed TTFT / cost's estimate
	healthy        *prometheus.GaugeVec     // replica
	scrapeInterval *prometheus.GaugeVec     // replica
	enginesShared  prometheus.Gauge
	ejections      *prometheus.CounterVec // replica
	retries        prometheus.Counter
	failOpen       *prometheus.CounterVec // model
	requests       *prometheus.CounterVec // model, code
	clientErrors   *prometheus.CounterVec // code
	tokenizeCache  *prometheus.CounterVec // result
	kvApplyErrors  *prometheus.CounterVec // replica, reason
	// restartRequired is 1 while the applied cluster config changes what
	// only a restart applies (hash seed, block size, tokenizer, index).
	restartRequired prometheus.Gauge

	// Self-check (selfcheck.go) and tokenizer agreement (agreement.go).
	predictionError  *prometheus.HistogramVec // replica, basis
	predictionChecks *prometheus.CounterVec   // replica, outcome
	suspect          *prometheus.GaugeVec     // replica, reason
	agreement        *prometheus.GaugeVec     // model, replica
	engineTokenizes  *prometheus.GaugeVec     // model

	// Operator's first look (issue 19): where the traffic goes, what the
	// gateway costs a request, and which build runs.
	replicaDecisions *prometheus.CounterVec   // model, replica
	pastTarget       *prometheus.CounterVec   // model, replica: cost's pick estimated past the TTFT target
	requestDuration  *prometheus.HistogramVec // model
	addedLatency     prometheus.Histogram
	buildInfo        *prometheus.GaugeVec // version, revision, goversion

	cache seriesCache // resolved children for the per-request path
	// Responses API affinity (responses.go).
	responseAffinity *prometheus.CounterVec // result
}

func newMetrics() *metrics {
	m := &metrics{reg: prometheus.NewRegistry()}
	m.decisions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_route_decisions_total",
		Help: "Routing decisions by model, strategy and the strategy branch that picked (selection).",
	}, []string{"model", "strategy", "selection"})
	m.matchFraction = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "kvmesh_route_match_fraction",
		Help:    "Fraction of the prompt's full blocks the picked replica was believed to hold.",
		Buckets: []float64{0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1},
	}, []string{"model"})
	m.decisionTime = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "kvmesh_route_decision_seconds",
		Help:    "Time from block keys to a pick: index match, load view and strategy (tokenization excluded).",
		Buckets: []float64{1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2},
	}, []string{"strategy"})
	m.inflight = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvmesh_proxy_inflight",
		Help: "Requests this gateway has in flight to each replica.",
	}, []string{"replica"})
	m.upstreamErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_proxy_upstream_errors_total",
		Help: "Failures talking to a replica, by reason.",
	}, []string{"replica", "reason"})
	m.ttft = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "kvmesh_proxy_ttft_seconds",
		Help:    "Time from sending a streaming request upstream to its first body byte, as the gateway sees it.",
		Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32},
	}, []string{"replica"})
	m.ttftEstimate = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kvmesh_route_ttft_estimate_ratio",
		Help: "A streaming request's TTFT as the gateway saw it over the cost strategy's estimate when it routed it (1: exact; below 1: the estimate was high). " +
			"Estimates far off on one replica point at its load view or learned rates (see kvmesh explain).",
		Buckets: prometheus.ExponentialBuckets(1.0/8, 2, 7), // 0.125 … 8
	}, []string{"replica"})
	m.healthy = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvmesh_proxy_replica_healthy",
		Help: "1 when the replica is in rotation (not ejected, /health passing), else 0. A model with none in rotation still routes to those failing /health alone (kvmesh_route_fail_open_total).",
	}, []string{"replica"})
	m.scrapeInterval = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvmesh_proxy_scrape_interval_seconds",
		Help: "How often the replica's /metrics is scraped now: shared_scrape_interval while the gateway's engines run requests of senders it cannot see (gateways outside its cluster, direct clients), scrape_interval otherwise.",
	}, []string{"replica"})
	m.enginesShared = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kvmesh_proxy_engines_shared",
		Help: "1 while the gateway scrapes its replicas at shared_scrape_interval: outside a cluster, its engines ran requests it did not send within the last 100 such intervals (other gateways', direct clients'); it routes on their load only as fresh as those scrapes. Gateways that share engines route best as one cluster.",
	})
	m.ejections = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_proxy_ejections_total",
		Help: "Passive ejections after consecutive failures.",
	}, []string{"replica"})
	m.retries = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvmesh_proxy_retries_total",
		Help: "Requests retried on another replica after a connect failure.",
	})
	m.failOpen = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_route_fail_open_total",
		Help: "Routing decisions made among replicas failing their /health polls, because none of the model's passed them (health_fail_open).",
	}, []string{"model"})
	m.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_proxy_requests_total",
		Help: "Proxied requests by model and HTTP status code class (2xx, 4xx, 5xx) or error.",
	}, []string{"model", "code"})
	m.clientErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_http_client_errors_total",
		Help: "Requests refused by the gateway itself, by stable error code.",
	}, []string{"code"})
	m.tokenizeCache = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_tokenize_remote_total",
		Help: "Remote tokenizations by result: hit (cache), miss (engine asked), fallback (local tokenizer used).",
	}, []string{"result"})
	m.kvApplyErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_index_kv_apply_errors_total",
		Help: "KV-event batches or events the index could not apply, by replica and reason.",
	}, []string{"replica", "reason"})
	m.restartRequired = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kvmesh_config_restart_required",
		Help: "1 while the applied cluster config changes hash seed, block size, tokenizer or index bounds, which take effect only when the gateway restarts.",
	})
	m.reg.MustRegister(m.decisions, m.matchFraction, m.decisionTime, m.inflight,
		m.upstreamErrors, m.ttft, m.ttftEstimate, m.healthy, m.scrapeInterval, m.enginesShared, m.ejections, m.retries, m.failOpen, m.requests,
		m.clientErrors, m.tokenizeCache, m.kvApplyErrors, m.restartRequired,
		collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(schedLatencies)),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.registerSelfCheck()
	m.registerAgreement()
	m.replicaDecisions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_route_replica_decisions_total",
		Help: "Routing decisions this gateway made, by model and the replica picked (retries count again).",
	}, []string{"model", "replica"})
	m.pastTarget = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_route_estimated_past_target_total",
		Help: "Cost decisions whose pick was estimated past the TTFT target (cost.ttft_target_seconds), by model and replica: even the best replica was expected to miss the SLO, " +
			"so the replicas are short of capacity for the load (or cost's view of them is off: kvmesh_route_ttft_estimate_ratio).",
	}, []string{"model", "replica"})
	m.requestDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "kvmesh_http_request_duration_seconds",
		Help:    "End to end, as the gateway sees a proxied request: from its arrival (before the body is read) to the last byte relayed, by model.",
		Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128},
	}, []string{"model"})
	m.addedLatency = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "kvmesh_http_added_latency_seconds",
		Help:    "What the gateway adds before the engine sees a request: from its arrival to the upstream request being sent (body read, tokenization, routing; per attempt).",
		Buckets: []float64{1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25},
	})
	m.buildInfo = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kvmesh_build_info",
		Help: "Always 1; the labels name the running build (kvmesh --version).",
	}, []string{"version", "revision", "goversion"})
	bi := buildinfo.Get()
	m.buildInfo.WithLabelValues(bi.Version, bi.Revision, bi.GoVersion).Set(1)
	m.reg.MustRegister(m.replicaDecisions, m.pastTarget, m.requestDuration, m.addedLatency, m.buildInfo)
	m.responseAffinity = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_proxy_response_affinity_total",
		Help: "Requests naming a stored response (previous_response_id, /v1/responses/{id}) by how its owning replica was found: known (relayed here), shared (recorded by a peer), discovered (asked the engines), unknown, owner_gone (its replica left the pool), owner_unavailable (ejected or failing health), shared_store (affinity off), undiscovered (a replica did not answer the lookup: 503 response_owner_undiscovered), discovery_busy (too many lookups at once: the same 503).",
	}, []string{"result"})
	m.reg.MustRegister(m.responseAffinity)
	return m
}

// decisionKey names the series one routing decision updates.
type decisionKey struct{ model, strategy, selection string }

// decisionSeries are those series, resolved once: label lookups hash every
// label value under a lock, which the per-request path need not repeat.
type decisionSeries struct {
	decisions prometheus.Counter
	took      prometheus.Observer
	match     prometheus.Observer
}

// requestKey names one kvmesh_proxy_requests_total series.
type requestKey struct{ model, code string }

// seriesCache holds the hot path's resolved metric children. Series of
// these vectors are never deleted, so a cached child stays the registered
// one.
type seriesCache struct {
	mu        sync.RWMutex
	decisions map[decisionKey]*decisionSeries
	requests  map[requestKey]prometheus.Counter
	durations map[string]prometheus.Observer
}

func (m *metrics) decisionSeries(k decisionKey) *decisionSeries {
	c := &m.cache
	c.mu.RLock()
	s := c.decisions[k]
	c.mu.RUnlock()
	if s != nil {
		return s
	}
	s = &decisionSeries{
		decisions: m.decisions.WithLabelValues(k.model, k.strategy, k.selection),
		took:      m.decisionTime.WithLabelValues(k.strategy),
		match:     m.matchFraction.WithLabelValues(k.model),
	}
	c.mu.Lock()
	if c.decisions == nil {
		c.decisions = map[decisionKey]*decisionSeries{}
	}
	c.decisions[k] = s
	c.mu.Unlock()
	return s
}

// duration returns the kvmesh_http_request_duration_seconds child for model.
func (m *metrics) duration(model string) prometheus.Observer {
	c := &m.cache
	c.mu.RLock()
	s := c.durations[model]
	c.mu.RUnlock()
	if s != nil {
		return s
	}
	s = m.requestDuration.WithLabelValues(model)
	c.mu.Lock()
	if c.durations == nil {
		c.durations = map[string]prometheus.Observer{}
	}
	c.durations[model] = s
	c.mu.Unlock()
	return s
}

// queuedPrefillCollector exports kvmesh_route_queued_prefill_tokens, read
// from the routing table at scrape time (the figure explain shows as
// QUEUED): nothing is updated on the request path for it.
type queuedPrefillCollector struct{ n *Node }

var queuedPrefillDesc = prometheus.NewDesc("kvmesh_route_queued_prefill_tokens",
	"Prompt tokens this gateway sent to a replica whose first token has not come back yet: the prefill queued there by this gateway (the cost model's QUEUED).",
	[]string{"model", "replica"}, nil)

func (c queuedPrefillCollector) Describe(ch chan<- *prometheus.Desc) { ch <- queuedPrefillDesc }

func (c queuedPrefillCollector) Collect(ch chan<- prometheus.Metric) {
	t := c.n.tbl.Load()
	if t == nil {
		return
	}
	for _, r := range t.replicas {
		ch <- prometheus.MustNewConstMetric(queuedPrefillDesc, prometheus.GaugeValue,
			float64(max(r.queuedPrefill.Load(), 0)), r.model, r.name)
	}
}

// request returns the kvmesh_proxy_requests_total child for model and code.
func (m *metrics) request(model, code string) prometheus.Counter {
	k := requestKey{model, code}
	c := &m.cache
	c.mu.RLock()
	s := c.requests[k]
	c.mu.RUnlock()
	if s != nil {
		return s
	}
	s = m.requests.WithLabelValues(model, code)
	c.mu.Lock()
	if c.requests == nil {
		c.requests = map[requestKey]prometheus.Counter{}
	}
	c.requests[k] = s
	c.mu.Unlock()
	return s
}

// forgetSeries deletes the series a dropped replica (its name gone from
// the routing table) leaves in the gateway's own metrics (self-check
// included; forgetChecks handles the agreement series, under their lock)
// and in the KV-event counters. Without it a deployment whose pods come and go, each
// under a new name, grows a set of series per pod it ever had for as long
// as the gateway runs. A request to the replica still finishing creates
// its few series again; they go with the process.
func (n *Node) forgetSeries(r *replica) {
	l := prometheus.Labels{"replica": r.name}
	for _, v := range []interface {
		DeletePartialMatch(prometheus.Labels) int
	}{n.m.inflight, n.m.healthy, n.m.scrapeInterval, n.m.ttft, n.m.ttftEstimate, n.m.ejections, n.m.upstreamErrors,
		n.m.kvApplyErrors, n.m.replicaDecisions, n.m.pastTarget, n.m.suspect, n.m.predictionChecks, n.m.predictionError} {
		v.DeletePartialMatch(l)
	}
	n.kvMetrics.Forget(r.name)
}
