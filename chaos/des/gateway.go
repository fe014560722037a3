package des

import (
	"fmt"
	"slices"

	"github.com/zeebo/xxh3"

	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/route"
)

// gateway is one kvmesh gateway in virtual time: node's routing flow
// (prepare keys, match, build candidates, pick, record, observe) over its
// own index and strategies.
type gateway struct {
	w      *World
	id     int
	ix     *index.Index
	hasher index.Hasher
	root   index.BlockKey
	mode   index.Mode
	ledger index.Ledger
	// charKeys: keys over the prompt's bytes (node's character tokenizer)
	// instead of the engine's tokens.
	charKeys bool
	set      *route.Set
	rngSeed  uint64

	inflight []int // this gateway's exact in-flight count per replica
	queued   []int // uncached prompt tokens sent, stream not finished
	// Engine load at the last scrape.
	running, waiting []int
	kvUsage          []float64
	scraped          []uint64 // replica version at the last scrape

	// selections[s][sel] counts decisions of strategy route.Names()[s]
	// with Selection sel (kvmesh_route_decisions_total).
	selections [][]float64

	keys    []index.BlockKey
	matched []int32
	cands   []route.Candidate
}

func newGateway(w *World, id int) (*gateway, error) {
	o := &w.opts
	charKeys := !o.events() || o.Tokenizer != "tiktoken"
	block := o.EngineBlockSize
	if !o.events() {
		block = 128 // node's character-mode block size
	}
	icfg := index.DefaultConfig()
	icfg.Seed = mix(o.Seed, "cluster")
	icfg.BlockTokens = block
	icfg.Capacity = o.IndexCapacity
	icfg.HistoryTTL = o.HistoryTTL
	icfg.SpeculativeTTL = o.SpeculativeTTL
	ix, err := index.New(icfg)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidOptions, err)
	}
	rcfg := o.Route
	if rcfg.PeerLoadDelaySeconds == 0 {
		// The gateways know how stale their peers' load is: the load
		// interval an operator configures (route's default is sync's).
		rcfg.PeerLoadDelaySeconds = o.LoadDelay.Seconds()
		if o.LoadDelay == 0 || o.NoSync {
			rcfg.PeerLoadDelaySeconds = -1
		}
	}
	set, err := route.NewSet(rcfg)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidOptions, err)
	}
	g := &gateway{
		w: w, id: id, ix: ix, hasher: ix.Hasher(), mode: index.ModeHistory, ledger: index.History,
		charKeys: charKeys, set: set, rngSeed: mix(o.Seed, "gateway-rng", fmt.Sprint(id)),
		inflight: make([]int, o.Replicas), queued: make([]int, o.Replicas),
		running: make([]int, o.Replicas), waiting: make([]int, o.Replicas), kvUsage: make([]float64, o.Replicas),
		matched: make([]int32, o.Replicas), scraped: make([]uint64, o.Replicas),
	}
	if o.events() {
		g.mode, _ = index.ParseMode(o.Mode)
		g.ledger = index.Speculative // every replica publishes KV events
	}
	g.root = g.hasher.Root(o.Model, "", "")
	members := make([]route.RingMember, 0, o.Replicas)
	for i, name := range w.names {
		ix.SetPublishesEvents(w.ids[i], o.events())
		ix.SetReplicaRoot(w.ids[i], g.root)
		members = append(members, route.RingMember{ID: w.ids[i], Name: name})
		g.running[i], g.waiting[i], g.kvUsage[i] = route.Unknown, route.Unknown, route.Unknown
	}
	if err := set.ConsistentHash.SetMembers(members); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidOptions, err)
	}
	g.selections = make([][]float64, len(strategyNames))
	for i := range g.selections {
		g.selections[i] = make([]float64, len(route.Selections())+1)
	}
	return g, nil
}

// serve routes f's request, whose prompt is prefix+req.Prompt, and
// dispatches it (node's serveInference and proxy, without the network).
func (g *gateway) serve(f *flight, prefix string, req study.Request) {
	w := g.w
	strat, err := g.set.Get(req.Target.Strategy)
	if err != nil {
		w.failLater(f, 400, fmt.Sprintf("http 400: unknown routing strategy %q", req.Target.Strategy))
		return
	}
	// prepare: the prompt's block keys and what the strategy sees. The
	// engine needs the tokens whatever the gateway keys by.
	// Every gateway keys prompts alike, so they share w.prompts.
	var toks []uint32
	toks, g.keys = w.prompts.prepareSplit(prefix, req.Prompt, g.keys)
	promptTokens := len(toks)
	if g.charKeys {
		promptTokens = len(prefix) + len(req.Prompt)
	}
	now := w.nowNs()
	rr := route.Request{
		TotalBlocks:  len(g.keys),
		BlockTokens:  g.hasher.BlockTokens(),
		PromptTokens: promptTokens,
		MaxTokens:    req.MaxTokens,
		SessionKey:   sessionKey(req.Session, g.root, g.keys),
		Now:          now,
	}
	// routeOnce: match, candidates, pick.
	g.ix.Match(g.keys, w.ids, g.mode, now, g.matched)
	g.cands = g.cands[:0]
	for i, id := range w.ids {
		local := g.inflight[i]
		inflight, peerQueued := local, 0
		if w.shareLoad {
			inflight += w.seenSum[i] - w.seen[g.id][i]
			peerQueued = w.queuedSum[i] - w.queuedSeen[g.id][i]
		}
		g.cands = append(g.cands, route.Candidate{
			ID:                      id,
			Name:                    w.names[i],
			Matched:                 int(g.matched[i]),
			InFlight:                inflight,
			LocalInFlight:           local,
			Running:                 g.running[i],
			Waiting:                 g.waiting[i],
			KVUsage:                 g.kvUsage[i],
			QueuedPrefillTokens:     g.queued[i],
			PeerQueuedPrefillTokens: peerQueued,
		})
	}
	g.rngSeed += 0x9e3779b97f4a7c15
	rng := route.NewRand(g.rngSeed)
	d := strat.Pick(&rr, g.cands, &rng, nil)
	g.count(strat.Name(), d.Selection)
	c := &g.cands[d.Index]
	rep := int(c.ID)
	f.gw, f.rep = g, rep
	f.uncached = uncachedTokens(&rr, c.Matched)
	f.estQueue = d.EstimatedQueue
	// proxy: count the request in flight, send it, record on success.
	g.addInflight(rep, 1)
	g.queued[rep] += f.uncached
	g.shareQueued(rep)
	f.queued = true
	if err := w.reps[rep].add(w, f, toks); err != nil {
		w.failLater(f, 400, "http 400: "+err.Error())
		return
	}
	g.record(rep, now)
}

// uncachedTokens is node's estimate of the prompt work left on a replica
// holding matched leading blocks.
func uncachedTokens(r *route.Request, matched int) int {
	prompt := max(r.PromptTokens, r.TotalBlocks*r.BlockTokens)
	return max(prompt-matched*r.BlockTokens, 0)
}

// sessionKey is node's consistent-hash key: the session id when given,
// else the key of the prompt's fourth block (or its last), else the root.
func sessionKey(session string, root index.BlockKey, keys []index.BlockKey) uint64 {
	if session != "" {
		return xxh3.HashString(session)
	}
	const affinityBlocks = 4
	switch {
	case len(keys) >= affinityBlocks:
		return uint64(keys[affinityBlocks-1])
	case len(keys) > 0:
		return uint64(keys[len(keys)-1])
	}
	return uint64(root)
}

// record writes the decision into this gateway's index and sends it to the
// peers, who apply it SyncDelay later with the original timestamp.
func (g *gateway) record(rep int, now int64) {
	if len(g.keys) == 0 {
		return
	}
	w := g.w
	id := w.ids[rep]
	_ = g.ix.Record(g.keys, id, g.ledger, now) // only ErrInvalidLedger, impossible here
	if !w.shareLoad {
		return
	}
	keys := slices.Clone(g.keys)
	ledger := g.ledger
	self := g.id
	w.q.push(event{at: w.now + w.opts.SyncDelay, fn: func() {
		for _, p := range w.gws {
			if p.id != self {
				_ = p.ix.Record(keys, id, ledger, now)
			}
		}
	}})
}

// addInflight changes this gateway's in-flight count to rep; peers see the
// new value LoadDelay later.
func (g *gateway) addInflight(rep, d int) {
	g.inflight[rep] += d
	w := g.w
	if !w.shareLoad {
		return
	}
	w.shareSeen(kindLoad, g.id, rep, g.inflight[rep])
}

// release ends f's stream at this gateway: in-flight and queued prefill
// go, and a successful stream teaches the cost model (node's observeCost).
func (g *gateway) release(f *flight, ok bool) {
	if f.rep < 0 {
		return
	}
	g.addInflight(f.rep, -1)
	g.releaseQueued(f)
	if !ok || !f.hasFirst {
		return
	}
	w := g.w
	ttft := (f.first - f.start).Seconds()
	obs := route.Observation{UncachedTokens: f.uncached, TTFT: ttft, QueueSeconds: f.estQueue}
	// As node's observeCost: the output length is the number of content
	// tokens, and TPOT spreads first-to-last over the n−1 gaps.
	if out := f.maxTokens; out > 1 {
		obs.OutputTokens = out
		obs.TPOT = (w.now - f.first).Seconds() / float64(out-1)
	}
	g.set.Model().Observe(w.ids[f.rep], obs)
}

// releaseQueued takes f's uncached tokens off its replica's queued
// prefill (once).
func (g *gateway) releaseQueued(f *flight) {
	if f.queued {
		g.queued[f.rep] -= f.uncached
		g.shareQueued(f.rep)
		f.queued = false
	}
}

// shareQueued makes peers see this gateway's queued prefill to rep
// LoadDelay later, with its in-flight count (the load report carries
// both: node.PeerQueuedPrefill).
func (g *gateway) shareQueued(rep int) {
	if g.w.shareLoad {
		g.w.shareSeen(kindQueued, g.id, rep, g.queued[rep])
	}
}

// scrape reads every engine's load, as node's scraper does each interval.
func (g *gateway) scrape() {
	for i, r := range g.w.reps {
		if g.scraped[i] == r.ver && g.running[i] != route.Unknown {
			continue // unchanged since the last scrape
		}
		g.running[i], g.waiting[i], g.kvUsage[i] = r.eng.Load()
		g.scraped[i] = r.ver
	}
}

// applyKV applies one engine's normalized KV-event batch (node's
// kvHandler, or a peer applying its owner's batch).
func (g *gateway) applyKV(rep int, b []index.KVEvent) {
	g.ix.ApplyKV(g.w.ids[rep], b, nil) // node counts and skips failures too
}

// strategyNames indexes the selection counters.
var strategyNames = route.Names()

// count adds one decision to the selection counters.
func (g *gateway) count(strategy string, sel route.Selection) {
	s := slices.Index(strategyNames, strategy)
	if s < 0 || int(sel) >= len(g.selections[s]) {
		return
	}
	g.selections[s][sel]++
}

// addSelections adds this gateway's decision counters to m, keyed
// "strategy/selection" as kvbench reads kvmesh_route_decisions_total.
func (g *gateway) addSelections(m map[string]float64) {
	for s, name := range strategyNames {
		for sel, v := range g.selections[s] {
			if v != 0 {
				m[name+"/"+route.Selection(sel).String()] += v
			}
		}
	}
}
