package sim

import (
	"github.com/prometheus/client_golang/prometheus"
	"strconv"
)

// ttftBuckets are vLLM's buckets for vllm:time_to_first_token_seconds.
var ttftBuckets = []float64{
	0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
	2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
}

// e2eBuckets are vLLM's buckets for vllm:e2e_request_latency_seconds.
var e2eBuckets = []float64{
	0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
	50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
}

// tpotBuckets are vLLM's buckets for vllm:time_per_output_token_seconds.
var tpotBuckets = []float64{
	0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
	2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
}

// lagBuckets are for kvmesh_sim_driver_lag_seconds, in wall seconds.
var lagBuckets = []float64{
	0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
	0.25, 0.5, 1, 2.5,
}

// metrics are the replica's Prometheus metrics, with vLLM's names and the
// model_name label, on a private registry. Durations are model seconds.
type metrics struct {
	reg       *prometheus.Registry
	success   *prometheus.CounterVec
	ttft      prometheus.Histogram
	e2e       prometheus.Histogram
	tpot      prometheus.Histogram
	driverLag prometheus.Histogram
	genTokens prometheus.Counter
	prompt    prometheus.Counter
	aborted   prometheus.Counter
	published prometheus.Counter
	pubErrors prometheus.Counter
}

// newMetrics registers the metrics; gauges and the prefix-cache counters read
// the engine through stats, which must be safe to call from any goroutine.
func newMetrics(model string, engine int, stats func() Stats) *metrics {
	l := prometheus.Labels{"model_name": model}
	if engine >= 0 {
		// vLLM labels every metric with the engine core's index too (its
		// data-parallel rank); the simulator adds it for a DPServer's
		// ranks only, so a single engine's exposition stays as it was.
		l["engine"] = strconv.Itoa(engine)
	}
	m := &metrics{
		reg: prometheus.NewRegistry(),
		success: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vllm:request_success_total", Help: "Count of successfully processed requests.", ConstLabels: l,
		}, []string{"finished_reason"}),
		ttft: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "vllm:time_to_first_token_seconds", Help: "Histogram of time to first token in seconds (model time).",
			ConstLabels: l, Buckets: ttftBuckets,
		}),
		e2e: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "vllm:e2e_request_latency_seconds", Help: "Histogram of end to end request latency in seconds (model time).",
			ConstLabels: l, Buckets: e2eBuckets,
		}),
		tpot: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "vllm:time_per_output_token_seconds", Help: "Histogram of time per output token in seconds (model time).",
			ConstLabels: l, Buckets: tpotBuckets,
		}),
		driverLag: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:        "kvmesh_sim_driver_lag_seconds",
			Help:        "Simulator only: wall seconds by which each engine step's outputs were released after their model-schedule due time (host scheduling delay; model time is not stretched by it).",
			ConstLabels: l, Buckets: lagBuckets,
		}),
		genTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vllm:generation_tokens_total", Help: "Number of generation tokens processed.", ConstLabels: l,
		}),
		prompt: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vllm:prompt_tokens_total", Help: "Number of prefill tokens processed.", ConstLabels: l,
		}),
		aborted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vllm:request_aborted_total", Help: "Requests aborted because the client went away (simulator only).", ConstLabels: l,
		}),
		published: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vllm:kv_event_batches_published_total", Help: "KV event batches published (simulator only).", ConstLabels: l,
		}),
		pubErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vllm:kv_event_publish_errors_total", Help: "KV event batches the publisher refused (simulator only).", ConstLabels: l,
		}),
	}
	gauge := func(name, help string, f func(Stats) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: l}, func() float64 { return f(stats()) })
	}
	counter := func(name, help string, f func(Stats) float64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: l}, func() float64 { return f(stats()) })
	}
	m.reg.MustRegister(
		m.success, m.ttft, m.e2e, m.tpot, m.driverLag, m.genTokens, m.prompt, m.aborted, m.published, m.pubErrors,
		gauge("vllm:num_requests_running", "Number of requests in model execution batches.", func(s Stats) float64 { return float64(s.Running) }),
		gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", func(s Stats) float64 { return float64(s.Waiting) }),
		gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", func(s Stats) float64 { return s.KVUsage }),
		// The pre-v0.10 name, still read by some gateways.
		gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", func(s Stats) float64 { return s.KVUsage }),
		counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", func(s Stats) float64 { return float64(s.PrefixQueries) }),
		counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", func(s Stats) float64 { return float64(s.PrefixHits) }),
		counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", func(s Stats) float64 { return float64(s.Preemptions) }),
	)
	return m
}
