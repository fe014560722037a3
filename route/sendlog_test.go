package route

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSendLog: the log keeps the requests in flight in the order they
// were sent, whatever order they were added in, forgets one per end, and
// answers the two questions the cost model and the load view ask.
func TestSendLog(t *testing.T) {
	var l SendLog
	for _, at := range []int64{10, 30, 20, 40, 20} { // out of order, 20 twice
		l.Add(at, 0)
	}
	require.Equal(t, 5, l.Len())
	for j, want := range []int64{40, 30, 20, 20, 10} {
		at, ok := l.Recent(j + 1)
		require.True(t, ok, "j=%d", j+1)
		require.Equal(t, want, at, "j=%d", j+1)
	}
	_, ok := l.Recent(6)
	require.False(t, ok, "fewer than 6 in flight")
	_, ok = l.Recent(0)
	require.False(t, ok)
	require.Equal(t, 4, l.After(19))
	require.Equal(t, 2, l.After(20), "sent at t is not after t")
	require.Equal(t, 0, l.After(40))

	l.Remove(20, 0)
	l.Remove(99, 0) // never sent: nothing to forget
	require.Equal(t, 4, l.Len())
	require.Equal(t, 2, l.After(20))
	require.Equal(t, 3, l.After(10))
	at, _ := l.Recent(3)
	require.Equal(t, int64(20), at, "one of the two sent at 20 remains")

	var none *SendLog
	_, ok = none.Recent(1)
	require.False(t, ok, "no log: nothing known")
}

// TestSendLogUncachedSince: the log sums the uncached prompt of the
// requests in flight sent at a time or later, whatever order they were
// added in; an ended request's prompt no longer counts, and of two sent
// at one instant the one ending is forgotten with its own prompt.
func TestSendLogUncachedSince(t *testing.T) {
	var l SendLog
	for _, s := range []struct {
		at       int64
		uncached int
	}{{10, 100}, {30, 300}, {20, 20}, {40, 4000}, {20, 2}} {
		l.Add(s.at, s.uncached)
	}
	require.Equal(t, 4422, l.UncachedSince(0))
	require.Equal(t, 4322, l.UncachedSince(20), "sent at t counts")
	require.Equal(t, 4300, l.UncachedSince(21))
	require.Zero(t, l.UncachedSince(41))
	at, _ := l.Recent(1)
	require.Equal(t, int64(40), at, "ordered by time, the prompts with them")

	l.Remove(20, 2) // the second sent at 20
	require.Equal(t, 4320, l.UncachedSince(20), "the one sent at 20 with 20 remains")
	l.Remove(20, 7) // no such prompt at 20: one sent then goes
	require.Equal(t, 4300, l.UncachedSince(20))
	l.Remove(40, 4000)
	require.Equal(t, 300, l.UncachedSince(11))

	var none *SendLog
	require.Zero(t, none.UncachedSince(0), "no log: nothing known")
}

// TestSendLogUnshown: at a scrape's news, the requests sent after the
// step that ended with the last token began may not show; before any
// token none count, and a step of unknown length counts from the token.
func TestSendLogUnshown(t *testing.T) {
	var l SendLog
	for _, at := range []int64{100, 250, 290} {
		l.Add(at, 0)
	}
	require.Equal(t, 0, l.Unshown(0, 50), "no token yet")
	require.Equal(t, 2, l.Unshown(300, 100), "sent after 200, when the step began")
	require.Equal(t, 1, l.Unshown(300, 25), "sent after 275")
	require.Equal(t, 1, l.Unshown(289, -5), "no step length: after the token itself")
	require.Equal(t, 3, l.Unshown(300, 250))
}

// TestSendLogConcurrent: senders add and end their requests at once (the
// proxy's goroutines); every request added and removed leaves the log
// empty, and it stays ordered meanwhile.
func TestSendLogConcurrent(t *testing.T) {
	var l SendLog
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 200 {
				at := int64(i*8 + g)
				l.Add(at, g)
				newest, ok := l.Recent(1)
				assert.True(t, ok)
				assert.GreaterOrEqual(t, newest, at, "at is in flight")
				assert.GreaterOrEqual(t, l.UncachedSince(at), g, "at's own prompt counts")
				l.Remove(at, g)
			}
		})
	}
	wg.Wait()
	require.Zero(t, l.Len())

	for g := range 4 {
		wg.Go(func() {
			for i := range 100 {
				at := i*4 + g
				l.Add(int64(at), at) // each prompt as long as its time
			}
		})
	}
	wg.Wait()
	require.Equal(t, 400, l.Len())
	require.Equal(t, l.Len(), l.After(-1))
	require.Equal(t, 59900, l.UncachedSince(200), "the prompts moved with their times: 200+…+399")
	for j := 1; j < 400; j++ {
		newer, _ := l.Recent(j)
		older, _ := l.Recent(j + 1)
		require.LessOrEqual(t, older, newer, "ordered, oldest first")
	}
}

// BenchmarkSendLog is the proxy's cost per request: one send added and
// the oldest of 64 in flight removed, as a replica at steady load sees.
func BenchmarkSendLog(b *testing.B) {
	var l SendLog
	for i := range 64 {
		l.Add(int64(i), 16)
	}
	b.ReportAllocs()
	t := int64(64)
	for b.Loop() {
		l.Add(t, 16)
		l.Remove(t-64, 16)
		t++
	}
}
