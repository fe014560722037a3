package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvmesh/kvmesh/internal/gosched"
	"github.com/kvmesh/kvmesh/node"
	"github.com/kvmesh/kvmesh/sync/config"
)

// errDoctorFailed is returned when any check failed (exit status 1).
var errDoctorFailed = errors.New("doctor: checks failed")

func newDoctorCmd() *cobra.Command {
	o := doctorOptions{}
	cmd := &cobra.Command{
		Use:   "doctor",
		Short: "Check a running deployment: gateways, tokenizers, KV-event streams, predictions, config",
		Long: `Check a running kvmesh deployment and print a verdict per gateway and replica.

For every gateway (--addr, repeatable): reachable and ready, the routing
config's digest equal on all of them, and in a cluster, fresh load reports
from every live peer (without them it routes as if their in-flight requests
were not there). For every replica: the gateway's
tokenizer agrees with the engine's /tokenize; its KV-event stream carries its
own blocks and no other replica's stream does (a unique probe prompt is pinned
to the replica through the first gateway and must come back confirmed on that
replica only); sent again, the probe finds as many tokens cached on the
engine as the gateway predicts; its event sequence is healthy (no malformed
or dropped batches); the index's predictions agree with the engine's
reported cached_tokens. For every gateway again at the end: how long its
goroutines waited for a thread during the checks (a warning when more than 1 %
waited over 10 ms: it is short of CPU). Exits non-zero when any check fails.

The debug views and the pin header need the admin token: --token, else
$KVMESH_ADMIN_TOKEN, else --token-file.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			tok, err := config.LoadToken(o.token, o.tokenFile)
			if err != nil {
				return err
			}
			o.token = tok
			return doctor(cmd.Context(), cmd.OutOrStdout(), o)
		},
	}
	fl := cmd.Flags()
	fl.StringArrayVar(&o.addrs, "addr", []string{"127.0.0.1:8080"}, "gateway address (host:port or URL; repeatable)")
	fl.StringVar(&o.token, "token", "", "admin token (prefer $KVMESH_ADMIN_TOKEN or --token-file)")
	fl.StringVar(&o.tokenFile, "token-file", "", "file holding the admin token")
	fl.DurationVar(&o.probeTimeout, "probe-timeout", 10*time.Second, "how long a probe prompt may take to come back confirmed")
	fl.BoolVar(&o.skipStreams, "skip-stream-probe", false, "do not send probe prompts (no KV-stream identity check)")
	fl.DurationVar(&o.healthGrace, "health-grace", defaultHealthGrace, "how long an unavailable replica may take to come back (a gateway polls one every unhealthy_interval) before it fails")
	return cmd
}

// doctorOptions are the doctor's inputs.
type doctorOptions struct {
	addrs        []string
	token        string
	tokenFile    string
	probeTimeout time.Duration
	skipStreams  bool
	// healthGrace is how long checkReplica waits for an unavailable
	// replica to come back before failing it (0: defaultHealthGrace).
	healthGrace time.Duration
}

// defaultHealthGrace is doctorOptions.healthGrace's default: four of a
// gateway's default polls of a failing replica (unhealthy_interval,
// 250 ms). An engine started with the gateway may answer /health just
// after the gateway's last poll found it down; the doctor run at once
// then saw it unavailable until the next poll (README's "Run a gateway",
// on a busy machine).
const defaultHealthGrace = time.Second

// verdicts collects and prints check results.
type verdicts struct {
	out   io.Writer
	fails int
	warns int
}

func (v *verdicts) pass(subject, format string, args ...any) {
	fmt.Fprintf(v.out, "PASS  %-22s %s\n", subject, fmt.Sprintf(format, args...))
}

func (v *verdicts) warn(subject, format string, args ...any) {
	v.warns++
	fmt.Fprintf(v.out, "WARN  %-22s %s\n", subject, fmt.Sprintf(format, args...))
}

func (v *verdicts) fail(subject, format string, args ...any) {
	v.fails++
	fmt.Fprintf(v.out, "FAIL  %-22s %s\n", subject, fmt.Sprintf(format, args...))
}

// gatewayView is what the doctor learned from one gateway.
type gatewayView struct {
	addr     string
	base     string
	ready    *node.ReadyReport
	replicas *node.ReplicasReport
	kv       map[string]map[string]float64 // metric (without prefix) → replica → value
	sched    gosched.Histogram             // scheduling latency when the checks began (nil: not exported)
	// metrics is the /metrics exposition read when the checks began (nil:
	// unreadable, metricsErr says why); the checks that need a gauge read
	// it here instead of fetching the exposition again.
	metrics    []byte
	metricsErr error
}

type doctorClient struct {
	http  *http.Client
	token string
}

func (c *doctorClient) do(ctx context.Context, method, url string, body []byte, hdr map[string]string) (int, []byte, error) {
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
		req.Header.Set(node.HeaderAdminToken, c.token)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 32<<20))
	return resp.StatusCode, data, err
}

func baseURL(addr string) string {
	if !strings.Contains(addr, "://") {
		addr = "http://" + addr
	}
	return strings.TrimRight(addr, "/")
}

// doctor runs every check and prints one line per verdict; it returns
// errDoctorFailed when any failed.
func doctor(ctx context.Context, out io.Writer, o doctorOptions) error {
	if ctx == nil {
		ctx = context.Background()
	}
	if len(o.addrs) == 0 {
		return errors.New("doctor needs at least one --addr")
	}
	if o.probeTimeout <= 0 {
		o.probeTimeout = 10 * time.Second
	}
	if o.healthGrace <= 0 {
		o.healthGrace = defaultHealthGrace
	}
	c := &doctorClient{http: &http.Client{Timeout: 30 * time.Second}, token: o.token}
	v := &verdicts{out: out}
	var gws []*gatewayView
	for _, a := range o.addrs {
		g := &gatewayView{addr: a, base: baseURL(a)}
		gws = append(gws, g)
		checkGateway(ctx, c, v, g)
	}
	checkConvergence(v, gws)
	checkLoadSharing(v, gws)

	// Replicas, in the order the first answering gateway lists them.
	var first *gatewayView
	for _, g := range gws {
		if g.replicas != nil {
			first = g
			break
		}
	}
	if first == nil {
		v.fail("replicas", "no gateway answered /debug/replicas: nothing to check")
	} else {
		for _, r := range first.replicas.Replicas {
			checkReplica(ctx, c, v, o, gws, first, r)
		}
	}
	for _, g := range gws {
		checkGatewayCPU(ctx, c, v, g)
	}
	fmt.Fprintf(out, "\nverdict: ")
	if v.fails > 0 {
		fmt.Fprintf(out, "FAIL (%d failed, %d warnings)\n", v.fails, v.warns)
		return fmt.Errorf("%w: %d", errDoctorFailed, v.fails)
	}
	fmt.Fprintf(out, "PASS (%d warnings)\n", v.warns)
	return nil
}

// checkGateway reads one gateway's /ready, /debug/replicas and /metrics.
func checkGateway(ctx context.Context, c *doctorClient, v *verdicts, g *gatewayView) {
	subject := "gateway " + g.addr
	st, data, err := c.do(ctx, http.MethodGet, g.base+"/ready", nil, nil)
	if err != nil {
		v.fail(subject, "unreachable: %v", err)
		return
	}
	if st != http.StatusOK {
		v.fail(subject, "not ready (%d): %s", st, strings.TrimSpace(string(data)))
		return
	}
	var rr node.ReadyReport
	if err := json.Unmarshal(data, &rr); err != nil {
		v.fail(subject, "unreadable /ready answer: %v", err)
		return
	}
	g.ready = &rr
	v.pass(subject, "reachable and ready (config version %d, digest %s)", rr.ConfigVersion, rr.ConfigDigest)
	for _, m := range rr.NoAvailableReplica {
		v.fail(subject, "model %s: no replica available; its requests get 503 (replicas below)", m)
	}
	for _, m := range rr.FailOpen {
		v.warn(subject, "model %s: every replica fails its /health polls, so the gateway routes among them anyway (health_fail_open); check the engines' /health and the gateway's health_timeout", m)
	}

	g.metrics, g.metricsErr = readMetrics(ctx, c, g)
	g.sched = parseSched(g.metrics)
	rep, err := fetchReplicas(ctx, c, g)
	if err != nil {
		v.fail(subject, "%v", err)
		return
	}
	g.replicas = rep
}

// readMetrics reads g's /metrics exposition.
func readMetrics(ctx context.Context, c *doctorClient, g *gatewayView) ([]byte, error) {
	st, data, err := c.do(ctx, http.MethodGet, g.base+"/metrics", nil, nil)
	switch {
	case err != nil:
		return nil, err
	case st != http.StatusOK:
		return nil, fmt.Errorf("answered %d", st)
	}
	return data, nil
}

// parseSched reads the scheduling latency histogram from a /metrics
// exposition; nil when it holds none (a gateway older than this doctor,
// or data nil).
func parseSched(data []byte) gosched.Histogram {
	if data == nil {
		return nil
	}
	rt, err := gosched.Parse(bytes.NewReader(data))
	if err != nil || len(rt.Sched) == 0 {
		return nil
	}
	return rt.Sched
}

// checkGatewayCPU reads g's scheduling latency again at the end of the
// checks and reports how long its ready goroutines waited for a thread
// (see cpuVerdict). A gateway that does not export the histogram (older
// than this doctor) is not checked.
func checkGatewayCPU(ctx context.Context, c *doctorClient, v *verdicts, g *gatewayView) {
	if g.ready == nil || g.sched == nil {
		return
	}
	data, _ := readMetrics(ctx, c, g)
	warn, msg, ok := cpuVerdict(g.sched, parseSched(data))
	switch {
	case !ok:
	case warn:
		v.warn("gateway "+g.addr, "%s", msg)
	default:
		v.pass("gateway "+g.addr, "%s", msg)
	}
}

// Thresholds of cpuVerdict. The runtime samples about one wake-up in
// eight, so a window of a few seconds at a handful of requests a second
// holds some hundreds; below minSchedWakeups the gateway's lifetime is
// judged instead. Over maxSchedOver10 of the wake-ups waiting over about
// 10 ms is a P99 over 10 ms, what KvmeshGatewayShortOfCPU alerts on. In
// issue 21's benchmark at 200 streams, the gateway sharing two cores
// with the load generator and two engines, it was 0–0.2 % in 14 blocks
// on the quiet machine, and 0.6 and 1.2 % in two runs that shared the
// cores with other work, where the gateway added 29–30 ms to the TTFT
// P99.
const (
	minSchedWakeups = 200
	maxSchedOver10  = 0.01
)

// cpuVerdict judges a gateway's CPU from its scheduling latency histogram
// at the start (before) and the end (after) of the checks: warn when
// more than maxSchedOver10 of its goroutine wake-ups waited over about
// 10 ms for a thread. It judges the window between the two when it holds
// minSchedWakeups, else everything since the gateway started; ok is false
// when after is nil or holds no wake-ups.
func cpuVerdict(before, after gosched.Histogram) (warn bool, msg string, ok bool) {
	w, when := after.Sub(before).Waits(), "during the checks"
	if w.Wakeups < minSchedWakeups {
		w, when = after.Waits(), "since it started"
	}
	if w.Wakeups <= 0 {
		return false, "", false
	}
	msg = fmt.Sprintf("CPU: of %.0f sampled goroutine wake-ups %s, %.2f%% waited over %.2g ms for a thread and %.2f%% over %.3g ms",
		w.Wakeups, when, 100*w.Over1, w.Bound1*1e3, 100*w.Over10, w.Bound10*1e3)
	if w.Over10 > maxSchedOver10 {
		return true, msg + ": the gateway is short of CPU (its cores shared with busier work, or a CPU limit below its load: compare process_cpu_seconds_total with go_sched_gomaxprocs_threads), and adds that wait to TTFT and to the gaps between streamed chunks", true
	}
	return false, msg, true
}

// fetchReplicas reads g's /debug/replicas.
func fetchReplicas(ctx context.Context, c *doctorClient, g *gatewayView) (*node.ReplicasReport, error) {
	st, data, err := c.do(ctx, http.MethodGet, g.base+"/debug/replicas", nil, nil)
	switch {
	case err != nil:
		return nil, fmt.Errorf("/debug/replicas: %w", err)
	case st == http.StatusUnauthorized:
		return nil, fmt.Errorf("/debug/replicas refused the admin token (set KVMESH_ADMIN_TOKEN or --token to the gateway's): %s", strings.TrimSpace(string(data)))
	case st != http.StatusOK:
		return nil, fmt.Errorf("/debug/replicas answered %d (a gateway older than this doctor?)", st)
	}
	var rep node.ReplicasReport
	if err := json.Unmarshal(data, &rep); err != nil {
		return nil, fmt.Errorf("unreadable /debug/replicas answer: %w", err)
	}
	return &rep, nil
}

// refreshReplicas reads g's /debug/replicas again; on any error it keeps
// what it had.
func refreshReplicas(ctx context.Context, c *doctorClient, g *gatewayView) {
	if rep, err := fetchReplicas(ctx, c, g); err == nil {
		g.replicas = rep
	}
}

// refreshKVMetrics reads every reachable gateway's KV-event counters.
func refreshKVMetrics(ctx context.Context, c *doctorClient, gws []*gatewayView) {
	for _, g := range gws {
		if g.ready == nil {
			continue
		}
		st, data, err := c.do(ctx, http.MethodGet, g.base+"/metrics", nil, nil)
		if err == nil && st == http.StatusOK {
			g.kv = parseKVEventMetrics(data)
		}
	}
}

// checkLoadSharing reads each clustered gateway's membership and load
// gauges (kvmesh_sync_members, this gateway included, and
// kvmesh_sync_peer_load_reports, the peers whose load report is fresh) and
// warns when reports from some live peer are missing: the gateway then
// sees that peer's in-flight requests only in its engine scrapes, and its
// routing herds with the others'. A gateway outside a cluster (no such
// gauges) is warned instead when its engines run requests it did not send
// (kvmesh_proxy_engines_shared); one alone in a cluster is not checked.
// It reads the exposition checkGateway took.
func checkLoadSharing(v *verdicts, gws []*gatewayView) {
	for _, g := range gws {
		if g.ready == nil {
			continue
		}
		subject := "gateway " + g.addr
		data := g.metrics
		if data == nil {
			v.warn(subject, "peers' load: /metrics unreadable (%v)", g.metricsErr)
			continue
		}
		members, ok := gaugeValue(data, "kvmesh_sync_members")
		fresh, ok2 := gaugeValue(data, "kvmesh_sync_peer_load_reports")
		if !ok || !ok2 {
			if shared, _ := gaugeValue(data, "kvmesh_proxy_engines_shared"); shared == 1 {
				v.warn(subject, "other senders: its engines run requests it did not send (other gateways outside a cluster, direct clients); it sees their load only in its scrapes, now every shared_scrape_interval, and routes on it that stale (run gateways that share engines as one cluster)")
			}
			continue
		}
		if members < 2 {
			continue
		}
		peers, got := int(members)-1, int(fresh)
		if got >= peers {
			v.pass(subject, "peers' load: fresh reports from all %d peer(s)", peers)
			continue
		}
		v.warn(subject, "peers' load: fresh reports from %d of %d peers; it routes without the others' in-flight requests (check NATS between the gateways: kvmesh_sync_nats_connected)", got, peers)
	}
}

// gaugeValue is the value of the unlabelled metric name in a Prometheus
// text exposition.
func gaugeValue(data []byte, name string) (float64, bool) {
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), name+" ")
		if !ok {
			continue
		}
		f, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
		return f, err == nil
	}
	return 0, false
}

// checkConvergence compares the gateways' routing configs.
func checkConvergence(v *verdicts, gws []*gatewayView) {
	digests := map[string][]string{}
	for _, g := range gws {
		if g.ready != nil {
			k := fmt.Sprintf("version %d digest %s", g.ready.ConfigVersion, g.ready.ConfigDigest)
			digests[k] = append(digests[k], g.addr)
		}
	}
	switch len(digests) {
	case 0:
	case 1:
		for k, as := range digests {
			v.pass("config", "%d gateway(s) route on one config (%s)", len(as), k)
		}
	default:
		keys := make([]string, 0, len(digests))
		for k := range digests {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		parts := make([]string, 0, len(keys))
		for _, k := range keys {
			parts = append(parts, fmt.Sprintf("%s: %s", strings.Join(digests[k], ","), k))
		}
		v.fail("config", "gateways route on different configs: %s", strings.Join(parts, "; "))
	}
}

// checkReplica runs the per-replica checks.
func checkReplica(ctx context.Context, c *doctorClient, v *verdicts, o doctorOptions, gws []*gatewayView, first *gatewayView, r node.ReplicaReport) {
	subject := "replica " + r.Name
	// Reachability, as the gateways' health checks see it.
	down, waited := unavailableOn(ctx, c, gws, r.Name, o.healthGrace)
	switch {
	case len(down) > 0:
		v.fail(subject, "unavailable (health check failing or ejected) on %s, still after %v", strings.Join(down, ", "), o.healthGrace)
	case waited > 0:
		v.pass(subject, "available on every gateway (model %s) after %v: a gateway's health check had not seen it up yet", r.Model, waited.Round(time.Millisecond))
	default:
		v.pass(subject, "available on every gateway (model %s)", r.Model)
	}

	// Tokenizer agreement.
	switch {
	case r.Agreement != nil && r.Agreement.Verdict == node.AgreementDisagree:
		a := r.Agreement
		if a.EngineTokenizes {
			// The keys are the engine's (auto did its job), so routing is
			// right; what is left is the cost of a /tokenize round trip
			// per prompt.
			v.warn(subject, "tokenizer: the gateway's %s tokenizer disagrees with the engine's /tokenize (probe %q: %s); the gateway now asks the engine's /tokenize for every prompt of the model, so its keys are right but each prompt costs a round trip; set --tokenizer hf:<dir> with the model's tokenizer files",
				a.Tokenizer, a.Probe, tokenCounts(a.GatewayTokens, a.EngineTokens))
			break
		}
		v.fail(subject, "tokenizer: the gateway's %s tokenizer disagrees with the engine's /tokenize (probe %q: %s); the gateway keeps its own tokenizer, so this replica's KV-event matches miss; set --tokenizer hf:<dir> with the model's tokenizer files",
			a.Tokenizer, a.Probe, tokenCounts(a.GatewayTokens, a.EngineTokens))
	case r.Agreement != nil:
		v.pass(subject, "tokenizer: the gateway's %s tokenizer agrees with the engine's /tokenize", r.Agreement.Tokenizer)
	case r.JudgedByEvents:
		v.warn(subject, "tokenizer: not probed yet (the engine's /tokenize did not answer, or the replica just joined)")
	}

	probed := false
	if r.JudgedByEvents && r.PublishesKVEvents {
		switch {
		case o.skipStreams:
			v.warn(subject, "kv stream: identity not checked (--skip-stream-probe)")
		case r.Agreement != nil && r.Agreement.Verdict == node.AgreementDisagree && !r.Agreement.EngineTokenizes:
			v.warn(subject, "kv stream: identity not checkable while the gateway's block keys differ from the engine's (tokenizer, above)")
		default:
			checkStreamIdentity(ctx, c, v, o, gws, first, r)
			probed = true
		}
		refreshKVMetrics(ctx, c, gws) // after the probe's batches
		checkSequence(v, gws, r)
	} else if !o.skipStreams && !r.PublishesKVEvents && modelHasEvents(first, r.Model) {
		// A replica without events of its own: its blocks must show up on
		// no other replica's stream (the README mistake of issue 15).
		checkStreamIdentity(ctx, c, v, o, gws, first, r)
		probed = true
	}
	if probed {
		// The probes' responses are self-check samples too: read the
		// replica's windows again, or a gateway no client has used yet
		// would be reported as having no sample.
		refreshReplicas(ctx, c, first)
	}

	// Prediction error, on every gateway.
	clean := true
	for _, g := range gws {
		if g.ready == nil {
			continue
		}
		for _, s := range g.ready.Suspect {
			if s.Replica != r.Name {
				continue
			}
			clean = false
			v.fail(subject, "prediction (%s): %s on %d of %d recent responses; likely cause: %s", g.addr, s.Reason, s.Failures, s.Samples, s.LikelyCause)
		}
	}
	if clean {
		samples := 0
		if rr := findReplica(first, r.Name); rr != nil {
			for _, p := range rr.Prediction {
				samples = max(samples, p.Samples)
			}
		}
		switch {
		case !r.JudgedByEvents:
			v.pass(subject, "prediction: history guesses, not judged")
		case samples == 0:
			v.warn(subject, "prediction: no response with usage.prompt_tokens_details.cached_tokens yet (vLLM needs --enable-prompt-tokens-details; streams need stream_options.include_usage)")
		default:
			v.pass(subject, "prediction: agrees with the engine's cached_tokens (%d recent responses)", samples)
		}
	}
}

// tokenCounts describes a tokenizer disagreement on a probe: two counts,
// or one count and different ids (a vocabulary that splits the probe the
// same way but numbers its tokens differently).
func tokenCounts(gateway, engine int) string {
	if gateway == engine {
		return fmt.Sprintf("%d tokens on both sides, different ids", gateway)
	}
	return fmt.Sprintf("gateway %d tokens, engine %d", gateway, engine)
}

// unavailableOn returns the gateways on which replica name is out of
// rotation. While it is on any, it reads those gateways' views again,
// every 50 ms for up to grace, and returns how long that took when the
// replica came back (0: it was available at once).
func unavailableOn(ctx context.Context, c *doctorClient, gws []*gatewayView, name string, grace time.Duration) (down []string, waited time.Duration) {
	start := time.Now()
	for {
		var out []*gatewayView
		for _, g := range gws {
			if rr := findReplica(g, name); rr != nil && !rr.Available {
				out = append(out, g)
			}
		}
		if len(out) == 0 {
			return nil, waited
		}
		if waited >= grace || ctx.Err() != nil {
			for _, g := range out {
				down = append(down, g.addr)
			}
			return down, 0
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
		for _, g := range out {
			refreshReplicas(ctx, c, g)
		}
		waited = time.Since(start)
	}
}

func findReplica(g *gatewayView, name string) *node.ReplicaReport {
	if g == nil || g.replicas == nil {
		return nil
	}
	for i := range g.replicas.Replicas {
		if g.replicas.Replicas[i].Name == name {
			return &g.replicas.Replicas[i]
		}
	}
	return nil
}

// probePrompt is a prompt no one else sends: a random nonce first (so no
// cached prefix can match it), then enough text for several blocks of any
// tokenizer.
func probePrompt(replica string) string {
	var nonce [12]byte
	_, _ = rand.Read(nonce[:])
	var b strings.Builder
	// The nonce comes first: a first block shared with any other prompt
	// (an earlier probe's) would be confirmed elsewhere legitimately.
	fmt.Fprintf(&b, "%s kvmesh doctor probe for replica %s. ", hex.EncodeToString(nonce[:]), replica)
	for i := 0; b.Len() < 3000; i++ {
		fmt.Fprintf(&b, "Line %d of the probe checks that this engine's KV events reach the gateways under its own name. ", i)
	}
	return b.String()
}

// strayGrace is how long the doctor keeps looking for a probe's blocks
// on other replicas' streams after the probed replica's own stream
// confirmed them.
const strayGrace = time.Second

// checkStreamIdentity pins a unique prompt to r through the first gateway
// and reads, on every gateway, which replicas' streams confirmed its
// blocks.
func checkStreamIdentity(ctx context.Context, c *doctorClient, v *verdicts, o doctorOptions, gws []*gatewayView, first *gatewayView, r node.ReplicaReport) {
	subject := "replica " + r.Name
	prompt := probePrompt(r.Name)
	body, _ := json.Marshal(map[string]any{"model": r.Model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
	st, data, err := c.do(ctx, http.MethodPost, first.base+"/v1/completions", body, map[string]string{node.HeaderPinReplica: r.Name})
	if err != nil || st != http.StatusOK {
		v.fail(subject, "kv stream: the pinned probe prompt failed (%d): %v %s", st, err, strings.TrimSpace(string(data)))
		return
	}
	route, _ := json.Marshal(map[string]any{"model": r.Model, "prompt": prompt})
	// What the first gateway (the one the probe went through) confirmed
	// on r, for the cache-reuse check below.
	reuse := struct {
		blocks, blockSize int
		ok                bool
	}{}
	for _, g := range gws {
		if g.replicas == nil {
			continue
		}
		where := ""
		if len(gws) > 1 {
			where = " (" + g.addr + ")"
		}
		var last node.RouteReport
		own := func() int {
			for _, b := range last.Confirmed {
				if b.Name == r.Name {
					return b.Blocks
				}
			}
			return 0
		}
		wait := o.probeTimeout
		if !r.PublishesKVEvents {
			wait = min(wait, 2*time.Second) // nothing to wait for but strays
		}
		poll := func() {
			st, data, err := c.do(ctx, http.MethodPost, g.base+"/debug/route", route, nil)
			if err == nil && st == http.StatusOK {
				_ = json.Unmarshal(data, &last)
			}
		}
		others := func() bool {
			for _, b := range last.Confirmed {
				if b.Name != r.Name && b.Blocks > 0 {
					return true
				}
			}
			return false
		}
		deadline := time.Now().Add(wait)
		for {
			poll()
			if (r.PublishesKVEvents && last.TotalBlocks > 0 && own() >= last.TotalBlocks-1) || time.Now().After(deadline) || ctx.Err() != nil {
				break
			}
			if !r.PublishesKVEvents && strays(last) {
				break
			}
			time.Sleep(100 * time.Millisecond) // polling a remote condition with a deadline
		}
		// A crossed stream's copy of the same events reaches the gateway
		// through another subscriber, possibly later than the replica's own
		// (on a busy machine by hundreds of milliseconds): look a little
		// longer before calling the stream clean.
		for settle := time.Now().Add(strayGrace); r.PublishesKVEvents && own() > 0 && !others() &&
			time.Now().Before(settle) && ctx.Err() == nil; {
			time.Sleep(100 * time.Millisecond) // polling a remote condition with a deadline
			poll()
		}
		var crossed []string
		for _, b := range last.Confirmed {
			if b.Name != r.Name && b.Blocks > 0 {
				crossed = append(crossed, fmt.Sprintf("%s (%d blocks)", b.Name, b.Blocks))
			}
		}
		switch n := own(); {
		case !r.PublishesKVEvents && len(crossed) > 0:
			v.fail(subject, "kv stream%s: %s publishes no KV events, yet the probe sent to it came back confirmed on %s: that replica's kv= endpoint carries %s's KV events (crossed event stream)",
				where, r.Name, strings.Join(crossed, ", "), r.Name)
		case !r.PublishesKVEvents:
			v.pass(subject, "kv stream%s: publishes no KV events, and no other replica's stream carries its blocks", where)
		case len(crossed) > 0:
			v.fail(subject, "kv stream%s: the probe sent to %s came back confirmed on %s: that replica's kv= endpoint carries %s's KV events (crossed event stream)",
				where, r.Name, strings.Join(crossed, ", "), r.Name)
			if n == 0 {
				v.fail(subject, "kv stream%s: and %s's own stream did not confirm it: its kv= endpoint does not carry its engine's events", where, r.Name)
			}
		case n == 0:
			v.fail(subject, "kv stream%s: the probe's %d blocks never came back confirmed on %s within %v: its kv= endpoint does not carry this engine's KV events (crossed or wrong endpoint, events off, or lost)",
				where, last.TotalBlocks, r.Name, o.probeTimeout)
		case n < last.TotalBlocks-1:
			v.warn(subject, "kv stream%s: only %d of the probe's %d blocks confirmed within %v", where, n, last.TotalBlocks, o.probeTimeout)
		default:
			v.pass(subject, "kv stream%s: the probe's %d blocks came back confirmed on %s and on no other replica", where, n, r.Name)
		}
		if n := own(); g == first && r.PublishesKVEvents && len(crossed) == 0 && n > 0 && n >= last.TotalBlocks-1 {
			reuse.blocks, reuse.blockSize, reuse.ok = n, last.BlockSize, true
		}
	}
	if reuse.ok {
		where := ""
		if len(gws) > 1 {
			where = " (" + first.addr + ")"
		}
		checkCacheReuse(ctx, c, v, first, r, body, reuse.blocks, reuse.blockSize, where)
	}
}

// checkCacheReuse sends r's probe again, through g and pinned to r. Its
// blocks are now confirmed on r, so the gateway predicts them cached, and
// the engine's usage.prompt_tokens_details.cached_tokens says whether it
// reused them: the self-check's comparison on a prompt whose answer is
// known, end to end (the gateway's token ids, block size and hash chain
// against the engine's own prefix cache). The slack is the self-check's:
// one block, vLLM's recompute of a fully cached prompt's last token.
func checkCacheReuse(ctx context.Context, c *doctorClient, v *verdicts, g *gatewayView, r node.ReplicaReport, body []byte, blocks, blockSize int, where string) {
	subject := "replica " + r.Name
	st, data, err := c.do(ctx, http.MethodPost, g.base+"/v1/completions", body, map[string]string{node.HeaderPinReplica: r.Name})
	if err != nil || st != http.StatusOK {
		v.fail(subject, "cache reuse%s: the repeated probe failed (%d): %v %s", where, st, err, strings.TrimSpace(string(data)))
		return
	}
	var resp struct {
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
			Details      *struct {
				Cached *int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	predicted := blocks * blockSize
	if json.Unmarshal(data, &resp) != nil || resp.Usage.Details == nil || resp.Usage.Details.Cached == nil {
		v.warn(subject, "cache reuse%s: the engine's answer carries no usage.prompt_tokens_details.cached_tokens, so whether it reuses the %d tokens the gateway predicts cached is not checked (vLLM needs --enable-prompt-tokens-details)",
			where, predicted)
		return
	}
	cached := *resp.Usage.Details.Cached
	switch reuseVerdict(predicted, cached, blockSize) {
	case reuseOver:
		v.fail(subject, "cache reuse%s: the gateway predicts %d of the repeated probe's tokens cached, the engine reused %d: it announced blocks it does not reuse (a cache salt, LoRA adapter or multimodal input the gateway does not key, or a KV cache so small it evicts at once); the index routes to cache that is not there",
			where, predicted, cached)
	case reuseUnder:
		v.fail(subject, "cache reuse%s: the engine reused %d of the repeated probe's tokens, more than the %d the gateway predicts: some of its blocks' events do not reach the gateway, or its block keys differ from the engine's (--block-size)",
			where, cached, predicted)
	default:
		v.pass(subject, "cache reuse%s: sent again, the probe found %d of its %d prompt tokens cached on the engine, as the gateway predicts (%d)",
			where, cached, resp.Usage.PromptTokens, predicted)
	}
}

// Outcomes of reuseVerdict.
const (
	reuseAgrees = iota
	reuseOver   // the gateway predicts more than one block beyond the engine's reuse
	reuseUnder  // the engine reused more than one block beyond the prediction
)

// reuseVerdict compares a prediction with the engine's cached tokens as
// the gateway's self-check does (node/selfcheck.go): a difference of up to
// one block either way agrees.
func reuseVerdict(predicted, cached, blockSize int) int {
	switch {
	case predicted-cached > blockSize:
		return reuseOver
	case cached-predicted > blockSize:
		return reuseUnder
	}
	return reuseAgrees
}

// modelHasEvents reports whether some replica of model feeds the index
// from KV events.
func modelHasEvents(g *gatewayView, model string) bool {
	for _, r := range g.replicas.Replicas {
		if r.Model == model && r.JudgedByEvents {
			return true
		}
	}
	return false
}

// strays reports whether a report shows any replica's confirmed blocks.
func strays(rep node.RouteReport) bool {
	for _, b := range rep.Confirmed {
		if b.Blocks > 0 {
			return true
		}
	}
	return false
}

// checkSequence reads the KV-event subscriber counters every gateway
// exports for r (in a cluster only the stream's owner has them).
func checkSequence(v *verdicts, gws []*gatewayView, r node.ReplicaReport) {
	subject := "replica " + r.Name
	sum := func(metric string) float64 {
		t := 0.0
		for _, g := range gws {
			t += g.kv[metric][r.Name]
		}
		return t
	}
	batches, gaps, malformed, dropped := sum("batches_total"), sum("gaps_total"), sum("malformed_total"), sum("dropped_total")
	resets := sum("resets_total")
	switch {
	case malformed > 0 || dropped > 0:
		v.fail(subject, "sequence: %.0f malformed and %.0f dropped batches (of %.0f; %.0f gaps, %.0f resets)", malformed, dropped, batches, gaps, resets)
	case batches == 0:
		v.warn(subject, "sequence: no KV-event batch counted on these gateways (in a cluster another gateway may own the stream)")
	case gaps > 0 || resets > 0:
		v.warn(subject, "sequence: %.0f batches, %.0f gaps, %.0f resets (engine restarts reset; repeated gaps mean lost events)", batches, gaps, resets)
	default:
		v.pass(subject, "sequence: %.0f batches, no gap, reset, malformed or dropped batch", batches)
	}
}

// parseKVEventMetrics reads kvmesh_kvevents_* samples from a Prometheus
// text exposition, summed per replica label: metric → replica → value.
// Resets for a re-pointed source are kept apart, as "source_changes_total".
func parseKVEventMetrics(data []byte) map[string]map[string]float64 {
	const prefix = "kvmesh_kvevents_"
	out := map[string]map[string]float64{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		brace := strings.IndexByte(line, '{')
		end := strings.LastIndexByte(line, '}')
		if brace < 0 || end < brace {
			continue
		}
		name := line[len(prefix):brace]
		labels := line[brace+1 : end]
		replica, reason := "", ""
		for _, kv := range strings.Split(labels, ",") {
			if k, val, ok := strings.Cut(kv, "="); ok && k == "replica" {
				replica, _ = strconv.Unquote(val)
			} else if ok && k == "reason" {
				reason, _ = strconv.Unquote(val)
			}
		}
		if name == "resets_total" && reason == "source_changed" {
			// A config change pointed the replica at another engine: not
			// a sequence problem (the alert leaves it out too).
			name = "source_changes_total"
		}
		f, err := strconv.ParseFloat(strings.TrimSpace(line[end+1:]), 64)
		if err != nil || replica == "" {
			continue
		}
		if out[name] == nil {
			out[name] = map[string]float64{}
		}
		out[name][replica] += f
	}
	return out
}
