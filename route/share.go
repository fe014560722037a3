package route

import (
	"math"
	"sync"

	"github.com/kvmesh/kvmesh/index"
)

// A shareTable forgets with the time constant CostConfig.ShareTauSeconds
// (default DefaultShareTauSeconds): a request t seconds ago counts
// e^(−t/τ). Half a minute spans a few stream lifetimes at the seed's load
// (a 128-token answer holds its slot for 6–10 s), long enough that a
// prefix's share is not the luck of the last few arrivals and short enough
// that a prefix that turns hot counts as hot within a minute. In the
// discrete-event seed grid (five seeds, see Cost) 10, 30 and 60 s gave the
// same verdicts within one row. It is model time: where engines run S
// times faster than real time (the live study), τ must be divided by S,
// or the table remembers S times as many requests of earlier phases, the
// current prefixes' shares come out that much too small, and copies of a
// hot prefix are charged as if it were rare (issue 18: the live hot50
// round 2 kept its hot group on one full replica).

// shareSlots is the size of a shareTable: prefix keys tracked at once
// (two slots are probed per key, so a popular prefix survives a colliding
// newcomer). A request counts up to maxPrefixes keys, most of them deep
// and its own, which the table forgets first.
const (
	shareBits  = 12
	shareSlots = 1 << shareBits
)

// maxPrefixes bounds a Prefixes: depths 1, 2, 4, …, 2^15 blocks, the
// last full block and the best match's depth (Prefixes.AddMatch).
const maxPrefixes = 18

// Prefixes are a prompt's prefixes at depths of 1, 2, 4, … blocks and at
// its last full block, each identified by the block key there (keys are
// chained, so the key at depth d names the whole prompt up to d). Cost
// counts each prefix's share of the recent requests (see Cost, duplicate
// prefill): a request shares a prefix with every request whose key at
// that depth is the same.
//
// Powers of two keep the count per request logarithmic in its length,
// and they let the share of any part of a prompt be read at a depth no
// more than twice as deep: the share of the prefix a replica would start
// computing at block m+1 is read at the shallowest depth ≥ m+1 (see at).
// A fixed depth would not do: a system prompt or chat template that every
// request starts with makes the first blocks of every prompt the same
// prefix, of share 1, however the documents after it differ.
//
// Twice as deep can take in what no one shares: the routing core adds
// the depth the best candidate holds (AddMatch), so the share of what is
// cached is read where the cache ends.
type Prefixes struct {
	n     uint8
	depth [maxPrefixes]int32
	key   [maxPrefixes]uint64
}

// NewPrefixes returns the prefixes of a prompt keyed as keys.
func NewPrefixes(keys []index.BlockKey) Prefixes {
	var p Prefixes
	for d := 1; d <= len(keys) && int(p.n) < maxPrefixes-2; d *= 2 {
		p.depth[p.n], p.key[p.n] = int32(d), uint64(keys[d-1])
		p.n++
	}
	if n := len(keys); n > 0 && int(p.depth[p.n-1]) != n {
		p.depth[p.n], p.key[p.n] = int32(min(n, math.MaxInt32)), uint64(keys[n-1])
		p.n++
	}
	return p
}

// AddMatch adds the prefix at depth d (1..len(keys)), the longest match
// any candidate holds, unless the prompt has a prefix at that depth
// already or no room is left. A replica holding d blocks holds the
// prompt as far as d, and the duplicate charge weighs the blocks up to d
// by the share of the prompt that deep. Without this prefix the blocks
// after the last power of two read the share of a deeper one, which
// takes in what no replica holds (the question after a document, this
// request's alone): a document of 309 blocks that 90 % of the requests
// carry had its last 53 blocks charged as a copy of a rare prompt, and
// `kvmesh explain` showed its share as 4 % (discrete-event hot90, 64
// replicas). Counting the depth in the recent requests' table makes it
// the depth later requests find the document at.
//
// Measured in the discrete-event 64-replica table (seeds 1–3, cost's
// passes minus the best baseline's, of 3,072): warm with KV events, where
// cost trailed prefix-cache in every seed (−20 at one gateway, −13 at 8
// synced), comes to a mean of 0 in both; the synced and single-gateway
// cells otherwise move within their seeds' spread. Isolated gateways in
// history mode, whose indexes do not see each other's copies, copied more
// and lost (cold −429 → −541, hot50 +403 → +122, hot90 −20 → −35) until
// they scraped the engines they share faster (node's
// Config.SharedScrapeInterval: −291, +731, +10).
func (p *Prefixes) AddMatch(d int, keys []index.BlockKey) {
	if d <= 0 || d > len(keys) || int(p.n) >= maxPrefixes {
		return
	}
	i := p.at(d)
	switch {
	case i >= 0 && int(p.depth[i]) == d:
		return
	case i < 0:
		i = int(p.n)
	}
	copy(p.depth[i+1:p.n+1], p.depth[i:p.n])
	copy(p.key[i+1:p.n+1], p.key[i:p.n])
	p.depth[i], p.key[i] = int32(d), uint64(keys[d-1])
	p.n++
}

// at returns the position of the shallowest prefix at least d blocks
// deep, or −1 when the prompt is shorter than d blocks.
func (p *Prefixes) at(d int) int {
	for i := 0; i < int(p.n); i++ {
		if int(p.depth[i]) >= d {
			return i
		}
	}
	return -1
}

// shareProbes returns key's two slots: its low bits, and the high bits
// of a multiplicative hash (which differ for keys that share low bits).
func shareProbes(key uint64) (i, j uint64) {
	return key % shareSlots, (key * 0x9e3779b97f4a7c15) >> (64 - shareBits)
}

// shareTable estimates each prefix's share of the requests a gateway
// routed recently: counts per prefix key (Request.Prefixes) and a total
// of requests, each decayed with time constant tau, in a fixed table
// (no allocation after construction). A key probes two slots; a new key
// takes the one whose count has decayed further, so the table keeps the
// prefixes that are still arriving and forgets one-off prompts. Safe for
// concurrent use.
type shareTable struct {
	tau   float64 // the time constant, seconds (NewModel: CostConfig.ShareTauSeconds resolved)
	mu    sync.Mutex
	at    int64 // time of the last update of total, ns
	total float64
	slots [shareSlots]shareSlot
}

type shareSlot struct {
	key uint64
	at  int64 // ns; 0: empty
	val float64
}

// shares writes the share of each of p's prefixes among the recent
// requests at now (ns) to out, in [0, 1], counting one more request with
// prefixes p first when add. A prefix not in the table has share 0, as
// has every prefix of a table with no requests yet. A now before the
// last update counts as the same time.
func (s *shareTable) shares(p *Prefixes, now int64, add bool, out *[maxPrefixes]float64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.total = decay(s.total, s.at, now, s.tau)
	s.at = max(s.at, now)
	if add {
		s.total++
	}
	for i := 0; i < int(p.n); i++ {
		out[i] = s.count(p.key[i], now, add)
	}
}

// count returns key's share at now, after counting one more when add;
// the caller holds mu and has brought total to now.
func (s *shareTable) count(key uint64, now int64, add bool) float64 {
	i, j := shareProbes(key)
	slot := (*shareSlot)(nil)
	switch {
	case s.slots[i].at != 0 && s.slots[i].key == key:
		slot = &s.slots[i]
	case s.slots[j].at != 0 && s.slots[j].key == key:
		slot = &s.slots[j]
	case add:
		// Take the emptier of the two slots.
		slot = &s.slots[i]
		if decay(s.slots[j].val, s.slots[j].at, now, s.tau) < decay(slot.val, slot.at, now, s.tau) {
			slot = &s.slots[j]
		}
		*slot = shareSlot{key: key}
	}
	if slot == nil {
		return 0
	}
	slot.val = decay(slot.val, slot.at, now, s.tau)
	slot.at = max(slot.at, now, 1)
	if add {
		slot.val++
	}
	if !(s.total > 0) {
		return 0
	}
	return min(slot.val/s.total, 1)
}

// duplication prices, for one Pick, the prefill a candidate would compute
// beyond the least any candidate computes: the part of the prompt another
// replica already holds (see Cost, duplicate prefill).
type duplication struct {
	// prefixes are the request's (Request.Prefixes).
	prefixes *Prefixes
	// weight[i] is (1 − s·K)⁺ for prefix i of share s over K candidates:
	// 1 for a prefix no recent request shared, 0 for one whose traffic
	// alone needs more than one replica. It weighs the blocks after the
	// previous prefix's depth up to prefix i's.
	weight [maxPrefixes]float64
	// cum[i] is the weighted number of blocks up to prefix i's depth.
	cum [maxPrefixes]float64
	// charged: some weight is above 0.
	charged bool
	// best is the longest match any candidate holds (blocks; Pick's
	// selection label reads it too).
	best int
	// least is the fewest prompt tokens any candidate computes (engine
	// tokens).
	least float64
	// share is the share of the prefix as far as the best match
	// (Explanation.PrefixShare); 0 when no candidate holds any of it.
	share float64
	// targetMiss is what a candidate estimated past the TTFT target is
	// charged in this Pick (0: no charge; see Cost).
	targetMiss float64
	// alone: this gateway sees every request on the candidates
	// (othersSeen is false), so its sends time a full running set's
	// slot wait (see Cost).
	alone bool
	// scrapeShare is the other senders' share of the traffic relative to
	// this gateway's where it sees them only in the engines' scrapes (see
	// scrapeShare), 0 otherwise: the multiplier of unshownOthers.
	scrapeShare float64
	// isolatedHot: other senders show only in the scrapes (scrapeShare
	// above 0, not alone) and the prefix is hot (see hot), so what their
	// copies of it compute shows only in the KV events (see inProgress).
	isolatedHot bool
}

// inProgress is the part of req's prompt that cand is likely computing
// for another sender, in the keys' units, where d.isolatedHot: cand's KV
// events show it holding the start of the prompt, less of it than another
// candidate holds (d.best), less the prefill this gateway queued there.
// KV events report a prefill chunk by chunk, so a replica that another
// gateway sent the prompt to shows its match growing while that prefill
// runs, and a scrape may not show the request yet: with a head start of
// a chunk or two such a replica ranked cheapest (see Cost.Pick), for
// every gateway that reads the same events. 0 for a nil d.
func (d *duplication) inProgress(req *Request, cand *Candidate) int {
	if d == nil || !d.isolatedHot || !cand.EventsFed {
		return 0
	}
	if matchedBlocks(req, cand) <= 0 {
		return 0
	}
	rest := req.UncachedTokens(cand.Matched) - req.UncachedTokens(d.best)
	return max(rest-max(cand.QueuedPrefillTokens, 0), 0)
}

// hot reports whether the prefix as far as the best match is hot over
// candidates replicas: its share of the traffic is more than
// hotPrefixReplicas replicas' fair share, so its own traffic needs copies.
func (d *duplication) hot(candidates int) bool {
	return d.share*float64(candidates) > hotPrefixReplicas
}

// duplication fills d with the duplicate-prefill pricing of req over
// cands, counting req in the prefix shares when add.
func (c *Cost) duplication(req *Request, cands []Candidate, add bool, d *duplication) {
	var shares [maxPrefixes]float64
	c.model.shares.shares(&req.Prefixes, req.Now, add, &shares)
	for i := range cands {
		d.best = max(d.best, matchedBlocks(req, &cands[i]))
	}
	d.weigh(&req.Prefixes, &shares, len(cands))
	if j := req.Prefixes.at(d.best); d.best > 0 && j >= 0 {
		d.share = shares[j]
	}
	if !d.charged {
		return
	}
	d.least = math.Inf(1)
	for i := range cands {
		d.least = min(d.least, req.tokens(c.computedUnits(req, &cands[i])))
	}
}

// weigh sets d's weights from the shares of p's prefixes over k
// candidates.
func (d *duplication) weigh(p *Prefixes, shares *[maxPrefixes]float64, k int) {
	d.prefixes = p
	prev, cum := 0, 0.0
	for i := 0; i < int(p.n); i++ {
		w := max(0, 1-shares[i]*float64(k))
		d.weight[i] = w
		d.charged = d.charged || w > 0
		cum += w * float64(int(p.depth[i])-prev)
		d.cum[i], prev = cum, int(p.depth[i])
	}
}

// weighted returns the weighted number of blocks 1..x (x within the
// prompt).
func (d *duplication) weighted(x int) float64 {
	i := d.prefixes.at(x)
	if x <= 0 || i < 0 {
		return 0
	}
	prevDepth, prevCum := 0, 0.0
	if i > 0 {
		prevDepth, prevCum = int(d.prefixes.depth[i-1]), d.cum[i-1]
	}
	return prevCum + d.weight[i]*float64(x-prevDepth)
}

// matchedBlocks is cand's match for req in [0, TotalBlocks].
func matchedBlocks(req *Request, cand *Candidate) int {
	return max(0, min(cand.Matched, req.TotalBlocks))
}

// penalty is the duplicate-prefill term of a candidate that matched
// blocks and would compute computed engine tokens at p seconds a token,
// stalling running decoding sequences: the tokens beyond the least any
// candidate computes, weighed by the mean weight of the blocks it would
// duplicate (after its match, up to the longest any candidate holds).
// A nil d charges nothing.
func (d *duplication) penalty(matched int, computed, p float64, running int) float64 {
	if d == nil || !d.charged || running <= 0 {
		return 0
	}
	extra := computed - d.least
	if !(extra > 0) {
		return 0
	}
	var w float64
	if d.best > matched {
		w = (d.weighted(d.best) - d.weighted(matched)) / float64(d.best-matched)
	} else if j := d.prefixes.at(matched + 1); j >= 0 {
		// As long a match as the best, but more to compute (the best
		// loads part of it from an offload tier): the next block's weight.
		w = d.weight[j]
	}
	return w * float64(running) * extra * p
}
