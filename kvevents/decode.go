package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
	"github.com/zeebo/xxh3"
)

// Sentinel errors of the wire format. Decode wraps them with %w and context.
var (
	// ErrMalformed: the payload is not a KV-event batch of any known
	// generation (bad msgpack, wrong shape, wrong field type, truncated).
	ErrMalformed = errors.New("kvevents: malformed payload")
	// ErrNoEvents: the payload is a well-formed batch but yields no event kvmesh
	// understands (an empty list, or only unknown event types). It is never
	// passed on as a silent empty batch: the Subscriber counts it
	// (no_event_batches_total) and consumes its seq, without a reset, since
	// nothing the index tracks was in it.
	ErrNoEvents = errors.New("kvevents: batch has no known events")
)

// MaxPayloadBytes bounds a payload the decoder accepts. vLLM batches are a few
// KB to a few MB (one engine step); anything larger is treated as malformed
// rather than risking memory on a hostile or corrupt message.
const MaxPayloadBytes = 64 << 20

// maxSkipDepth bounds the nesting of unknown values the decoder skips; vLLM's
// extra_keys nest two or three levels deep.
const maxSkipDepth = 32

// Decoder decodes vLLM KV-event payloads of all three generations:
//
//	(a) array batch [ts, [events...], dp_rank?] with tagged-array events
//	    ["BlockStored", block_hashes, parent_block_hash, token_ids, ...],
//	    trailing default fields omitted;
//	(b) array batch with map events {"type": "BlockStored", ...} (v0.26);
//	(c) map batch {"ts", "events", "data_parallel_rank"} with map events.
//
// Unknown fields and unknown event types are skipped (see Decode's ignored
// count). A Decoder reuses its buffers and is not safe for concurrent use;
// use one per goroutine.
type Decoder struct {
	rd      bytes.Reader
	dec     *msgpack.Decoder
	payload []byte // the payload being decoded, for the integer fast path
	scratch []byte
	// tmp collects the fields of one event before its type is known (map
	// events may carry "type" anywhere); its slices are swapped into the
	// output event so no copy is made.
	tmp BlockStored
	// ek collects what the event's extra_keys say (see finishExtraKeys).
	ek extraKeysScan
}

// extraKeysScan is what extra_keys told about one event. vLLM builds each
// block's entry as (LoRA name?, multimodal keys..., cache salt (first block
// of a sequence only)?, prompt-embedding hash?), or None when empty.
// Strings are the LoRA name and the salt (and, before vLLM made multimodal
// keys (id, offset) tuples, multimodal ids); tuples and byte strings are
// multimodal and prompt-embedding keys.
type extraKeysScan struct {
	present bool
	// first holds the string items of entry 0 (at most maxFirstStrings);
	// firstOpaque is set when entry 0 had anything else or more strings.
	first       []string
	firstOpaque bool
	// other is the first string item of entries 1.., at entry otherAt;
	// opaque is the first entry 1.. with a non-string item, a second
	// string, or a string different from other; -1 for none.
	other    string
	hasOther bool
	otherAt  int
	opaque   int
}

// maxFirstStrings bounds the strings kept from a first block's extra keys:
// the LoRA name and the salt, plus one to see that there were more.
const maxFirstStrings = 3

func (e *extraKeysScan) reset() {
	e.present, e.first, e.firstOpaque = false, e.first[:0], false
	e.other, e.hasOther, e.otherAt, e.opaque = "", false, 0, -1
}

func (e *extraKeysScan) markOpaque(i int) {
	if i == 0 {
		e.firstOpaque = true
	} else if e.opaque < 0 || i < e.opaque {
		e.opaque = i
	}
}

// extraKeys reads extra_keys: list[tuple | None] | None.
func (d *Decoder) extraKeys() error {
	if d.isNil() {
		return d.dec.DecodeNil()
	}
	n, err := d.arrayLen()
	if err != nil {
		return err
	}
	if n < 0 {
		return nil
	}
	e := &d.ek
	e.present = true
	for i := range n {
		if d.isNil() {
			if err := d.dec.DecodeNil(); err != nil {
				return err
			}
			continue
		}
		c, err := d.dec.PeekCode()
		if err != nil {
			return err
		}
		if !isArray(c) {
			e.markOpaque(i)
			if err := d.skip(1); err != nil {
				return err
			}
			continue
		}
		m, err := d.arrayLen()
		if err != nil {
			return err
		}
		strs := 0
		for range m {
			c, err := d.dec.PeekCode()
			if err != nil {
				return err
			}
			if !msgpcode.IsString(c) {
				// A multimodal (id, offset) tuple, a prompt-embedding
				// hash (bytes), or something newer.
				e.markOpaque(i)
				if err := d.skip(2); err != nil {
					return err
				}
				continue
			}
			p, err := d.str()
			if err != nil {
				return err
			}
			strs++
			switch {
			case i == 0:
				if len(e.first) < maxFirstStrings {
					e.first = append(e.first, string(p))
				} else {
					e.firstOpaque = true
				}
			case !e.hasOther:
				e.other, e.hasOther, e.otherAt = string(p), true, i
			case string(p) != e.other:
				e.markOpaque(i)
			}
			if i > 0 && strs > 1 {
				e.markOpaque(i)
			}
		}
	}
	return nil
}

// finishExtraKeys fills s's extra-key summary once the whole event (its
// LoRA name and parent) is known. Blocks after a sequence's first carry
// only the LoRA name; the first carries the LoRA name, then the salt. One
// string besides the LoRA name in a parentless first block is read as the
// salt. (An older engine's lone multimodal id there would be misread as a
// salt; that only yields keys no request computes, never a false match,
// and the multimodal item's later blocks are opaque anyway.)
func (d *Decoder) finishExtraKeys(s *BlockStored) {
	e := &d.ek
	s.HasExtraKeys, s.CacheSalt, s.OpaqueFrom, s.HasOpaque = e.present, "", 0, false
	if !e.present {
		return
	}
	opaque := e.opaque
	if e.hasOther && e.other != s.LoRAName && (opaque < 0 || e.otherAt < opaque) {
		opaque = e.otherAt
	}
	first := e.first
	if !s.HasParent && s.LoRAName != "" && len(first) > 0 && first[0] == s.LoRAName {
		first = first[1:]
	}
	switch {
	case e.firstOpaque:
		opaque = 0
	case s.HasParent:
		if len(first) > 1 || len(first) == 1 && first[0] != s.LoRAName {
			opaque = 0
		}
	case len(first) == 1:
		s.CacheSalt = first[0]
	case len(first) > 1:
		opaque = 0
	}
	if opaque >= 0 {
		s.OpaqueFrom, s.HasOpaque = opaque, true
	}
}

// NewDecoder returns a Decoder with empty reusable buffers.
func NewDecoder() *Decoder {
	d := &Decoder{scratch: make([]byte, 0, 64)}
	d.dec = msgpack.NewDecoder(&d.rd)
	return d
}

// Decode is a convenience wrapper that decodes payload into a new Batch.
func Decode(payload []byte) (*Batch, error) {
	b := new(Batch)
	if _, err := NewDecoder().Decode(payload, b); err != nil {
		return nil, err
	}
	return b, nil
}

// Decode decodes payload into b, reusing b's slices and event bodies (b is
// overwritten; nothing decoded earlier into b stays valid). ignored is the
// number of events of unknown type that were skipped. On error b's content is
// unspecified and the error wraps ErrMalformed or ErrNoEvents. Decode never
// panics on any input.
func (d *Decoder) Decode(payload []byte, b *Batch) (ignored int, err error) {
	b.TS = 0
	b.Events = b.Events[:0]
	dp := b.DataParallelRank
	b.DataParallelRank = nil
	if len(payload) == 0 {
		return 0, fmt.Errorf("%w: empty payload", ErrMalformed)
	}
	if len(payload) > MaxPayloadBytes {
		return 0, fmt.Errorf("%w: payload of %d bytes exceeds %d", ErrMalformed, len(payload), MaxPayloadBytes)
	}
	d.rd.Reset(payload)
	d.dec.ResetReader(&d.rd)
	d.payload = payload
	ignored, err = d.batch(b, dp)
	d.payload = nil
	if err != nil {
		if errors.Is(err, ErrNoEvents) {
			return ignored, err
		}
		return ignored, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	if d.rd.Len() != 0 {
		return ignored, fmt.Errorf("%w: %d trailing bytes after the batch", ErrMalformed, d.rd.Len())
	}
	if len(b.Events) == 0 {
		return ignored, fmt.Errorf("%w (%d unknown events skipped)", ErrNoEvents, ignored)
	}
	return ignored, nil
}

func (d *Decoder) batch(b *Batch, dp *int64) (int, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return 0, err
	}
	switch {
	case isArray(c):
		n, err := d.arrayLen()
		if err != nil {
			return 0, err
		}
		if n < 2 {
			return 0, fmt.Errorf("array batch of %d elements, want [ts, events, dp_rank?]", n)
		}
		if b.TS, err = d.float(); err != nil {
			return 0, fmt.Errorf("batch ts: %w", err)
		}
		ignored, err := d.events(b)
		if err != nil {
			return ignored, err
		}
		if n >= 3 {
			if b.DataParallelRank, err = d.optInt(dp); err != nil {
				return ignored, fmt.Errorf("batch data_parallel_rank: %w", err)
			}
		}
		for i := 3; i < n; i++ {
			if err := d.skip(0); err != nil {
				return ignored, err
			}
		}
		return ignored, nil
	case isMap(c):
		n, err := d.mapLen()
		if err != nil {
			return 0, err
		}
		ignored, sawEvents := 0, false
		for range n {
			key, err := d.str()
			if err != nil {
				return ignored, fmt.Errorf("batch key: %w", err)
			}
			switch string(key) {
			case "ts":
				if b.TS, err = d.float(); err != nil {
					return ignored, fmt.Errorf("batch ts: %w", err)
				}
			case "events":
				if sawEvents {
					return ignored, errors.New("batch has two events fields")
				}
				sawEvents = true
				if ignored, err = d.events(b); err != nil {
					return ignored, err
				}
			case "data_parallel_rank":
				if b.DataParallelRank, err = d.optInt(dp); err != nil {
					return ignored, fmt.Errorf("batch data_parallel_rank: %w", err)
				}
			default:
				if err := d.skip(0); err != nil {
					return ignored, err
				}
			}
		}
		return ignored, nil
	}
	return 0, fmt.Errorf("batch is msgpack code 0x%02x, want array or map", c)
}

func (d *Decoder) events(b *Batch) (ignored int, err error) {
	n, err := d.arrayLen()
	if err != nil {
		return 0, fmt.Errorf("events: %w", err)
	}
	if n < 0 {
		return 0, errors.New("events is nil")
	}
	if cap(b.Events)-len(b.Events) < n {
		b.Events = growEvents(b.Events, n)
	}
	for i := range n {
		known, err := d.event(b)
		if err != nil {
			return ignored, fmt.Errorf("event %d: %w", i, err)
		}
		if !known {
			ignored++
		}
	}
	return ignored, nil
}

func growEvents(ev []Event, n int) []Event {
	out := make([]Event, len(ev), len(ev)+n)
	copy(out, ev)
	return out
}

// event decodes one event of either shape. It reports false for an event of
// unknown type, which it skips.
func (d *Decoder) event(b *Batch) (bool, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return false, err
	}
	t := &d.tmp
	t.BlockHashes = t.BlockHashes[:0]
	t.ParentBlockHash, t.HasParent = 0, false
	t.TokenIDs = t.TokenIDs[:0]
	t.BlockSize = 0
	t.Medium, t.LoRAName = "", ""
	t.GroupIdx, t.SpecKind, t.SlidingWindow = 0, "", 0
	d.ek.reset()
	hasLoRA, lora := false, int64(0)
	var kind Kind

	switch {
	case isArray(c):
		n, err := d.arrayLen()
		if err != nil {
			return false, err
		}
		if n < 1 {
			return false, errors.New("tagged event without a tag")
		}
		tag, err := d.str()
		if err != nil {
			return false, fmt.Errorf("event tag: %w", err)
		}
		kind = parseKind(tag)
		for i := 1; i < n; i++ {
			if kind == 0 {
				if err := d.skip(0); err != nil {
					return false, err
				}
				continue
			}
			// Positions follow the field order of vLLM's structs.
			field := fieldUnknown
			switch kind {
			case KindBlockStored:
				if i-1 < len(storedFields) {
					field = storedFields[i-1]
				}
			case KindBlockRemoved:
				if i-1 < len(removedFields) {
					field = removedFields[i-1]
				}
			}
			if err := d.field(field, &hasLoRA, &lora); err != nil {
				return false, err
			}
		}
	case isMap(c):
		n, err := d.mapLen()
		if err != nil {
			return false, err
		}
		sawType := false
		for range n {
			key, err := d.str()
			if err != nil {
				return false, fmt.Errorf("event key: %w", err)
			}
			if string(key) == "type" {
				tag, err := d.str()
				if err != nil {
					return false, fmt.Errorf("event type: %w", err)
				}
				kind, sawType = parseKind(tag), true
				continue
			}
			if err := d.field(fieldByName(key), &hasLoRA, &lora); err != nil {
				return false, err
			}
		}
		if !sawType {
			return false, errors.New("map event without a type")
		}
	default:
		return false, fmt.Errorf("event is msgpack code 0x%02x, want array or map", c)
	}

	if kind == 0 {
		return false, nil
	}
	ev := nextEvent(b)
	ev.Kind = kind
	switch kind {
	case KindBlockStored:
		s := ev.Stored
		if s == nil {
			s = new(BlockStored)
		}
		ev.Stored, ev.Removed = s, nil
		s.BlockHashes, t.BlockHashes = t.BlockHashes, s.BlockHashes[:0]
		s.TokenIDs, t.TokenIDs = t.TokenIDs, s.TokenIDs[:0]
		s.ParentBlockHash, s.HasParent = t.ParentBlockHash, t.HasParent
		s.BlockSize, s.Medium, s.LoRAName = t.BlockSize, t.Medium, t.LoRAName
		s.GroupIdx, s.SpecKind, s.SlidingWindow = t.GroupIdx, t.SpecKind, t.SlidingWindow
		d.finishExtraKeys(s)
		if hasLoRA {
			if s.LoRAID == nil {
				s.LoRAID = new(int64)
			}
			*s.LoRAID = lora
		} else {
			s.LoRAID = nil
		}
	case KindBlockRemoved:
		r := ev.Removed
		if r == nil {
			r = new(BlockRemoved)
		}
		ev.Stored, ev.Removed = nil, r
		r.BlockHashes, t.BlockHashes = t.BlockHashes, r.BlockHashes[:0]
		r.Medium, r.GroupIdx = t.Medium, t.GroupIdx
	case KindAllBlocksCleared:
		ev.Stored, ev.Removed = nil, nil
	}
	return true, nil
}

// fieldID names an event field the decoder reads; every other field is
// skipped.
type fieldID uint8

const (
	fieldUnknown fieldID = iota
	fieldBlockHashes
	fieldParentBlockHash
	fieldTokenIDs
	fieldBlockSize
	fieldLoRAID
	fieldMedium
	fieldLoRAName
	fieldExtraKeys
	fieldGroupIdx
	fieldSpecKind
	fieldSlidingWindow
)

// Field order of vLLM's BlockStored / BlockRemoved structs, which is the
// position order of the tagged-array encoding. Later fields are skipped.
var (
	storedFields = [...]fieldID{fieldBlockHashes, fieldParentBlockHash, fieldTokenIDs, fieldBlockSize, fieldLoRAID,
		fieldMedium, fieldLoRAName, fieldExtraKeys, fieldGroupIdx, fieldSpecKind, fieldSlidingWindow}
	removedFields = [...]fieldID{fieldBlockHashes, fieldMedium, fieldGroupIdx}
)

func fieldByName(key []byte) fieldID {
	switch string(key) {
	case "block_hashes":
		return fieldBlockHashes
	case "parent_block_hash":
		return fieldParentBlockHash
	case "token_ids":
		return fieldTokenIDs
	case "block_size":
		return fieldBlockSize
	case "lora_id":
		return fieldLoRAID
	case "medium":
		return fieldMedium
	case "lora_name":
		return fieldLoRAName
	case "extra_keys":
		return fieldExtraKeys
	case "group_idx":
		return fieldGroupIdx
	case "kv_cache_spec_kind":
		return fieldSpecKind
	case "kv_cache_spec_sliding_window":
		return fieldSlidingWindow
	}
	return fieldUnknown
}

var fieldNames = [...]string{"unknown", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys",
	"group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}

// field decodes one named field into d.tmp, skipping names it does not know.
// The same names mean the same thing in every event type, so the decoder
// does not need the type first.
func (d *Decoder) field(name fieldID, hasLoRA *bool, lora *int64) error {
	t := &d.tmp
	var err error
	switch name {
	case fieldBlockHashes:
		t.BlockHashes, err = d.hashes(t.BlockHashes)
	case fieldParentBlockHash:
		if d.isNil() {
			_ = d.dec.DecodeNil()
			t.HasParent = false
			return nil
		}
		t.ParentBlockHash, err = d.hash()
		t.HasParent = err == nil
	case fieldTokenIDs:
		t.TokenIDs, err = d.tokens(t.TokenIDs)
	case fieldBlockSize:
		var n int64
		n, err = d.dec.DecodeInt64()
		if err == nil && (n < 0 || n > 1<<20) {
			err = fmt.Errorf("block_size %d out of range", n)
		}
		t.BlockSize = int(n)
	case fieldLoRAID:
		if d.isNil() {
			_ = d.dec.DecodeNil()
			*hasLoRA = false
			return nil
		}
		*lora, err = d.dec.DecodeInt64()
		*hasLoRA = err == nil
	case fieldMedium:
		t.Medium, err = d.optStr()
	case fieldLoRAName:
		t.LoRAName, err = d.optStr()
	case fieldExtraKeys:
		err = d.extraKeys()
	case fieldGroupIdx:
		t.GroupIdx, err = d.optSmallInt(1 << 16)
	case fieldSpecKind:
		// Newer fields are read leniently: a value of another type is
		// skipped, as an unknown field would be.
		if c, perr := d.dec.PeekCode(); perr == nil && msgpcode.IsString(c) {
			t.SpecKind, err = d.optStr()
		} else {
			return d.skip(0)
		}
	case fieldSlidingWindow:
		t.SlidingWindow, err = d.optSmallInt(1 << 30)
	default:
		return d.skip(0)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", fieldNames[name], err)
	}
	return nil
}

func nextEvent(b *Batch) *Event {
	n := len(b.Events)
	if n < cap(b.Events) {
		b.Events = b.Events[:n+1]
	} else {
		b.Events = append(b.Events, Event{})
	}
	return &b.Events[n]
}

func parseKind(tag []byte) Kind {
	switch string(tag) {
	case "BlockStored":
		return KindBlockStored
	case "BlockRemoved":
		return KindBlockRemoved
	case "AllBlocksCleared":
		return KindAllBlocksCleared
	}
	return 0
}

func (d *Decoder) hashes(dst []EngineHash) ([]EngineHash, error) {
	n, err := d.arrayLen()
	if err != nil {
		return dst, err
	}
	if n < 0 {
		return dst, errors.New("nil list")
	}
	if cap(dst)-len(dst) < n {
		grown := make([]EngineHash, len(dst), len(dst)+n)
		copy(grown, dst)
		dst = grown
	}
	// Fast path: integer hashes parsed straight from the payload.
	pos := len(d.payload) - d.rd.Len()
	i := 0
	for ; i < n; i++ {
		v, _, next, ok := rawInt(d.payload, pos)
		if !ok {
			break
		}
		dst = append(dst, EngineHash(v))
		pos = next
	}
	if _, err := d.rd.Seek(int64(pos), io.SeekStart); err != nil {
		return dst, err
	}
	// Slow path for the rest (byte-string hashes, errors).
	for ; i < n; i++ {
		h, err := d.hash()
		if err != nil {
			return dst, err
		}
		dst = append(dst, h)
	}
	return dst, nil
}

// rawInt parses the msgpack integer at p[pos]. It returns the value's 64 bits
// (two's complement for negative numbers), whether the code was a signed
// one, and the position after it; ok is false when p[pos] is not a complete
// integer.
func rawInt(p []byte, pos int) (v uint64, signed bool, next int, ok bool) {
	if pos >= len(p) {
		return 0, false, pos, false
	}
	c := p[pos]
	var size int
	switch {
	case c < 0x80:
		return uint64(c), false, pos + 1, true
	case c >= 0xe0:
		return uint64(int64(int8(c))), true, pos + 1, true
	case c == msgpcode.Uint8 || c == msgpcode.Int8:
		size = 1
	case c == msgpcode.Uint16 || c == msgpcode.Int16:
		size = 2
	case c == msgpcode.Uint32 || c == msgpcode.Int32:
		size = 4
	case c == msgpcode.Uint64 || c == msgpcode.Int64:
		size = 8
	default:
		return 0, false, pos, false
	}
	if pos+1+size > len(p) {
		return 0, false, pos, false
	}
	b := p[pos+1 : pos+1+size]
	signed = c >= msgpcode.Int8
	switch size {
	case 1:
		v = uint64(b[0])
		if signed {
			v = uint64(int64(int8(b[0])))
		}
	case 2:
		v = uint64(binary.BigEndian.Uint16(b))
		if signed {
			v = uint64(int64(int16(v)))
		}
	case 4:
		v = uint64(binary.BigEndian.Uint32(b))
		if signed {
			v = uint64(int64(int32(v)))
		}
	case 8:
		v = binary.BigEndian.Uint64(b)
	}
	return v, signed, pos + 1 + size, true
}

// hash decodes one engine block hash: an unsigned or signed integer kept
// bit-for-bit, or a byte/str string folded to 64 bits with xxh3.Hash.
func (d *Decoder) hash() (EngineHash, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return 0, err
	}
	switch {
	case isInt(c):
		v, err := d.dec.DecodeUint64()
		return EngineHash(v), err
	case msgpcode.IsBin(c) || msgpcode.IsString(c):
		p, err := d.str()
		if err != nil {
			return 0, err
		}
		return EngineHash(xxh3.Hash(p)), nil
	}
	return 0, fmt.Errorf("block hash is msgpack code 0x%02x, want int or bytes", c)
}

func (d *Decoder) tokens(dst []uint32) ([]uint32, error) {
	n, err := d.arrayLen()
	if err != nil {
		return dst, err
	}
	if n < 0 {
		return dst, errors.New("nil list")
	}
	if cap(dst)-len(dst) < n {
		grown := make([]uint32, len(dst), len(dst)+n)
		copy(grown, dst)
		dst = grown
	}
	pos := len(d.payload) - d.rd.Len()
	for range n {
		v, signed, next, ok := rawInt(d.payload, pos)
		if !ok {
			return dst, fmt.Errorf("token id at byte %d is not an integer", pos)
		}
		if signed && int64(v) < 0 || v > 0xFFFFFFFF {
			return dst, fmt.Errorf("token id %d out of range", int64(v))
		}
		dst = append(dst, uint32(v))
		pos = next
	}
	_, err = d.rd.Seek(int64(pos), io.SeekStart)
	return dst, err
}

// arrayLen reads an array header (-1 for nil) and bounds its length by the
// bytes left, since every element takes at least one byte.
func (d *Decoder) arrayLen() (int, error) {
	n, err := d.dec.DecodeArrayLen()
	if err != nil {
		return 0, err
	}
	if n > d.rd.Len() {
		return 0, fmt.Errorf("array of %d elements in %d bytes", n, d.rd.Len())
	}
	return n, nil
}

func (d *Decoder) mapLen() (int, error) {
	n, err := d.dec.DecodeMapLen()
	if err != nil {
		return 0, err
	}
	if n < 0 {
		return 0, errors.New("nil map")
	}
	if 2*n > d.rd.Len() {
		return 0, fmt.Errorf("map of %d entries in %d bytes", n, d.rd.Len())
	}
	return n, nil
}

// str reads a str or bin value into the scratch buffer; the result is valid
// until the next read.
func (d *Decoder) str() ([]byte, error) {
	n, err := d.dec.DecodeBytesLen()
	if err != nil {
		return nil, err
	}
	if n < 0 {
		return nil, errors.New("nil string")
	}
	if n > d.rd.Len() {
		return nil, fmt.Errorf("string of %d bytes in %d bytes", n, d.rd.Len())
	}
	if cap(d.scratch) < n {
		d.scratch = make([]byte, n)
	}
	d.scratch = d.scratch[:n]
	if err := d.dec.ReadFull(d.scratch); err != nil {
		return nil, err
	}
	return d.scratch, nil
}

// optSmallInt reads a nil-able integer in [0, max] (nil: 0).
// A value that is not an integer is skipped (0).
func (d *Decoder) optSmallInt(max int64) (int, error) {
	if d.isNil() {
		return 0, d.dec.DecodeNil()
	}
	if c, err := d.dec.PeekCode(); err == nil && !isInt(c) {
		return 0, d.skip(0)
	}
	n, err := d.dec.DecodeInt64()
	if err == nil && (n < 0 || n > max) {
		err = fmt.Errorf("%d out of range [0, %d]", n, max)
	}
	return int(n), err
}

// optStr reads a nil-able string; the common medium names are interned so a
// typical event allocates no string.
func (d *Decoder) optStr() (string, error) {
	if d.isNil() {
		return "", d.dec.DecodeNil()
	}
	p, err := d.str()
	if err != nil {
		return "", err
	}
	switch string(p) {
	case "":
		return "", nil
	case "GPU":
		return "GPU", nil
	case "CPU":
		return "CPU", nil
	case "DISK":
		return "DISK", nil
	}
	return string(p), nil
}

// optInt reads a nil-able integer, reusing old's storage when set.
func (d *Decoder) optInt(old *int64) (*int64, error) {
	if d.isNil() {
		return nil, d.dec.DecodeNil()
	}
	c, _ := d.dec.PeekCode()
	if !isInt(c) {
		return nil, fmt.Errorf("msgpack code 0x%02x, want int", c)
	}
	v, err := d.dec.DecodeInt64()
	if err != nil {
		return nil, err
	}
	if old == nil {
		old = new(int64)
	}
	*old = v
	return old, nil
}

func (d *Decoder) float() (float64, error) {
	c, err := d.dec.PeekCode()
	if err != nil {
		return 0, err
	}
	if c != msgpcode.Float && c != msgpcode.Double && !isInt(c) {
		return 0, fmt.Errorf("msgpack code 0x%02x, want float", c)
	}
	return d.dec.DecodeFloat64()
}

func (d *Decoder) isNil() bool {
	c, err := d.dec.PeekCode()
	return err == nil && c == msgpcode.Nil
}

// skip skips one value of any type. Unlike msgpack's own Skip it checks every
// claimed length against the bytes left (so a corrupt length cannot make it
// allocate) and bounds nesting. Extension types never occur in vLLM payloads
// and are rejected.
func (d *Decoder) skip(depth int) error {
	if depth > maxSkipDepth {
		return fmt.Errorf("values nested deeper than %d", maxSkipDepth)
	}
	c, err := d.dec.PeekCode()
	if err != nil {
		return err
	}
	switch {
	case isArray(c):
		n, err := d.arrayLen()
		if err != nil {
			return err
		}
		for range n {
			if err := d.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case isMap(c):
		n, err := d.mapLen()
		if err != nil {
			return err
		}
		for range 2 * n {
			if err := d.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case msgpcode.IsString(c) || msgpcode.IsBin(c):
		n, err := d.dec.DecodeBytesLen()
		if err != nil {
			return err
		}
		if n > d.rd.Len() {
			return fmt.Errorf("string of %d bytes in %d bytes", n, d.rd.Len())
		}
		_, err = d.rd.Seek(int64(n), io.SeekCurrent)
		return err
	case msgpcode.IsExt(c) || msgpcode.IsFixedExt(c):
		return fmt.Errorf("unexpected msgpack extension 0x%02x", c)
	}
	// Scalars: nil, bool, ints, floats have fixed sizes.
	return d.dec.Skip()
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

func isInt(c byte) bool {
	if msgpcode.IsFixedNum(c) {
		return true
	}
	switch c {
	case msgpcode.Uint8, msgpcode.Uint16, msgpcode.Uint32, msgpcode.Uint64,
		msgpcode.Int8, msgpcode.Int16, msgpcode.Int32, msgpcode.Int64:
		return true
	}
	return false
}
