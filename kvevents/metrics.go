package kvevents

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the subscriber-side counters, labelled by replica. One Metrics
// is shared by all Subscribers of a process; register it once.
type Metrics struct {
	Batches       *prometheus.CounterVec // {replica}
	Events        *prometheus.CounterVec // {replica,type}
	IgnoredEvents *prometheus.CounterVec // {replica}: events of unknown type
	Malformed     *prometheus.CounterVec // {replica}: payloads or frames that failed to decode
	// NoEventBatches: well-formed batches without a known event (ErrNoEvents):
	// their seq is consumed, nothing the index tracks is lost.
	NoEventBatches *prometheus.CounterVec // {replica}
	Gaps           *prometheus.CounterVec // {replica}: seq jumps forward
	Replays        *prometheus.CounterVec // {replica,result}: complete|partial|failed
	Resets         *prometheus.CounterVec // {replica,reason}: rewind|gap_unrecoverable|overflow|malformed
	Duplicates     *prometheus.CounterVec // {replica}: batches already delivered
	// Replayed counts the batches (of Batches) that came from replay
	// answers (catch-up, join, gap) rather than live: Batches minus
	// Replayed arrived live, so a replica whose batches all come from
	// replays has a live (PUB/SUB) path that does not carry them.
	Replayed   *prometheus.CounterVec // {replica}
	Dropped    *prometheus.CounterVec // {replica}: dropped on a full queue
	Reconnects *prometheus.CounterVec // {replica}: SUB connections re-established
	// Tolerated counts foreign publishers' quirks accepted rather than
	// treated as loss or rejected, by kind: parent_zero (a chain start sent
	// with parent_block_hash 0, index.TolParentZero; counted by the
	// consumer applying the event) and replay_from_one (a join replay from
	// seq 0 answered from seq 1 by a publisher numbering from 1).
	Tolerated *prometheus.CounterVec // {replica,kind}
}

// Tolerance kinds, the kind label of Metrics.Tolerated.
const (
	TolParentZero    = "parent_zero"
	TolReplayFromOne = "replay_from_one"
)

// NewMetrics creates unregistered counters.
func NewMetrics() *Metrics {
	c := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "kvmesh", Subsystem: "kvevents", Name: name, Help: help,
		}, labels)
	}
	return &Metrics{
		Batches:        c("batches_total", "KV-event batches delivered to the handler.", "replica"),
		Events:         c("events_total", "KV events delivered to the handler, by type.", "replica", "type"),
		IgnoredEvents:  c("ignored_events_total", "KV events of unknown type skipped.", "replica"),
		Malformed:      c("malformed_total", "KV-event messages that failed to decode (a lost batch resets the replica unless a replayed copy decodes).", "replica"),
		NoEventBatches: c("no_event_batches_total", "Well-formed KV-event batches without a known event (empty, or only unknown event types): nothing lost.", "replica"),
		Gaps:           c("gaps_total", "Forward jumps in a replica's sequence numbers.", "replica"),
		Replays:        c("replays_total", "Replay requests, by result (complete, partial, failed).", "replica", "result"),
		Resets:         c("resets_total", "Times a replica's confirmed state was declared unknown, by reason.", "replica", "reason"),
		Duplicates:     c("duplicates_total", "Batches dropped because their seq was already delivered.", "replica"),
		Replayed:       c("replayed_batches_total", "KV-event batches delivered from replay answers (catch-up, join, gap) rather than live; part of batches_total.", "replica"),
		Dropped:        c("dropped_total", "Batches dropped because the delivery queue was full.", "replica"),
		Reconnects:     c("reconnects_total", "SUB connections (re)established to a replica's publisher.", "replica"),
		Tolerated:      c("tolerated_total", "Publisher quirks accepted instead of counted as loss or rejected, by kind (parent_zero, replay_from_one).", "replica", "kind"),
	}
}

func (m *Metrics) vecs() []*prometheus.CounterVec {
	return []*prometheus.CounterVec{m.Batches, m.Events, m.IgnoredEvents, m.Malformed, m.NoEventBatches, m.Gaps,
		m.Replays, m.Resets, m.Duplicates, m.Replayed, m.Dropped, m.Reconnects, m.Tolerated}
}

func (m *Metrics) collectors() []prometheus.Collector {
	var cs []prometheus.Collector
	for _, v := range m.vecs() {
		cs = append(cs, v)
	}
	return cs
}

// Forget deletes every series of replica. Call it once the replica is gone for good (its name left the
// configuration): a deployment whose pods come and go would otherwise
// keep a set of series for every pod it ever had. A subscriber still
// running for the replica would create its series again.
func (m *Metrics) Forget(replica string) {
	l := prometheus.Labels{"replica": replica}
	for _, v := range m.vecs() {
		v.DeletePartialMatch(l)
	}
}

// Register registers every counter on r.
func (m *Metrics) Register(r prometheus.Registerer) error {
	var errs []error
	for _, c := range m.collectors() {
		errs = append(errs, r.Register(c))
	}
	return errors.Join(errs...)
}
