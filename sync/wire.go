package sync

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/kvmesh/kvmesh/index"
)

// Wire format of peer messages, version 1 (NATS payloads and memberlist
// user messages alike). Integers are unsigned LEB128 varints ("uv") unless
// noted; "sv" is a zig-zag signed varint; u64 is 8 bytes little-endian;
// str is uv length then bytes.
//
//	header:    'K' 'M' version(=1) kind
//	kind 1, decisions (routing-decision deltas):
//	           origin str, seq uv (per origin, from 1), sentAt sv (Unix ns),
//	           names uv, names × str (the batch's replica-name table),
//	           entries uv, entries × {
//	               ledger byte (0 history, 1 speculative),
//	               name uv (index into the table),
//	               age uv (sentAt − decision time, ns),
//	               keys uv, keys × u64 (block keys, prompt order)}
//	kind 2, kv (one engine batch, normalized by its owner):
//	           origin str, replica str, seq uv (the engine's own sequence
//	           number), engineTS u64 (float64 bits, engine clock),
//	           sentAt sv, flags byte (bit 0: reset), reason byte,
//	           events uv, events × index.AppendKVEvent's encoding
//	           (kind byte 1 stored, 2 removed, 3 all cleared; stored:
//	           hashes uv, hashes × u64, flags byte (bit 0 parent, bit 1
//	           root), [parent u64], [root u64], blockTokens uv, tokens uv
//	           (= hashes×blockTokens), tokens × uv; removed: hashes uv,
//	           hashes × u64; cleared: nothing)
//	kind 3, load:   origin str, sentAt sv, loads uv, loads × {replica str, inflight uv}
//	kind 5, queued: origin str, sentAt sv, loads uv, loads × {replica str, tokens uv}
//	           (queued prefill tokens; added after version 1 shipped, on its
//	           own subject, see below)
//	kind 4, digest: origin str, sentAt sv, entries 3 × uv (history,
//	           speculative, confirmed), sources uv, sources × {source str, seq uv}
//
// Kind 5 is the queued-prefill half of a load report. It is a separate
// message, not a field appended to kind 3, because decoders of this
// format reject trailing bytes, unknown versions and unknown kinds alike:
// a kind-3 message that grew a field, or a version-2 header, would be
// dropped as malformed by a gateway of the previous release, which would
// then lose its peers' in-flight counts during a rolling upgrade. Kind 3
// stays byte for byte what it was, and kind 5 travels on a subject that
// previous releases do not subscribe to (kvmesh.<cluster>.queued.<node>),
// so they never see it; a gateway of this release that hears only kind 3
// from a peer counts that peer's queued prefill as 0 (unknown).
//
// Trailing bytes after a message are an error. Every count is checked
// against the bytes left before anything is allocated, so a hostile length
// costs nothing; decodeMessage never panics.
const (
	wireMagic0  = 'K'
	wireMagic1  = 'M'
	wireVersion = 1

	maxName    = 255     // replica, origin and source names
	maxEntries = 1 << 16 // decisions per batch, events per kv batch, loads, sources
	maxKeys    = 1 << 20 // keys per decision, hashes per event
	// MaxMessageBytes bounds an encoded message (the embedded NATS server's
	// max_payload is set to it; external servers must allow it).
	MaxMessageBytes = 8 << 20
)

// msgKind is a peer message type.
type msgKind uint8

// Message kinds.
const (
	kindDecisions msgKind = 1
	kindKV        msgKind = 2
	kindLoad      msgKind = 3
	kindDigest    msgKind = 4
	kindQueued    msgKind = 5
)

func (k msgKind) String() string {
	switch k {
	case kindDecisions:
		return "decisions"
	case kindKV:
		return "kv"
	case kindLoad:
		return "load"
	case kindDigest:
		return "digest"
	case kindQueued:
		return "queued"
	}
	return "unknown"
}

// Decision is one routing decision: replica probably holds Keys.
type Decision struct {
	Replica string
	Ledger  index.Ledger // History or Speculative
	At      int64        // decision time, Unix ns (the origin's clock)
	Keys    []index.BlockKey
}

// DecisionBatch is one published batch of an origin's decisions.
type DecisionBatch struct {
	Origin  string
	Seq     uint64 // per origin, from 1, +1 per batch
	SentAt  int64
	Entries []Decision
}

// KVBatch is one engine batch republished by the engine's owner gateway.
type KVBatch struct {
	Origin   string
	Replica  string
	Seq      uint64  // the engine's sequence number
	EngineTS float64 // the engine's clock, seconds
	SentAt   int64
	// Reset says the replica's confirmed state is unknown (Reason is the
	// kvevents.ResetReason); a reset carries no events.
	Reset  bool
	Reason uint8
	// Events are the owner's normalized events (kvevents.Normalize), which
	// every gateway applies with index.ApplyKV.
	Events []index.KVEvent
}

// ReplicaLoad is one gateway's load on one replica.
type ReplicaLoad struct {
	Replica string
	// InFlight is the gateway's requests in flight to the replica (kind 3).
	InFlight int
	// QueuedPrefillTokens is the uncached prompt tokens of the gateway's
	// requests to the replica that have not yet produced a first byte
	// (kind 5; route.Candidate.QueuedPrefillTokens at its origin).
	QueuedPrefillTokens int
}

// loadReport is a gateway's load. A kind-3 message carries (and decodes
// to) the InFlight counts only, a kind-5 message the QueuedPrefillTokens
// only; the other field is 0.
type loadReport struct {
	Origin string
	SentAt int64
	Loads  []ReplicaLoad
}

// watermark is the last sequence number applied from one source:
// "d/<origin>" for an origin's decision batches, "kv/<replica>" for an
// engine's KV batches (engine seq + 1; 0 = nothing applied).
type watermark struct {
	Source string
	Seq    uint64
}

// digest summarizes a gateway's index for anti-entropy.
type digest struct {
	Origin  string
	SentAt  int64
	Entries [3]uint64 // per ledger (informational)
	Sources []watermark
}

// message is a decoded peer message; the field Kind names is set (Load
// for both kindLoad and kindQueued).
type message struct {
	Kind      msgKind
	Decisions *DecisionBatch
	KV        *KVBatch
	Load      *loadReport
	Digest    *digest
}

func appendHeader(dst []byte, k msgKind) []byte {
	return append(dst, wireMagic0, wireMagic1, wireVersion, byte(k))
}

func appendStr(dst []byte, s string) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

func appendU64(dst []byte, v uint64) []byte { return binary.LittleEndian.AppendUint64(dst, v) }

func checkName(what, s string) error {
	if len(s) > maxName {
		return fmt.Errorf("%w: %s of %d bytes", ErrTooLarge, what, len(s))
	}
	return nil
}

// AppendDecisions appends the encoding of b to dst.
func AppendDecisions(dst []byte, b *DecisionBatch) ([]byte, error) {
	if err := checkName("origin", b.Origin); err != nil {
		return dst, err
	}
	if len(b.Entries) > maxEntries {
		return dst, fmt.Errorf("%w: %d decisions", ErrTooLarge, len(b.Entries))
	}
	start := len(dst)
	dst = appendHeader(dst, kindDecisions)
	dst = appendStr(dst, b.Origin)
	dst = binary.AppendUvarint(dst, b.Seq)
	dst = binary.AppendVarint(dst, b.SentAt)
	// Name table: replicas in order of first appearance. Batches are small
	// and hold few replicas, so a linear scan beats a map.
	var names [16]string
	table := names[:0]
	find := func(s string) int {
		for i, n := range table {
			if n == s {
				return i
			}
		}
		return -1
	}
	for i := range b.Entries {
		if find(b.Entries[i].Replica) < 0 {
			if err := checkName("replica", b.Entries[i].Replica); err != nil {
				return dst[:start], err
			}
			table = append(table, b.Entries[i].Replica)
		}
	}
	dst = binary.AppendUvarint(dst, uint64(len(table)))
	for _, n := range table {
		dst = appendStr(dst, n)
	}
	dst = binary.AppendUvarint(dst, uint64(len(b.Entries)))
	for i := range b.Entries {
		e := &b.Entries[i]
		if e.Ledger != index.History && e.Ledger != index.Speculative {
			return dst[:start], fmt.Errorf("%w: ledger %v", index.ErrInvalidLedger, e.Ledger)
		}
		if len(e.Keys) > maxKeys {
			return dst[:start], fmt.Errorf("%w: %d keys", ErrTooLarge, len(e.Keys))
		}
		age := b.SentAt - e.At
		if age < 0 {
			age = 0
		}
		dst = append(dst, byte(e.Ledger))
		dst = binary.AppendUvarint(dst, uint64(find(e.Replica)))
		dst = binary.AppendUvarint(dst, uint64(age))
		dst = binary.AppendUvarint(dst, uint64(len(e.Keys)))
		for _, k := range e.Keys {
			dst = appendU64(dst, uint64(k))
		}
	}
	if len(dst)-start > MaxMessageBytes {
		return dst[:start], fmt.Errorf("%w: %d bytes", ErrTooLarge, len(dst)-start)
	}
	return dst, nil
}

// AppendKV appends the encoding of b to dst.
func AppendKV(dst []byte, b *KVBatch) ([]byte, error) {
	if err := checkName("origin", b.Origin); err != nil {
		return dst, err
	}
	if err := checkName("replica", b.Replica); err != nil {
		return dst, err
	}
	if len(b.Events) > maxEntries {
		return dst, fmt.Errorf("%w: %d events", ErrTooLarge, len(b.Events))
	}
	start := len(dst)
	dst = appendHeader(dst, kindKV)
	dst = appendStr(dst, b.Origin)
	dst = appendStr(dst, b.Replica)
	dst = binary.AppendUvarint(dst, b.Seq)
	dst = appendU64(dst, math.Float64bits(b.EngineTS))
	dst = binary.AppendVarint(dst, b.SentAt)
	var flags byte
	if b.Reset {
		flags |= 1
	}
	dst = append(dst, flags, b.Reason)
	dst = binary.AppendUvarint(dst, uint64(len(b.Events)))
	for i := range b.Events {
		var err error
		if dst, err = index.AppendKVEvent(dst, &b.Events[i]); err != nil {
			if errors.Is(err, index.ErrKVEventTooLarge) {
				err = fmt.Errorf("%w: %w", ErrTooLarge, err)
			}
			return dst[:start], err
		}
	}
	if len(dst)-start > MaxMessageBytes {
		return dst[:start], fmt.Errorf("%w: %d bytes", ErrTooLarge, len(dst)-start)
	}
	return dst, nil
}

// appendLoad appends the kind-3 encoding of r (its InFlight counts) to dst.
func appendLoad(dst []byte, r *loadReport) ([]byte, error) {
	return appendLoads(dst, r, kindLoad)
}

// appendQueued appends the kind-5 encoding of r (its QueuedPrefillTokens)
// to dst.
func appendQueued(dst []byte, r *loadReport) ([]byte, error) {
	return appendLoads(dst, r, kindQueued)
}

func appendLoads(dst []byte, r *loadReport, k msgKind) ([]byte, error) {
	if err := checkName("origin", r.Origin); err != nil {
		return dst, err
	}
	if len(r.Loads) > maxEntries {
		return dst, fmt.Errorf("%w: %d loads", ErrTooLarge, len(r.Loads))
	}
	start := len(dst)
	dst = appendHeader(dst, k)
	dst = appendStr(dst, r.Origin)
	dst = binary.AppendVarint(dst, r.SentAt)
	dst = binary.AppendUvarint(dst, uint64(len(r.Loads)))
	for _, l := range r.Loads {
		if err := checkName("replica", l.Replica); err != nil {
			return dst[:start], err
		}
		n := l.InFlight
		if k == kindQueued {
			n = l.QueuedPrefillTokens
		}
		dst = appendStr(dst, l.Replica)
		dst = binary.AppendUvarint(dst, uint64(min(max(n, 0), math.MaxInt32)))
	}
	return dst, nil
}

// appendDigest appends the encoding of d to dst.
func appendDigest(dst []byte, d *digest) ([]byte, error) {
	if err := checkName("origin", d.Origin); err != nil {
		return dst, err
	}
	if len(d.Sources) > maxEntries {
		return dst, fmt.Errorf("%w: %d sources", ErrTooLarge, len(d.Sources))
	}
	start := len(dst)
	dst = appendHeader(dst, kindDigest)
	dst = appendStr(dst, d.Origin)
	dst = binary.AppendVarint(dst, d.SentAt)
	for _, e := range d.Entries {
		dst = binary.AppendUvarint(dst, e)
	}
	dst = binary.AppendUvarint(dst, uint64(len(d.Sources)))
	for _, w := range d.Sources {
		if err := checkName("source", w.Source); err != nil {
			return dst[:start], err
		}
		dst = appendStr(dst, w.Source)
		dst = binary.AppendUvarint(dst, w.Seq)
	}
	return dst, nil
}

// reader decodes with a sticky error: after the first failure every read
// returns zero values, so callers check err once per structure.
type reader struct {
	b   []byte
	err error
}

func (r *reader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
	}
	r.b = nil
}

func (r *reader) byte1(what string) byte {
	if r.err != nil {
		return 0
	}
	if len(r.b) < 1 {
		r.fail("truncated %s", what)
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *reader) uv(what string) uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.fail("bad varint %s", what)
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) sv(what string) int64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.fail("bad varint %s", what)
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) u64(what string) uint64 {
	if r.err != nil {
		return 0
	}
	if len(r.b) < 8 {
		r.fail("truncated %s", what)
		return 0
	}
	v := binary.LittleEndian.Uint64(r.b)
	r.b = r.b[8:]
	return v
}

// count reads a count bounded by max and by the bytes left, given the
// minimum encoded size of one item.
func (r *reader) count(what string, max int, minSize int) int {
	v := r.uv(what)
	if r.err != nil {
		return 0
	}
	if v > uint64(max) || v*uint64(minSize) > uint64(len(r.b)) {
		r.fail("%s count %d out of bounds", what, v)
		return 0
	}
	return int(v)
}

func (r *reader) str(what string) string {
	n := r.uv(what)
	if r.err != nil {
		return ""
	}
	if n > maxName || n > uint64(len(r.b)) {
		r.fail("%s length %d out of bounds", what, n)
		return ""
	}
	s := string(r.b[:n])
	r.b = r.b[n:]
	return s
}

// decodeMessage decodes one peer message. Errors wrap ErrMalformed; it never
// panics and keeps no reference to data.
func decodeMessage(data []byte) (message, error) {
	if len(data) > MaxMessageBytes {
		return message{}, fmt.Errorf("%w: %d bytes", ErrMalformed, len(data))
	}
	if len(data) < 4 || data[0] != wireMagic0 || data[1] != wireMagic1 {
		return message{}, fmt.Errorf("%w: bad magic", ErrMalformed)
	}
	if data[2] != wireVersion {
		return message{}, fmt.Errorf("%w: version %d", ErrMalformed, data[2])
	}
	r := &reader{b: data[4:]}
	var m message
	m.Kind = msgKind(data[3])
	switch m.Kind {
	case kindDecisions:
		m.Decisions = decodeDecisions(r)
	case kindKV:
		m.KV = decodeKV(r)
	case kindLoad, kindQueued:
		m.Load = decodeLoad(r, m.Kind)
	case kindDigest:
		m.Digest = decodeDigest(r)
	default:
		return message{}, fmt.Errorf("%w: kind %d", ErrMalformed, data[3])
	}
	if r.err == nil && len(r.b) != 0 {
		r.fail("%d trailing bytes", len(r.b))
	}
	if r.err != nil {
		return message{}, r.err
	}
	return m, nil
}

func decodeDecisions(r *reader) *DecisionBatch {
	b := &DecisionBatch{Origin: r.str("origin"), Seq: r.uv("seq"), SentAt: r.sv("sentAt")}
	n := r.count("names", maxEntries, 1)
	names := make([]string, n)
	for i := range names {
		names[i] = r.str("name")
	}
	ne := r.count("entries", maxEntries, 4)
	if r.err != nil {
		return nil
	}
	b.Entries = make([]Decision, ne)
	for i := range b.Entries {
		e := &b.Entries[i]
		l := index.Ledger(r.byte1("ledger"))
		if r.err == nil && l != index.History && l != index.Speculative {
			r.fail("ledger %d", l)
		}
		ni := r.uv("name index")
		if r.err == nil && ni >= uint64(len(names)) {
			r.fail("name index %d of %d", ni, len(names))
		}
		age := r.uv("age")
		if r.err == nil && age > math.MaxInt64/2 {
			r.fail("age %d", age)
		}
		nk := r.count("keys", maxKeys, 8)
		if r.err != nil {
			return nil
		}
		e.Ledger, e.Replica, e.At = l, names[ni], b.SentAt-int64(age)
		e.Keys = make([]index.BlockKey, nk)
		for j := range e.Keys {
			e.Keys[j] = index.BlockKey(r.u64("key"))
		}
	}
	return b
}

func decodeKV(r *reader) *KVBatch {
	b := &KVBatch{Origin: r.str("origin"), Replica: r.str("replica"), Seq: r.uv("seq")}
	b.EngineTS = math.Float64frombits(r.u64("engineTS"))
	b.SentAt = r.sv("sentAt")
	flags := r.byte1("flags")
	b.Reset, b.Reason = flags&1 != 0, r.byte1("reason")
	if r.err == nil && flags&^1 != 0 {
		r.fail("flags %#x", flags)
	}
	n := r.count("events", maxEntries, 1)
	if r.err != nil {
		return nil
	}
	if b.Reset && n != 0 {
		r.fail("reset with %d events", n)
		return nil
	}
	b.Events = make([]index.KVEvent, n)
	for i := range b.Events {
		rest, err := index.ReadKVEvent(r.b, &b.Events[i])
		if err != nil {
			r.fail("%v", err)
			return nil
		}
		r.b = rest
	}
	return b
}

func decodeLoad(r *reader, k msgKind) *loadReport {
	what := "inflight"
	if k == kindQueued {
		what = "queued tokens"
	}
	l := &loadReport{Origin: r.str("origin"), SentAt: r.sv("sentAt")}
	n := r.count("loads", maxEntries, 2)
	if r.err != nil {
		return nil
	}
	l.Loads = make([]ReplicaLoad, n)
	for i := range l.Loads {
		l.Loads[i].Replica = r.str("replica")
		v := r.uv(what)
		if r.err == nil && v > math.MaxInt32 {
			r.fail("%s %d", what, v)
		}
		if k == kindQueued {
			l.Loads[i].QueuedPrefillTokens = int(v)
		} else {
			l.Loads[i].InFlight = int(v)
		}
	}
	return l
}

func decodeDigest(r *reader) *digest {
	d := &digest{Origin: r.str("origin"), SentAt: r.sv("sentAt")}
	for i := range d.Entries {
		d.Entries[i] = r.uv("entries")
	}
	n := r.count("sources", maxEntries, 2)
	if r.err != nil {
		return nil
	}
	d.Sources = make([]watermark, n)
	for i := range d.Sources {
		d.Sources[i] = watermark{Source: r.str("source"), Seq: r.uv("seq")}
	}
	return d
}
