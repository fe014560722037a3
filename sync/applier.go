package sync

import (
	"context"
	"math"
	"strings"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

// Watermark source names in snapshots and digests.
const (
	srcDecisions = "d/"    // + origin: highest contiguous decision batch seq applied
	srcKV        = "kv/"   // + replica: engine seq + 1 of the last batch applied (0 = none)
	srcKVTS      = "kvts/" // + replica: float64 bits of that batch's engine time

	// An owner's digest also carries, for one of its engines at a time,
	// the fingerprint of its confirmed view (kvCheck), which peers compare
	// with theirs at the same watermark (Cluster.checkKV).
	srcKVAt  = "kvat/"  // + replica: the watermark (seq + 1) the fingerprint was taken at
	srcKVN   = "kvn/"   // + replica: engine blocks held (index.EngineFingerprint)
	srcKVSum = "kvsum/" // + replica: their fingerprint
)

// Bounds on what a KV batch or a snapshot watermark may claim (DESIGN §9:
// a member is trusted for its own engines' streams only, and only within
// what an engine can produce).
const (
	// kvSeqSlack is how far an engine's seq may jump beyond the last one
	// applied here, on top of kvMaxBatchRate per second since then. A
	// batch beyond it is refused (kv_rejected_total{reason="seq_jump"}),
	// not taken as the new watermark: one forged seq 2^40 would otherwise
	// make every real batch a "duplicate".
	kvSeqSlack = 1 << 16
	// kvMaxBatchRate is the most KV batches per second an engine is
	// assumed to publish (vLLM publishes at most one per scheduler step:
	// a few hundred per second). 10,000 leaves a wide margin.
	kvMaxBatchRate = 10_000
	// kvMaxClockSkew is how far an engine's clock (EngineTS, Unix seconds)
	// may run ahead of this gateway's before a batch or watermark is
	// refused (kv_rejected_total{reason="clock_ahead"}): an engine clock in
	// the future would make the real stream look older.
	kvMaxClockSkew = 5 * time.Minute
	// ownerGrace is how long after ownership of an engine moved (in this
	// gateway's view) the previous owner's batches are still accepted:
	// they were in flight, or its view changed a moment later.
	ownerGrace = 10 * time.Second
)

// dedupWindow is how far above the contiguous watermark an origin's
// batches may arrive out of order (NATS and gossip interleaving) before the
// missing ones are declared lost.
const dedupWindow = 1024

// originState tracks which decision batches of one origin were applied:
// every seq <= base, plus the seqs in above.
type originState struct {
	base  uint64
	above map[uint64]struct{}
}

// accept reports whether seq is new, marks it applied and returns how many
// earlier seqs were given up as lost to keep the window bounded.
func (o *originState) accept(seq uint64) (fresh bool, lost uint64) {
	if seq <= o.base {
		return false, 0
	}
	if _, dup := o.above[seq]; dup {
		return false, 0
	}
	if seq > o.base+dedupWindow {
		newBase := seq - dedupWindow
		for s := o.base + 1; s <= newBase; s++ {
			if _, ok := o.above[s]; ok {
				delete(o.above, s)
			} else {
				lost++
			}
		}
		o.base = newBase
	}
	if seq == o.base+1 {
		o.base++
		for {
			if _, ok := o.above[o.base+1]; !ok {
				break
			}
			delete(o.above, o.base+1)
			o.base++
		}
	} else {
		if o.above == nil {
			o.above = make(map[uint64]struct{})
		}
		o.above[seq] = struct{}{}
	}
	return true, lost
}

// kvState tracks one engine's KV stream as applied here.
type kvState struct {
	valid  bool // false: nothing applied since the start or a reset
	seq    uint64
	engine float64   // engine clock of the last applied batch
	at     time.Time // local time the state last moved (bounds seq jumps)
	// gap: batches after goodSeq were lost on the way here, so the
	// confirmed view may hold blocks whose removal was lost. Batches after
	// the gap are still applied (routing stays close), but the watermark
	// this gateway advertises and snapshots stays at goodSeq until a
	// repair replaces the view, so no peer takes it for a newer one.
	gap        bool
	goodSeq    uint64
	goodEngine float64
	// recent holds the view's fingerprint after each of the last
	// kvRecent batches applied in sequence since the last reset, gap or
	// restore (a ring; nrecent entries valid, the newest at last). Under
	// a steady stream of batches this gateway has moved past the seq of
	// an owner's fingerprint by the time its digest lands, and without
	// these a view that lost blocks' removals would never be compared
	// while the engine is busy (ci1112: 170 stale blocks for 20 s).
	recent  [kvRecent]kvCheck
	nrecent int
	last    int
}

// kvRecent is how many recent fingerprints a view keeps per engine: a
// digest reaches its peers within a few batches even when the engine
// publishes hundreds a second.
const kvRecent = 256

// record keeps chk as the newest recent fingerprint.
func (st *kvState) record(chk kvCheck) {
	st.last = (st.last + 1) % kvRecent
	st.recent[st.last] = chk
	st.nrecent = min(st.nrecent+1, kvRecent)
}

// forget drops the recent fingerprints: the view no longer follows from
// them batch by batch.
func (st *kvState) forget() { st.nrecent = 0 }

// recentAt returns the recent fingerprint taken at watermark at.
func (st *kvState) recentAt(at uint64) (kvCheck, bool) {
	for i := range st.nrecent {
		c := st.recent[(st.last-i+kvRecent)%kvRecent]
		switch {
		case c.at == at:
			return c, true
		case c.at < at:
			return kvCheck{}, false // older ones only from here
		}
	}
	return kvCheck{}, false
}

// mark is the watermark st stands for: the last batch up to which the view
// is complete, and its engine clock; ok false when nothing is known.
func (st *kvState) mark() (seq uint64, engine float64, ok bool) {
	switch {
	case !st.valid:
		return 0, 0, false
	case st.gap:
		return st.goodSeq, st.goodEngine, true
	}
	return st.seq, st.engine, true
}

// cleared records that the replica's view was emptied (reset, clear,
// engine restart): nothing lost before it matters any more.
func (st *kvState) cleared() { st.gap = false }

// inbound is one decoded peer message on its way to the applier.
type inbound struct {
	msg message
	via string // "nats" or "gossip"
}

// applier applies peers' deltas to the index from one goroutine, keeps the
// per-source watermarks, and buffers while a snapshot is being restored.
// mu is held for each application and while a snapshot is encoded, so a
// snapshot's watermarks always match its content.
type applier struct {
	c *Cluster
	q chan inbound

	mu            sync.Mutex
	origins       map[string]*originState
	kv            map[string]*kvState
	bootstrapping bool
	buf           []inbound
	gapSince      time.Time      // first unrepaired loss; zero = none
	kvRep         index.KVReport // applyKVLocked's scratch
}

func newApplier(c *Cluster) *applier {
	return &applier{
		c:       c,
		q:       make(chan inbound, c.cfg.ApplyQueue),
		origins: make(map[string]*originState),
		kv:      make(map[string]*kvState),
	}
}

// enqueue hands a message to the applier without blocking; a full queue
// drops it and schedules a repair.
func (a *applier) enqueue(in inbound) {
	select {
	case a.q <- in:
	default:
		a.c.m.dropped.WithLabelValues(in.msg.Kind.String(), "queue_full").Inc()
		a.markLoss()
	}
}

func (a *applier) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case in := <-a.q:
			a.mu.Lock()
			if a.bootstrapping {
				if len(a.buf) < a.c.cfg.BootstrapBuffer {
					a.buf = append(a.buf, in)
				} else {
					a.c.m.dropped.WithLabelValues(in.msg.Kind.String(), "bootstrap_overflow").Inc()
					a.markLossLocked()
				}
			} else {
				a.applyLocked(in)
			}
			a.mu.Unlock()
		}
	}
}

func (a *applier) markLoss() {
	a.mu.Lock()
	a.markLossLocked()
	a.mu.Unlock()
}

func (a *applier) markLossLocked() {
	if a.gapSince.IsZero() {
		a.gapSince = time.Now()
	}
}

// hasLoss reports an unrepaired loss.
func (a *applier) hasLoss() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return !a.gapSince.IsZero()
}

// takeLoss reports and clears an unrepaired loss.
func (a *applier) takeLoss() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	had := !a.gapSince.IsZero()
	a.gapSince = time.Time{}
	return had
}

func (a *applier) applyLocked(in inbound) {
	switch in.msg.Kind {
	case kindDecisions:
		a.applyDecisionsLocked(in.msg.Decisions, false)
	case kindKV:
		if reason := a.checkKVLocked(in.msg.KV, time.Now()); reason != "" {
			a.c.m.kvRejected.WithLabelValues(in.via, reason).Inc()
			a.c.log.Debug("KV batch refused", "replica", in.msg.KV.Replica, "origin", in.msg.KV.Origin,
				"seq", in.msg.KV.Seq, "reset", in.msg.KV.Reset, "reason", reason)
			return
		}
		a.applyKVLocked(in.msg.KV)
	}
}

// checkKVLocked returns why a peer's KV batch must not be applied ("" =
// apply it): it does not come from the engine's owner, its seq jumps
// further than the engine can have published since the last batch, or its
// engine clock is in the future. Resets and clears come only from the
// owner too (a reset carries no seq).
func (a *applier) checkKVLocked(b *KVBatch, now time.Time) string {
	if !a.c.kvOwn.accepts(b.Replica, originNode(b.Origin), now) {
		return "not_owner"
	}
	if b.Reset {
		return ""
	}
	if clockAhead(b.EngineTS, now) {
		return "clock_ahead"
	}
	if st := a.kv[b.Replica]; st != nil && st.valid && b.Seq > st.seq && b.Seq-st.seq > seqBound(st.at, now) {
		return "seq_jump"
	}
	return ""
}

// seqBound is how far an engine's seq may have advanced since last.
func seqBound(last, now time.Time) uint64 {
	el := now.Sub(last).Seconds()
	if el < 0 || last.IsZero() {
		el = 0
	}
	return kvSeqSlack + uint64(min(el, 1e7)*kvMaxBatchRate)
}

// clockAhead reports an engine time (Unix seconds) beyond this gateway's
// clock plus kvMaxClockSkew.
func clockAhead(engineTS float64, now time.Time) bool {
	return engineTS > float64(now.Add(kvMaxClockSkew).UnixNano())/1e9
}

// applyDecisionsLocked applies a decision batch unless it was seen; own
// re-applies this gateway's batches after a restore (no dedupe state).
func (a *applier) applyDecisionsLocked(b *DecisionBatch, own bool) {
	if !own && b.Seq == 0 {
		return // seqs start at 1; receive counts a 0 as malformed
	}
	if !own {
		o := a.origins[b.Origin]
		if o == nil {
			// An origin the restored snapshot did not know started after
			// it was taken (or published nothing before): all its
			// batches from 1 on are due here, so a later first seq is a
			// loss that anti-entropy repairs.
			o = &originState{}
			a.origins[b.Origin] = o
		}
		fresh, lost := o.accept(b.Seq)
		if lost > 0 {
			a.c.m.gaps.WithLabelValues("decisions").Add(float64(lost))
			a.markLossLocked()
		}
		if !fresh {
			a.c.m.dropped.WithLabelValues("decisions", "duplicate").Add(float64(len(b.Entries)))
			return
		}
	}
	now := time.Now().UnixNano()
	ix, reps := a.c.deps.Index, a.c.deps.Replicas
	applied := 0
	for i := range b.Entries {
		e := &b.Entries[i]
		id, ok := reps.ReplicaID(e.Replica)
		if !ok {
			a.c.m.dropped.WithLabelValues("decisions", "unknown_replica").Inc()
			continue
		}
		if err := ix.Record(e.Keys, id, e.Ledger, e.At); err != nil {
			a.c.m.dropped.WithLabelValues("decisions", "apply_error").Inc()
			continue
		}
		applied++
		if !own {
			a.c.m.lag.Observe(float64(now-e.At) / 1e9)
		}
	}
	a.c.m.applied.WithLabelValues("decisions").Add(float64(applied))
	if h := a.c.onApplied; h != nil && !own {
		h(b, now)
	}
}

// applyKVLocked applies one owner-normalized engine batch, idempotently by
// (replica, engine seq).
func (a *applier) applyKVLocked(b *KVBatch) {
	id, ok := a.c.deps.Replicas.ReplicaID(b.Replica)
	if !ok {
		a.c.m.dropped.WithLabelValues("kv", "unknown_replica").Inc()
		return
	}
	st := a.kv[b.Replica]
	if st == nil {
		st = &kvState{}
		a.kv[b.Replica] = st
	}
	ix := a.c.deps.Index
	if b.Reset {
		a.emptyLocked(id, st)
		a.c.m.applied.WithLabelValues("kv").Inc()
		return
	}
	inSeq := !st.valid
	if !st.valid {
		// Where this gateway took up the stream: a start past the
		// owner's first batches is what the owner's fingerprint (checkKV)
		// has to catch, and a failure to catch it needs this seq to read.
		a.c.log.Debug("KV stream taken up", "replica", b.Replica, "origin", b.Origin, "seq", b.Seq,
			"events", len(b.Events))
	} else {
		switch {
		case b.Seq == st.seq+1:
			inSeq = true
		case b.Seq > st.seq+1:
			// Batches the owner delivered were lost on the way here.
			a.c.m.gaps.WithLabelValues("kv").Inc()
			a.c.log.Info("KV batches lost on the way here", "replica", b.Replica, "origin", b.Origin,
				"expected_seq", st.seq+1, "seq", b.Seq)
			a.markLossLocked()
			if !st.gap {
				st.gap, st.goodSeq, st.goodEngine = true, st.seq, st.engine
			}
		case b.EngineTS > st.engine || st.seq-b.Seq > kvSeqSlack:
			// An older seq with a newer engine clock: the engine restarted
			// while ownership moved (the new owner saw no rewind). A seq
			// far below the watermark from the owner is one too, or the
			// watermark was wrong (a bad snapshot value): either way the
			// owner's stream wins, so no single value can stall ingestion.
			ix.ClearReplica(id)
			st.cleared()
			st.forget()
			inSeq = true
		default:
			a.c.m.dropped.WithLabelValues("kv", "duplicate").Inc()
			return
		}
	}
	rep := &a.kvRep
	ix.ApplyKV(id, b.Events, rep)
	if len(rep.Errors) > 0 {
		a.c.m.dropped.WithLabelValues("kv", "apply_error").Add(float64(len(rep.Errors)))
	}
	if rep.ParentZero > 0 && a.c.deps.KVMetrics != nil {
		// Every gateway applies the batch, so each counts it once.
		a.c.deps.KVMetrics.Tolerated.WithLabelValues(b.Replica, index.TolParentZero.String()).Add(float64(rep.ParentZero))
	}
	if rep.Cleared {
		st.cleared()
	}
	st.valid, st.seq, st.engine, st.at = true, b.Seq, b.EngineTS, time.Now()
	if inSeq && !st.gap {
		n, sum := ix.EngineFingerprint(id)
		st.record(kvCheck{at: b.Seq + 1, n: n, sum: sum})
	} else {
		st.forget()
	}
	a.c.m.applied.WithLabelValues("kv").Inc()
}

// resumePoint is where a new owner of replica's stream can take it up:
// the last batch applied here, when the view since the last reset is
// complete (no seq gap). ok is false when there is nothing to resume.
func (a *applier) resumePoint(replica string) (rp kvevents.ResumePoint, ok bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	st := a.kv[replica]
	if st == nil || !st.valid || st.gap {
		return rp, false
	}
	return kvevents.ResumePoint{Seq: kvevents.Seq(st.seq), EngineTS: st.engine}, true
}

// dropGapped empties this gateway's view of replica's engine when batches
// were lost on the way here since its last reset (kvState.gap), and
// reports whether it did. A gateway about to own the engine calls it
// before its subscriber replays the engine's buffer: the replay's batches
// up to the last one applied here are duplicates by seq and would be
// dropped, so the removals the gap lost would stay in the owner's view
// for good (no peer repairs an owner's view). Emptied, the view is
// rebuilt in order from the replay (ci1208: an owner kept 107 removed
// blocks of a scaled-out engine).
func (a *applier) dropGapped(replica string) bool {
	id, ok := a.c.deps.Replicas.ReplicaID(replica)
	if !ok {
		return false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	st := a.kv[replica]
	if st == nil || !st.valid || !st.gap {
		return false
	}
	a.emptyLocked(id, st)
	return true
}

// emptyLocked empties this gateway's view of engine id, whose stream
// state is st: nothing applied since.
func (a *applier) emptyLocked(id index.ReplicaID, st *kvState) {
	a.c.deps.Index.ClearReplica(id)
	st.valid = false
	st.cleared()
	st.forget()
}

// applyLocal applies a batch this gateway produced as an engine's owner.
func (a *applier) applyLocal(b *KVBatch) {
	a.mu.Lock()
	a.applyKVLocked(b)
	a.mu.Unlock()
}

// watermarksLocked returns the per-source watermarks, as stored in
// snapshots.
func (a *applier) watermarksLocked() map[string]uint64 {
	w := make(map[string]uint64, len(a.origins)+2*len(a.kv))
	for o, st := range a.origins {
		w[srcDecisions+o] = st.base
	}
	for r, st := range a.kv {
		if seq, engine, ok := st.mark(); ok {
			w[srcKV+r] = seq + 1
			w[srcKVTS+r] = math.Float64bits(engine)
		} else {
			w[srcKV+r] = 0
		}
	}
	return w
}

// setWatermarksLocked replaces the dedupe state of the sources a restore
// took with the snapshot's watermarks w: every decision origin when
// decisions is set, and the engines in kv. The state of every other source
// stays as it was.
func (a *applier) setWatermarksLocked(w map[string]uint64, decisions bool, kv map[string]bool) {
	if decisions {
		clear(a.origins)
	}
	// A taken view with no watermark (the peer applied nothing since a
	// reset, or ever) keeps the engine clock this gateway last knew:
	// without it any peer's view would count as newer (kvNewer), even one
	// from before the reset that emptied the taken one.
	prev := make(map[string]float64, len(kv))
	for r := range kv {
		if st := a.kv[r]; st != nil {
			prev[r] = st.engine
		}
		delete(a.kv, r)
	}
	for k, v := range w {
		switch {
		case strings.HasPrefix(k, srcDecisions):
			if decisions {
				a.origins[k[len(srcDecisions):]] = &originState{base: v}
			}
		case strings.HasPrefix(k, srcKV):
			r := k[len(srcKV):]
			if !kv[r] {
				continue
			}
			st := &kvState{at: time.Now(), engine: prev[r]}
			if v > 0 {
				st.valid, st.seq = true, v-1
				st.engine = math.Float64frombits(w[srcKVTS+r])
			}
			a.kv[r] = st
		}
	}
}

// kvNewer reports whether the snapshot watermarks w hold a newer complete
// view of engine replica than this gateway: a later engine clock, or the
// same clock and a later seq (an engine restart rewinds the seq but not
// the clock). A snapshot that knows nothing of it is never newer.
func (a *applier) kvNewerLocked(w map[string]uint64, replica string) bool {
	v := w[srcKV+replica]
	if v == 0 {
		return false
	}
	st := a.kv[replica]
	if st == nil {
		return true
	}
	theirs := math.Float64frombits(w[srcKVTS+replica])
	return a.kvNewer(st, v, theirs)
}

// kvWatermarkBad returns why a snapshot's watermark for replica must not
// be taken ("" = sane), by the same bounds as a batch (checkKVLocked):
// an engine clock in the future, or a seq further beyond this gateway's
// than the engine can have published since.
func (a *applier) kvWatermarkBadLocked(w map[string]uint64, replica string, now time.Time) string {
	v := w[srcKV+replica]
	if v == 0 {
		return ""
	}
	if clockAhead(math.Float64frombits(w[srcKVTS+replica]), now) {
		return "clock_ahead"
	}
	if st := a.kv[replica]; st != nil && st.valid && v-1 > st.seq && v-1-st.seq > seqBound(st.at, now) {
		return "seq_jump"
	}
	return ""
}

// leadUseful reports whether a peer's digest watermark for source (in
// peer, the digest's sources) is a reason to repair from that peer. For a
// KV source it asks what restoreFrom asks of a snapshot watermark: sane
// (kvWatermarkBadLocked: a forged digest must not make this gateway
// repair from its sender over and over) and newer (kvNewerLocked, by the
// engine clock the digest carries beside the seq). The latter leaves out
// a peer that missed a reset this gateway applied: it advertises a higher
// seq at the engine clock of the reset view, and pulling its snapshot
// would take nothing, every repair interval for as long as the engine
// stays idle. A digest without the clock (a release before it carried
// one) is taken at its seq.
func (a *applier) leadUseful(source string, peer map[string]uint64, now time.Time) bool {
	r, ok := strings.CutPrefix(source, srcKV)
	if !ok || peer[source] == 0 {
		return true
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.kvWatermarkBadLocked(peer, r, now) != "" {
		return false
	}
	_, hasClock := peer[srcKVTS+r]
	return !hasClock || a.kvNewerLocked(peer, r)
}

// kvNewer is kvNewerLocked for a known state st and the snapshot's
// watermark v (seq+1) and engine clock theirs.
func (a *applier) kvNewer(st *kvState, v uint64, theirs float64) bool {
	seq, engine, ok := st.mark()
	if !ok {
		// Nothing since a reset (st.engine is the clock of the last batch
		// before it; 0 if none): a peer that missed the reset is not newer.
		return theirs > st.engine
	}
	return theirs > engine || theirs == engine && v-1 > seq
}

// beginBuffering makes the applier buffer instead of applying.
func (a *applier) beginBuffering() {
	a.mu.Lock()
	a.bootstrapping = true
	a.buf = a.buf[:0]
	a.mu.Unlock()
}

// endBuffering applies what was buffered (through the normal dedupe, so
// deltas at or below the restored watermarks are dropped) and resumes.
func (a *applier) endBuffering() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, in := range a.buf {
		a.applyLocked(in)
	}
	clear(a.buf)
	a.buf = a.buf[:0]
	a.bootstrapping = false
}

// sources returns a digest's watermark list.
func (a *applier) sources() []watermark {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make([]watermark, 0, len(a.origins)+2*len(a.kv))
	for o, st := range a.origins {
		out = append(out, watermark{Source: srcDecisions + o, Seq: st.base})
	}
	for r, st := range a.kv {
		var v uint64
		if seq, engine, ok := st.mark(); ok {
			v = seq + 1
			// The engine clock beside it, as in snapshots: a peer counts
			// this gateway ahead only where a restore would take its view
			// (leadUseful). Releases before it ignore the source.
			out = append(out, watermark{Source: srcKVTS + r, Seq: math.Float64bits(engine)})
		}
		out = append(out, watermark{Source: srcKV + r, Seq: v})
	}
	return out
}

// kvCheck is the fingerprint of a gateway's confirmed view of one engine
// (index.EngineFingerprint) and the watermark it stands for.
type kvCheck struct {
	at  uint64 // seq + 1 of the last batch applied
	n   int
	sum uint64
}

// kvCheckOf returns replica's kvCheck, taken under the applier lock so
// that no batch lands between the watermark and the fingerprint; ok is
// false while the view has no complete watermark (a seq gap, which the
// watermark comparison repairs; for the owner's own check, at 0, also
// nothing applied since a reset). A non-zero at asks for the view at that
// watermark only: the current view, or one of the recent fingerprints
// (kvState.recent) when this gateway has moved past it; at any other there
// is nothing to compare.
//
// A view emptied by a reset is compared at the seq it last applied before
// the reset: an owner that still advertises a view there did not apply
// that reset. The reset came from a gateway that owned the engine for a
// moment only (memberlist took the owner for dead), and with the engine
// idle nothing else would ever repair the view (no batch follows, and the
// owner's watermark is not ahead of the one the reset left).
func (a *applier) kvCheckOf(replica string, at uint64) (kvCheck, bool) {
	id, ok := a.c.deps.Replicas.ReplicaID(replica)
	if !ok {
		return kvCheck{}, false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	st := a.kv[replica]
	if st == nil || st.gap || !st.valid && at == 0 {
		return kvCheck{}, false
	}
	if at != 0 && st.seq+1 != at {
		// Past (or not yet at) the owner's seq: the fingerprint this
		// view had there, if it followed the stream batch by batch since.
		return st.recentAt(at)
	}
	n, sum := a.c.deps.Index.EngineFingerprint(id)
	return kvCheck{at: st.seq + 1, n: n, sum: sum}, true
}

// kvApplied returns the last applied batch seq of replica's KV events
// (see Cluster.KVApplied).
func (a *applier) kvApplied(replica string) (uint64, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	st := a.kv[replica]
	if st == nil || !st.valid {
		return 0, false
	}
	return st.seq, true
}

// forgetKV drops what this gateway knew of replica's KV stream (an engine
// no longer listed: Cluster.SetKVSources). An engine listed again under
// that name starts afresh, as at a gateway's start.
func (a *applier) forgetKV(replica string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	delete(a.kv, replica)
}

// forgetOrigins drops the dedupe state of origins of a departed node.
func (a *applier) forgetOrigins(node string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for o := range a.origins {
		if originNode(o) == node {
			delete(a.origins, o)
		}
	}
}

// originNode is the node name of an origin id "<node>#<incarnation>".
func originNode(origin string) string {
	if i := strings.LastIndexByte(origin, '#'); i >= 0 {
		return origin[:i]
	}
	return origin
}
