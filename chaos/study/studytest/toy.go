// Package studytest provides Toy, a small deterministic virtual-time Engine
// for testing the study core (scenarios, driver, statistics, outputs)
// without sockets. Its service model is deliberately crude: a replica serves
// up to Slots requests at once, a request's prefill takes ColdPrefill or
// WarmPrefill depending on whether its document prefix is cached on that
// replica, and each token takes TokenTime.
package studytest

import (
	"container/heap"
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/chaos/study"
)

// Toy is a virtual-time study.Engine. It is not safe for concurrent use,
// like every study.Engine.
type Toy struct {
	// Slots is how many requests one replica serves at once.
	Slots int
	// ColdPrefill and WarmPrefill are the prefill times for an uncached and
	// a cached document prefix.
	ColdPrefill, WarmPrefill time.Duration
	// TokenTime is the time per generated token.
	TokenTime time.Duration
	// Route, if set, picks the replica for a routed request; the default
	// implements random, least-request and a history prefix-cache.
	Route func(t *Toy, req study.Request) int
	// Drop, if set, makes a request fail (HTTP 503) when it returns true.
	Drop func(req study.Request) bool
	// Resets counts ResetCaches calls.
	Resets int

	names    []string
	gateways int
	now      time.Duration
	seq      int
	events   eventHeap
	rng      *rand.Rand

	inflight []int
	busy     []int
	waitq    [][]func()
	cache    []map[string]bool
	history  map[string]int
	queries  []float64
	hits     []float64
	success  []float64
	selected map[string]float64
}

var _ study.Engine = (*Toy)(nil)

// NewToy returns a Toy with replicas named A, B, ... and the given number of
// gateways.
func NewToy(replicas, gateways int, seed uint64) *Toy {
	t := &Toy{
		Slots: 4, ColdPrefill: 800 * time.Millisecond, WarmPrefill: 100 * time.Millisecond,
		TokenTime: 40 * time.Millisecond,
		gateways:  gateways, rng: rand.New(rand.NewPCG(seed, seed+1)),
		history: map[string]int{}, selected: map[string]float64{},
	}
	for i := range replicas {
		t.names = append(t.names, string(rune('A'+i)))
		t.cache = append(t.cache, map[string]bool{})
	}
	t.inflight = make([]int, replicas)
	t.busy = make([]int, replicas)
	t.waitq = make([][]func(), replicas)
	t.queries = make([]float64, replicas)
	t.hits = make([]float64, replicas)
	t.success = make([]float64, replicas)
	return t
}

// Replicas implements study.Engine.
func (t *Toy) Replicas() []string { return t.names }

// Gateways implements study.Engine.
func (t *Toy) Gateways() int { return t.gateways }

// Now implements study.Engine.
func (t *Toy) Now() time.Duration { return t.now }

// At implements study.Engine.
func (t *Toy) At(at time.Duration, fn func()) {
	if at < t.now {
		at = t.now
	}
	t.seq++
	heap.Push(&t.events, event{at: at, seq: t.seq, fn: fn})
}

// DocPrefix returns the part of a prompt that identifies its document: up
// to the question or session line.
func DocPrefix(p string) string {
	for _, sep := range []string{"\n\nSession ", "\nQuestion "} {
		if i := strings.Index(p, sep); i >= 0 {
			return p[:i]
		}
	}
	return p
}

// InflightOf returns the number of requests on replica r.
func (t *Toy) InflightOf(r int) int { return t.inflight[r] }

func (t *Toy) defaultRoute(req study.Request) int {
	switch req.Target.Strategy {
	case "least-request", "cost":
		return t.leastLoaded()
	case "prefix-cache":
		if r, ok := t.history[DocPrefix(req.Prompt)]; ok {
			t.selected["prefix-cache/prefix_match"]++
			return r
		}
		t.selected["prefix-cache/least_request_fallback"]++
		return t.leastLoaded()
	}
	return t.rng.IntN(len(t.names))
}

func (t *Toy) leastLoaded() int {
	best := []int{}
	for r := range t.names {
		switch {
		case len(best) == 0 || t.inflight[r] < t.inflight[best[0]]:
			best = []int{r}
		case t.inflight[r] == t.inflight[best[0]]:
			best = append(best, r)
		}
	}
	return best[t.rng.IntN(len(best))]
}

// Send implements study.Engine.
func (t *Toy) Send(req study.Request, done func(study.Outcome)) {
	start := t.now
	r := req.Target.Replica
	if !req.Target.Direct {
		if t.Route != nil {
			r = t.Route(t, req)
		} else {
			r = t.defaultRoute(req)
		}
		t.history[DocPrefix(req.Prompt)] = r
	}
	if t.Drop != nil && t.Drop(req) {
		t.At(t.now+10*time.Millisecond, func() {
			done(study.Outcome{Start: start, Status: 503, Replica: t.names[r], CachedTokens: -1, Err: "toy: dropped"})
		})
		return
	}
	t.inflight[r]++
	run := func() {
		t.busy[r]++
		doc := DocPrefix(req.Prompt)
		prefill := t.ColdPrefill
		q := float64(len(req.Prompt))
		t.queries[r] += q
		if t.cache[r][doc] {
			prefill = t.WarmPrefill
			t.hits[r] += float64(len(doc))
		}
		t.cache[r][doc] = true
		first := t.now + prefill - start
		last := first + time.Duration(req.MaxTokens-1)*t.TokenTime
		t.At(start+last, func() {
			t.busy[r]--
			t.inflight[r]--
			t.success[r]++
			if len(t.waitq[r]) > 0 {
				next := t.waitq[r][0]
				t.waitq[r] = t.waitq[r][1:]
				next()
			}
			done(study.Outcome{
				Start: start, Status: 200, Replica: t.names[r],
				FirstContent: first, LastContent: last, End: last + time.Millisecond,
				ContentChunks: req.MaxTokens, GotDone: true, HasUsage: true,
				PromptTokens: len(req.Prompt) / 4, CompletionTokens: req.MaxTokens, CachedTokens: -1,
				Text: fmt.Sprintf(" answer from %s.", t.names[r]),
			})
		})
	}
	if t.busy[r] < t.Slots {
		run()
	} else {
		t.waitq[r] = append(t.waitq[r], run)
	}
}

// Observe implements study.Engine.
func (t *Toy) Observe(done func(study.Observation)) {
	o := study.Observation{At: t.now}
	for r := range t.names {
		o.Running = append(o.Running, t.busy[r])
		o.Waiting = append(o.Waiting, len(t.waitq[r]))
	}
	t.At(t.now, func() { done(o) })
}

// Run implements study.Engine.
func (t *Toy) Run(ctx context.Context) error {
	for t.events.Len() > 0 {
		if err := ctx.Err(); err != nil {
			t.events = nil
			return err
		}
		ev := heap.Pop(&t.events).(event)
		t.now = ev.at
		ev.fn()
	}
	return nil
}

// ResetCaches implements study.Engine.
func (t *Toy) ResetCaches(context.Context) error {
	t.Resets++
	for r := range t.cache {
		t.cache[r] = map[string]bool{}
	}
	return nil
}

// Counters implements study.Engine.
func (t *Toy) Counters(context.Context) (study.Counters, error) {
	c := study.Counters{
		Queries: append([]float64(nil), t.queries...),
		Hits:    append([]float64(nil), t.hits...),
		Success: append([]float64(nil), t.success...),
	}
	c.Selections = map[string]float64{}
	for k, v := range t.selected {
		c.Selections[k] = v
	}
	return c, nil
}

// WaitIdle implements study.Engine.
func (t *Toy) WaitIdle(context.Context) error {
	for r := range t.names {
		if t.inflight[r] != 0 {
			return fmt.Errorf("toy: replica %s busy outside Run", t.names[r])
		}
	}
	return nil
}

// Close implements study.Engine.
func (t *Toy) Close() error { return nil }

type event struct {
	at  time.Duration
	seq int
	fn  func()
}

type eventHeap []event

func (h eventHeap) Len() int { return len(h) }
func (h eventHeap) Less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].seq < h[j].seq
}
func (h eventHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *eventHeap) Push(x any)   { *h = append(*h, x.(event)) }
func (h *eventHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}
