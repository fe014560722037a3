package study

// startWorkload schedules a workload phase (Plan.Workload): one record per
// line, in file order, and each arrival unit's first request at its start
// (Workload.starts).
func (d *driver) startWorkload() {
	w := d.plan.Workload
	if w.Salted {
		d.salt = WorkloadSalt(d.cfg.Seed, d.ph.Name)
	}
	d.recs = make([]RequestRecord, len(w.lines))
	d.pending = len(d.recs)
	for i, l := range w.lines {
		un := &w.units[l.unit]
		mt := l.maxTokens
		if mt == 0 {
			mt = d.cfg.MaxTokens
		}
		r := d.newRecord(i, l.unit, l.line, mt)
		if un.session != "" {
			r.Session, r.Turn = un.ordinal, l.turn
		}
	}
	for u, at := range w.starts(d.cfg.RPS) {
		d.recs[w.units[u].lines[0]].Scheduled = secs(at)
		d.e.At(d.t0+at, func() { d.workloadTurn(u, 0, "", "") })
	}
}

// workloadTurn sends request k of arrival unit u: a single request, or
// turn k+1 of a session, whose prompt is prev (the previous turn's
// prompt), answer and the line's prompt. A session turn that is not sent
// or does not complete aborts the session's remaining turns.
func (d *driver) workloadTurn(u, k int, prev, answer string) {
	w := d.plan.Workload
	un := &w.units[u]
	i := un.lines[k]
	l := &w.lines[i]
	r := &d.recs[i]
	if un.session == "" {
		d.send(i, d.salt, l.prompt, nil)
		return
	}
	if k > 0 {
		r.Scheduled = secs(d.e.Now() - d.t0)
	}
	prompt := d.salt + l.prompt
	if k > 0 {
		prompt = prev + answer + l.prompt
	}
	sent := d.send(i, "", prompt, func(o Outcome) {
		if k+1 == len(un.lines) {
			return
		}
		if !Complete(o, r.MaxTokens) {
			d.abortWorkload(u, k+1)
			return
		}
		think := w.lines[un.lines[k+1]].think
		if think < 0 {
			think = d.cfg.Think
		}
		d.e.At(d.e.Now()+think, func() { d.workloadTurn(u, k+1, prompt, o.Text) })
	})
	if !sent {
		d.abortWorkload(u, k+1)
	}
}

// abortWorkload records requests from.. of session unit u as unsent.
func (d *driver) abortWorkload(u, from int) {
	for _, i := range d.plan.Workload.units[u].lines[from:] {
		r := &d.recs[i]
		r.Err = abortedSession
		r.Scheduled = secs(d.e.Now() - d.t0)
		r.Start = r.Scheduled
		d.finish()
	}
}
