package config

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the store's Prometheus series. Every gateway exports them;
// comparing kvmesh_config_version across gateways shows convergence.
type metrics struct {
	// version: kvmesh_config_version, the applied config's version (the
	// count of applied config changes); 0 before the first apply.
	version prometheus.Gauge
	// membership: kvmesh_config_membership_index, the raft index of the
	// latest committed raft membership configuration (voters joining or
	// leaving): membership changes move it, not kvmesh_config_version.
	membership prometheus.Gauge
	// applies: kvmesh_config_applies_total{result="applied"|"rejected"},
	// config commands applied or rejected by this node's FSM.
	applies *prometheus.CounterVec
	// leader: kvmesh_raft_leader, 1 while this node is the raft leader.
	leader prometheus.Gauge
	// voters: kvmesh_raft_voters, voters in the raft configuration as this
	// node knows it.
	voters prometheus.Gauge
	// forwarded: kvmesh_config_forwarded_total{result="ok"|"error"}, writes
	// this node forwarded to the leader.
	forwarded *prometheus.CounterVec
	// tailTruncations: kvmesh_config_raft_log_tail_truncations_total, raft
	// log suffixes deleted on this node (a conflicting uncommitted tail;
	// see wal.go).
	tailTruncations prometheus.Counter
	// adminRejected: kvmesh_config_admin_rejected_total{api="grpc"|"http",
	// reason}, admin API input refused: a client error answered by the
	// API (reason is its stable code: unauthenticated, invalid_config,
	// bad_request, version_conflict, not_found, body_too_large) or input
	// the gRPC server drops before any handler (bad_preface, handshake,
	// malformed; see GuardedServerOptions).
	adminRejected *prometheus.CounterVec
	// raftTransportErrors: kvmesh_config_raft_transport_errors_total{kind},
	// errors raft's network transport hit on this node's raft port and
	// otherwise only logs: kind "decode" (a connection sent bytes that are
	// not a raft RPC: junk, an unknown RPC type, a malformed message),
	// "truncated" (a connection that ended inside a request), "accept",
	// "flush", "unauthenticated" (a connection that failed the mutual-TLS
	// handshake: no certificate or none from the cluster CA; closed before
	// raft read a byte) or "other". See transportLogger, countingLayer and
	// tlsStreamLayer.
	raftTransportErrors *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		version: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvmesh_config_version",
			Help: "Version of the routing config applied on this node: the number of config changes applied (membership changes do not count); 0 before the first apply.",
		}),
		membership: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvmesh_config_membership_index",
			Help: "Raft index of the latest committed raft membership configuration on this node (moves when voters join or leave).",
		}),
		applies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_config_applies_total",
			Help: "Routing-config commands applied or rejected (validation, version conflict) by this node's FSM.",
		}, []string{"result"}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvmesh_raft_leader",
			Help: "1 while this node is the raft leader of the config store, else 0.",
		}),
		voters: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvmesh_raft_voters",
			Help: "Voters in the config store's raft configuration as known to this node.",
		}),
		forwarded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_config_forwarded_total",
			Help: "Config writes this node forwarded to the raft leader, by result.",
		}, []string{"result"}),
		tailTruncations: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_config_raft_log_tail_truncations_total",
			Help: "Raft log suffixes deleted on this node (uncommitted entries overwritten by a new leader).",
		}),
		adminRejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_config_admin_rejected_total",
			Help: "Admin API input refused, by API (grpc, http) and reason (unauthenticated, invalid_config, bad_request, version_conflict, not_found, body_too_large, bad_preface, handshake, malformed).",
		}, []string{"api", "reason"}),
		raftTransportErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_config_raft_transport_errors_total",
			Help: "Errors on this node's raft port that raft's transport only logs, by kind (unauthenticated: a connection that failed the mutual-TLS handshake, closed before raft read it; decode: bytes that are not a raft RPC; truncated: a connection that ended inside a request; accept; flush; other).",
		}, []string{"kind"}),
	}
	m.applies.WithLabelValues("applied")
	m.applies.WithLabelValues("rejected")
	m.forwarded.WithLabelValues("ok")
	// Exported at 0 from the start: the cluster-key alert reads it.
	m.raftTransportErrors.WithLabelValues("unauthenticated")
	m.forwarded.WithLabelValues("error")
	if reg == nil {
		return m, nil
	}
	// A store reopened in the same process (a restart in tests, a node
	// rebuilt after a config error) reuses the series already registered.
	var err error
	if m.version, err = register(reg, m.version); err != nil {
		return nil, err
	}
	if m.membership, err = register(reg, m.membership); err != nil {
		return nil, err
	}
	if m.applies, err = register(reg, m.applies); err != nil {
		return nil, err
	}
	if m.leader, err = register(reg, m.leader); err != nil {
		return nil, err
	}
	if m.voters, err = register(reg, m.voters); err != nil {
		return nil, err
	}
	if m.forwarded, err = register(reg, m.forwarded); err != nil {
		return nil, err
	}
	if m.tailTruncations, err = register(reg, m.tailTruncations); err != nil {
		return nil, err
	}
	if m.adminRejected, err = register(reg, m.adminRejected); err != nil {
		return nil, err
	}
	if m.raftTransportErrors, err = register(reg, m.raftTransportErrors); err != nil {
		return nil, err
	}
	return m, nil
}

// register registers c, or returns the identical collector registered
// before.
func register[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	err := reg.Register(c)
	var are prometheus.AlreadyRegisteredError
	switch {
	case err == nil:
		return c, nil
	case errors.As(err, &are):
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	return c, fmt.Errorf("config: metrics: %w", err)
}
