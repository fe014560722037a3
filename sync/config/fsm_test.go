package config

import (
	"bytes"
	"io"
	"log/slog"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
)

func newTestFSM(t *testing.T) (*FSM, *metrics) {
	t.Helper()
	m, err := newMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	return newFSM(m, slog.New(slog.DiscardHandler), nil), m
}

func applyCmd(t *testing.T, f *FSM, index uint64, c Command) applyResult {
	t.Helper()
	data, err := encodeCommand(c)
	require.NoError(t, err)
	res, ok := f.Apply(&raft.Log{Index: index, Type: raft.LogCommand, Data: data}).(applyResult)
	require.True(t, ok)
	return res
}

func TestFSMCommands(t *testing.T) {
	f, m := newTestFSM(t)
	require.Nil(t, f.Current().Config)

	// Replica commands need a config.
	res := applyCmd(t, f, 1, AddReplicaCommand("chat", ReplicaConfig{Name: "x", URL: "http://h:1"}))
	require.ErrorIs(t, res.err, ErrNotFound)

	// The version counts applied changes, not raft indexes: the first
	// change at raft index 2 is version 1.
	res = applyCmd(t, f, 2, SetCommand(testConfig(), Version(0)))
	require.NoError(t, res.err)
	require.Equal(t, uint64(1), res.version)
	require.Equal(t, uint64(1), f.Current().Version)

	// Compare-and-set against a stale version is a conflict.
	res = applyCmd(t, f, 3, SetCommand(testConfig(), Version(0)))
	require.ErrorIs(t, res.err, ErrVersionConflict)
	require.Equal(t, uint64(1), f.Current().Version)

	// Raft's own entries (a membership change, a leader's no-op) between
	// two changes leave the version alone: the next change is version 2.
	require.Nil(t, f.Apply(&raft.Log{Index: 4, Type: raft.LogConfiguration}))
	require.Nil(t, f.Apply(&raft.Log{Index: 5, Type: raft.LogNoop}))
	f.StoreConfiguration(4, raft.Configuration{})
	require.Equal(t, uint64(1), f.Current().Version)

	res = applyCmd(t, f, 6, PatchCommand([]byte(`{"prefix_cache":{"imbalance_abs_count":3},"models":{"code":{"replicas":[{"name":"c0","url":"http://h:9"}]}}}`), Version(1)))
	require.NoError(t, res.err)
	cur := f.Current().Config
	require.Equal(t, 3, cur.PrefixCache.ImbalanceAbsCount)
	require.Len(t, cur.Models, 2)
	require.Equal(t, testConfig().HashSeed, cur.HashSeed, "a patch keeps a 64-bit seed exact")

	// A patch producing an invalid document is rejected with the field.
	res = applyCmd(t, f, 5, PatchCommand([]byte(`{"models":{"code":{"replicas":[{"name":"c0","url":"nope"}]}}}`), nil))
	require.ErrorIs(t, res.err, ErrInvalidConfig)
	require.Contains(t, res.err.Error(), `models["code"].replicas[0].url`)
	require.Equal(t, uint64(2), f.Current().Version)

	res = applyCmd(t, f, 6, AddReplicaCommand("chat", ReplicaConfig{Name: "r2", URL: "http://h:2"}))
	require.NoError(t, res.err)
	require.Len(t, f.Current().Config.Models["chat"].Replicas, 3)
	res = applyCmd(t, f, 7, AddReplicaCommand("chat", ReplicaConfig{Name: "c0", URL: "http://h:2"}))
	require.ErrorIs(t, res.err, ErrInvalidConfig, "replica names are unique across models")
	res = applyCmd(t, f, 8, RemoveReplicaCommand("chat", "r0"))
	require.NoError(t, res.err)
	require.Equal(t, "r1", f.Current().Config.Models["chat"].Replicas[0].Name)
	res = applyCmd(t, f, 9, RemoveReplicaCommand("chat", "r0"))
	require.ErrorIs(t, res.err, ErrNotFound)
	res = applyCmd(t, f, 10, RemoveReplicaCommand("code", "c0"))
	require.ErrorIs(t, res.err, ErrInvalidConfig, "the last replica of a pool cannot go")

	// A malformed entry is rejected, not applied.
	out := f.Apply(&raft.Log{Index: 11, Type: raft.LogCommand, Data: []byte("garbage")}).(applyResult)
	require.ErrorIs(t, out.err, ErrBadCommand)
	require.Equal(t, uint64(4), f.Current().Version, "one version per applied change")

	require.Equal(t, 4.0, metricValue(t, m.applies.WithLabelValues("applied")))
	require.Equal(t, 7.0, metricValue(t, m.applies.WithLabelValues("rejected")))
	require.Equal(t, 4.0, metricValue(t, m.version))
	require.Equal(t, 4.0, metricValue(t, m.membership), "the membership change's raft index")
}

func TestFSMSetDoesNotAliasCaller(t *testing.T) {
	f, _ := newTestFSM(t)
	c := testConfig()
	applyCmd(t, f, 1, SetCommand(c, nil))
	// A published config is never modified by later commands.
	before := f.Current()
	applyCmd(t, f, 2, AddReplicaCommand("chat", ReplicaConfig{Name: "r9", URL: "http://h:9"}))
	require.Len(t, before.Config.Models["chat"].Replicas, 2)
	require.Len(t, f.Current().Config.Models["chat"].Replicas, 3)
}

type memSink struct {
	bytes.Buffer
	cancelled bool
}

func (s *memSink) ID() string    { return "mem" }
func (s *memSink) Cancel() error { s.cancelled = true; return nil }
func (s *memSink) Close() error  { return nil }

func TestFSMSnapshotRestore(t *testing.T) {
	f, _ := newTestFSM(t)
	applyCmd(t, f, 7, SetCommand(testConfig(), nil))
	applyCmd(t, f, 8, SetCommand(testConfig(), nil))
	snap, err := f.Snapshot()
	require.NoError(t, err)
	var sink memSink
	require.NoError(t, snap.Persist(&sink))
	snap.Release()

	g, _ := newTestFSM(t)
	require.NoError(t, g.Restore(io.NopCloser(bytes.NewReader(sink.Bytes()))))
	require.Equal(t, f.Current().Version, g.Current().Version)
	require.Equal(t, *f.Current().Config, *g.Current().Config)

	// A corrupt snapshot is refused and leaves the FSM alone.
	require.Error(t, g.Restore(io.NopCloser(bytes.NewReader([]byte(`{"version":9,"config":{"models":{}}}`)))))
	require.Equal(t, uint64(2), g.Current().Version)
}

// metricValue reads a gauge's or counter's current value.
func metricValue(t *testing.T, m prometheus.Metric) float64 {
	t.Helper()
	var out dto.Metric
	require.NoError(t, m.Write(&out))
	switch {
	case out.Gauge != nil:
		return out.Gauge.GetValue()
	case out.Counter != nil:
		return out.Counter.GetValue()
	}
	t.Fatalf("metric %v is neither gauge nor counter", m.Desc())
	return 0
}

func discard() *slog.Logger { return slog.New(slog.DiscardHandler) }

func TestMetricsReRegister(t *testing.T) {
	reg := prometheus.NewRegistry()
	a, err := newMetrics(reg)
	require.NoError(t, err)
	b, err := newMetrics(reg)
	require.NoError(t, err, "a reopened store reuses its series")
	a.version.Set(42)
	require.Equal(t, 42.0, metricValue(t, b.version))
	clash := prometheus.NewRegistry()
	require.NoError(t, clash.Register(prometheus.NewCounter(prometheus.CounterOpts{Name: "kvmesh_config_version"})))
	_, err = newMetrics(clash)
	require.Error(t, err, "a different collector under the same name is an error")
}
