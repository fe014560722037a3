package des

import (
	"strconv"

	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/kvevents"
)

// replica is one simulated engine: a sim.Engine stepped by the event loop
// the way sim.Server's driver steps it.
type replica struct {
	id      int
	name    string
	eng     *sim.Engine
	flights map[sim.RequestID]*flight
	next    uint64

	// busy is true while a step is scheduled or running; an idle engine
	// is stepped again when a request arrives.
	busy bool
	cur  sim.StepResult
	// shown are the gauges a scrape reads: the engine's as of the last
	// step that ended (sim.Server's rule, vLLM's: the running step's
	// figures show when it ends); coming are the running step's.
	shown, coming sim.Gauges

	// ver counts changes of the engine's state; memo is its Stats at
	// memoVer (Stats copies a map, so scrapes reuse it while unchanged).
	ver, memoVer uint64
	memo         sim.Stats
	memoOK       bool
}

// add queues f's prompt on the engine and wakes an idle engine.
func (r *replica) add(w *World, f *flight, toks []uint32) error {
	r.next++
	id := sim.RequestID(strconv.FormatUint(r.next, 36))
	if err := r.eng.Add(sim.Request{ID: id, Prompt: toks, MaxTokens: f.maxTokens}, w.t()); err != nil {
		return err
	}
	r.flights[id] = f
	r.ver++
	if !r.busy {
		r.busy = true
		w.q.push(event{at: w.now, kind: kindStep, a: int32(r.id)})
	}
	return nil
}

// step runs one engine step now; its results take effect at its end. KV
// events leave now, as sim.Server publishes them when it runs the step.
func (r *replica) step(w *World) {
	res := r.eng.Step(w.t())
	r.ver++
	if len(res.Events) > 0 {
		w.publish(r, res.Events)
	}
	r.coming = r.eng.Gauges()
	if res.Idle() {
		r.shown = r.coming
		r.busy = false
		return
	}
	r.cur = res
	w.q.push(event{at: w.now + res.Duration, kind: kindStepEnd, a: int32(r.id)})
}

// stepEnd delivers the running step's first tokens and completions, then
// starts the next step at once (sim.Server's driver does the same).
func (r *replica) stepEnd(w *World) {
	res := r.cur
	r.cur = sim.StepResult{}
	r.shown = r.coming
	now := w.nowNs()
	for i := range res.Outputs {
		o := &res.Outputs[i]
		f := r.flights[o.ID]
		if f != nil && f.gw != nil {
			f.gw.sawToken(r.id, now, int64(res.Duration), o.Index == 0)
		}
		if o.Index != 0 {
			continue
		}
		if f != nil && !f.hasFirst {
			f.first, f.hasFirst = w.now, true
			if f.gw != nil && w.opts.QueuedUntilFirstToken {
				f.gw.releaseQueued(f)
			}
		}
	}
	for i := range res.Finished {
		fin := &res.Finished[i]
		f := r.flights[fin.ID]
		if f == nil {
			continue
		}
		delete(r.flights, fin.ID)
		w.complete(f, fin)
	}
	r.step(w)
}

// stats returns the engine's counters and shown gauges, recomputed only
// when the engine changed since the last call.
func (r *replica) stats() sim.Stats {
	if !r.memoOK || r.memoVer != r.ver {
		r.memo = r.eng.Stats()
		r.memo.Running, r.memo.Waiting, r.memo.KVUsage = r.shown.Running, r.shown.Waiting, r.shown.KVUsage
		r.memoVer, r.memoOK = r.ver, true
	}
	return r.memo
}

// publish hands an engine's KV events to every gateway's index, KVDelay
// from now, in one event (the gateways apply them in gateway order). The
// batch is normalized for the index once, as a synced cluster's owner does
// before its peers apply it (kvevents.Normalize; nil: the batch is kept
// until the gateways apply it).
func (w *World) publish(r *replica, evs []kvevents.Event) {
	if !w.opts.events() || len(evs) == 0 {
		return
	}
	b := kvevents.Normalize(w.hasher, w.opts.Model, &kvevents.Batch{Events: evs}, nil)
	w.q.push(event{at: w.now + w.opts.KVDelay, fn: func() {
		for _, g := range w.gws {
			g.applyKV(r.id, b)
		}
	}})
}

// mix derives a 64-bit seed from a seed and labels.
func mix(seed uint64, labels ...string) uint64 {
	h := xxh3.New()
	var b [8]byte
	for i := range b {
		b[i] = byte(seed >> (8 * i))
	}
	_, _ = h.Write(b[:])
	for _, l := range labels {
		_, _ = h.WriteString(l)
		_, _ = h.Write([]byte{0})
	}
	return h.Sum64()
}
