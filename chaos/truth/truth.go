package truth

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/index"
)

// Engine is the ground-truth source: an engine's own table of reusable
// blocks. *sim.Server implements it. CachedBlocks may be called concurrently
// with the engine running.
type Engine interface {
	CachedBlocks() []sim.CachedBlock
}

var _ Engine = (*sim.Server)(nil)

// Truth is the set of kvmesh keys and engine hashes a perfect consumer of one
// engine's KV events holds in its confirmed ledger.
type Truth struct {
	Keys   map[index.BlockKey]struct{}
	Hashes map[uint64]struct{}
	// Inner holds the keys that are not the last index block of any cached
	// engine block (empty when engine and index block sizes are equal).
	// An engine block of k index blocks shares its first k-1 keys with
	// every sibling block that starts with the same tokens; see
	// Comparison.MissingLast.
	Inner map[index.BlockKey]struct{}
}

// FromBlocks computes the truth for blocks as keyed by h from root (the
// consumer's root for the engine's model: Hasher.Root(model, "", "")). Each
// block's keys are computed from its whole token chain (Prefix); an engine
// block of k index blocks stands for the last k keys of its chain. It keeps
// nothing of blocks.
func FromBlocks(blocks []sim.CachedBlock, h index.Hasher, root index.BlockKey) (Truth, error) {
	t := Truth{
		Keys:   make(map[index.BlockKey]struct{}, len(blocks)),
		Hashes: make(map[uint64]struct{}, len(blocks)),
		Inner:  make(map[index.BlockKey]struct{}),
	}
	ib := h.BlockTokens()
	// last maps an engine hash to the key of its last index block, so a
	// child whose parent was already seen chains from it instead of
	// rehashing the whole prefix.
	last := make(map[uint64]index.BlockKey, len(blocks))
	var keys []index.BlockKey
	for i := range blocks {
		b := &blocks[i]
		eb := len(b.Tokens)
		if eb == 0 || eb%ib != 0 {
			return Truth{}, fmt.Errorf("%w: engine block of %d tokens, index block of %d", ErrBlockSize, eb, ib)
		}
		if len(b.Prefix) < eb || len(b.Prefix)%eb != 0 || !slices.Equal(b.Prefix[len(b.Prefix)-eb:], b.Tokens) {
			return Truth{}, fmt.Errorf("%w: hash %#x: prefix of %d tokens, block of %d", ErrMalformedBlock, uint64(b.Hash), len(b.Prefix), eb)
		}
		if pk, ok := last[uint64(b.Parent)]; ok && b.HasParent {
			keys = h.AppendKeys(keys[:0], pk, b.Tokens)
		} else {
			keys = h.AppendKeys(keys[:0], root, b.Prefix)
			keys = keys[len(keys)-eb/ib:]
		}
		for j, k := range keys {
			t.Keys[k] = struct{}{}
			if j < len(keys)-1 {
				t.Inner[k] = struct{}{}
			}
		}
		t.Hashes[uint64(b.Hash)] = struct{}{}
		last[uint64(b.Hash)] = keys[len(keys)-1]
	}
	for i := range blocks {
		if k, ok := last[uint64(blocks[i].Hash)]; ok {
			delete(t.Inner, k) // the last key of some engine block
		}
	}
	return t, nil
}

// maxExamples bounds the example differences a Comparison keeps.
const maxExamples = 8

// Comparison is one replica's index state measured against its engine.
type Comparison struct {
	// TruthKeys, IndexKeys and CommonKeys count the engine's keys, the
	// index's confirmed keys for the replica, and both.
	TruthKeys, IndexKeys, CommonKeys int
	// TruthHashes, IndexHashes and CommonHashes do the same for engine
	// hashes (the index's engine map for the replica).
	TruthHashes, IndexHashes, CommonHashes int
	// MissingLast counts missing keys that are the last index block of
	// some cached engine block (Truth.Inner does not hold them): an index
	// that lost one of these lost a whole engine block.
	MissingLast int
	// Missing holds up to 8 keys the engine has and the index lacks;
	// Extra up to 8 keys the index holds that the engine does not.
	Missing, Extra []index.BlockKey
}

// Precision is the fraction of the index's confirmed keys that the engine
// really holds (1 when the index holds none).
func (c Comparison) Precision() float64 {
	if c.IndexKeys == 0 {
		return 1
	}
	return float64(c.CommonKeys) / float64(c.IndexKeys)
}

// Recall is the fraction of the engine's keys the index holds (1 when the
// engine holds none).
func (c Comparison) Recall() float64 {
	if c.TruthKeys == 0 {
		return 1
	}
	return float64(c.CommonKeys) / float64(c.TruthKeys)
}

// Exact reports whether the index holds exactly the engine's keys and
// engine hashes.
func (c Comparison) Exact() bool {
	return c.CommonKeys == c.TruthKeys && c.CommonKeys == c.IndexKeys &&
		c.CommonHashes == c.TruthHashes && c.CommonHashes == c.IndexHashes
}

// String summarises the comparison on one line.
func (c Comparison) String() string {
	return fmt.Sprintf("keys truth=%d index=%d common=%d missing-last=%d (precision %.4f recall %.4f) hashes truth=%d index=%d common=%d missing=%x extra=%x",
		c.TruthKeys, c.IndexKeys, c.CommonKeys, c.MissingLast, c.Precision(), c.Recall(),
		c.TruthHashes, c.IndexHashes, c.CommonHashes, c.Missing, c.Extra)
}

// Compare measures replica r's confirmed entries and engine hashes in ix
// against t.
func Compare(t Truth, ix *index.Index, r index.ReplicaID) Comparison {
	keys := ix.AppendReplicaKeys(nil, r, index.Confirmed)
	hashes := ix.AppendEngineHashes(nil, r)
	c := compareKeys(t, keys)
	c.TruthHashes = len(t.Hashes)
	seenH := make(map[uint64]struct{}, len(hashes))
	for _, h := range hashes {
		if _, dup := seenH[h]; dup {
			continue
		}
		seenH[h] = struct{}{}
		c.IndexHashes++
		if _, ok := t.Hashes[h]; ok {
			c.CommonHashes++
		}
	}
	return c
}

// compareKeys counts keys (an index's, duplicates ignored) against t's
// keys, with examples of what is missing and extra.
func compareKeys(t Truth, keys []index.BlockKey) Comparison {
	c := Comparison{TruthKeys: len(t.Keys)}
	seen := make(map[index.BlockKey]struct{}, len(keys))
	for _, k := range keys {
		if _, dup := seen[k]; dup {
			continue
		}
		seen[k] = struct{}{}
		c.IndexKeys++
		if _, ok := t.Keys[k]; ok {
			c.CommonKeys++
		} else if len(c.Extra) < maxExamples {
			c.Extra = append(c.Extra, k)
		}
	}
	for k := range t.Keys {
		if _, ok := seen[k]; ok {
			continue
		}
		if _, inner := t.Inner[k]; !inner {
			c.MissingLast++
		}
		if len(c.Missing) < maxExamples {
			c.Missing = append(c.Missing, k)
		}
	}
	return c
}

// GroupedEngine is an Engine that may also hold blocks outside its GPU
// full-attention group: a hybrid model's sliding-window group and an
// offload tier (nil when it has none). *sim.Server implements it.
type GroupedEngine interface {
	Engine
	WindowCachedBlocks() []sim.CachedBlock
	OffloadedBlocks() []sim.CachedBlock
}

var _ GroupedEngine = (*sim.Server)(nil)

// CompareEngine reads e's truth, keyed like ix from root, and compares it
// with replica r in ix. The keys are group 0's on the GPU (the confirmed
// ledger). The index keeps a block's engine hash while any group or tier
// holds it, so for a GroupedEngine the truth's hashes are those of every
// group and tier.
func CompareEngine(e Engine, ix *index.Index, r index.ReplicaID, root index.BlockKey) (Comparison, error) {
	t, err := FromBlocks(e.CachedBlocks(), ix.Hasher(), root)
	if err != nil {
		return Comparison{}, err
	}
	if g, ok := e.(GroupedEngine); ok {
		for _, bs := range [][]sim.CachedBlock{g.WindowCachedBlocks(), g.OffloadedBlocks()} {
			for i := range bs {
				t.Hashes[uint64(bs[i].Hash)] = struct{}{}
			}
		}
	}
	return Compare(t, ix, r), nil
}

// CompareTier measures the keys replica r holds in ix's offload tier
// (index.AppendReplicaTierKeys) against blocks, the engine's own table of
// that tier (sim.Server.OffloadedBlocks), keyed from root. Only the key
// fields are filled: the index's engine hashes are shared by all tiers
// (CompareEngine checks them).
func CompareTier(blocks []sim.CachedBlock, ix *index.Index, r index.ReplicaID, root index.BlockKey, tier index.Tier) (Comparison, error) {
	t, err := FromBlocks(blocks, ix.Hasher(), root)
	if err != nil {
		return Comparison{}, err
	}
	return compareKeys(t, ix.AppendReplicaTierKeys(nil, r, tier)), nil
}

// HitEngine is an engine that says what it would hit: sim.Server.PrefixHit
// (by its own rule: vLLM's hybrid rule for a hybrid model, the offload
// tier's load for an offloading engine).
type HitEngine interface {
	PrefixHit(tokens []uint32) (gpu, offloaded int)
}

var _ HitEngine = (*sim.Server)(nil)

// HitComparison is a set of prompts matched by an index and hit by the
// engine.
type HitComparison struct {
	// Prompts is the number compared and Equal those for which the index's
	// GPU match and offload run (CPU plus disk) both equal the engine's.
	Prompts, Equal int
	// GPUBlocks and OffloadBlocks sum the engine's hits over the prompts.
	GPUBlocks, OffloadBlocks int
	// Diffs describes up to 8 prompts that differ.
	Diffs []string
}

// Exact reports whether the index agreed on every prompt.
func (c HitComparison) Exact() bool { return c.Equal == c.Prompts }

func (c HitComparison) String() string {
	return fmt.Sprintf("hits: %d/%d prompts equal, engine gpu=%d offload=%d blocks, diffs %v",
		c.Equal, c.Prompts, c.GPUBlocks, c.OffloadBlocks, c.Diffs)
}

// CompareHits asks e what each prompt (the engine's tokens) would hit and
// ix what it matches for replica r in kv-events mode (MatchTiers), with
// the keys capped as vLLM caps its hit (at most the prompt minus one
// token). Speculative entries are ignored (the match runs at a time when
// they have expired), so only what the engine's events said counts. The
// engine's block must equal the index's (ErrBlockSize otherwise).
func CompareHits(e HitEngine, engineBlock int, ix *index.Index, r index.ReplicaID, root index.BlockKey, prompts [][]uint32) (HitComparison, error) {
	h := ix.Hasher()
	if engineBlock != h.BlockTokens() {
		return HitComparison{}, fmt.Errorf("%w: engine block of %d tokens, index block of %d", ErrBlockSize, engineBlock, h.BlockTokens())
	}
	// Far enough ahead that every speculative entry is expired.
	later := time.Now().Add(24 * time.Hour).UnixNano()
	var c HitComparison
	var keys []index.BlockKey
	gpu, cpu, disk := make([]int32, 1), make([]int32, 1), make([]int32, 1)
	cand := []index.ReplicaID{r}
	for _, p := range prompts {
		if len(p) == 0 {
			continue
		}
		keys = h.AppendKeys(keys[:0], root, p)
		keys = keys[:min(len(keys), (len(p)-1)/engineBlock)]
		ix.MatchTiers(keys, cand, index.ModeKVEvents, later, gpu, cpu, disk)
		eg, eo := e.PrefixHit(p)
		c.Prompts++
		c.GPUBlocks += eg
		c.OffloadBlocks += eo
		if int(gpu[0]) == eg && int(cpu[0]+disk[0]) == eo {
			c.Equal++
		} else if len(c.Diffs) < maxExamples {
			c.Diffs = append(c.Diffs, fmt.Sprintf("%d-token prompt: index gpu=%d offload=%d, engine gpu=%d offload=%d",
				len(p), gpu[0], cpu[0]+disk[0], eg, eo))
		}
	}
	return c, nil
}

// AwaitHits polls CompareHits like Await until the index agrees on every
// prompt.
func AwaitHits(ctx context.Context, poll time.Duration, check func() (HitComparison, error)) (HitComparison, time.Duration, error) {
	start := time.Now()
	tick := time.NewTicker(poll)
	defer tick.Stop()
	for {
		c, err := check()
		if err != nil || c.Exact() {
			return c, time.Since(start), err
		}
		select {
		case <-ctx.Done():
			return c, time.Since(start), fmt.Errorf("%w after %v: %s: %w", ErrTimeout, time.Since(start).Round(time.Millisecond), c, ctx.Err())
		case <-tick.C:
		}
	}
}

// Await calls check every poll until ok accepts its result, and returns that
// result with the time it took. On ctx's end it returns the last result and
// ErrTimeout (wrapping the context's error); a check error is returned at
// once.
func Await(ctx context.Context, poll time.Duration, check func() (Comparison, error), ok func(Comparison) bool) (Comparison, time.Duration, error) {
	start := time.Now()
	tick := time.NewTicker(poll)
	defer tick.Stop()
	for {
		c, err := check()
		if err != nil {
			return c, time.Since(start), err
		}
		if ok(c) {
			return c, time.Since(start), nil
		}
		select {
		case <-ctx.Done():
			return c, time.Since(start), fmt.Errorf("%w after %v: %s: %w", ErrTimeout, time.Since(start).Round(time.Millisecond), c, ctx.Err())
		case <-tick.C:
		}
	}
}

// IsExact is an Await predicate: the index matches the engine exactly.
func IsExact(c Comparison) bool { return c.Exact() }

// IsExactButSharedInner is an Await predicate for an index whose block is
// smaller than the engine's: it holds no key the engine lacks, exactly the
// engine's hashes and the last key of every engine block, but may lack inner
// keys. index.ApplyRemoved removes every index block an evicted engine block
// maps to, including leading sub-blocks a still-cached sibling engine block
// shares (documented by index: "removing either removes the confirmed
// entry"), so such keys are lost until the sibling is stored again.
func IsExactButSharedInner(c Comparison) bool {
	return c.CommonKeys == c.IndexKeys && c.MissingLast == 0 &&
		c.CommonHashes == c.TruthHashes && c.CommonHashes == c.IndexHashes
}
