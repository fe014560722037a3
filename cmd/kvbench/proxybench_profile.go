package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// proxybench --profile: a CPU profile of each kvmesh target, taken from
// the gateway's own /debug/pprof/profile (the admin token's) while one
// more untimed run of blocks streams through it, so that where the
// gateway's time goes is measured by the benchmark that finds the gap,
// not by a build with a profiling hook.

// profileResult is one kvmesh target's profile at one stream count.
type profileResult struct {
	capture
	Shares []profileShare `json:"shares,omitempty"`
	Top    string         `json:"top,omitempty"` // go tool pprof -top, its first lines
}

// capture is what --profile and --trace report of every capture.
type capture struct {
	Target   string `json:"target"`
	Streams  int    `json:"streams"`
	File     string `json:"file"`
	Seconds  int    `json:"seconds"`
	Requests int    `json:"requests"` // sent while the capture ran
	Error    string `json:"error,omitempty"`
}

// profileShare is one line of the summary: a share of the CPU samples.
type profileShare struct {
	What    string  `json:"what"`
	Percent float64 `json:"percent"`
}

// newAdminToken returns a random admin token for the kvmesh targets.
func newAdminToken() (string, error) {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

// profileBlock profiles t (a kvmesh target, t.base set, whose admin
// token is token) for seconds while blocks of conc streams run through it
// (takeCapture), writes the profile to dir and summarises it.
func profileBlock(ctx context.Context, t *target, token string, seconds int, dir string,
	bodies func(int) []byte, want []byte, conc, perWorker int, stagger time.Duration) profileResult {
	c, _ := takeCapture(ctx, t, token, "profile", "pprof", seconds, dir, bodies, want, conc, perWorker, stagger)
	res := profileResult{capture: c}
	if res.Error != "" {
		return res
	}
	top, err := pprofTop(ctx, res.File)
	if err != nil {
		res.Error = "go tool pprof: " + err.Error() + " (the profile is in " + res.File + ")"
		return res
	}
	res.Shares = profileShares(top)
	res.Top = topTable(top, 15)
	return res
}

// takeCapture GETs /debug/pprof/<what> (profile or trace) from t for
// seconds with the admin token while blocks of conc streams run through
// t back to back, writes it to dir as <target>-<conc>streams.<ext> and
// returns it. The blocks stop when the capture has arrived; at most
// maxProfileBlocks run. c.Error says what failed.
func takeCapture(ctx context.Context, t *target, token, what, ext string, seconds int, dir string,
	bodies func(int) []byte, want []byte, conc, perWorker int, stagger time.Duration) (c capture, body []byte) {
	c = capture{Target: t.name, Streams: conc, Seconds: seconds}
	type fetched struct {
		body []byte
		err  error
	}
	done := make(chan fetched, 1)
	go func() {
		b, err := fetchDebug(ctx, t.base, token, what, seconds)
		done <- fetched{b, err}
	}()
	var got fetched
	arrived := false
	for blocks := 0; !arrived && blocks < maxProfileBlocks && ctx.Err() == nil; blocks++ {
		select {
		case got = <-done:
			arrived = true
		default:
			c.Requests += runBlock(ctx, t, bodies, want, conc, perWorker, stagger).requests
		}
	}
	if !arrived {
		got = <-done // the capture's own deadline ends the wait
	}
	if got.err != nil {
		c.Error = got.err.Error()
		return c, nil
	}
	file := filepath.Join(dir, fmt.Sprintf("%s-%dstreams.%s", t.name, conc, ext))
	if err := os.WriteFile(file, got.body, 0o644); err != nil {
		c.Error = err.Error()
		return c, nil
	}
	c.File = file
	return c, got.body
}

// maxProfileBlocks bounds the blocks run while one capture is taken.
const maxProfileBlocks = 1000

// fetchDebug GETs base/debug/pprof/<what>?seconds=N (what: profile or
// trace) with the admin token and returns the capture's bytes.
func fetchDebug(ctx context.Context, base, token, what string, seconds int) ([]byte, error) {
	// The gateway answers when the capture ends: allow for a slow start.
	ctx, cancel := context.WithTimeout(ctx, time.Duration(seconds)*time.Second+30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("%s/debug/pprof/%s?seconds=%d", base, what, seconds), nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	switch resp.StatusCode {
	case http.StatusOK:
		return b, nil
	case http.StatusNotFound:
		return nil, errors.New("the gateway serves no /debug/pprof/ (a kvmesh built before it had one?)")
	default:
		return nil, fmt.Errorf("/debug/pprof/%s: %s: %s", what, resp.Status, firstLines(string(b), 3))
	}
}

// pprofTop runs go tool pprof -top over every node of the profile.
func pprofTop(ctx context.Context, file string) (string, error) {
	cmd := exec.CommandContext(ctx, "go", "tool", "pprof", "-top", "-nodefraction=0", "-edgefraction=0", file)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("%w: %s", err, firstLines(errb.String(), 3))
	}
	return out.String(), nil
}

// topLine is one function's line of go tool pprof -top.
type topLine struct {
	name       string
	flat, cumu float64 // percent of all samples
}

// parseTop reads the function lines of go tool pprof -top output:
// flat, flat%, sum%, cum, cum% and the name (which may carry a suffix
// such as "(inline)").
func parseTop(top string) []topLine {
	var out []topLine
	for _, l := range strings.Split(top, "\n") {
		f := strings.Fields(l)
		if len(f) < 6 || !strings.HasSuffix(f[1], "%") || !strings.HasSuffix(f[4], "%") {
			continue
		}
		flat, err1 := strconv.ParseFloat(strings.TrimSuffix(f[1], "%"), 64)
		cumu, err2 := strconv.ParseFloat(strings.TrimSuffix(f[4], "%"), 64)
		if err1 != nil || err2 != nil {
			continue // the header line
		}
		out = append(out, topLine{name: f[5], flat: flat, cumu: cumu})
	}
	return out
}

// syscallLeaves are the runtime's own system-call functions (futex,
// epoll, sleeps), beside the syscall packages.
var syscallLeaves = map[string]bool{
	"runtime.futex": true, "runtime.epollwait": true, "runtime.usleep": true, "runtime.osyield": true,
	"runtime.write1": true, "runtime.read": true, "runtime.madvise": true, "runtime.tgkill": true,
	"runtime.nanosleep": true, "runtime.sched_yield": true,
}

// isSyscall reports whether a function is a system call's entry point.
func isSyscall(name string) bool {
	return syscallLeaves[name] || strings.HasPrefix(name, "syscall.") ||
		strings.HasPrefix(name, "internal/runtime/syscall") || strings.HasPrefix(name, "golang.org/x/sys/unix.")
}

// profileShares sums a profile's samples into the few figures issue 21's
// note asks for. Lines marked "flat" add the samples that stopped in
// those functions (they do not overlap); "cum" is one function with
// everything it called (it overlaps the flat lines).
func profileShares(top string) []profileShare {
	var sys, kv, nethttp, cumFind, cumGC, cumMalloc float64
	for _, l := range parseTop(top) {
		switch {
		case isSyscall(l.name):
			sys += l.flat
		case strings.HasPrefix(l.name, "github.com/kvmesh/kvmesh/"):
			kv += l.flat
		case strings.HasPrefix(l.name, "net/http."):
			nethttp += l.flat
		}
		switch l.name {
		case "runtime.findRunnable":
			cumFind = l.cumu
		case "runtime.gcBgMarkWorker":
			cumGC = l.cumu
		case "runtime.mallocgc":
			cumMalloc = l.cumu
		}
	}
	return []profileShare{
		{"system calls (flat: read, write, epoll, futex, sleeps)", sys},
		{"kvmesh's own code (flat)", kv},
		{"net/http (flat)", nethttp},
		{"runtime.findRunnable (cum: the scheduler looking for work)", cumFind},
		{"runtime.gcBgMarkWorker (cum: GC's background marking)", cumGC},
		{"runtime.mallocgc (cum: allocation)", cumMalloc},
	}
}

// topTable returns the total line, the column header and the first n
// function lines of go tool pprof -top output (not the file's details
// above them).
func topTable(top string, n int) string {
	var b strings.Builder
	rows := -1
	for _, l := range strings.Split(top, "\n") {
		switch {
		case strings.HasPrefix(l, "Duration:") || strings.HasPrefix(l, "Showing nodes"):
			b.WriteString(l + "\n")
		case rows < 0 && strings.Contains(l, "flat%"):
			rows = 0
			b.WriteString(l + "\n")
		case rows >= 0 && rows < n && strings.TrimSpace(l) != "":
			rows++
			b.WriteString(l + "\n")
		}
	}
	return strings.TrimRight(b.String(), "\n")
}

// firstLines returns s's first n lines.
func firstLines(s string, n int) string {
	lines := strings.SplitAfterN(s, "\n", n+1)
	if len(lines) > n {
		lines = lines[:n]
	}
	return strings.TrimRight(strings.Join(lines, ""), "\n")
}

// write prints one profile's summary.
func (p profileResult) write(w io.Writer) {
	fmt.Fprintf(w, "\nCPU profile, %s at %d streams", p.Target, p.Streams)
	if p.Error != "" {
		fmt.Fprintf(w, ": not taken: %s\n", p.Error)
		return
	}
	fmt.Fprintf(w, " (%d s, %d requests): %s\n", p.Seconds, p.Requests, p.File)
	for _, s := range p.Shares {
		fmt.Fprintf(w, "  %5.1f%%  %s\n", s.Percent, s.What)
	}
	fmt.Fprintf(w, "go tool pprof -top %s:\n%s\n", p.File, p.Top)
}
