package route

import (
	"math"
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
		at, _, ok := l.Recent(j + 1)
		require.True(t, ok, "j=%d", j+1)
		require.Equal(t, want, at, "j=%d", j+1)
	}
	_, _, ok := l.Recent(6)
	require.False(t, ok, "fewer than 6 in flight")
	_, _, ok = l.Recent(0)
	require.False(t, ok)
	require.Equal(t, 4, l.After(19))
	require.Equal(t, 2, l.After(20), "sent at t is not after t")
	require.Equal(t, 0, l.After(40))

	l.Remove(20, 0, true)
	l.Remove(99, 0, true) // never sent: nothing to forget
	require.Equal(t, 4, l.Len())
	require.Equal(t, 2, l.After(20))
	require.Equal(t, 3, l.After(10))
	at, _, _ := l.Recent(3)
	require.Equal(t, int64(20), at, "one of the two sent at 20 remains")

	var none *SendLog
	_, _, ok = none.Recent(1)
	require.False(t, ok, "no log: nothing known")
}

// TestSendLogSince: Recent sums the uncached prompt sent from the
// request it names on, whatever order the requests were added in. A
// request that has ended after its prefill still counts for those sent
// before it (the replica computed its prompt while they ran) and never
// for those sent after it; one taken back counts for none; of two sent
// at one instant, the one ending is forgotten with its own prompt.
func TestSendLogSince(t *testing.T) {
	var l SendLog
	for _, s := range []struct {
		at       int64
		uncached int
	}{{10, 100}, {30, 300}, {20, 20}, {40, 4000}, {20, 2}} {
		l.Add(s.at, s.uncached)
	}
	since := func(j int) (int64, int) {
		t.Helper()
		at, since, ok := l.Recent(j)
		require.True(t, ok, "j=%d", j)
		return at, since
	}
	for j, want := range []struct {
		at    int64
		since int
	}{{40, 4000}, {30, 4300}, {20, 4302}, {20, 4322}, {10, 4422}} {
		at, s := since(j + 1)
		require.Equal(t, want.at, at, "j=%d", j+1)
		require.Equal(t, want.since, s, "j=%d: the prompts moved with their times", j+1)
	}

	l.Remove(20, 2, true) // the second sent at 20
	at, s := since(3)
	require.Equal(t, int64(20), at, "the one sent at 20 with 20 remains")
	require.Equal(t, 4322, s, "the ended one sent at 20 with 2 still counts")
	l.Remove(40, 4000, true)
	_, s = since(1)
	require.Equal(t, 4300, s, "sent at 30: 30's own and the ended 40's")
	l.Remove(10, 100, true)
	_, s = since(2)
	require.Equal(t, 4322, s, "sent at 20: the ended 10's was sent before")
	l.Remove(20, 7, true) // no such prompt at 20: one sent then goes
	require.Equal(t, 1, l.Len())

	// Added late, behind the 30 in flight and the ended 40, ahead of the
	// ended 20.
	l.Add(25, 5)
	at, s = since(2)
	require.Equal(t, int64(25), at)
	require.Equal(t, 4305, s, "sent at 25: its own, 30's and 40's")
	_, s = since(1)
	require.Equal(t, 4300, s, "sent at 30: the one added later but sent before does not count")

	// A request taken back (it never reached the replica, or ended
	// before its first token) counts for no one, and the requests sent
	// after it keep their sums.
	var b SendLog
	for i, u := range []int{10, 200, 3000, 40000} {
		b.Add(int64(i+1), u)
	}
	b.Remove(2, 200, false)
	for j, want := range []int{40000, 43000, 43010} {
		_, s, _ = b.Recent(j + 1)
		require.Equal(t, want, s, "j=%d", j+1)
	}
	b.Add(5, 500)
	b.Remove(5, 500, false)
	b.Remove(4, 40000, true)
	_, s, _ = b.Recent(2)
	require.Equal(t, 43010, s, "sent at 1: 3's and the served 4's")
	b.Add(6, 6)
	_, s, _ = b.Recent(1)
	require.Equal(t, 6, s)

	// The running sum wraps around; what was sent since does not.
	var w SendLog
	w.total = math.MaxUint32 - 10
	w.Add(1, 8)
	w.Add(2, 30)
	w.Add(3, -5) // nothing to compute
	_, s, _ = w.Recent(3)
	require.Equal(t, 38, s)

	var none *SendLog
	_, s, ok := none.Recent(1)
	require.False(t, ok)
	require.Zero(t, s, "no log: nothing known")
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
// empty, and it stays ordered meanwhile, each request's prompt counted
// as sent after the requests sent before it, whatever order they were
// added in.
func TestSendLogConcurrent(t *testing.T) {
	var l SendLog
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 200 {
				at := int64(i*8 + g)
				l.Add(at, g)
				newest, _, ok := l.Recent(1)
				assert.True(t, ok)
				assert.GreaterOrEqual(t, newest, at, "at is in flight")
				l.Remove(at, g, true)
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
	at, since, _ := l.Recent(200)
	require.Equal(t, int64(200), at)
	require.Equal(t, 59900, since, "the prompts moved with their times: 200+…+399")
	for j := 1; j < 400; j++ {
		newer, newerSince, _ := l.Recent(j)
		older, olderSince, _ := l.Recent(j + 1)
		require.LessOrEqual(t, older, newer, "ordered, oldest first")
		require.Equal(t, older, int64(olderSince-newerSince), "the older one's own prompt (as long as its time) between the two")
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
		l.Remove(t-64, 16, true)
		t++
	}
}
