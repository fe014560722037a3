package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"time"

	"github.com/kvmesh/kvmesh/internal/gosched/schedtrace"
)

// proxybench --trace: an execution trace of each kvmesh target, taken
// from the gateway's own /debug/pprof/trace while one more untimed run of
// blocks streams through it. The CPU profile says where the gateway's CPU
// goes; the trace says what its goroutines waited for when a chunk or a
// first byte came late: the wake-ups that waited a millisecond or more
// for a P, what the Ps ran meanwhile, and whether a GC was on.

// traceResult is one kvmesh target's execution trace at one stream count.
type traceResult struct {
	capture
	Summary *schedtrace.Summary `json:"summary,omitempty"`
}

// traceBlock traces t (a kvmesh target, t.base set, whose admin token is
// token) for seconds while blocks of conc streams run through it
// (takeCapture), writes the trace to dir and summarises it.
func traceBlock(ctx context.Context, t *target, token string, seconds int, dir string,
	bodies func(int) []byte, want []byte, conc, perWorker int, stagger time.Duration) traceResult {
	c, body := takeCapture(ctx, t, token, "trace", "trace", seconds, dir, bodies, want, conc, perWorker, stagger)
	res := traceResult{capture: c}
	if res.Error != "" {
		return res
	}
	s, err := schedtrace.Analyze(bytes.NewReader(body), "github.com/kvmesh/kvmesh/")
	if err != nil {
		res.Error = err.Error() + " (the trace is in " + res.File + ")"
		return res
	}
	res.Summary = &s
	return res
}

// write prints one trace's summary.
func (r traceResult) write(w io.Writer) {
	fmt.Fprintf(w, "\nExecution trace, %s at %d streams", r.Target, r.Streams)
	if r.Error != "" {
		fmt.Fprintf(w, ": not taken: %s\n", r.Error)
		return
	}
	fmt.Fprintf(w, " (%d s, %d requests): %s (go tool trace %s)\n", r.Seconds, r.Requests, r.File, r.File)
	r.Summary.Write(w, 5)
}
