package index

import (
	"encoding/binary"
	"fmt"
	"unsafe"

	"github.com/zeebo/xxh3"
)

const (
	// DefaultBlockTokens is the default number of tokens per block: vLLM's
	// default KV block size, so confirmed and routed keys line up.
	DefaultBlockTokens = 16
	// MaxBlockTokens bounds the index block (Config.BlockTokens) so that
	// key computation works in a fixed stack buffer (8 + 4*MaxBlockTokens
	// bytes) without allocating. Engine blocks may be larger (see
	// MaxEngineBlockTokens): an index block size that divides them keys
	// them, e.g. 16 for a hybrid model's 1568-token blocks.
	MaxBlockTokens = 1024
)

// littleEndian reports whether uint32s are stored little-endian in memory,
// in which case AppendKeys copies tokens instead of encoding them one by one.
var littleEndian = func() bool {
	v := uint32(1)
	return *(*byte)(unsafe.Pointer(&v)) == 1
}()

// Hasher computes block keys. The zero Hasher is not usable: build one with
// NewHasher. A Hasher is a small immutable value, safe to copy and to use
// from any number of goroutines.
//
// Keys are defined as
//
//	root = Root(model, lora, salt)        (mixes in the cluster seed)
//	k_0  = xxh3(root as 8 little-endian bytes || tokens of block 0 as uint32 LE)
//	k_i  = xxh3(k_{i-1} as 8 LE bytes || tokens of block i as uint32 LE)
//
// Only full blocks produce keys; a trailing partial block is ignored.
type Hasher struct {
	seed   uint64
	tokens int
}

// NewHasher returns a Hasher for the cluster seed and a block size in tokens
// (1..MaxBlockTokens).
func NewHasher(seed uint64, blockTokens int) (Hasher, error) {
	if blockTokens < 1 || blockTokens > MaxBlockTokens {
		return Hasher{}, fmt.Errorf("%w: block size %d tokens (want 1..%d)", ErrInvalidConfig, blockTokens, MaxBlockTokens)
	}
	return Hasher{seed: seed, tokens: blockTokens}, nil
}

// BlockTokens returns the block size in tokens.
func (h Hasher) BlockTokens() int { return h.tokens }

// Seed returns the cluster seed.
func (h Hasher) Seed() uint64 { return h.seed }

// Root returns the key before the first block of a prompt for a model, a LoRA
// adapter name ("" for none) and a cache salt ("" for none). Each string is
// hashed with a seed derived from the previous value and its position, so
// ("a","") and ("","a") give different roots. Root does not allocate.
func (h Hasher) Root(model, lora, salt string) BlockKey {
	r := xxh3.HashStringSeed(model, h.seed^0x6b766d6573682d6d) // "kvmesh-m"
	r = xxh3.HashStringSeed(lora, r^0x6b766d6573682d6c)        // "kvmesh-l"
	r = xxh3.HashStringSeed(salt, r^0x6b766d6573682d73)        // "kvmesh-s"
	return BlockKey(r)
}

// AppendKeys appends the keys of the full blocks of tokens, chained from
// parent (a root or the key of the block before tokens[0]), to dst and
// returns the extended slice. It allocates only if dst lacks capacity.
func (h Hasher) AppendKeys(dst []BlockKey, parent BlockKey, tokens []uint32) []BlockKey {
	// Size the stack buffer to the block: zeroing 4 KB per call would cost
	// as much as hashing a few small blocks.
	if h.tokens <= 64 {
		var buf [8 + 4*64]byte
		return h.appendKeys(dst, parent, tokens, buf[:])
	}
	var buf [8 + 4*MaxBlockTokens]byte
	return h.appendKeys(dst, parent, tokens, buf[:])
}

func (h Hasher) appendKeys(dst []BlockKey, parent BlockKey, tokens []uint32, buf []byte) []BlockKey {
	bs := h.tokens
	if bs == 0 {
		return dst
	}
	n := len(tokens) / bs
	size := 8 + 4*bs
	buf = buf[:size]
	k := uint64(parent)
	for i := range n {
		blk := tokens[i*bs : (i+1)*bs]
		binary.LittleEndian.PutUint64(buf[:8], k)
		b := buf[8:size]
		if littleEndian {
			// The tokens' memory already is the little-endian encoding.
			copy(b, unsafe.Slice((*byte)(unsafe.Pointer(&blk[0])), 4*bs))
		} else {
			for j, t := range blk {
				binary.LittleEndian.PutUint32(b[4*j:], t)
			}
		}
		k = xxh3.Hash(buf)
		dst = append(dst, BlockKey(k))
	}
	return dst
}

// AppendKeysBytes is AppendKeys for character mode: each byte of text is one
// token (AIBrix-style history routing without a tokenizer). The keys equal
// those AppendKeys gives for the same bytes widened to uint32, so the two
// modes share one definition; the text is not copied or converted first.
func (h Hasher) AppendKeysBytes(dst []BlockKey, parent BlockKey, text []byte) []BlockKey {
	return appendByteKeys(h, dst, parent, text)
}

// AppendKeysString is AppendKeysBytes for a string, without converting it.
func (h Hasher) AppendKeysString(dst []BlockKey, parent BlockKey, text string) []BlockKey {
	return appendByteKeys(h, dst, parent, text)
}

func appendByteKeys[T ~string | ~[]byte](h Hasher, dst []BlockKey, parent BlockKey, text T) []BlockKey {
	var buf [8 + 4*MaxBlockTokens]byte // once per call; character blocks are large
	bs := h.tokens
	if bs == 0 {
		return dst
	}
	n := len(text) / bs
	size := 8 + 4*bs
	k := uint64(parent)
	for i := range n {
		binary.LittleEndian.PutUint64(buf[:8], k)
		b := buf[8:size]
		base := i * bs
		for j := range bs {
			binary.LittleEndian.PutUint32(b[4*j:], uint32(text[base+j]))
		}
		k = xxh3.Hash(buf[:size])
		dst = append(dst, BlockKey(k))
	}
	return dst
}
