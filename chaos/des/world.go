package des

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node/tokenizer"
	"github.com/kvmesh/kvmesh/route"
)

// epoch is virtual time zero as a wall-clock instant: the engines take
// time.Time and the index and strategies Unix nanoseconds. It is fixed, so
// nothing depends on when a simulation runs.
var epoch = time.Unix(1_767_225_600, 0) // 2026-01-01T00:00:00Z

// World is one cell's simulated replicas and gateways in virtual time. It
// implements study.Engine. It is not safe for concurrent use (no Engine
// is) and starts no goroutines.
type World struct {
	opts  Options
	names []string
	ids   []index.ReplicaID
	// final is the engines' stats at Close (EngineStats).
	final []sim.Stats
	tok   tokenizer.Tokenizer
	// prompts turns gateway-routed prompts into tokens and keys.
	prompts *prompts
	// hasher is the gateways' (one cluster seed and block size).
	hasher index.Hasher

	q       queue
	now     time.Duration
	pending int // study work not yet done: timers, sends, samples
	closed  bool

	reps []*replica
	gws  []*gateway
	// seen[g][r] is gateway g's in-flight count to replica r as its peers
	// see it (LoadDelay late); seenSum[r] sums it over gateways.
	seen    [][]int
	seenSum []int
	// queuedSeen and queuedSum are the same for the gateways' queued
	// prefill (route.Candidate.PeerQueuedPrefillTokens).
	queuedSeen [][]int
	queuedSum  []int
	// shareLoad and shareRecords say whether gateways exchange load and
	// decisions (more than one gateway and not NoSync).
	shareLoad bool

	answers map[int]string // generated text by length (deterministic)

	// Processed counts events run so far (for throughput figures).
	processed uint64
}

var _ study.Engine = (*World)(nil)

// ReplicaName returns the name of replica i: A..Z, then AA, AB, ... like
// spreadsheet columns, so the first two are the seed's "A" and "B".
func ReplicaName(i int) string {
	var b []byte
	for i++; i > 0; i = (i - 1) / 26 {
		b = append(b, byte('A'+(i-1)%26))
	}
	for l, r := 0, len(b)-1; l < r; l, r = l+1, r-1 {
		b[l], b[r] = b[r], b[l]
	}
	return string(b)
}

// New builds a World from o: idle engines with empty caches, gateways with
// empty indexes, every gateway's first load scrape done at time zero.
func New(o Options) (*World, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	w := &World{opts: o, answers: map[int]string{}}
	if o.Tokenizer == tokenizer.NameTiktoken {
		inner, err := tokenizer.New(tokenizer.NameTiktoken)
		if err != nil {
			return nil, fmt.Errorf("des: tokenizer: %w", err)
		}
		// Prompts of one group share a ~28 KB prefix: the prefix cache
		// makes their encoding cost only the new tail, with the same tokens.
		if w.tok, err = tokenizer.NewCached(inner, tokenizer.DefaultCachedConfig()); err != nil {
			return nil, fmt.Errorf("des: tokenizer: %w", err)
		}
	} else {
		w.tok = tokenizer.Bytes{}
	}
	prof, _ := sim.LookupProfile(o.Profile)
	ec := sim.EngineConfig{
		MaxModelLen:         o.MaxModelLen,
		MaxNumSeqs:          o.MaxNumSeqs,
		MaxNumBatchedTokens: o.MaxNumBatchedTokens,
		BlockSize:           o.EngineBlockSize,
		NumBlocks:           o.EngineTokens / o.EngineBlockSize,
		Profile:             prof,
		// One hash seed for every engine (as vLLM with a fixed hash
		// seed): the index then shares engine-hash mappings between
		// replicas, which keeps 64 replicas' maps small.
		HashSeed:   mix(o.Seed, "engine-hash") | 1,
		EmitEvents: o.events(),
	}
	if o.HybridSlidingWindow > 0 {
		ec.SlidingWindow = o.HybridSlidingWindow
		ec.SlidingWindowBlocks = o.HybridWindowTokens / o.EngineBlockSize
	}
	if o.OffloadBlocks > 0 {
		ec.OffloadBlocks = o.OffloadBlocks
		ec.OffloadLoadTokensPerSecond = o.OffloadLoadTokensPerSecond
		if ec.OffloadLoadTokensPerSecond == 0 {
			ec.OffloadLoadTokensPerSecond = route.DefaultOffloadConfig().CPULoadTokensPerSecond
		}
	}
	for i := range o.Replicas {
		eng, err := sim.NewEngine(ec)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrInvalidOptions, err)
		}
		w.names = append(w.names, ReplicaName(i))
		w.ids = append(w.ids, index.ReplicaID(i))
		w.reps = append(w.reps, &replica{id: i, name: ReplicaName(i), eng: eng, flights: map[sim.RequestID]*flight{}})
	}
	w.shareLoad = o.Gateways > 1 && !o.NoSync
	w.seen, w.queuedSeen = make([][]int, o.Gateways), make([][]int, o.Gateways)
	for g := range o.Gateways {
		w.seen[g], w.queuedSeen[g] = make([]int, o.Replicas), make([]int, o.Replicas)
	}
	w.seenSum, w.queuedSum = make([]int, o.Replicas), make([]int, o.Replicas)
	for g := range o.Gateways {
		gw, err := newGateway(w, g)
		if err != nil {
			return nil, err
		}
		w.gws = append(w.gws, gw)
	}
	g0 := w.gws[0]
	w.prompts = newPrompts(w.tok, g0.hasher, g0.root, g0.charKeys)
	w.hasher = g0.hasher
	for _, g := range w.gws {
		g.scrape()
		phase := time.Duration(int64(o.ScrapeInterval) * int64(g.id) / int64(o.Gateways))
		tick := o.scrapeTick()
		w.q.push(event{at: time.Duration(int64(tick)*int64(g.id)/int64(o.Gateways)) + tick, kind: kindScrape, a: int32(g.id)})
		w.q.push(event{at: o.ExpireInterval + phase, kind: kindExpire, a: int32(g.id)})
	}
	return w, nil
}

// t is the current virtual time as an instant (for the engines).
func (w *World) t() time.Time { return epoch.Add(w.now) }

// nowNs is the current virtual time in Unix nanoseconds (for the index and
// the strategies).
func (w *World) nowNs() int64 { return epoch.UnixNano() + int64(w.now) }

// Options returns the options the World was built with.
func (w *World) Options() Options { return w.opts }

// Events returns how many events the World has run.
func (w *World) Events() uint64 { return w.processed }

// Replicas implements study.Engine.
func (w *World) Replicas() []string { return w.names }

// Gateways implements study.Engine.
func (w *World) Gateways() int { return len(w.gws) }

// Now implements study.Engine.
func (w *World) Now() time.Duration { return w.now }

// At implements study.Engine.
func (w *World) At(t time.Duration, fn func()) {
	w.pending++
	w.q.push(event{at: max(t, w.now), fn: fn, work: true})
}

// flight is one request between Send and its outcome.
type flight struct {
	start     time.Duration
	first     time.Duration
	hasFirst  bool
	maxTokens int
	rep       int
	done      func(study.Outcome)
	// Gateway bookkeeping (gw nil for a direct request).
	gw       *gateway
	sentAt   int64 // when gw sent it (Unix ns)
	uncached int
	queued   bool // uncached is counted in gw's queued prefill
	// obs is the routing core's observation, completed when the stream
	// ends (gateway.release).
	obs route.Observation
}

// Send implements study.Engine.
func (w *World) Send(req study.Request, done func(study.Outcome)) { w.send("", req, done) }

// SendPrefixed implements study.PrefixSender: Send for the prompt
// prefix+req.Prompt. A routed request is keyed without joining the two
// when its prefix group is known (prompts.prepareSplit).
func (w *World) SendPrefixed(prefix string, req study.Request, done func(study.Outcome)) {
	w.send(prefix, req, done)
}

var _ study.PrefixSender = (*World)(nil)

// send starts the request for the prompt prefix+req.Prompt.
func (w *World) send(prefix string, req study.Request, done func(study.Outcome)) {
	w.pending++
	f := &flight{start: w.now, maxTokens: req.MaxTokens, done: done, rep: -1}
	if w.closed {
		w.failLater(f, 0, ErrClosed.Error())
		return
	}
	if req.Target.Direct {
		if req.Target.Replica < 0 || req.Target.Replica >= len(w.reps) {
			w.failLater(f, 0, fmt.Sprintf("des: no replica %d", req.Target.Replica))
			return
		}
		f.rep = req.Target.Replica
		toks := w.tok.Encode(nil, prefix+req.Prompt)
		if err := w.reps[f.rep].add(w, f, toks); err != nil {
			w.failLater(f, 400, "http 400: "+err.Error())
		}
		return
	}
	if req.Target.Gateway < 0 || req.Target.Gateway >= len(w.gws) {
		w.failLater(f, 0, fmt.Sprintf("des: no gateway %d", req.Target.Gateway))
		return
	}
	w.gws[req.Target.Gateway].serve(f, prefix, req)
}

// failLater delivers a failed outcome from the loop, never from Send.
func (w *World) failLater(f *flight, status int, msg string) {
	w.q.push(event{at: w.now, fn: func() {
		if f.gw != nil {
			f.gw.release(f, false, nil)
		}
		o := study.Outcome{Start: f.start, Status: status, CachedTokens: -1, Err: msg}
		if f.rep >= 0 && f.gw != nil {
			o.Replica = w.names[f.rep]
		}
		w.pending--
		f.done(o)
	}})
}

// complete delivers a finished request's outcome: what the streaming client
// sees of a vLLM stream that ended now.
func (w *World) complete(f *flight, fin *sim.Finished) {
	if f.gw != nil {
		f.gw.release(f, true, fin)
	}
	o := study.Outcome{
		Start:            f.start,
		Status:           200,
		Replica:          w.names[f.rep],
		LastContent:      w.now - f.start,
		End:              w.now - f.start,
		ContentChunks:    fin.OutputTokens,
		GotDone:          true,
		HasUsage:         true,
		PromptTokens:     fin.PromptTokens,
		CompletionTokens: fin.OutputTokens,
		CachedTokens:     fin.CachedTokens,
		Text:             w.answer(fin.OutputTokens),
	}
	if f.hasFirst {
		o.FirstContent = f.first - f.start
	}
	w.pending--
	f.done(o)
}

// answer returns the text the simulator generates for n tokens.
func (w *World) answer(n int) string {
	if s, ok := w.answers[n]; ok {
		return s
	}
	var b strings.Builder
	for i := range n {
		b.WriteString(sim.OutputTokenText(i))
	}
	s := b.String()
	w.answers[n] = s
	return s
}

// Observe implements study.Engine: the engines' gauges now, as a scrape
// would return them.
func (w *World) Observe(done func(study.Observation)) {
	o := study.Observation{At: w.now}
	for _, r := range w.reps {
		o.Running = append(o.Running, r.shown.Running)
		o.Waiting = append(o.Waiting, r.shown.Waiting)
	}
	w.pending++
	w.q.push(event{at: w.now, fn: func() { done(o) }, work: true})
}

// Run implements study.Engine: it runs events in virtual-time order until no
// study work is pending. Background events (steps of idle engines, scrapes,
// propagation of events and decisions) that fall later stay queued for the
// next Run.
func (w *World) Run(ctx context.Context) error {
	if w.closed {
		return ErrClosed
	}
	for n := 0; w.pending > 0; n++ {
		if n&4095 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		if w.q.len() == 0 {
			return fmt.Errorf("%w: %d pending", ErrStalled, w.pending)
		}
		ev := w.q.pop()
		w.now = ev.at
		w.processed++
		if ev.work {
			w.pending--
		}
		switch ev.kind {
		case kindFunc:
			ev.fn()
		case kindStep:
			w.reps[ev.a].step(w)
		case kindStepEnd:
			w.reps[ev.a].stepEnd(w)
		case kindScrape:
			g := w.gws[ev.a]
			g.scrape()
			w.q.push(event{at: w.now + w.opts.scrapeTick(), kind: kindScrape, a: ev.a})
		case kindLoad:
			setSeen(w.seen, w.seenSum, int(ev.a), int(ev.b), int(ev.c))
		case kindQueued:
			setSeen(w.queuedSeen, w.queuedSum, int(ev.a), int(ev.b), int(ev.c))
		case kindExpire:
			w.gws[ev.a].ix.Expire(w.nowNs(), w.opts.ExpireNodes)
			w.q.push(event{at: w.now + w.opts.ExpireInterval, kind: kindExpire, a: ev.a})
		}
	}
	return nil
}

// shareSeen makes peers see gateway g's figure v for replica r (kind
// kindLoad: in-flight count; kindQueued: queued prefill) LoadDelay later,
// as its next load report would.
func (w *World) shareSeen(k kind, g, r, v int) {
	seen, sum := w.seen, w.seenSum
	if k == kindQueued {
		seen, sum = w.queuedSeen, w.queuedSum
	}
	if w.opts.LoadDelay == 0 {
		setSeen(seen, sum, g, r, v)
		return
	}
	w.q.push(event{at: w.now + w.opts.LoadDelay, kind: k, a: int32(g), b: int32(r), c: int64(v)})
}

// setSeen makes peers see gateway g's figure v for replica r in seen
// (in-flight counts or queued prefill), keeping sum[r] its total over
// gateways.
func setSeen(seen [][]int, sum []int, g, r, v int) {
	sum[r] += v - seen[g][r]
	seen[g][r] = v
}

// ResetCaches implements study.Engine: every engine drops its cached
// blocks; the AllBlocksCleared events reach the gateways KVDelay later.
func (w *World) ResetCaches(context.Context) error {
	if w.closed {
		return ErrClosed
	}
	for _, r := range w.reps {
		ok, evs := r.eng.ResetPrefixCache()
		if !ok {
			return fmt.Errorf("%w: replica %s holds requests", ErrReset, r.name)
		}
		r.ver++
		w.publish(r, evs)
	}
	return nil
}

// Counters implements study.Engine.
func (w *World) Counters(context.Context) (study.Counters, error) {
	var c study.Counters
	if w.closed {
		return c, ErrClosed
	}
	for _, r := range w.reps {
		st := r.stats()
		var ok uint64
		for _, v := range st.Finished {
			ok += v
		}
		c.Queries = append(c.Queries, float64(st.PrefixQueries))
		c.Hits = append(c.Hits, float64(st.PrefixHits))
		c.Success = append(c.Success, float64(ok))
	}
	c.Selections = map[string]float64{}
	for _, g := range w.gws {
		g.addSelections(c.Selections)
	}
	return c, nil
}

// WaitIdle implements study.Engine. Between Runs no request is in flight,
// so the engines are idle unless a request was abandoned by a cancelled Run.
func (w *World) WaitIdle(context.Context) error {
	if w.closed {
		return ErrClosed
	}
	for _, r := range w.reps {
		if len(r.flights) > 0 {
			return fmt.Errorf("%w: replica %s has %d requests", ErrNotIdle, r.name, len(r.flights))
		}
	}
	return nil
}

// Close implements study.Engine; it is idempotent.
func (w *World) Close() error {
	if !w.closed {
		w.final = w.EngineStats()
		w.closed = true
		w.q = queue{}
		w.reps, w.gws = nil, nil
	}
	return nil
}

// EngineStats returns each replica's engine counters and gauges
// (sim.Engine.Stats), in Replicas order: cumulative over the World's life,
// initialisation steps included; after Close, the figures at Close.
func (w *World) EngineStats() []sim.Stats {
	if w.closed {
		return w.final
	}
	out := make([]sim.Stats, len(w.reps))
	for i, r := range w.reps {
		out[i] = r.stats()
	}
	return out
}
