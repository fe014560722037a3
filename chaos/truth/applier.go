package truth

import (
	"errors"
	"sync/atomic"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

// Applier is a reference kvevents.Handler: it applies each named replica's
// events to an index as a gateway does. GPU-tier BlockStored events go to
// ApplyStored, BlockRemoved to ApplyRemoved, AllBlocksCleared and stream
// resets to ClearReplica. Batches of replicas it does not know are ignored.
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

func gpuTier(medium string) bool { return medium == "" || medium == sim.MediumGPU || medium == "gpu" }

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
			if st == nil || !gpuTier(st.Medium) {
				continue
			}
			r.hashes = appendHashes(r.hashes[:0], st.BlockHashes)
			err := a.ix.ApplyStored(r.id, index.StoredBlocks{
				Hashes:      r.hashes,
				ParentHash:  uint64(st.ParentBlockHash),
				HasParent:   st.HasParent,
				Tokens:      st.TokenIDs,
				BlockTokens: st.BlockSize,
			})
			if err != nil {
				a.applyErrors.Add(1)
				if errors.Is(err, index.ErrUnknownParent) {
					a.unknownParent.Add(1)
				}
			}
		case kvevents.KindBlockRemoved:
			rm := ev.Removed
			if rm == nil || !gpuTier(rm.Medium) {
				continue
			}
			r.hashes = appendHashes(r.hashes[:0], rm.BlockHashes)
			a.ix.ApplyRemoved(r.id, r.hashes)
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
