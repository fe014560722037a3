package des

import (
	"fmt"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/chaos/study"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node/tokenizer"
	"github.com/kvmesh/kvmesh/route"
)

// gateway is one kvmesh gateway in virtual time: it keys prompts as node
// does and routes them through the same routing core (route.Scratch.Route:
// match, candidates, pick, ledger, observation), with itself as the load
// view over its arrays, then records and observes as node's proxy does.
type gateway struct {
	w      *World
	id     int
	ix     *index.Index
	hasher index.Hasher
	root   index.BlockKey
	mode   index.Mode
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
	// When this gateway's streams last carried a token from each replica,
	// and the step period then (route.Candidate.LastTokenAt, StepNanos).
	lastToken, stepNanos []int64
	// This gateway's in-flight count to each replica when a scrape last
	// brought news of the engine, the requests in flight there a scrape
	// may not show, and when the last scrape came
	// (route.Candidate.ScrapedInFlight, UnshownSent; node's scrape).
	scrapedInflight []int
	unshownSent     []int
	scrapedAt       []int64
	// The queued prefill, this gateway's and the peers' as seen, when
	// each engine's last scrape was read
	// (route.Candidate.ScrapedQueuedPrefillTokens).
	scrapedQueued []int
	// sends[i] holds when this gateway sent its requests in flight to
	// replica i (route.Candidate.Sends; node's replica.sends).
	sends []route.SendLog
	// scrapeDue is when each engine is due a scrape at ScrapeInterval,
	// with shared scrapes (Options.sharedScrapes; nil without: every
	// scrape reads all); othersSeenAt is when a scrape last showed an
	// engine running more than this gateway's own, if othersSeen.
	scrapeDue    []time.Duration
	othersSeen   bool
	othersSeenAt time.Duration

	// selections[s][sel] counts decisions of strategy route.Names()[s]
	// with Selection sel (kvmesh_route_decisions_total).
	selections [][]float64

	keys []index.BlockKey
	core route.Scratch
}

var _ route.LoadView = (*gateway)(nil)

func newGateway(w *World, id int) (*gateway, error) {
	o := &w.opts
	charKeys := !o.events() || o.Tokenizer != tokenizer.NameTiktoken
	block := IndexBlockTokens(o.EngineBlockSize)
	if !o.events() {
		block = route.CharacterBlockTokens // node's character-mode default
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
		// Isolated gateways see each other only in the engines'
		// scrapes, as stale as the interval they scrape at (see
		// Cost.Pick, node's routeConfig).
		rcfg.PeerLoadDelaySeconds = o.LoadDelay.Seconds()
		if o.NoSync {
			rcfg.PeerLoadDelaySeconds = o.scrapeTick().Seconds()
		} else if o.LoadDelay == 0 {
			rcfg.PeerLoadDelaySeconds = -1
		}
	}
	set, err := route.NewSet(rcfg)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidOptions, err)
	}
	g := &gateway{
		w: w, id: id, ix: ix, hasher: ix.Hasher(), mode: index.ModeHistory,
		charKeys: charKeys, set: set, rngSeed: mix(o.Seed, "gateway-rng", fmt.Sprint(id)),
		inflight: make([]int, o.Replicas), queued: make([]int, o.Replicas),
		running: make([]int, o.Replicas), waiting: make([]int, o.Replicas), kvUsage: make([]float64, o.Replicas),
		scraped:   make([]uint64, o.Replicas),
		lastToken: make([]int64, o.Replicas), stepNanos: make([]int64, o.Replicas),
		scrapedInflight: make([]int, o.Replicas),
		unshownSent:     make([]int, o.Replicas), scrapedAt: make([]int64, o.Replicas),
		scrapedQueued: make([]int, o.Replicas),
		sends:         make([]route.SendLog, o.Replicas),
	}
	if o.events() {
		g.mode, _ = index.ParseMode(o.Mode)
	}
	if o.sharedScrapes() {
		g.scrapeDue = make([]time.Duration, o.Replicas)
	}
	g.root = g.hasher.Root(o.Model, "", "")
	members := make([]route.RingMember, 0, o.Replicas)
	for i, name := range w.names {
		ix.SetPublishesEvents(w.ids[i], o.events())
		ix.SetReplicaRoot(w.ids[i], g.root)
		members = append(members, route.RingMember{ID: w.ids[i], Name: name})
		g.running[i], g.waiting[i], g.kvUsage[i] = route.Unknown, route.Unknown, route.Unknown
		g.scrapedInflight[i] = route.Unknown
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
	if s, ok := w.opts.substitute[req.Target.Strategy]; ok {
		strat, err = s, nil
	}
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
	rr := route.NewRequest(g.keys, g.root, g.hasher.BlockTokens(), promptTokens, req.MaxTokens, req.Session)
	rr.Now = now
	if g.charKeys {
		rr.UnitsPerToken = g.set.Model().UnitsPerToken()
	}
	g.rngSeed += 0x9e3779b97f4a7c15
	rng := route.NewRand(g.rngSeed)
	out := g.core.Route(&route.Input{
		Keys: g.keys, Replicas: w.ids, Index: g.ix, Mode: g.mode, Load: g,
		Strategy: strat, Rand: &rng, Request: &rr,
	})
	g.count(strat.Name(), out.Decision.Selection)
	rep := out.Decision.Index
	f.gw, f.rep = g, rep
	f.uncached = out.Uncached
	f.obs = out.Observation
	// proxy: count the request in flight, send it, record on success.
	g.addInflight(rep, 1)
	f.sentAt = now
	g.sent(rep, now, f.uncached)
	g.queued[rep] += f.uncached
	g.shareQueued(rep)
	f.queued = true
	if err := w.reps[rep].add(w, f, toks); err != nil {
		w.failLater(f, 400, "http 400: "+err.Error())
		return
	}
	g.record(rep, out.Ledger, now)
}

// Candidate fills c with replica i's load as this gateway sees it: its
// own in-flight and queued prefill exactly, the peers' as last shared,
// the engine's at the last scrape.
func (g *gateway) Candidate(i int, c *route.Candidate) {
	w := g.w
	local := g.inflight[i]
	inflight, peerQueued := local, 0
	if w.shareLoad {
		inflight += w.seenSum[i] - w.seen[g.id][i]
		peerQueued = g.peerQueued(i)
	}
	c.Name = w.names[i]
	c.InFlight, c.LocalInFlight = inflight, local
	c.Running, c.Waiting, c.KVUsage = g.running[i], g.waiting[i], g.kvUsage[i]
	c.QueuedPrefillTokens = g.queued[i]
	c.PeerQueuedPrefillTokens = peerQueued
	c.ScrapedQueuedPrefillTokens = g.scrapedQueued[i]
	c.LastTokenAt, c.StepNanos = g.lastToken[i], g.stepNanos[i]
	// Peers share their load: the scrape is not compared with InFlight
	// (see route.Candidate.ScrapedInFlight).
	c.ScrapedInFlight = g.scrapedInflight[i]
	c.ScrapedInFlightKnown = !w.shareLoad && c.ScrapedInFlight >= 0
	c.UnshownSent = g.unshownSent[i]
	c.Sends = &g.sends[i]
}

// peerQueued is the peers' queued prefill to replica i as this gateway
// sees it (their reports, LoadDelay stale).
func (g *gateway) peerQueued(i int) int {
	return g.w.queuedSum[i] - g.w.queuedSeen[g.id][i]
}

// sent notes a request sent to replica rep at now (Unix ns) with
// uncached prompt units to compute there: no scrape shows it yet.
func (g *gateway) sent(rep int, now int64, uncached int) {
	g.unshownSent[rep]++
	g.sends[rep].Add(now, uncached)
}

// sawToken notes a token streamed from replica rep at now (Unix ns); a
// token after the stream's first comes one step after the one before it,
// so step is that step's length.
func (g *gateway) sawToken(rep int, now, step int64, first bool) {
	g.lastToken[rep] = now
	if !first {
		g.stepNanos[rep] = step
	}
}

// PublishesKVEvents reports whether replica i publishes KV events: every
// engine does when the gateways use them.
func (g *gateway) PublishesKVEvents(int) bool { return g.w.opts.events() }

// record writes the decision into this gateway's index and sends it to the
// peers, who apply it SyncDelay later with the original timestamp.
func (g *gateway) record(rep int, ledger index.Ledger, now int64) {
	if len(g.keys) == 0 {
		return
	}
	w := g.w
	id := w.ids[rep]
	_ = g.ix.Record(g.keys, id, ledger, now) // only ErrInvalidLedger, impossible here
	if !w.shareLoad {
		return
	}
	keys := slices.Clone(g.keys)
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
func (g *gateway) release(f *flight, ok bool, fin *sim.Finished) {
	if f.rep < 0 {
		return
	}
	g.addInflight(f.rep, -1)
	g.sends[f.rep].Remove(f.sentAt, f.uncached, f.hasFirst)
	g.releaseQueued(f)
	if !ok || !f.hasFirst {
		return
	}
	w := g.w
	// As node's observeCost: the output length is the number of content
	// tokens, one per content event.
	out := f.maxTokens
	obs := f.obs.Stream((f.first - f.start).Seconds(), out, out, (w.now - f.first).Seconds())
	if fin != nil { // the engine's usage, as node reads it from the stream
		obs = obs.Engine(fin.PromptTokens, fin.CachedTokens, true).Prompt(fin.PromptTokens)
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

// scrape reads the load of every engine that is due, as node's scraper
// does each interval: every ScrapeInterval, and with shared scrapes
// (Options.sharedScrapes) every SharedScrapeInterval while a scrape within
// the last sharedMemory such intervals showed an engine running requests
// beyond this gateway's own (node's scrapeAfter, sharesEngines).
func (g *gateway) scrape() {
	o, now := &g.w.opts, g.w.now
	shares := g.scrapeDue != nil && g.othersSeen && now-g.othersSeenAt < sharedMemory*o.SharedScrapeInterval
	for i, r := range g.w.reps {
		if g.scrapeDue != nil && now < g.scrapeDue[i] && !shares {
			continue
		}
		// An engine unchanged since the last scrape shows the same.
		if g.scraped[i] != r.ver || g.running[i] == route.Unknown {
			run, wait := g.running[i], g.waiting[i]
			g.running[i], g.waiting[i], g.kvUsage[i] = r.shown.Running, r.shown.Waiting, r.shown.KVUsage
			g.scraped[i] = r.ver
			// News, as node's scrape: no peers' reports, see Candidate.
			if run != g.running[i] || wait != g.waiting[i] || g.lastToken[i] > g.scrapedAt[i] || g.scrapedInflight[i] < 0 {
				g.scrapedInflight[i], g.unshownSent[i] = g.inflight[i], g.sends[i].Unshown(g.lastToken[i], g.stepNanos[i])
			}
		}
		g.scrapedAt[i] = g.w.nowNs()
		g.scrapedQueued[i] = g.queued[i]
		if g.w.shareLoad {
			g.scrapedQueued[i] += g.peerQueued(i)
		}
		if g.scrapeDue != nil {
			g.scrapeDue[i] = now + o.ScrapeInterval
			if g.running[i] >= 0 && g.waiting[i] >= 0 && g.running[i]+g.waiting[i] > g.inflight[i] {
				g.othersSeen, g.othersSeenAt = true, now
			}
		}
	}
}

// sharedMemory is node's: how many shared scrape intervals a gateway
// keeps scraping every engine that often after a scrape last showed
// other senders.
const sharedMemory = 100

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
