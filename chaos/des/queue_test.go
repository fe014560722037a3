package des

import (
	"math/rand/v2"
	"sort"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestQueueOrdersByTimeThenSchedulingOrder(t *testing.T) {
	var q queue
	r := rand.New(rand.NewPCG(1, 2))
	type key struct {
		at  time.Duration
		seq int64
	}
	var want []key
	for i := range 2000 {
		at := time.Duration(r.IntN(50)) * time.Millisecond // many equal times
		// Half are work events, which may take the FIFO part.
		q.push(event{at: at, c: int64(i), work: r.IntN(2) == 0})
		want = append(want, key{at, int64(i)})
	}
	sort.SliceStable(want, func(i, j int) bool { return want[i].at < want[j].at })
	for i := range want {
		ev := q.pop()
		require.Equal(t, want[i].at, ev.at, "event %d", i)
		require.Equal(t, want[i].seq, ev.c, "event %d: equal times must pop in scheduling order", i)
	}
	require.Zero(t, q.len())
}

func TestQueueInterleavedPushPop(t *testing.T) {
	var q queue
	r := rand.New(rand.NewPCG(3, 4))
	last := time.Duration(-1)
	lastSeq := uint64(0)
	now := time.Duration(0)
	for range 5000 {
		if q.len() == 0 || r.IntN(3) > 0 {
			q.push(event{at: now + time.Duration(r.IntN(10)), work: r.IntN(2) == 0})
			continue
		}
		ev := q.pop()
		require.True(t, ev.at > last || (ev.at == last && ev.seq > lastSeq), "popped out of order")
		last, lastSeq, now = ev.at, ev.seq, ev.at
	}
}

func TestWorldAtRunsInTimeOrder(t *testing.T) {
	w, err := New(DefaultOptions())
	require.NoError(t, err)
	defer w.Close()
	var got []int
	w.At(3*time.Second, func() { got = append(got, 3) })
	w.At(time.Second, func() {
		got = append(got, 1)
		w.At(2*time.Second, func() { got = append(got, 2) })
		w.At(0, func() { got = append(got, 10) }) // in the past: runs now, after this
	})
	w.At(time.Second, func() { got = append(got, 11) })
	require.NoError(t, w.Run(t.Context()))
	require.Equal(t, []int{1, 11, 10, 2, 3}, got)
	require.Equal(t, 3*time.Second, w.Now())
}

// TestQueueFIFOAndHeapMerge pushes work timers in time order (the FIFO
// part) mixed with earlier, equal and later background events (the heap)
// and checks the pops against a sort by (at, scheduling order).
func TestQueueFIFOAndHeapMerge(t *testing.T) {
	var q queue
	r := rand.New(rand.NewPCG(5, 6))
	type key struct {
		at  time.Duration
		seq int64
	}
	var want []key
	now := time.Duration(0)
	popped := 0
	check := func(ev event) {
		require.Equal(t, want[popped].at, ev.at, "pop %d", popped)
		require.Equal(t, want[popped].seq, ev.c, "pop %d", popped)
		popped++
	}
	for i := range 20000 {
		var ev event
		if r.IntN(3) == 0 {
			ev = event{at: now + time.Duration(r.IntN(30)), c: int64(i)}
		} else {
			ev = event{at: time.Duration(i / 3), c: int64(i), work: true}
		}
		ev.at = max(ev.at, now)
		q.push(ev)
		want = append(want, key{ev.at, int64(i)})
		if r.IntN(4) == 0 {
			sort.SliceStable(want[popped:], func(a, b int) bool { return want[popped+a].at < want[popped+b].at })
			ev := q.pop()
			check(ev)
			now = ev.at
		}
	}
	sort.SliceStable(want[popped:], func(a, b int) bool { return want[popped+a].at < want[popped+b].at })
	for q.len() > 0 {
		check(q.pop())
	}
	require.Equal(t, len(want), popped)
}
