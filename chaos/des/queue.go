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
	kindQueued              // gateway a's queued prefill for replica b becomes c, as peers see it
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

// queue orders events by (at, seq). It keeps two parts: a FIFO of events
// pushed in non-decreasing time order (a phase schedules all its arrivals
// up front, in time order: tens of thousands of timers that would otherwise
// deepen every heap operation) and a binary min-heap of the rest (steps,
// propagation delays, scrapes). An event joins the FIFO when its time is no
// earlier than the FIFO's last and it is study work (the timers; background
// events such as a far-off expiry would only push the timers into the
// heap); since seq grows with every push, the FIFO
// stays sorted by (at, seq). pop takes the smaller head of the two, so the
// order is exactly that of a single heap.
type queue struct {
	h    []event
	fifo []event
	head int // fifo[head:] are queued
	seq  uint64
}

// before reports whether a orders before b.
func before(a, b *event) bool {
	if a.at != b.at {
		return a.at < b.at
	}
	return a.seq < b.seq
}

func (q *queue) less(i, j int) bool { return before(&q.h[i], &q.h[j]) }

// push schedules ev, stamping its sequence number.
func (q *queue) push(ev event) {
	q.seq++
	ev.seq = q.seq
	if n := len(q.fifo); ev.work && (n == q.head || ev.at >= q.fifo[n-1].at) {
		q.fifo = append(q.fifo, ev)
		return
	}
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
	if q.head < len(q.fifo) && (len(q.h) == 0 || before(&q.fifo[q.head], &q.h[0])) {
		ev := q.fifo[q.head]
		q.fifo[q.head] = event{}
		q.head++
		if q.head == len(q.fifo) {
			q.fifo, q.head = q.fifo[:0], 0
		} else if q.head >= 4096 && 2*q.head >= len(q.fifo) {
			n := copy(q.fifo, q.fifo[q.head:])
			clear(q.fifo[n:])
			q.fifo, q.head = q.fifo[:n], 0
		}
		return ev
	}
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

func (q *queue) len() int { return len(q.h) + len(q.fifo) - q.head }
