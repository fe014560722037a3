package sync

import (
	"github.com/kvmesh/kvmesh/index"
)

// replicaTable is a fixed Replicas: replica i of names has ReplicaID i, the
// way node numbers its replicas in configuration order. Immutable, so safe
// for concurrent use.
type replicaTable struct {
	ids   map[string]index.ReplicaID
	names []string
}

var _ Replicas = (*replicaTable)(nil)

// newReplicaTable returns the table for names (copied). Duplicate names keep
// their first ID.
func newReplicaTable(names []string) *replicaTable {
	t := &replicaTable{ids: make(map[string]index.ReplicaID, len(names)), names: append([]string(nil), names...)}
	for i, n := range names {
		if _, dup := t.ids[n]; !dup {
			t.ids[n] = index.ReplicaID(i)
		}
	}
	return t
}

// ReplicaID implements Replicas.
func (t *replicaTable) ReplicaID(name string) (index.ReplicaID, bool) {
	id, ok := t.ids[name]
	return id, ok
}

// ReplicaName implements Replicas.
func (t *replicaTable) ReplicaName(id index.ReplicaID) (string, bool) {
	if int(id) >= len(t.names) {
		return "", false
	}
	return t.names[id], true
}

// loadFunc adapts a function to LoadSource.
type loadFunc func(dst []ReplicaLoad) []ReplicaLoad

var _ LoadSource = loadFunc(nil)

// AppendInFlight implements LoadSource.
func (f loadFunc) AppendInFlight(dst []ReplicaLoad) []ReplicaLoad { return f(dst) }

// KVOwner returns the live member that owns replica's KV events now ("" if
// replica is not a KV source or there is no member).
func (c *Cluster) KVOwner(replica string) string {
	found := false
	for _, s := range c.kvSources() {
		if s.Replica == replica {
			found = true
		}
	}
	if !found {
		return ""
	}
	var names []string
	for _, m := range c.ms.snapshot() {
		if !m.Meta.Leaving {
			names = append(names, m.Name)
		}
	}
	return Owner(replica, names)
}

// OwnsKV reports whether this gateway currently runs replica's KV-event
// subscriber.
func (c *Cluster) OwnsKV(replica string) bool { return c.own.owned(replica) }

// KVApplied returns the sequence number of the last batch of replica's KV
// events this gateway applied (from the engine as its owner, or from the
// owner through the cluster), ok false when none since the start or the
// last reset. Harnesses wait on it for an engine's events to be in.
func (c *Cluster) KVApplied(replica string) (seq uint64, ok bool) {
	return c.ap.kvApplied(replica)
}
