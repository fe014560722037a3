package sync

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the cluster's Prometheus collectors (kvmesh_sync_*).
type metrics struct {
	members          prometheus.Gauge
	eventsDropped    prometheus.Counter
	published        *prometheus.CounterVec // {kind, transport}
	applied          *prometheus.CounterVec // {kind}
	dropped          *prometheus.CounterVec // {kind, reason}
	malformed        *prometheus.CounterVec // {source}
	lag              prometheus.Histogram
	gaps             *prometheus.CounterVec // {kind}
	bootstrapSeconds prometheus.Histogram
	bootstrapBytes   prometheus.Counter
	servedBytes      prometheus.Counter
	bootstraps       *prometheus.CounterVec // {result}
	ownerChanges     prometheus.Counter
	owned            prometheus.Gauge
	natsConnected    prometheus.GaugeFunc
	repairs          *prometheus.CounterVec // {result}
	peerLoadReports  prometheus.Gauge
	peerRejected     prometheus.Counter
	peerInput        *prometheus.CounterVec // {reason}
	gossipRejected   prometheus.Counter
	natsRejected     *prometheus.CounterVec // {port, reason}
	natsDrops        prometheus.Counter
	kvRejected       *prometheus.CounterVec // {source, reason}
	kvDiverged       prometheus.Counter
}

// newMetrics builds the metrics; natsUp reports the NATS connection's
// state at scrape time.
func newMetrics(natsUp func() bool) *metrics {
	const ns, sub = "kvmesh", "sync"
	return &metrics{
		members: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub,
			Name: "members", Help: "Live gateways of this cluster, this one included."}),
		eventsDropped: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "member_events_dropped_total", Help: "Membership events dropped on a full listener queue."}),
		published: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "messages_published_total", Help: "Peer messages published, by kind and transport (nats, gossip)."},
			[]string{"kind", "transport"}),
		applied: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "deltas_applied_total", Help: "Peer deltas applied to the index: decisions (entries) and kv (batches)."},
			[]string{"kind"}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "deltas_dropped_total", Help: "Deltas not applied, by kind and reason (duplicate, stale, queue_full, unknown_replica, pending_full, bootstrap_overflow, apply_error, publish_error)."},
			[]string{"kind", "reason"}),
		malformed: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "messages_malformed_total", Help: "Peer messages that failed to decode, by source (nats, gossip, meta)."},
			[]string{"source"}),
		lag: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Subsystem: sub,
			Name: "delta_propagation_seconds", Help: "Decision time at the origin to application here (clocks of two hosts).",
			Buckets: []float64{.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5}}),
		gaps: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "sequence_gaps_total", Help: "Sequence gaps seen in a source's stream (lost messages), by kind."},
			[]string{"kind"}),
		bootstrapSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: ns, Subsystem: sub,
			Name: "snapshot_pull_seconds", Help: "Duration of a snapshot pull and restore (bootstrap or repair).",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 12)}),
		bootstrapBytes: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "snapshot_received_bytes_total", Help: "Snapshot bytes received from peers."}),
		servedBytes: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "snapshot_served_bytes_total", Help: "Snapshot bytes served to peers."}),
		bootstraps: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "snapshot_pulls_total", Help: "Snapshot pulls by result (ok, error, no_peer)."},
			[]string{"result"}),
		ownerChanges: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "kv_owner_changes_total", Help: "KV-event sources this gateway started or stopped owning."}),
		owned: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub,
			Name: "kv_owned_sources", Help: "KV-event sources this gateway currently ingests."}),
		// Read from the connection at scrape time, not set from nats.go's
		// asynchronous callbacks: those run later than the state change
		// (and may interleave with Start), so a set gauge could disagree
		// with what the publisher sees, or stay stale.
		natsConnected: prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub,
			Name: "nats_connected", Help: "1 while the NATS connection is up, else 0 (deltas fall back to gossip)."},
			func() float64 {
				if natsUp() {
					return 1
				}
				return 0
			}),
		repairs: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "antientropy_repairs_total", Help: "Anti-entropy repairs (snapshot pulls after drift) by result."},
			[]string{"result"}),
		peerLoadReports: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub,
			Name: "peer_load_reports", Help: "Peers whose load report is fresh."}),
		peerRejected: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "peer_unauthenticated_total", Help: "Peer-service connections and calls refused for want of the cluster key (failed mutual-TLS handshake) or a missing or wrong PeerToken."}),
		peerInput: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "peer_rejected_total", Help: "Input refused on the peer gRPC port, by reason: bad_preface (not an HTTP/2 connection), handshake (failed TLS handshake), malformed (a request that does not decode), unauthenticated (missing or wrong PeerToken, also in peer_unauthenticated_total)."},
			[]string{"reason"}),
		gossipRejected: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "gossip_rejected_total", Help: "Gossip packets and streams refused because they were not encrypted with a cluster key."}),
		natsRejected: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "nats_rejected_total", Help: "Connections the embedded NATS server refused, by port (client, route) and reason (unauthenticated: wrong or missing password; handshake: no TLS or a certificate without the cluster key)."},
			[]string{"port", "reason"}),
		natsDrops: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "nats_disconnects_total", Help: "Times this gateway's NATS connection dropped (not counting its own close); deltas go to gossip until it reconnects."}),
		kvRejected: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "kv_rejected_total", Help: "KV-event input refused, by source (nats, gossip, snapshot) and reason (not_owner: a reset, clear or batch from a member that does not own the engine; seq_jump: a sequence number far beyond the engine's rate; clock_ahead: an engine time in the future)."},
			[]string{"source", "reason"}),
		kvDiverged: prometheus.NewCounter(prometheus.CounterOpts{Namespace: ns, Subsystem: sub,
			Name: "kv_diverged_total", Help: "Times an engine owner's digest showed this gateway's confirmed view of the engine differing from the owner's at the same watermark (batches lost where no sequence gap shows them, e.g. before the first one applied here, or a reset from a gateway that owned the engine for a moment only); each schedules a repair from the owner."}),
	}
}

// initRefusals exports every refusal series, and both anti-entropy
// results, at 0 from the start, so that dashboards and alerts
// (deploy/prometheus) see the series before the first refusal or repair:
// increase() over a series born at its first increment misses that
// increment.
func (m *metrics) initRefusals() {
	m.repairs.WithLabelValues("ok")
	m.repairs.WithLabelValues("error")
	for _, pr := range [][2]string{{"client", "unauthenticated"}, {"route", "unauthenticated"}, {"route", "handshake"}} {
		m.natsRejected.WithLabelValues(pr[0], pr[1])
	}
	for _, src := range []string{"nats", "gossip"} {
		for _, r := range []string{"not_owner", "seq_jump", "clock_ahead"} {
			m.kvRejected.WithLabelValues(src, r)
		}
	}
	for _, r := range []string{"seq_jump", "clock_ahead"} {
		m.kvRejected.WithLabelValues("snapshot", r)
	}
}

func (m *metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.members, m.eventsDropped, m.published, m.applied, m.dropped,
		m.malformed, m.lag, m.gaps, m.bootstrapSeconds, m.bootstrapBytes, m.servedBytes, m.bootstraps,
		m.ownerChanges, m.owned, m.natsConnected, m.repairs, m.peerLoadReports, m.peerRejected, m.peerInput,
		m.gossipRejected, m.natsRejected, m.natsDrops, m.kvRejected, m.kvDiverged}
}

func (m *metrics) register(r prometheus.Registerer) error {
	m.initRefusals()
	if r == nil {
		return nil
	}
	for _, c := range m.collectors() {
		if err := r.Register(c); err != nil {
			return fmt.Errorf("sync: register metrics: %w", err)
		}
	}
	return nil
}
