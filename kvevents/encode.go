package kvevents

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// ErrBadEncoding: an Encoding or ReplayForm name or value is not known.
var ErrBadEncoding = errors.New("kvevents: unknown encoding")

// Encoding selects which generation of vLLM's payload format an Encoder
// writes. The Decoder reads all of them regardless.
type Encoding uint8

const (
	// EncodingMap is vLLM v0.26: the batch is an array [ts, events, dp_rank]
	// and each event a map {"type": "BlockStored", ...}. The default.
	EncodingMap Encoding = iota
	// EncodingArray is the older form: array batch, tagged-array events
	// ["BlockStored", block_hashes, ...] with trailing default fields omitted.
	EncodingArray
	// EncodingMapEnvelope is the newest form: the batch is a map
	// {"ts", "events", "data_parallel_rank"} with map events.
	EncodingMapEnvelope
)

// ParseEncoding maps "map", "array" and "map-envelope" to an Encoding.
func ParseEncoding(s string) (Encoding, error) {
	switch s {
	case "map":
		return EncodingMap, nil
	case "array":
		return EncodingArray, nil
	case "map-envelope":
		return EncodingMapEnvelope, nil
	}
	return 0, fmt.Errorf("%w %q (want map, array or map-envelope)", ErrBadEncoding, s)
}

func (e Encoding) String() string {
	switch e {
	case EncodingMap:
		return "map"
	case EncodingArray:
		return "array"
	case EncodingMapEnvelope:
		return "map-envelope"
	}
	return fmt.Sprintf("Encoding(%d)", uint8(e))
}

// Valid reports whether e is one of the defined encodings.
func (e Encoding) Valid() bool { return e <= EncodingMapEnvelope }

// Encoder writes Batches in one Encoding the way vLLM's msgspec encoder does:
// compact integers, float64 ts, fields in struct order, fields whose value is
// their default (extra_keys, group_idx, a nil data_parallel_rank in map form)
// omitted. An Encoder reuses its buffer and is not safe for concurrent use.
type Encoder struct {
	form Encoding
	buf  bytes.Buffer
	enc  *msgpack.Encoder
}

// NewEncoder returns an Encoder for form. It panics on an invalid form, which
// is a programming error (configs are checked by Validate).
func NewEncoder(form Encoding) *Encoder {
	if !form.Valid() {
		panic(fmt.Sprintf("kvevents: NewEncoder(%v)", form))
	}
	e := &Encoder{form: form}
	e.enc = msgpack.NewEncoder(&e.buf)
	e.enc.UseCompactInts(true)
	return e
}

// Encode returns b encoded in a new slice.
func Encode(b *Batch, form Encoding) ([]byte, error) {
	return NewEncoder(form).Append(nil, b)
}

// Append appends the encoding of b to dst and returns the extended slice.
// Events with Kind set but a nil body encode as empty lists.
func (e *Encoder) Append(dst []byte, b *Batch) ([]byte, error) {
	e.buf.Reset()
	if err := e.batch(b); err != nil {
		return dst, err
	}
	return append(dst, e.buf.Bytes()...), nil
}

func (e *Encoder) batch(b *Batch) error {
	en := e.enc
	if e.form == EncodingMapEnvelope {
		n := 2
		if b.DataParallelRank != nil {
			n = 3
		}
		_ = en.EncodeMapLen(n)
		_ = en.EncodeString("ts")
		_ = en.EncodeFloat64(b.TS)
		_ = en.EncodeString("events")
		if err := e.events(b.Events); err != nil {
			return err
		}
		if b.DataParallelRank != nil {
			_ = en.EncodeString("data_parallel_rank")
			_ = en.EncodeInt(*b.DataParallelRank)
		}
		return nil
	}
	// The array batch has a default for data_parallel_rank, so msgspec omits
	// it when nil.
	n := 2
	if b.DataParallelRank != nil {
		n = 3
	}
	_ = en.EncodeArrayLen(n)
	_ = en.EncodeFloat64(b.TS)
	if err := e.events(b.Events); err != nil {
		return err
	}
	if b.DataParallelRank != nil {
		_ = en.EncodeInt(*b.DataParallelRank)
	}
	return nil
}

func (e *Encoder) events(evs []Event) error {
	_ = e.enc.EncodeArrayLen(len(evs))
	for i := range evs {
		if err := e.event(&evs[i]); err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
	}
	return nil
}

func (e *Encoder) event(ev *Event) error {
	en := e.enc
	arr := e.form == EncodingArray
	switch ev.Kind {
	case KindBlockStored:
		s := ev.Stored
		if s == nil {
			s = &BlockStored{}
		}
		// All seven fields have no default in vLLM's struct, so msgspec
		// writes them all; extra_keys and the group fields only when set.
		extra := s.CacheSalt != "" || s.HasExtraKeys
		grouped := s.GroupIdx != 0 || s.SpecKind != "" || s.SlidingWindow != 0
		n := 8
		switch {
		case grouped && (arr || extra):
			// The array form needs the extra_keys slot before the group's.
			n = 12
		case grouped:
			n = 11
		case extra:
			n = 9
		}
		if arr {
			_ = en.EncodeArrayLen(n)
			_ = en.EncodeString("BlockStored")
		} else {
			_ = en.EncodeMapLen(n)
			_ = en.EncodeString("type")
			_ = en.EncodeString("BlockStored")
		}
		e.key(arr, "block_hashes")
		e.hashes(s.BlockHashes)
		e.key(arr, "parent_block_hash")
		if s.HasParent {
			_ = en.EncodeUint(uint64(s.ParentBlockHash))
		} else {
			_ = en.EncodeNil()
		}
		e.key(arr, "token_ids")
		_ = en.EncodeArrayLen(len(s.TokenIDs))
		for _, t := range s.TokenIDs {
			_ = en.EncodeUint(uint64(t))
		}
		e.key(arr, "block_size")
		_ = en.EncodeInt(int64(s.BlockSize))
		e.key(arr, "lora_id")
		if s.LoRAID != nil {
			_ = en.EncodeInt(*s.LoRAID)
		} else {
			_ = en.EncodeNil()
		}
		e.key(arr, "medium")
		e.optStr(s.Medium)
		e.key(arr, "lora_name")
		e.optStr(s.LoRAName)
		if extra {
			e.key(arr, "extra_keys")
			e.extraKeys(s)
		} else if grouped && arr {
			_ = en.EncodeNil()
		}
		if grouped {
			e.key(arr, "group_idx")
			_ = en.EncodeInt(int64(s.GroupIdx))
			e.key(arr, "kv_cache_spec_kind")
			e.optStr(s.SpecKind)
			e.key(arr, "kv_cache_spec_sliding_window")
			if s.SlidingWindow != 0 {
				_ = en.EncodeInt(int64(s.SlidingWindow))
			} else {
				_ = en.EncodeNil()
			}
		}
	case KindBlockRemoved:
		r := ev.Removed
		if r == nil {
			r = &BlockRemoved{}
		}
		n := 3
		if r.GroupIdx != 0 {
			n = 4
		}
		if arr {
			_ = en.EncodeArrayLen(n)
			_ = en.EncodeString("BlockRemoved")
		} else {
			_ = en.EncodeMapLen(n)
			_ = en.EncodeString("type")
			_ = en.EncodeString("BlockRemoved")
		}
		e.key(arr, "block_hashes")
		e.hashes(r.BlockHashes)
		e.key(arr, "medium")
		e.optStr(r.Medium)
		if r.GroupIdx != 0 {
			e.key(arr, "group_idx")
			_ = en.EncodeInt(int64(r.GroupIdx))
		}
	case KindAllBlocksCleared:
		if arr {
			_ = en.EncodeArrayLen(1)
		} else {
			_ = en.EncodeMapLen(1)
			_ = en.EncodeString("type")
		}
		_ = en.EncodeString("AllBlocksCleared")
	default:
		return fmt.Errorf("kvevents: cannot encode event kind %d", ev.Kind)
	}
	return nil
}

// extraKeys writes extra_keys as vLLM builds them for a text request: per
// block the LoRA name, plus the cache salt on a sequence's first block; None
// for a block with neither. Multimodal and prompt-embedding keys are not
// represented in BlockStored, so OpaqueFrom is not encoded.
func (e *Encoder) extraKeys(s *BlockStored) {
	en := e.enc
	_ = en.EncodeArrayLen(len(s.BlockHashes))
	for i := range s.BlockHashes {
		n := 0
		if s.LoRAName != "" {
			n++
		}
		salted := i == 0 && !s.HasParent && s.CacheSalt != ""
		if salted {
			n++
		}
		if n == 0 {
			_ = en.EncodeNil()
			continue
		}
		_ = en.EncodeArrayLen(n)
		if s.LoRAName != "" {
			_ = en.EncodeString(s.LoRAName)
		}
		if salted {
			_ = en.EncodeString(s.CacheSalt)
		}
	}
}

func (e *Encoder) key(arr bool, name string) {
	if !arr {
		_ = e.enc.EncodeString(name)
	}
}

func (e *Encoder) hashes(hs []EngineHash) {
	_ = e.enc.EncodeArrayLen(len(hs))
	for _, h := range hs {
		_ = e.enc.EncodeUint(uint64(h))
	}
}

func (e *Encoder) optStr(s string) {
	if s == "" {
		_ = e.enc.EncodeNil()
		return
	}
	_ = e.enc.EncodeString(s)
}
