package des

import "time"

// kind says what an event does. Hot events are typed so that scheduling
// them does not allocate a closure.
type kind uint8

const (
	kindFunc    kind = iota // call fn
	kindStep                // replica a: run a step
	kindStepEnd             // replica a: the running step's results take effect
	kindScrape              // gateway a: scrape every engine's load
	kindLoad                // gateway a's in-flight count for replica b becomes c, as peers see it
	kindExpire              // gateway a: index expiry
)

// event is one scheduled action at virtual time at. seq orders events with
// equal times by scheduling order, which makes the simulation
// deterministic.
type event struct {
	at   time.Duration
	seq  uint64
	fn   func()
	kind kind
	a, b int32
	c    int64
	// work marks an event that counts as pending study work (a timer, an
	// outcome or a sample callback): Run returns when none is left.
	work bool
}

// queue is a binary min-heap of events ordered by (at, seq).
type queue struct {
	h   []event
	seq uint64
}

func (q *queue) less(i, j int) bool {
	a, b := &q.h[i], &q.h[j]
	if a.at != b.at {
		return a.at < b.at
	}
	return a.seq < b.seq
}

// push schedules ev, stamping its sequence number.
func (q *queue) push(ev event) {
	q.seq++
	ev.seq = q.seq
	q.h = append(q.h, ev)
	i := len(q.h) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !q.less(i, p) {
			break
		}
		q.h[i], q.h[p] = q.h[p], q.h[i]
		i = p
	}
}

// pop removes and returns the earliest event; the queue must not be empty.
func (q *queue) pop() event {
	h := q.h
	top := h[0]
	n := len(h) - 1
	h[0] = h[n]
	h[n] = event{}
	q.h = h[:n]
	i := 0
	for {
		l := 2*i + 1
		if l >= n {
			break
		}
		m := l
		if r := l + 1; r < n && q.less(r, l) {
			m = r
		}
		if !q.less(m, i) {
			break
		}
		q.h[i], q.h[m] = q.h[m], q.h[i]
		i = m
	}
	return top
}

func (q *queue) len() int { return len(q.h) }
