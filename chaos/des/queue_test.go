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
		q.push(event{at: at, c: int64(i)})
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
			q.push(event{at: now + time.Duration(r.IntN(10))})
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
