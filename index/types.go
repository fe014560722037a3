package index

import "fmt"

// BlockKey identifies a block of prompt tokens together with everything before
// it: k_i = H(k_{i-1}, tokens of block i), with k_{-1} derived from the cluster
// seed, model, LoRA name and cache salt. Every gateway computes the same keys
// for the same prompt, so keys travel between gateways unchanged.
type BlockKey uint64

// ReplicaID is a dense, process-local handle for an engine replica, assigned
// by a Registry. It is never sent to another process: replicas travel between
// gateways by name.
type ReplicaID uint16

// MaxReplicas is the number of distinct ReplicaIDs one index can hold.
const MaxReplicas = 1 << 16

// Ledger says how the index came to believe a replica holds a block.
type Ledger uint8

const (
	// History entries are learned from routing decisions (AIBrix-style):
	// a request was sent there, so its blocks are probably cached there.
	History Ledger = iota
	// Speculative entries are routing decisions not yet confirmed by a KV
	// event; they live for seconds so that a burst of requests with one
	// prefix sticks together before the engine reports its blocks.
	Speculative
	// Confirmed entries come from the engine's own BlockStored events and
	// leave with BlockRemoved, AllBlocksCleared or a stream reset.
	Confirmed
	numLedgers
)

func (l Ledger) String() string {
	switch l {
	case History:
		return "history"
	case Speculative:
		return "speculative"
	case Confirmed:
		return "confirmed"
	}
	return "unknown"
}

// Mode selects which ledgers a match trusts.
type Mode uint8

const (
	// ModeHistory trusts only history entries: AIBrix v0.7 behaviour.
	ModeHistory Mode = iota
	// ModeKVEvents trusts confirmed and speculative entries.
	ModeKVEvents
	// ModeHybrid trusts confirmed and speculative entries for replicas that
	// publish KV events and history entries for those that do not.
	ModeHybrid
)

func (m Mode) String() string {
	switch m {
	case ModeHistory:
		return "history"
	case ModeKVEvents:
		return "kv-events"
	case ModeHybrid:
		return "hybrid"
	}
	return "unknown"
}

// ParseMode turns a mode's name, as String spells it, into a Mode.
func ParseMode(s string) (Mode, error) {
	switch s {
	case "history":
		return ModeHistory, nil
	case "kv-events":
		return ModeKVEvents, nil
	case "hybrid":
		return ModeHybrid, nil
	}
	return 0, fmt.Errorf("%w: %q (want history, kv-events or hybrid)", ErrUnknownMode, s)
}
