package route

import (
	"math"
	"sync"
)

// SendLog holds when a gateway sent the requests it has in flight to one
// replica, and the prompt each left to compute there: the load view adds
// a request as it is sent and removes it when its stream ends. The cost
// model reads from it how soon a full running set frees a slot, and how
// much prefill the replica has taken since (Candidate.Sends, Recent), and
// the load view how many requests a scrape may not show yet (Unshown).
// It is safe for concurrent use; the zero value is empty.
type SendLog struct {
	mu    sync.Mutex
	sends []send // oldest first
	// total sums the uncached prompt of every request ever added, ended
	// ones too, less those taken back (Remove): what was sent since a
	// request is total less its before.
	// It wraps around; the difference stays right while fewer than 2³²
	// units are sent during one request's stream.
	total uint32
}

// send is one request in a SendLog: when it was sent (Unix ns), the
// uncached prompt it sent (Route's Output.Uncached, in the keys' units)
// and SendLog.total before it, in the order of the times sent. The two
// counts are 32 bits wide to keep a send at 16 bytes: Remove moves the
// sends after the one it forgets, and the proxy removes one a request.
type send struct {
	at       int64
	uncached int32
	before   uint32
}

// Add notes a request sent at t (Unix ns) that leaves uncached prompt
// units to compute on the replica.
func (l *SendLog) Add(t int64, uncached int) {
	l.mu.Lock()
	u := units(uncached)
	l.sends = append(l.sends, send{at: t, uncached: u, before: l.total})
	l.total += uint32(u)
	// Concurrent senders may add out of order, by little: move t back
	// to its place, the sends it passes then counting its prompt as sent
	// before theirs.
	for i := len(l.sends) - 1; i > 0 && l.sends[i-1].at > t; i-- {
		a, b := &l.sends[i-1], &l.sends[i]
		b.before = a.before
		a.before += uint32(b.uncached)
		*a, *b = *b, *a
	}
	l.mu.Unlock()
}

// Remove forgets one request sent at t with uncached units, as Add was
// given them, when its stream ends; of several sent at t it prefers one
// with those units. prefilled says the replica computed the prompt (its
// first token came): the prompt then still counts as sent for the
// requests sent before it (Recent). A request that never reached the
// replica, or ended before its first token, is taken back whole. Remove
// does nothing when no request was sent at t.
func (l *SendLog) Remove(t int64, uncached int, prefilled bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	i, found := l.search(t)
	if !found {
		return
	}
	u := units(uncached)
	for j := i; j < len(l.sends) && l.sends[j].at == t; j++ {
		if l.sends[j].uncached == u {
			i = j
			break
		}
	}
	if !prefilled {
		back := uint32(l.sends[i].uncached)
		l.total -= back
		for k := i + 1; k < len(l.sends); k++ {
			l.sends[k].before -= back
		}
	}
	copy(l.sends[i:], l.sends[i+1:])
	l.sends = l.sends[:len(l.sends)-1]
}

// units is an uncached prompt as a send keeps it: none when negative,
// and no more than 32 bits hold.
func units(uncached int) int32 {
	return int32(min(max(uncached, 0), math.MaxInt32))
}

// search finds the first send at t or later, and whether one is at t;
// l.mu is held. It is written out: slices.BinarySearchFunc's call per
// step cost about 9 ns of BenchmarkSendLog's 47 (the proxy's cost per
// request).
func (l *SendLog) search(t int64) (int, bool) {
	lo, hi := 0, len(l.sends)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if l.sends[m].at < t {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo, lo < len(l.sends) && l.sends[lo].at == t
}

// Len returns the number of requests in flight.
func (l *SendLog) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.sends)
}

// After counts the requests in flight that were sent after t (Unix ns).
func (l *SendLog) After(t int64) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	i, found := l.search(t)
	for found && i < len(l.sends) && l.sends[i].at == t {
		i++
	}
	return len(l.sends) - i
}

// Recent returns when the j-th most recently sent request in flight was
// sent (j = 1: the newest) and since, the uncached prompt units sent to
// the replica from that request on: its own and those of every request
// sent after it, in flight or ended after its prefill (see Remove). That
// is the prefill the replica has computed, or has still to compute,
// since that request arrived, and every engine step that computes a
// chunk of it delays that request's decode (see Cost's slot wait). ok is
// false when fewer than j are in flight, when j < 1 and for a nil l.
func (l *SendLog) Recent(j int) (at int64, since int, ok bool) {
	if l == nil || j < 1 {
		return 0, 0, false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if j > len(l.sends) {
		return 0, 0, false
	}
	s := l.sends[len(l.sends)-j]
	return s.at, int(l.total - s.before), true
}

// Unshown counts the requests in flight that a scrape bringing news of
// the replica may not show: those sent after the step that ended with
// the last token the gateway received from the replica began,
// lastToken−stepNanos. The scrape is at least as new as that step's end,
// whose figures show every request that arrived before the step began;
// a request sent later shows only once a step has ended after it
// arrived, which the gateway cannot tell without another token. Before
// any token (lastToken ≤ 0) it counts none. Counting all of them instead
// held a gateway's first requests off the replicas it had not used yet:
// on 64 replicas behind 8 isolated gateways (discrete-event table, seeds
// 1–6, hot90 alone with KV events) cost passed 364 fewer than
// least-request instead of 308.
func (l *SendLog) Unshown(lastToken, stepNanos int64) int {
	if lastToken <= 0 {
		return 0
	}
	return l.After(lastToken - max(stepNanos, 0))
}
