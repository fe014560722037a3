package logx

import (
	"strings"
	"sync"
)

// Tail is an io.Writer that keeps the last n writes: under a slog
// handler, the last n log records. Tests and the chaos suite log into one
// and print it only when something failed, so that a failure on a busy
// machine shows what the components did without a rerun, and a passing
// run prints nothing. Safe for concurrent use.
type Tail struct {
	mu    sync.Mutex
	lines []string
	next  int // where the next write goes once lines is full
	n     int
}

// NewTail returns a Tail that keeps the last n writes (n ≥ 1).
func NewTail(n int) *Tail { return &Tail{n: max(n, 1)} }

// Write keeps a copy of p as one entry, dropping the oldest when full.
func (l *Tail) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.lines) < l.n {
		l.lines = append(l.lines, string(p))
	} else {
		l.lines[l.next] = string(p)
		l.next = (l.next + 1) % l.n
	}
	return len(p), nil
}

// Len is the number of entries held.
func (l *Tail) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.lines)
}

// String is the entries held, oldest first, concatenated.
func (l *Tail) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b strings.Builder
	for i := range l.lines {
		b.WriteString(l.lines[(l.next+i)%len(l.lines)])
	}
	return b.String()
}
