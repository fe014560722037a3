package cluster

import (
	"fmt"
	"strings"
	"sync"
	"time"
)

// Row is one scenario's figures.
type Row struct {
	Scenario string
	Load     LoadResult
	// Precision and Recall are the worst over every gateway-engine pair at
	// the scenario's last check.
	Precision, Recall float64
	// Converge is the longest time any check in the scenario took to reach
	// its predicate.
	Converge time.Duration
	// ConfigVersions lists each gateway's config version ("-" without a
	// config store).
	ConfigVersions string
	// Note is free text (what the scenario did, extra counters).
	Note string
}

// Line formats the row as one line of figures.
func (r Row) Line() string {
	cv := r.ConfigVersions
	if cv == "" {
		cv = "-"
	}
	return fmt.Sprintf("%-28s sent=%-5d ok=%-5d failed=%-4d lost=%-3d precision=%.4f recall=%.4f converge=%-8v config=%s %s",
		r.Scenario, r.Load.Sent, r.Load.OK, r.Load.Failed, r.Load.Lost, r.Precision, r.Recall,
		r.Converge.Round(time.Millisecond), cv, r.Note)
}

// Report collects rows from scenarios that may run in parallel.
type Report struct {
	mu   sync.Mutex
	rows []Row
}

// Add records a row.
func (rp *Report) Add(r Row) {
	rp.mu.Lock()
	defer rp.mu.Unlock()
	rp.rows = append(rp.rows, r)
}

// Rows returns the rows recorded so far.
func (rp *Report) Rows() []Row {
	rp.mu.Lock()
	defer rp.mu.Unlock()
	return append([]Row(nil), rp.rows...)
}

// Table formats every row under a header, with totals.
func (rp *Report) Table() string {
	rows := rp.Rows()
	var b strings.Builder
	fmt.Fprintf(&b, "%-28s %6s %6s %7s %5s %9s %7s %9s  %s\n", "scenario", "sent", "ok", "failed", "lost", "precision", "recall", "converge", "config / notes")
	var tot LoadResult
	for _, r := range rows {
		cv := r.ConfigVersions
		if cv == "" {
			cv = "-"
		}
		fmt.Fprintf(&b, "%-28s %6d %6d %7d %5d %9.4f %7.4f %9v  %s %s\n", r.Scenario, r.Load.Sent, r.Load.OK, r.Load.Failed,
			r.Load.Lost, r.Precision, r.Recall, r.Converge.Round(time.Millisecond), cv, r.Note)
		tot.Sent += r.Load.Sent
		tot.OK += r.Load.OK
		tot.Failed += r.Load.Failed
		tot.Lost += r.Load.Lost
	}
	fmt.Fprintf(&b, "%-28s %6d %6d %7d %5d\n", "TOTAL", tot.Sent, tot.OK, tot.Failed, tot.Lost)
	return b.String()
}
