package index

// KVKind says what a KVEvent does to a replica's confirmed entries. The
// values equal kvevents.Kind's (and the sync wire's event kind byte).
type KVKind uint8

const (
	// KVStored: Stored's blocks became cached (ApplyStored).
	KVStored KVKind = iota + 1
	// KVRemoved: the engine blocks Removed were evicted (ApplyRemoved).
	KVRemoved
	// KVCleared: every block of the replica was dropped (ClearReplica).
	KVCleared
)

func (k KVKind) String() string {
	switch k {
	case KVStored:
		return "stored"
	case KVRemoved:
		return "removed"
	case KVCleared:
		return "cleared"
	}
	return "unknown"
}

// KVEvent is one engine KV event normalized for the index: the one form in
// which engine events travel inside kvmesh. kvevents.Normalize builds it
// from a decoded engine batch (choosing the tier, the root and the
// indexable blocks), the sync wire carries it between gateways
// (AppendKVEvent, ReadKVEvent) and ApplyKV applies it, so a new stored-block
// field is added here, in the codec below and in ApplyStoredReport.
type KVEvent struct {
	Kind KVKind
	// Stored is the event's blocks (KVStored only).
	Stored StoredBlocks
	// Removed holds the evicted engine hashes (KVRemoved only).
	Removed []uint64
	// Group is the KV-cache group the removed blocks left and Tier the
	// tier (KVRemoved only; a stored event's are in Stored).
	Group int
	Tier  Tier
}

// KVReport is what ApplyKV did with a batch, for the caller's metrics. A
// caller may reuse one report across batches (ApplyKV resets it and reuses
// Errors' backing array).
type KVReport struct {
	// Errors holds each stored event ApplyStoredReport rejected, in order
	// (wrapping ErrUnknownParent, ErrBlockSize, ErrMalformedStored,
	// ErrNoRoot or ErrGroup); rejected events changed nothing.
	Errors []error
	// ParentZero counts stored events taken as chain starts (TolParentZero).
	ParentZero int
	// Removed counts confirmed entries the batch's removals dropped.
	Removed int
	// Cleared is set when the batch held a KVCleared event.
	Cleared bool
}

// ApplyKV applies one normalized batch of replica r in order: KVStored
// through ApplyStoredReport, KVRemoved through ApplyRemoved, KVCleared
// through ClearReplica; events of another kind are ignored. It is the one
// apply path for engine events (node, sync and the DES call it; chaos/truth
// keeps its own reading on purpose) and fills rep (which may be nil). It
// keeps nothing of evs.
func (x *Index) ApplyKV(r ReplicaID, evs []KVEvent, rep *KVReport) {
	if rep != nil {
		*rep = KVReport{Errors: rep.Errors[:0]}
	}
	for i := range evs {
		ev := &evs[i]
		switch ev.Kind {
		case KVStored:
			tol, err := x.ApplyStoredReport(r, ev.Stored)
			if rep == nil {
				continue
			}
			if err != nil {
				rep.Errors = append(rep.Errors, err)
			}
			if tol == TolParentZero {
				rep.ParentZero++
			}
		case KVRemoved:
			n := x.applyRemoved(r, ev.Group, ev.Tier, ev.Removed)
			if rep != nil {
				rep.Removed += n
			}
		case KVCleared:
			n := x.ClearReplica(r)
			if rep != nil {
				rep.Removed += n
				rep.Cleared = true
			}
		}
	}
}
