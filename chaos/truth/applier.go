package truth

import (
	"errors"
	"sync/atomic"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

// Applier is a reference kvevents.Handler: it applies each named replica's
// events to an index as a gateway does, with its own reading of the events
// (not kvevents.Normalize, so a test compares two readings). BlockStored
// events go to ApplyStored with their KV-cache group (group_idx, its kind
// and sliding window) and their tier (medium GPU or none, CPU, DISK; other
// media are skipped), BlockRemoved to ApplyRemovedGroup (GPU) or
// ApplyRemovedTier (CPU, DISK), AllBlocksCleared and stream resets to
// ClearReplica. Batches of replicas it does not know are ignored. It does
// not derive roots from LoRA names or cache salts (the simulator sends
// neither).
//
// One Applier may serve several Subscribers (one per replica): each replica
// has its own scratch state, and a Subscriber calls the Handler for its
// replica from one goroutine.
type Applier struct {
	ix       *index.Index
	replicas map[string]*applierReplica

	applyErrors   atomic.Uint64
	unknownParent atomic.Uint64
	resets        atomic.Uint64
}

type applierReplica struct {
	id     index.ReplicaID
	hashes []uint64
}

var _ kvevents.Handler = (*Applier)(nil)

// NewApplier returns an Applier writing to ix for the named replicas. The
// caller sets each replica's root on ix (SetReplicaRoot) before events flow.
func NewApplier(ix *index.Index, replicas map[string]index.ReplicaID) *Applier {
	a := &Applier{ix: ix, replicas: make(map[string]*applierReplica, len(replicas))}
	for name, id := range replicas {
		a.replicas[name] = &applierReplica{id: id}
	}
	return a
}

// tierOf reads an event's medium: the GPU (none said, or "GPU"), the
// simulator's CPU tier, or DISK; ok is false for anything else.
func tierOf(medium string) (t index.Tier, ok bool) {
	switch medium {
	case "", sim.MediumGPU, "gpu":
		return index.TierGPU, true
	case sim.MediumCPU, "cpu":
		return index.TierCPU, true
	case "DISK", "disk":
		return index.TierDisk, true
	}
	return 0, false
}

// groupKind reads a kv_cache_spec_kind: sliding_window, or full attention
// for anything else the simulator sends.
func groupKind(kind string) index.GroupKind {
	if kind == sim.SpecSlidingWindow {
		return index.GroupSliding
	}
	return index.GroupFull
}

// HandleBatch implements kvevents.Handler.
func (a *Applier) HandleBatch(name string, _ kvevents.Seq, b *kvevents.Batch) {
	r, ok := a.replicas[name]
	if !ok {
		return
	}
	for i := range b.Events {
		ev := &b.Events[i]
		switch ev.Kind {
		case kvevents.KindBlockStored:
			st := ev.Stored
			if st == nil {
				continue
			}
			tier, ok := tierOf(st.Medium)
			if !ok {
				continue
			}
			r.hashes = appendHashes(r.hashes[:0], st.BlockHashes)
			sb := index.StoredBlocks{
				Hashes:      r.hashes,
				ParentHash:  uint64(st.ParentBlockHash),
				HasParent:   st.HasParent,
				Tokens:      st.TokenIDs,
				BlockTokens: st.BlockSize,
				Group:       st.GroupIdx,
				Tier:        tier,
			}
			if st.GroupIdx != 0 || st.SpecKind != "" {
				sb.GroupKind = groupKind(st.SpecKind)
				if sb.GroupKind == index.GroupSliding {
					sb.Window = st.SlidingWindow
				}
			}
			err := a.ix.ApplyStored(r.id, sb)
			if err != nil {
				a.applyErrors.Add(1)
				if errors.Is(err, index.ErrUnknownParent) {
					a.unknownParent.Add(1)
				}
			}
		case kvevents.KindBlockRemoved:
			rm := ev.Removed
			if rm == nil {
				continue
			}
			tier, ok := tierOf(rm.Medium)
			if !ok {
				continue
			}
			r.hashes = appendHashes(r.hashes[:0], rm.BlockHashes)
			if tier == index.TierGPU {
				a.ix.ApplyRemovedGroup(r.id, rm.GroupIdx, r.hashes)
			} else {
				a.ix.ApplyRemovedTier(r.id, tier, r.hashes)
			}
		case kvevents.KindAllBlocksCleared:
			a.ix.ClearReplica(r.id)
		}
	}
}

// HandleReset implements kvevents.Handler: the replica's confirmed entries
// are dropped.
func (a *Applier) HandleReset(name string, _ kvevents.ResetReason) {
	r, ok := a.replicas[name]
	if !ok {
		return
	}
	a.resets.Add(1)
	a.ix.ClearReplica(r.id)
}

// ApplyErrors counts BlockStored events the index rejected (any reason);
// UnknownParent counts those rejected for a parent it did not know.
func (a *Applier) ApplyErrors() (all, unknownParent uint64) {
	return a.applyErrors.Load(), a.unknownParent.Load()
}

// Resets counts HandleReset calls over all replicas.
func (a *Applier) Resets() uint64 { return a.resets.Load() }

func appendHashes(dst []uint64, hs []kvevents.EngineHash) []uint64 {
	for _, h := range hs {
		dst = append(dst, uint64(h))
	}
	return dst
}
