package node

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Engine metric names the load view scrapes.
const (
	metricRunning = "vllm:num_requests_running"
	metricWaiting = "vllm:num_requests_waiting"
	metricKVUsage = "vllm:kv_cache_usage_perc"
	// metricGPUUsage is the name vLLM used for KV usage before v0.10.
	metricGPUUsage = "vllm:gpu_cache_usage_perc"
)

// probeLoop owns one replica's active health checks and load scrapes until
// ctx ends (the Node stops or the replica leaves the routing table). The
// two run on their own timers in this one goroutine, so a replica never
// has two probes in flight.
func (n *Node) probeLoop(ctx context.Context, r *replica) {
	var scrapeC, healthC <-chan time.Time
	var scrapeT *time.Timer
	var wakeC <-chan struct{}
	if n.cfg.ScrapeInterval > 0 {
		if n.cfg.sharedScrape() > 0 {
			wakeC = n.sharedWake()
		}
		n.scrape(ctx, r)
		scrapeT = time.NewTimer(n.scrapeAfter(r))
		defer scrapeT.Stop()
		scrapeC = scrapeT.C
	}
	var healthT *time.Timer
	if n.cfg.HealthInterval > 0 {
		n.checkHealth(ctx, r)
		healthT = time.NewTimer(n.healthPollAfter(r))
		defer healthT.Stop()
		healthC = healthT.C
	}
	// The tokenizer agreement probe (agreement.go) runs when the replica
	// is available and has no verdict since it last became available: at
	// start, after an outage or ejection, and for a replica a config change
	// added.
	agreed := false
	agreement := func() {
		if !r.available(nowNanos()) {
			agreed = false
		} else if !agreed {
			agreed = n.checkAgreement(ctx, r)
		}
	}
	agreement()
	for {
		select {
		case <-ctx.Done():
			return
		case <-scrapeC:
			n.scrape(ctx, r)
			scrapeT.Reset(n.scrapeAfter(r))
		case <-wakeC:
			// The gateway started sharing its engines: the next scrape
			// is a shared interval away, not the rest of a long one.
			wakeC = n.sharedWake()
			scrapeT.Reset(n.scrapeAfter(r))
		case <-healthC:
			n.checkHealth(ctx, r)
			healthT.Reset(n.healthPollAfter(r))
		}
		if r.available(nowNanos()) {
			r.mHealthy.Set(1)
		} else {
			r.mHealthy.Set(0)
		}
		agreement()
	}
}

// scrapeAfter is how long after its last scrape the replica is scraped
// again: Config.SharedScrapeInterval while this gateway shares its
// engines with senders it cannot see (sharesEngines), ScrapeInterval
// otherwise. It sets the replica's kvmesh_proxy_scrape_interval_seconds
// and kvmesh_proxy_engines_shared. Only the replica's probe loop calls it.
func (n *Node) scrapeAfter(r *replica) time.Duration {
	d := n.cfg.ScrapeInterval
	shared := 0.0
	if s := n.cfg.sharedScrape(); s > 0 && n.sharesEngines(nowNanos()) {
		d, shared = s, 1
	}
	r.mScrape.Set(d.Seconds())
	n.m.enginesShared.Set(shared)
	return d
}

// sharedMemory is how many shared scrape intervals a gateway keeps
// scraping every replica at that interval after a scrape last showed
// other senders (10 s at the default): an engine the others have not
// sent to lately is one they may send to next, and a scrape that shows
// it idle for half a second draws every gateway to it at once.
const sharedMemory = 100

// sharedWake is the channel closed when the gateway next starts sharing
// its engines (wakeShared).
func (n *Node) sharedWake() <-chan struct{} {
	for {
		if p := n.shareWake.Load(); p != nil {
			return *p
		}
		ch := make(chan struct{})
		n.shareWake.CompareAndSwap(nil, &ch)
	}
}

// wakeShared wakes every probe loop waiting on sharedWake.
func (n *Node) wakeShared() {
	ch := make(chan struct{})
	if old := n.shareWake.Swap(&ch); old != nil {
		close(*old)
	}
}

// sharesEngines reports whether, at now (Unix ns), this gateway shares
// its engines with senders it cannot see: no peer reports its load, and
// a scrape within the last sharedMemory shared intervals showed some
// engine running or queueing more requests than this gateway had open
// there (othersRecent).
func (n *Node) sharesEngines(now int64) bool {
	return n.peerLoad() == nil && n.othersRecent(n.othersSeenAt.Load(), now)
}

// othersRecent reports whether a scrape at at (Unix ns; 0: none) that
// showed other senders lies within sharedMemory shared intervals of now,
// with shared scrapes on (Config.sharedScrape).
func (n *Node) othersRecent(at, now int64) bool {
	s := n.cfg.sharedScrape()
	return at != 0 && s > 0 && now-at < sharedMemory*int64(s)
}

// healthPollAfter is how long after its last /health poll the replica is
// polled again: UnhealthyInterval while that poll failed (a restarted
// engine returns to rotation soon, an outage is confirmed soon),
// HealthInterval otherwise. Only the replica's probe loop calls it.
func (n *Node) healthPollAfter(r *replica) time.Duration {
	if r.healthFails > 0 {
		return n.downPollInterval()
	}
	return n.cfg.HealthInterval
}

// downPollInterval is how often a replica that failed its last /health
// poll is polled.
func (n *Node) downPollInterval() time.Duration {
	if n.cfg.UnhealthyInterval > 0 {
		return n.cfg.UnhealthyInterval
	}
	return n.cfg.HealthInterval
}

// checkHealth polls /health; any 2xx within HealthTimeout is up. ctx is
// the probe loop's: once it ends (the gateway stops, or the replica left
// the routing table) a failed poll is ours, not the replica's, and counts
// nothing. Counted, it would bring back a dropped replica's series right
// after forgetSeries deleted them (ci1134).
func (n *Node) checkHealth(ctx context.Context, r *replica) {
	hctx, cancel := context.WithTimeout(ctx, n.cfg.HealthTimeout)
	defer cancel()
	up := false
	req, err := http.NewRequestWithContext(hctx, http.MethodGet, r.endpoint("/health"), nil)
	if err == nil {
		var resp *http.Response
		if resp, err = n.client.Do(req); err == nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
			resp.Body.Close()
			up = resp.StatusCode >= 200 && resp.StatusCode < 300
			if !up {
				err = fmt.Errorf("status %d", resp.StatusCode)
			}
		}
	}
	if ctx.Err() != nil {
		return // stopping: the failure is ours, not the replica's
	}
	if !up {
		n.m.upstreamErrors.WithLabelValues(r.name, reasonHealthCheck).Inc()
	}
	if r.setActive(up, n.cfg.UnhealthyAfter) {
		if up {
			n.log.Info("replica healthy again", "replica", r.name)
		} else {
			n.log.Warn("replica failed its health check", "replica", r.name, "err", err)
		}
	}
}

// scrape reads the engine's load figures from /metrics. A scrape the
// probe loop's ctx ended counts nothing (see checkHealth).
func (n *Node) scrape(ctx context.Context, r *replica) {
	sctx, cancel := context.WithTimeout(ctx, n.cfg.ScrapeTimeout)
	defer cancel()
	l, err := n.fetchLoad(sctx, r)
	if err != nil {
		if ctx.Err() == nil {
			n.m.upstreamErrors.WithLabelValues(r.name, reasonScrape).Inc()
			if r.scrapeOK.Swap(false) {
				n.log.Debug("replica metrics scrape failed", "replica", r.name, "err", err)
			}
			// Stale figures would mislead the strategies: forget them.
			r.running.Store(-1)
			r.waiting.Store(-1)
			r.kvUsage.Store(math.Float64bits(math.NaN()))
		}
		return
	}
	r.scrapeOK.Store(true)
	// The engine's figures are as of its last step (vLLM's gauges come
	// from the scheduler's stats after each step): they bring news when
	// they changed or a token came since the last scrape (a step ended).
	// Until then, requests sent count as unshown, and so do those the
	// news may not show (route.SendLog.Unshown).
	own, now := r.inflight.Load(), nowNanos()
	if l.running != r.running.Load() || l.waiting != r.waiting.Load() ||
		r.lastToken.Load() > r.scrapedAt.Load() || r.scrapedInFlight.Load() < 0 {
		r.scrapedInFlight.Store(own)
		r.unshownSent.Store(int64(r.sends.Unshown(r.lastToken.Load(), r.stepNanos.Load())))
	}
	r.scrapedAt.Store(now)
	r.scrapedQueued.Store(max(r.queuedPrefill.Load(), 0) + int64(n.peerQueuedPrefill(r.name)))
	r.running.Store(l.running)
	r.waiting.Store(l.waiting)
	r.kvUsage.Store(math.Float64bits(l.kvUsage))
	// Requests beyond this gateway's own, where no peer reports its load,
	// are senders it sees only here (route.Candidate.ScrapedInFlight).
	if n.peerLoad() == nil && l.running >= 0 && l.waiting >= 0 && l.running+l.waiting > own {
		if prev := n.othersSeenAt.Swap(now); n.cfg.sharedScrape() > 0 && !n.othersRecent(prev, now) {
			n.log.Info("engines run requests of senders outside this gateway, and no peer reports its load: scraping every replica at shared_scrape_interval (gateways that share engines route best as one cluster)",
				"replica", r.name, "engine_requests", l.running+l.waiting, "own", own, "interval", n.cfg.SharedScrapeInterval)
			n.wakeShared()
		}
	}
}

func (n *Node) fetchLoad(ctx context.Context, r *replica) (engineLoad, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, r.endpoint("/metrics"), nil)
	if err != nil {
		return engineLoad{}, err
	}
	resp, err := n.client.Do(req)
	if err != nil {
		return engineLoad{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return engineLoad{}, fmt.Errorf("status %d", resp.StatusCode)
	}
	if r.dpRank == "" {
		return parseEngineLoad(io.LimitReader(resp.Body, 16<<20))
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return engineLoad{}, err
	}
	return parseRankLoad(data, r.dpRank)
}

// parseRankLoad is parseEngineLoad for one data-parallel rank: the series
// labelled engine="rank" (vLLM labels its metrics per engine core), or
// every series when the engine labels none so (then each rank sees the
// whole engine's load).
func parseRankLoad(data []byte, rank string) (engineLoad, error) {
	l, err := parseEngineLoadFiltered(bytes.NewReader(data), `engine="`+rank+`"`)
	if err == nil {
		return l, nil
	}
	return parseEngineLoad(bytes.NewReader(data))
}

// engineLoad is what one scrape yields. Counts are -1 and kvUsage NaN when
// the engine did not export them.
type engineLoad struct {
	running, waiting int64
	kvUsage          float64
}

// parseEngineLoad reads the Prometheus text exposition format and sums
// running and waiting over all series (several engines or data-parallel
// ranks behind one URL), taking the highest KV usage. It understands label
// values with escaped quotes, braces and spaces, optional timestamps and
// the special values NaN and ±Inf (which it ignores).
func parseEngineLoad(rd io.Reader) (engineLoad, error) { return parseEngineLoadFiltered(rd, "") }

// parseEngineLoadFiltered is parseEngineLoad over the samples whose label
// set holds label (`name="value"`; "" keeps every sample).
func parseEngineLoadFiltered(rd io.Reader, label string) (engineLoad, error) {
	l := engineLoad{running: -1, waiting: -1, kvUsage: math.NaN()}
	var running, waiting, kv float64
	var haveR, haveW, haveKV, haveGPU bool
	gpu := math.NaN()
	sc := bufio.NewScanner(rd)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if len(line) == 0 || line[0] == '#' || !strings.HasPrefix(line, "vllm:") {
			continue
		}
		if label != "" && !hasLabel(line, label) {
			continue
		}
		name, v, ok := parseSample(line)
		if !ok || math.IsNaN(v) || math.IsInf(v, 0) {
			continue
		}
		switch name {
		case metricRunning:
			running += v
			haveR = true
		case metricWaiting:
			waiting += v
			haveW = true
		case metricKVUsage:
			if !haveKV || v > kv {
				kv = v
			}
			haveKV = true
		case metricGPUUsage:
			if !haveGPU || v > gpu {
				gpu = v
			}
			haveGPU = true
		}
	}
	if err := sc.Err(); err != nil {
		return l, err
	}
	if haveR {
		l.running = int64(math.Round(running))
	}
	if haveW {
		l.waiting = int64(math.Round(waiting))
	}
	switch {
	case haveKV:
		l.kvUsage = kv
	case haveGPU:
		l.kvUsage = gpu
	}
	if !haveR && !haveW && !haveKV && !haveGPU {
		return l, fmt.Errorf("%w: no vllm load metrics in the exposition", ErrUpstream)
	}
	return l, nil
}

// parseSample splits one sample line into its metric name and value.
func parseSample(line string) (string, float64, bool) {
	i := strings.IndexAny(line, "{ \t")
	if i <= 0 {
		return "", 0, false
	}
	name := line[:i]
	rest := line[i:]
	if rest[0] == '{' {
		// Skip the label set, honouring quoted values with escapes.
		inQuote, esc := false, false
		end := -1
		for j := 1; j < len(rest); j++ {
			c := rest[j]
			switch {
			case esc:
				esc = false
			case inQuote && c == '\\':
				esc = true
			case c == '"':
				inQuote = !inQuote
			case !inQuote && c == '}':
				end = j
			}
			if end >= 0 {
				break
			}
		}
		if end < 0 {
			return "", 0, false
		}
		rest = rest[end+1:]
	}
	fields := strings.Fields(rest)
	if len(fields) == 0 {
		return "", 0, false
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return "", 0, false
	}
	return name, v, true
}

// hasLabel reports whether sample line's label set holds label
// (`name="value"`, as the exposition format writes it).
func hasLabel(line, label string) bool {
	i := strings.IndexByte(line, '{')
	if i < 0 {
		return false
	}
	set := line[i:]
	return strings.Contains(set, "{"+label) || strings.Contains(set, ","+label)
}
