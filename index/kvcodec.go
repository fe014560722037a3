package index

import (
	"encoding/binary"
	"fmt"
	"math"
)

// Bounds of one encoded KVEvent.
const (
	// MaxKVEventHashes bounds the engine hashes of one encoded event.
	MaxKVEventHashes = 1 << 20
	// MaxKVEventTokens bounds the tokens of one encoded stored event.
	MaxKVEventTokens = 1 << 24
)

// Stored-event flag bits of the encoding.
const (
	kvfParent = 1 << 0
	kvfRoot   = 1 << 1
	kvfGroup  = 1 << 2
	kvfTier   = 1 << 3
	kvfAll    = kvfParent | kvfRoot | kvfGroup | kvfTier

	// kvGroupBit on the kind byte of a removal says a group follows,
	// kvTierBit a tier (after the group).
	kvGroupBit = 0x80
	kvTierBit  = 0x40
)

// AppendKVEvent appends the binary encoding of ev to dst (the sync wire's
// event encoding): a kind byte, then for KVStored the hash count (uvarint),
// the hashes (8 bytes little-endian each), a flag byte (1: parent, 2: root),
// the parent and root when flagged (8 bytes each), the group, its kind
// (a byte) and window when flagged (4; uvarints), the tier (a byte) when
// flagged (8), the block size and token count (uvarints) and the tokens
// (uvarints); for KVRemoved the hash count and hashes, preceded by the
// group (uvarint) when the kind byte has 0x80 (group not 0) and the tier
// (a byte) when it has 0x40 (not the GPU); nothing more for KVCleared.
// GPU events of group 0 encode as they did before groups and tiers
// existed, so only hybrid models' and offload tiers' events need a peer
// that knows them. Each event has exactly one encoding. It fails with ErrKVEventTooLarge beyond MaxKVEventHashes or
// MaxKVEventTokens, ErrMalformedStored for an inconsistent stored event and
// ErrMalformedKVEvent for an unknown kind, returning dst unchanged.
func AppendKVEvent(dst []byte, ev *KVEvent) ([]byte, error) {
	switch ev.Kind {
	case KVStored:
		s := &ev.Stored
		if len(s.Hashes) > MaxKVEventHashes || len(s.Tokens) > MaxKVEventTokens {
			return dst, fmt.Errorf("%w: %d hashes, %d tokens", ErrKVEventTooLarge, len(s.Hashes), len(s.Tokens))
		}
		if s.BlockTokens <= 0 || s.BlockTokens > MaxEngineBlockTokens || len(s.Tokens) != len(s.Hashes)*s.BlockTokens ||
			s.Group < 0 || s.Window < 0 || s.GroupKind > GroupSliding || s.Tier >= numTiers {
			return dst, fmt.Errorf("%w: stored event with %d hashes, block %d, %d tokens",
				ErrMalformedStored, len(s.Hashes), s.BlockTokens, len(s.Tokens))
		}
		dst = append(dst, byte(ev.Kind))
		dst = appendHashes(dst, s.Hashes)
		var f byte
		if s.HasParent {
			f |= kvfParent
		}
		if s.HasRoot {
			f |= kvfRoot
		}
		grouped := s.Group != 0 || s.GroupKind != GroupFull || s.Window != 0
		if grouped {
			f |= kvfGroup
		}
		if s.Tier != TierGPU {
			f |= kvfTier
		}
		dst = append(dst, f)
		if s.HasParent {
			dst = binary.LittleEndian.AppendUint64(dst, s.ParentHash)
		}
		if s.HasRoot {
			dst = binary.LittleEndian.AppendUint64(dst, uint64(s.Root))
		}
		if grouped {
			dst = binary.AppendUvarint(dst, uint64(s.Group))
			dst = append(dst, byte(s.GroupKind))
			dst = binary.AppendUvarint(dst, uint64(s.Window))
		}
		if s.Tier != TierGPU {
			dst = append(dst, byte(s.Tier))
		}
		dst = binary.AppendUvarint(dst, uint64(s.BlockTokens))
		dst = binary.AppendUvarint(dst, uint64(len(s.Tokens)))
		for _, t := range s.Tokens {
			dst = binary.AppendUvarint(dst, uint64(t))
		}
	case KVRemoved:
		if len(ev.Removed) > MaxKVEventHashes {
			return dst, fmt.Errorf("%w: %d hashes", ErrKVEventTooLarge, len(ev.Removed))
		}
		if ev.Group < 0 || ev.Tier >= numTiers {
			return dst, fmt.Errorf("%w: group %d tier %d", ErrMalformedKVEvent, ev.Group, ev.Tier)
		}
		kb := byte(ev.Kind)
		if ev.Group != 0 {
			kb |= kvGroupBit
		}
		if ev.Tier != TierGPU {
			kb |= kvTierBit
		}
		dst = append(dst, kb)
		if ev.Group != 0 {
			dst = binary.AppendUvarint(dst, uint64(ev.Group))
		}
		if ev.Tier != TierGPU {
			dst = append(dst, byte(ev.Tier))
		}
		dst = appendHashes(dst, ev.Removed)
	case KVCleared:
		dst = append(dst, byte(ev.Kind))
	default:
		return dst, fmt.Errorf("%w: kind %d", ErrMalformedKVEvent, ev.Kind)
	}
	return dst, nil
}

func appendHashes(dst []byte, hs []uint64) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(hs)))
	for _, h := range hs {
		dst = binary.LittleEndian.AppendUint64(dst, h)
	}
	return dst
}

// ReadKVEvent decodes one event AppendKVEvent encoded from the start of b
// into ev (overwriting it; the slices are freshly allocated, so ev keeps no
// reference to b) and returns the rest of b. Every failure wraps
// ErrMalformedKVEvent; it never panics, and counts are checked against the
// bytes left before anything is allocated.
func ReadKVEvent(b []byte, ev *KVEvent) ([]byte, error) {
	d := kvDecoder{b: b}
	kb := d.byte1("event kind")
	*ev = KVEvent{Kind: KVKind(kb &^ (kvGroupBit | kvTierBit))}
	if kb&(kvGroupBit|kvTierBit) != 0 && ev.Kind != KVRemoved {
		d.fail("event kind %#x", kb)
	}
	if kb&kvGroupBit != 0 {
		g := d.uv("group")
		if d.err == nil && (g == 0 || g > math.MaxInt32) {
			d.fail("group %d", g)
		}
		ev.Group = int(g)
	}
	if kb&kvTierBit != 0 {
		t := d.byte1("tier")
		if d.err == nil && (t == 0 || t >= byte(numTiers)) {
			d.fail("tier %d", t)
		}
		ev.Tier = Tier(t)
	}
	switch ev.Kind {
	case KVStored:
		s := &ev.Stored
		s.Hashes = d.hashes()
		f := d.byte1("stored flags")
		if d.err == nil && f&^kvfAll != 0 {
			d.fail("stored flags %#x", f)
		}
		s.HasParent, s.HasRoot = f&kvfParent != 0, f&kvfRoot != 0
		if s.HasParent {
			s.ParentHash = d.u64("parent")
		}
		if s.HasRoot {
			s.Root = BlockKey(d.u64("root"))
		}
		if f&kvfGroup != 0 {
			g := d.uv("group")
			k := d.byte1("group kind")
			w := d.uv("window")
			if d.err == nil && (g > math.MaxInt32 || k > byte(GroupSliding) || w > math.MaxInt32 || g == 0 && k == 0 && w == 0) {
				d.fail("group %d kind %d window %d", g, k, w)
			}
			s.Group, s.GroupKind, s.Window = int(g), GroupKind(k), int(w)
		}
		if f&kvfTier != 0 {
			t := d.byte1("tier")
			if d.err == nil && (t == 0 || t >= byte(numTiers)) {
				d.fail("tier %d", t)
			}
			s.Tier = Tier(t)
		}
		bt := d.uv("block tokens")
		if d.err == nil && (bt == 0 || bt > MaxEngineBlockTokens) {
			d.fail("block tokens %d", bt)
		}
		s.BlockTokens = int(bt)
		nt := d.count("tokens", MaxKVEventTokens, 1)
		if d.err == nil && uint64(nt) != uint64(len(s.Hashes))*bt {
			d.fail("%d tokens for %d blocks of %d", nt, len(s.Hashes), bt)
		}
		if d.err != nil {
			break
		}
		s.Tokens = make([]uint32, nt)
		for j := range s.Tokens {
			t := d.uv("token")
			if t > math.MaxUint32 && d.err == nil {
				d.fail("token %d", t)
			}
			s.Tokens[j] = uint32(t)
		}
	case KVRemoved:
		ev.Removed = d.hashes()
	case KVCleared:
	default:
		d.fail("event kind %d", ev.Kind)
	}
	if d.err != nil {
		*ev = KVEvent{}
		return nil, d.err
	}
	return d.b, nil
}

// kvDecoder reads with a sticky error, like the sync wire's reader.
type kvDecoder struct {
	b   []byte
	err error
	tmp [binary.MaxVarintLen64]byte
}

func (d *kvDecoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s", ErrMalformedKVEvent, fmt.Sprintf(format, args...))
	}
	d.b = nil
}

func (d *kvDecoder) byte1(what string) byte {
	if d.err != nil {
		return 0
	}
	if len(d.b) < 1 {
		d.fail("truncated %s", what)
		return 0
	}
	v := d.b[0]
	d.b = d.b[1:]
	return v
}

func (d *kvDecoder) uv(what string) uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	// A varint longer than its value needs would give an event a second
	// encoding.
	if n <= 0 || n != len(binary.AppendUvarint(d.tmp[:0], v)) {
		d.fail("bad varint %s", what)
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *kvDecoder) u64(what string) uint64 {
	if d.err != nil {
		return 0
	}
	if len(d.b) < 8 {
		d.fail("truncated %s", what)
		return 0
	}
	v := binary.LittleEndian.Uint64(d.b)
	d.b = d.b[8:]
	return v
}

// count reads a count bounded by max and by the bytes left, given the
// minimum encoded size of one item.
func (d *kvDecoder) count(what string, max, minSize int) int {
	v := d.uv(what)
	if d.err != nil {
		return 0
	}
	if v > uint64(max) || v*uint64(minSize) > uint64(len(d.b)) {
		d.fail("%s count %d out of bounds", what, v)
		return 0
	}
	return int(v)
}

func (d *kvDecoder) hashes() []uint64 {
	n := d.count("hashes", MaxKVEventHashes, 8)
	if d.err != nil {
		return nil
	}
	hs := make([]uint64, n)
	for j := range hs {
		hs[j] = d.u64("hash")
	}
	return hs
}
