package study

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"time"
)

// ScenarioWorkload is the scenario of a user's own traffic (kvbench
// --workload): the prompts and sessions of a workload file replace the
// seed's documents. It runs only with Config.Workload set.
const ScenarioWorkload = "workload"

// ErrBadWorkload is returned by ReadWorkload for a malformed workload file;
// the message names the line.
var ErrBadWorkload = errors.New("study: bad workload file")

// MaxWorkloadLine is the longest line ReadWorkload accepts (bytes).
const MaxWorkloadLine = 16 << 20

// Workload is a user's traffic, read from a JSONL file (docs/workload.md):
// one object per line, each one request —
//
//	{"prompt": "...", "session": "s1", "at_ms": 120, "max_tokens": 64, "think_ms": 500}
//
// Only "prompt" is required. Lines without "session" are single requests;
// the lines of one session are its turns in file order, and turn t's
// prompt is the previous turn's prompt, the answer the engine gave to it
// and this line's "prompt", joined as they are (the file carries any
// separators, e.g. "\nUser: ...\nAssistant:"). A turn after the first is
// sent think_ms (default Config.Think) after the previous turn's answer.
//
// Arrival units are the single requests and the sessions' first turns.
// Either every unit has "at_ms" (model milliseconds from the phase's
// start, any order), or none has and they go out in file order at
// Config.RPS requests per second overall (a session takes as many slots
// as it has turns, as the seed's multiturn scenario does).
//
// The exported fields are the summary written into results.json; the
// requests themselves are not.
type Workload struct {
	// Path is the file as given.
	Path string `json:"path"`
	// SHA256 is the file's hash, so a result names the exact traffic.
	SHA256 string `json:"sha256"`
	// Requests is the number of requests (lines), every turn counted.
	Requests int `json:"requests"`
	// Units is the number of arrival units (single requests and sessions).
	Units int `json:"units"`
	// Sessions is the number of sessions (lines sharing a "session").
	Sessions int `json:"sessions"`
	// Scheduled reports that arrival times come from the file's at_ms.
	Scheduled bool `json:"scheduled"`
	// Salted reports that every prompt was prefixed with a per-phase
	// salt line (WorkloadSalt), so phases share no prefix in the engines'
	// caches or the gateways' indexes.
	Salted bool `json:"salted"`

	lines []workloadLine
	units []workloadUnit
}

// workloadLine is one request of the file.
type workloadLine struct {
	line      int // 1-based line number in the file
	unit      int
	turn      int // 1-based turn within its session; 0 for a single request
	prompt    string
	at        time.Duration // arrival (units' first lines with Scheduled)
	maxTokens int           // 0: Config.MaxTokens
	think     time.Duration // -1: Config.Think
}

// workloadUnit is one arrival unit: a single request or a session.
type workloadUnit struct {
	session string // "" for a single request
	ordinal int    // 1-based session number among sessions; 0 for single
	lines   []int  // indexes into Workload.lines, in turn order
}

// rawLine is a line as decoded; pointers tell absent from zero.
type rawLine struct {
	Session   *string  `json:"session"`
	Prompt    *string  `json:"prompt"`
	AtMS      *float64 `json:"at_ms"`
	MaxTokens *int     `json:"max_tokens"`
	ThinkMS   *float64 `json:"think_ms"`
}

// LoadWorkload reads the workload file at path (ReadWorkload).
func LoadWorkload(path string) (*Workload, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadWorkload, err)
	}
	defer func() { _ = f.Close() }()
	w, err := ReadWorkload(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	w.Path = path
	return w, nil
}

// ReadWorkload parses a workload (see Workload). Blank lines are skipped;
// every other line must be one JSON object with known fields. Errors wrap
// ErrBadWorkload and name the line.
func ReadWorkload(r io.Reader) (*Workload, error) {
	h := sha256.New()
	sc := bufio.NewScanner(io.TeeReader(r, h))
	sc.Buffer(make([]byte, 0, 64<<10), MaxWorkloadLine)
	w := &Workload{}
	bySession := map[string]int{} // session -> unit
	firstAt, firstNoAt := 0, 0    // line numbers of a unit with and without at_ms
	bad := func(n int, f string, a ...any) error {
		return fmt.Errorf("%w: line %d: %s", ErrBadWorkload, n, fmt.Sprintf(f, a...))
	}
	n := 0
	for sc.Scan() {
		n++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		var raw rawLine
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&raw); err != nil {
			return nil, bad(n, "%v (want one JSON object such as {\"prompt\":\"...\"})", err)
		}
		if dec.More() {
			return nil, bad(n, "more than one JSON value on the line")
		}
		if raw.Prompt == nil || *raw.Prompt == "" {
			return nil, bad(n, "\"prompt\" is missing or empty")
		}
		l := workloadLine{line: n, prompt: *raw.Prompt, think: -1}
		if raw.MaxTokens != nil {
			if *raw.MaxTokens < 1 {
				return nil, bad(n, "\"max_tokens\" %d < 1", *raw.MaxTokens)
			}
			l.maxTokens = *raw.MaxTokens
		}
		first := true
		if raw.Session != nil {
			if *raw.Session == "" {
				return nil, bad(n, "\"session\" is empty (leave it out for a single request)")
			}
			if u, ok := bySession[*raw.Session]; ok {
				first = false
				l.unit = u
			} else {
				w.Sessions++
				bySession[*raw.Session] = len(w.units)
				l.unit = len(w.units)
				w.units = append(w.units, workloadUnit{session: *raw.Session, ordinal: w.Sessions})
			}
			l.turn = len(w.units[l.unit].lines) + 1
		} else {
			l.unit = len(w.units)
			w.units = append(w.units, workloadUnit{})
		}
		switch {
		case raw.AtMS != nil && !first:
			return nil, bad(n, "\"at_ms\" on turn %d of session %q: only a session's first turn has an arrival time; later turns follow the previous answer after think_ms",
				l.turn, *raw.Session)
		case raw.AtMS != nil:
			if !(*raw.AtMS >= 0) || math.IsInf(*raw.AtMS, 0) {
				return nil, bad(n, "\"at_ms\" %v must be >= 0", *raw.AtMS)
			}
			l.at = time.Duration(*raw.AtMS * float64(time.Millisecond))
			if firstAt == 0 {
				firstAt = n
			}
		case first:
			if firstNoAt == 0 {
				firstNoAt = n
			}
		}
		if firstAt > 0 && firstNoAt > 0 {
			return nil, bad(n, "line %d has \"at_ms\" and line %d has none: give every request and session start an arrival time, or none (then --rps paces them)",
				firstAt, firstNoAt)
		}
		if raw.ThinkMS != nil {
			if first {
				return nil, bad(n, "\"think_ms\" on a first turn or single request: it is the pause before a later turn")
			}
			if !(*raw.ThinkMS >= 0) || math.IsInf(*raw.ThinkMS, 0) {
				return nil, bad(n, "\"think_ms\" %v must be >= 0", *raw.ThinkMS)
			}
			l.think = time.Duration(*raw.ThinkMS * float64(time.Millisecond))
		}
		w.units[l.unit].lines = append(w.units[l.unit].lines, len(w.lines))
		w.lines = append(w.lines, l)
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, fmt.Errorf("%w: line %d: longer than %d bytes", ErrBadWorkload, n+1, MaxWorkloadLine)
		}
		return nil, fmt.Errorf("%w: %w", ErrBadWorkload, err)
	}
	if len(w.lines) == 0 {
		return nil, fmt.Errorf("%w: no requests", ErrBadWorkload)
	}
	w.Requests = len(w.lines)
	w.Units = len(w.units)
	w.Scheduled = firstAt > 0
	w.SHA256 = hex.EncodeToString(h.Sum(nil))
	return w, nil
}

// starts returns each unit's arrival time relative to the phase start:
// the file's at_ms, or file order at rps requests per second overall.
func (w *Workload) starts(rps float64) []time.Duration {
	out := make([]time.Duration, len(w.units))
	interval := time.Duration(float64(time.Second) / rps)
	slot := 0
	for u, un := range w.units {
		if w.Scheduled {
			out[u] = w.lines[un.lines[0]].at
			continue
		}
		out[u] = time.Duration(slot) * interval
		slot += len(un.lines)
	}
	return out
}

// Span returns the model time from the phase start to the last unit's
// arrival at rps (without the sessions' later turns and the answers).
func (w *Workload) Span(rps float64) time.Duration {
	var last time.Duration
	for _, t := range w.starts(rps) {
		last = max(last, t)
	}
	return last
}

// WorkloadSalt returns the salt line prefixed to every prompt of phase
// (Workload.Salted): the same for every request of the phase, so the
// file's prefix sharing is kept, and different between phases.
func WorkloadSalt(seed uint64, phase string) string {
	return "kvbench " + Salt(seed, phase, 0, 0)[:32] + "\n"
}
