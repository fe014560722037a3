package node

import (
	"math"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
	"github.com/kvmesh/kvmesh/route"
)

// PeerLoad reports the in-flight counts other gateways last published for
// a replica, so that load-aware strategies see cluster-wide load. The
// replication work implements it; a Node without one sees only its own
// requests. InFlight is called on the routing hot path, concurrently, and
// must not block or allocate.
type PeerLoad interface {
	// InFlight is the sum of the peers' in-flight requests to the replica
	// named replica (0 when unknown).
	InFlight(replica string) int
}

// PeerQueuedPrefill is implemented by a PeerLoad whose peers also report
// their queued prefill: the uncached prompt tokens each has sent to a
// replica and not yet seen a first token for. The cost strategy adds it to
// this gateway's own (route.Candidate.PeerQueuedPrefillTokens), so that a
// recompute is not sent where a peer's prefill is already running. A
// PeerLoad without it leaves the figure 0 (unknown). QueuedPrefill is
// called on the routing hot path, concurrently, and must not block or
// allocate.
type PeerQueuedPrefill interface {
	// QueuedPrefill is the sum of the peers' queued prefill tokens to the
	// replica named replica (0 when unknown).
	QueuedPrefill(replica string) int
}

// RecordListener hears every routing decision the Node writes into its
// index, so that replication can publish it to peers (DESIGN §2, flow 1).
// Recorded is called on the request path right after the index write,
// concurrently from many requests; it must not block, and must copy keys if
// it keeps them.
type RecordListener interface {
	Recorded(model, replica string, ledger index.Ledger, keys []index.BlockKey, now int64)
}

// replica is one engine as the node tracks it. Counters are atomics so that
// the routing hot path reads them without a lock.
type replica struct {
	id        index.ReplicaID
	name      string
	cfg       ReplicaConfig
	model     string // the pool's model; a replica moved to another pool is a new *replica
	base      *url.URL
	targetPod string // host:port, AIBrix's target-pod header value
	// dpRank is the HeaderDataParallelRank value of a data-parallel rank
	// replica (expandRanks), "" otherwise.
	dpRank string
	// dialAddr (host:port) and pathPrefix (the URL's path without a
	// trailing slash) address a plain-http replica for the proxy's own
	// client (upstream.go); dialAddr is "" when the Transport serves it.
	dialAddr   string
	pathPrefix string

	inflight      atomic.Int64 // requests this gateway has open to the replica
	queuedPrefill atomic.Int64 // uncached prompt tokens sent, first byte not yet seen
	// When this gateway's streams last received a token from the replica
	// (unix nanos) and the gap before it in the same stream: the engine's
	// step period (route.Candidate.LastTokenAt, StepNanos; see sawToken).
	lastToken, stepNanos atomic.Int64
	// inflight as it was when a successful scrape last brought news of
	// the engine (-1 before the first): what the engine shows beyond it
	// is other senders' load; unshownSent counts the requests in flight
	// that a scrape may not show yet; scrapedAt is when the last
	// successful scrape came (unix nanos). See
	// route.Candidate.ScrapedInFlight, UnshownSent.
	scrapedInFlight atomic.Int64
	unshownSent     atomic.Int64
	scrapedAt       atomic.Int64
	// scrapedQueued is the queued prefill (this gateway's and the peers'
	// reported) when the last successful scrape was read
	// (route.Candidate.ScrapedQueuedPrefillTokens).
	scrapedQueued atomic.Int64
	// sends holds when (unix nanos) this gateway sent its requests in
	// flight there (route.Candidate.Sends; see sent, ended).
	sends route.SendLog

	// Engine-scraped load; -1 until the first successful scrape.
	running  atomic.Int64
	waiting  atomic.Int64
	kvUsage  atomic.Uint64 // math.Float64bits; NaN bits when unknown
	scrapeOK atomic.Bool

	// Health. ejectedUntil and activeDown are read lock-free by routing;
	// mu serialises the bookkeeping that decides them.
	ejectedUntil atomic.Int64 // unix nanos; 0 = not ejected
	activeDown   atomic.Bool  // UnhealthyAfter /health polls in a row failed
	healthFails  int          // consecutive failed polls; the probe goroutine's own
	mu           sync.Mutex
	consecFails  int
	ejections    int // consecutive ejections without a success in between

	// KV events: the replica's subscriber (nil without a kv source) and
	// the scratch its handler normalizes batches into and reports through
	// (only that subscriber's goroutine touches them).
	sub      *kvevents.Subscriber
	kvBatch  []index.KVEvent
	kvReport index.KVReport

	// check is the self-check of the index's predictions against the
	// engine's reported cached tokens (selfcheck.go); it survives reloads
	// with the replica.
	check predictionCheck

	// cancel stops the probe loop (set by startReplica; the routing-table
	// rebuild, serialised by Node.reloadMu, and Shutdown call it).
	cancel func()

	// Pre-resolved metric children (label lookups cost a hash each).
	mInflight prometheus.Gauge
	mTTFT     prometheus.Observer
	mTTFTEst  prometheus.Observer // kvmesh_route_ttft_estimate_ratio
	mHealthy  prometheus.Gauge
	mScrape   prometheus.Gauge   // kvmesh_proxy_scrape_interval_seconds
	mPicked   prometheus.Counter // kvmesh_route_replica_decisions_total
	mPast     prometheus.Counter // kvmesh_route_estimated_past_target_total
}

// pool is the replicas serving one model.
type pool struct {
	model    string
	strategy string // "" = node default
	mode     index.Mode
	set      *route.Set
	replicas []*replica
	// sharedStore: ModelConfig.SharedResponseStore.
	sharedStore bool
	// tok is the model's own tokenizer (ModelConfig.Tokenizer), resolved
	// when the table was built; nil: the Node's global one.
	tok *keyTokenizer
	// failingOpen is set while the model's decisions route among replicas
	// failing their health checks (Config.HealthFailOpen), so that entering
	// and leaving that state is logged once. A pointer: the pool's copies
	// (EPP subsets) and its successors across config reloads share it.
	failingOpen *atomic.Bool
}

// failingHealth is the number of p's replicas that are out of rotation at
// now only because their /health polls fail.
func (p *pool) failingHealth(now int64) int {
	k := 0
	for _, r := range p.replicas {
		if r.failingHealthOnly(now) {
			k++
		}
	}
	return k
}

// routable reports how p routes at now: ok when some replica is available;
// failOpen when none is but Config.HealthFailOpen lets routing use those
// failing only their /health polls; neither when requests get 503.
func (p *pool) routable(now int64, healthFailOpen bool) (ok, failOpen bool) {
	for _, r := range p.replicas {
		if r.available(now) {
			return true, false
		}
	}
	return false, healthFailOpen && p.failingHealth(now) > 0
}

func newReplica(id index.ReplicaID, cfg ReplicaConfig, model string) (*replica, error) {
	u, err := url.Parse(cfg.URL)
	if err != nil {
		return nil, err
	}
	r := &replica{id: id, name: cfg.Name, cfg: cfg, model: model, base: u, targetPod: u.Host}
	if u.Scheme == "http" && u.User == nil && u.RawQuery == "" && u.Fragment == "" && u.Hostname() != "" {
		port := u.Port()
		if port == "" {
			port = "80"
		}
		r.dialAddr = net.JoinHostPort(u.Hostname(), port)
		r.pathPrefix = strings.TrimRight(u.EscapedPath(), "/")
	}
	if cfg.DataParallelSize > 1 {
		r.dpRank = strconv.Itoa(cfg.DataParallelRank)
	}
	r.running.Store(-1)
	r.scrapedInFlight.Store(-1)
	r.waiting.Store(-1)
	r.kvUsage.Store(math.Float64bits(math.NaN()))
	return r, nil
}

// endpoint returns the replica's URL for path (which starts with "/").
func (r *replica) endpoint(path string) string {
	b := r.cfg.URL
	for len(b) > 0 && b[len(b)-1] == '/' {
		b = b[:len(b)-1]
	}
	return b + path
}

// available reports whether the replica may get traffic at now.
func (r *replica) available(now int64) bool {
	return !r.activeDown.Load() && now >= r.ejectedUntil.Load()
}

// failingHealthOnly reports whether the replica is out of rotation at now
// only because its /health polls fail: it is not ejected for failing
// requests. Config.HealthFailOpen routes to such replicas when a model has
// no available one.
func (r *replica) failingHealthOnly(now int64) bool {
	return r.activeDown.Load() && now >= r.ejectedUntil.Load()
}

// availableAt is when an unavailable replica may get traffic again: the end
// of its ejection, or now+probe for an actively-down one (the next poll).
func (r *replica) availableAt(now int64, probe time.Duration) int64 {
	t := r.ejectedUntil.Load()
	if r.activeDown.Load() {
		t = max(t, now+int64(probe))
	}
	return t
}

// onSuccess records a request that the replica served.
func (r *replica) onSuccess() {
	r.mu.Lock()
	r.consecFails = 0
	r.ejections = 0
	r.mu.Unlock()
}

// onFailure records a failed request and ejects the replica after
// ejectAfter consecutive failures, for backoff·2^(ejections) capped at
// maxBackoff. It reports whether this failure ejected the replica.
func (r *replica) onFailure(now int64, ejectAfter int, backoff, maxBackoff time.Duration) (bool, time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.consecFails++
	if r.consecFails < ejectAfter {
		return false, 0
	}
	d := backoff
	for i := 0; i < r.ejections && d < maxBackoff; i++ {
		d *= 2
	}
	d = min(d, maxBackoff)
	r.ejections++
	r.consecFails = 0
	r.ejectedUntil.Store(now + int64(d))
	return true, d
}

// setActive records the outcome of an active /health poll: threshold
// consecutive failures mark the replica down, one success marks it up. It
// reports whether the state changed. It does not end a passive ejection:
// a replica may answer /health while failing requests. Only the replica's
// probe goroutine calls it.
func (r *replica) setActive(up bool, threshold int) (changed bool) {
	if up {
		r.healthFails = 0
		return r.activeDown.Swap(false)
	}
	r.healthFails++
	if r.healthFails < threshold {
		return false
	}
	return !r.activeDown.Swap(true)
}

// load returns the engine-scraped figures, -1 (route.Unknown) when unknown.
func (r *replica) load() (running, waiting int, kv float64) {
	kv = math.Float64frombits(r.kvUsage.Load())
	if math.IsNaN(kv) {
		kv = -1
	}
	return int(r.running.Load()), int(r.waiting.Load()), kv
}

// sent notes a request sent to the replica at now (unix nanos) with
// uncached prompt units to compute there (the decision's Uncached): no
// scrape shows it yet. Its stream's end calls ended(now, uncached,
// prefilled).
func (r *replica) sent(now int64, uncached int) {
	r.unshownSent.Add(1)
	r.sends.Add(now, uncached)
}

// ended notes the end of the stream of the request sent at sentAt with
// uncached units: it holds no slot there any more. prefilled says the
// replica computed its prompt (route.SendLog.Remove).
func (r *replica) ended(sentAt int64, uncached int, prefilled bool) {
	r.sends.Remove(sentAt, uncached, prefilled)
}

// sawToken notes a token relayed from the replica at now (unix nanos)
// whose stream's previous token came at prev (0 for its first). Engines
// emit a step's tokens together, so a gap within one stream is a step
// and the last token marks a step's end: the cost model reads when the
// step in progress ends from the two (route.Candidate.StepNanos).
func (r *replica) sawToken(now, prev int64) {
	r.lastToken.Store(now)
	if prev > 0 && now > prev {
		r.stepNanos.Store(now - prev)
	}
}
