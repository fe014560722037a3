package config

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"

	"github.com/hashicorp/raft"
)

// Versioned is an applied routing config and its version: the number of
// config changes applied so far (set, patch), so that it moves only when
// the config does. Raft's own entries (membership changes, a new leader's
// no-op) do not count; they move kvmesh_config_membership_index. Every
// node applies the same log, so every node reaches the same version. A
// data directory written when the version was the raft index keeps its
// (larger) version and counts on from it. Both are immutable once
// published: readers share the pointer and must not modify Config.
type Versioned struct {
	Version uint64         `json:"version"`
	Config  *RoutingConfig `json:"config,omitempty"`
}

// applyResult is what FSM.Apply returns through raft's ApplyFuture.
type applyResult struct {
	version uint64
	err     error
}

// FSM is the raft state machine holding the routing config. Apply, Snapshot
// and Restore are called by raft (one at a time); Current may be called
// concurrently from any goroutine and never blocks.
type FSM struct {
	cur      atomic.Pointer[Versioned]
	index    atomic.Uint64 // raft index of the last command or configuration entry taken
	metrics  *metrics
	log      *slog.Logger
	onChange func() // called after every swap; must not block
}

var _ raft.FSM = (*FSM)(nil)

func newFSM(m *metrics, log *slog.Logger, onChange func()) *FSM {
	f := &FSM{metrics: m, log: log, onChange: onChange}
	f.cur.Store(&Versioned{})
	return f
}

// Index is the raft index of the last command or configuration entry the
// FSM took (0 before the first; a restored snapshot does not set it).
func (f *FSM) Index() uint64 { return f.index.Load() }

// Current returns the last applied config (Version 0, Config nil before
// the first apply).
func (f *FSM) Current() *Versioned { return f.cur.Load() }

// Apply implements raft.FSM. A command that fails to decode or validate is
// recorded as rejected (counted, logged) and leaves the config unchanged;
// every node reaches the same verdict because the check is deterministic.
func (f *FSM) Apply(l *raft.Log) any {
	defer f.index.Store(l.Index)
	if l.Type != raft.LogCommand {
		return nil
	}
	cmd, err := decodeCommand(l.Data)
	var next *RoutingConfig
	if err == nil {
		next, err = cmd.apply(f.cur.Load())
	}
	if err != nil {
		f.metrics.applies.WithLabelValues("rejected").Inc()
		f.log.Warn("config command rejected", "index", l.Index, "op", cmd.Op, "err", err)
		return applyResult{version: f.cur.Load().Version, err: err}
	}
	version := f.cur.Load().Version + 1
	f.swap(&Versioned{Version: version, Config: next})
	f.metrics.applies.WithLabelValues("applied").Inc()
	f.log.Info("config applied", "version", version, "op", cmd.Op, "raft_index", l.Index)
	return applyResult{version: version}
}

var _ raft.ConfigurationStore = (*FSM)(nil)

// StoreConfiguration implements raft.ConfigurationStore: raft calls it
// with each committed membership configuration, which this FSM does not
// keep, only exports (kvmesh_config_membership_index).
func (f *FSM) StoreConfiguration(index uint64, _ raft.Configuration) {
	f.index.Store(index)
	f.metrics.membership.Set(float64(index))
}

func (f *FSM) swap(v *Versioned) {
	f.cur.Store(v)
	f.metrics.version.Set(float64(v.Version))
	if f.onChange != nil {
		f.onChange()
	}
}

// Snapshot implements raft.FSM: the current document, already immutable.
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	return fsmSnapshot{v: f.cur.Load()}, nil
}

// Restore implements raft.FSM. A snapshot is trusted as far as its format
// (it was produced by a node's FSM from validated configs), but it is
// validated again so corruption cannot install a broken config.
func (f *FSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	var v Versioned
	if err := json.NewDecoder(rc).Decode(&v); err != nil {
		return fmt.Errorf("%w: snapshot: %w", ErrBadCommand, err)
	}
	if v.Config != nil {
		if err := v.Config.Validate(); err != nil {
			return fmt.Errorf("config: snapshot at version %d: %w", v.Version, err)
		}
	} else if v.Version != 0 {
		return fmt.Errorf("%w: snapshot version %d without config", ErrBadCommand, v.Version)
	}
	f.swap(&v)
	f.log.Info("config restored from snapshot", "version", v.Version)
	return nil
}

type fsmSnapshot struct{ v *Versioned }

func (s fsmSnapshot) Persist(sink raft.SnapshotSink) error {
	err := json.NewEncoder(sink).Encode(s.v)
	if err != nil {
		return errors.Join(err, sink.Cancel())
	}
	return sink.Close()
}

func (s fsmSnapshot) Release() {}
