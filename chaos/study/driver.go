package study

import (
	"context"
	"time"
)

// abortedSession is the error recorded for the remaining turns of a session
// whose earlier turn was not sent or did not complete.
const abortedSession = "session aborted: an earlier turn did not complete"

// unsentCap is the error recorded for an arrival the in-flight cap kept back.
const unsentCap = "not sent: client in-flight cap reached"

// driver runs one phase's arrivals on an engine. All its state is touched
// only from the engine's callbacks, which run one at a time.
type driver struct {
	e        Engine
	cfg      *Config
	ph       *Phase
	plan     *Plan
	progress func()

	t0       time.Duration
	inflight int
	pending  int // arrivals not yet finished (sent-and-done or unsent)
	nextGW   int
	recs     []RequestRecord
	obs      []Observation
	lastDone time.Duration
	// prefixes caches each document's Prefix (about 29 KB, the same for
	// every arrival of its group), built on first use.
	prefixes []string
	// salt is the per-phase salt line of a salted workload phase.
	salt string
}

// prefix returns plan.Docs[g].Prefix(), built once per phase.
func (d *driver) prefix(g int) string {
	if d.prefixes == nil {
		d.prefixes = make([]string, len(d.plan.Docs))
	}
	if d.prefixes[g] == "" {
		d.prefixes[g] = d.plan.Docs[g].Prefix()
	}
	return d.prefixes[g]
}

// drive schedules the plan's arrivals, runs the engine until every arrival
// finished, and returns one record per scheduled arrival plus the gauge
// samples.
func drive(ctx context.Context, e Engine, cfg *Config, ph *Phase, plan *Plan, step func()) (*driver, error) {
	d := &driver{e: e, cfg: cfg, ph: ph, plan: plan, progress: step}
	if d.progress == nil {
		d.progress = func() {}
	}
	d.t0 = e.Now() + time.Millisecond
	interval := time.Duration(float64(time.Second) / cfg.RPS)
	switch {
	case plan.Workload != nil:
		d.startWorkload()
	case plan.Turns > 1:
		d.recs = make([]RequestRecord, plan.Sessions*plan.Turns)
		d.pending = len(d.recs)
		for s := range plan.Sessions {
			for t := 1; t <= plan.Turns; t++ {
				r := d.record(s*plan.Turns+t-1, plan.SessionGroup[s])
				r.Session, r.Turn = s+1, t
			}
			// Sessions start at RPS/Turns so that requests arrive at
			// about RPS overall.
			at := d.t0 + time.Duration(s*plan.Turns)*interval
			d.recs[s*plan.Turns].Scheduled = secs(at - d.t0)
			e.At(at, func() { d.turn(s, 1, "", "") })
		}
	default:
		d.recs = make([]RequestRecord, len(plan.Sequence))
		d.pending = len(d.recs)
		for i, g := range plan.Sequence {
			d.record(i, g)
			at := d.t0 + time.Duration(i)*interval
			d.recs[i].Scheduled = secs(at - d.t0)
			e.At(at, func() { d.arrive(i) })
		}
	}
	d.sample(0)
	if err := e.Run(ctx); err != nil {
		return d, err
	}
	return d, nil
}

func (d *driver) record(i, group int) *RequestRecord {
	return d.newRecord(i, group, d.plan.Docs[group].Number, d.cfg.MaxTokens)
}

// newRecord starts request i's record with this phase's fields.
func (d *driver) newRecord(i, group, document, maxTokens int) *RequestRecord {
	r := &d.recs[i]
	*r = RequestRecord{
		Phase:     d.ph.Name,
		Scenario:  d.ph.Scenario,
		Round:     d.ph.Round,
		Strategy:  d.ph.Strategy,
		Mode:      d.ph.Cell.Mode,
		Gateways:  d.ph.Cell.Gateways,
		Isolated:  d.ph.Cell.Isolated,
		Seq:       i,
		Group:     group,
		Document:  document,
		MaxTokens: maxTokens,
	}
	return r
}

// sample observes the engines every SampleEvery of model time from the
// first arrival until the last arrival finished.
func (d *driver) sample(k int) {
	d.e.Observe(func(o Observation) {
		o.At -= d.t0
		d.obs = append(d.obs, o)
	})
	if d.pending > 0 {
		d.e.At(d.t0+time.Duration(k+1)*d.cfg.SampleEvery, func() { d.sample(k + 1) })
	}
}

// finish marks one arrival done.
func (d *driver) finish() {
	d.pending--
	d.lastDone = d.e.Now()
	d.progress()
}

// send sends record i's request (prompt prefix+tail) unless the cap is
// reached, and calls then with the outcome (on the engine's loop). It
// reports whether the request was sent. An engine that is a PrefixSender
// gets prefix and tail apart.
func (d *driver) send(i int, prefix, tail string, then func(Outcome)) bool {
	r := &d.recs[i]
	if d.inflight >= d.cfg.InflightCap {
		r.Err = unsentCap
		r.Start = secs(d.e.Now() - d.t0)
		d.finish()
		return false
	}
	d.inflight++
	gw := d.nextGW % d.ph.Cell.Gateways
	d.nextGW++
	r.Gateway = gw
	session := ""
	if r.Turn > 0 {
		session = d.ph.Name + "/s" + itoa(r.Session)
	}
	req := Request{
		Prompt:    tail,
		MaxTokens: r.MaxTokens,
		Session:   session,
		Target:    Target{Gateway: gw, Strategy: d.ph.Strategy},
	}
	done := func(o Outcome) {
		d.inflight--
		r.fill(o, d.t0, d.cfg.SLO)
		d.finish()
		if then != nil {
			then(o)
		}
	}
	if ps, ok := d.e.(PrefixSender); ok && prefix != "" {
		ps.SendPrefixed(prefix, req, done)
		return true
	}
	req.Prompt = prefix + tail
	d.e.Send(req, done)
	return true
}

func (d *driver) arrive(i int) {
	r := &d.recs[i]
	// Document.Prompt(i), without rebuilding the prefix.
	d.send(i, d.prefix(r.Group), "\n"+QuestionLine(i), nil)
}

// turn sends turn t (1-based) of session s; prev is the previous turn's
// prompt and answer its generated text. When a turn is not sent or does
// not complete, the session's remaining turns are recorded as unsent: they
// count as failures.
func (d *driver) turn(s, t int, prev, answer string) {
	base := s * d.plan.Turns
	r := &d.recs[base+t-1]
	if t > 1 {
		r.Scheduled = secs(d.e.Now() - d.t0)
	}
	var prompt string
	if t == 1 {
		prompt = firstTurnPrompt(d.prefix(r.Group), s+1)
	} else {
		prompt = TurnPrompt(d.plan.Docs[r.Group], s+1, t, prev, answer)
	}
	sent := d.send(base+t-1, "", prompt, func(o Outcome) {
		if t == d.plan.Turns {
			return
		}
		if !Complete(o, d.cfg.MaxTokens) {
			d.abort(s, t+1)
			return
		}
		d.e.At(d.e.Now()+d.cfg.Think, func() { d.turn(s, t+1, prompt, o.Text) })
	})
	if !sent {
		d.abort(s, t+1)
	}
}

// abort records turns from..Turns of session s as unsent.
func (d *driver) abort(s, from int) {
	for t := from; t <= d.plan.Turns; t++ {
		r := &d.recs[s*d.plan.Turns+t-1]
		r.Err = abortedSession
		r.Scheduled = secs(d.e.Now() - d.t0)
		r.Start = r.Scheduled
		d.finish()
	}
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	var b [20]byte
	i := len(b)
	for n > 0 {
		i--
		b[i] = byte('0' + n%10)
		n /= 10
	}
	return string(b[i:])
}
