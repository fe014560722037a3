package index

import "errors"

// ErrUnknownMode is returned by ParseMode for a name it does not know.
var ErrUnknownMode = errors.New("index: unknown mode")

var (
	// ErrInvalidConfig wraps every Config.Validate and Hasher complaint.
	ErrInvalidConfig = errors.New("index: invalid config")
	// ErrInvalidLedger is returned by Record for a ledger it does not write
	// (confirmed entries come only from ApplyStored).
	ErrInvalidLedger = errors.New("index: invalid ledger")
	// ErrBlockSize is returned by ApplyStored when the engine block size is
	// not a positive multiple of the index block size.
	ErrBlockSize = errors.New("index: engine block size is not a multiple of the index block size")
	// ErrMalformedStored is returned by ApplyStored when the token count does
	// not equal len(Hashes) * BlockSize.
	ErrMalformedStored = errors.New("index: malformed stored blocks")
	// ErrNoRoot is returned by ApplyStored when neither the call nor
	// SetReplicaRoot gave the replica a root key.
	ErrNoRoot = errors.New("index: replica has no root key")
	// ErrUnknownParent is returned by ApplyStored when the parent engine hash
	// is not in the replica's engine map (its event was missed): the chain
	// cannot be computed, so the blocks are skipped and counted.
	ErrUnknownParent = errors.New("index: unknown parent block")
	// ErrBadSnapshot wraps every reason Restore rejects its input.
	ErrBadSnapshot = errors.New("index: bad snapshot")
)

var (
	// ErrMalformedKVEvent wraps every reason ReadKVEvent rejects its input,
	// and AppendKVEvent's complaint about an unknown event kind.
	ErrMalformedKVEvent = errors.New("index: malformed KV event")
	// ErrKVEventTooLarge is returned by AppendKVEvent for an event beyond
	// MaxKVEventHashes or MaxKVEventTokens.
	ErrKVEventTooLarge = errors.New("index: KV event too large")
)

// ErrGroup is returned by ApplyStored for a KV-cache group outside
// [0, MaxGroups); nothing changes.
var ErrGroup = errors.New("index: KV-cache group out of range")
