package suite

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/node"
)

// awaitVersion waits until every live gateway applies config version v
// and returns when that happened.
func awaitVersion(t *R, c *cluster.Cluster, v uint64) time.Time {
	t.Helper()
	require.Eventually(t, func() bool {
		for _, g := range c.Gateways() {
			if g.Node.ConfigVersion() < v {
				return false
			}
		}
		return true
	}, 10*time.Second, time.Millisecond, "config v%d applied everywhere: %s", v, c.ConfigVersions())
	return time.Now()
}

// ScaleOutAndIn (scenario 5): under a steady streaming load over the
// live gateways, the gateway tier grows 3 → 5 and shrinks back to 3
// (graceful stops), an engine is added through the raft config (it gets
// traffic and every gateway's index of it fills) and an original engine is
// removed while long streams pinned to it (consistent-hash session) are
// running: they finish with every token, [DONE] and usage, and nothing is
// routed to it once the removal is applied. No request fails or is lost; the cluster ends exact
// with one config version.
func scaleOutAndIn(t *R) {
	c := startClusterMode(t, 3, 2, func(cfg *cluster.Config) {
		// e0, the engine removed at the end, runs at a fifth of the fast
		// profile's speed: its answers take longer, so more of the load's
		// are in flight when its removal applies (its long streams are
		// held then; see step 4).
		cfg.Sim = func(i int, sc *sim.Config) {
			if i == 0 {
				sc.Speed = 0.2
			}
		}
		// The long streams follow their session's place on the ring.
		// Consistent-hash's load bound would send a stream elsewhere
		// whenever e0 (slow, so holding more of the load's requests)
		// had more in flight than its share: as many as 12 streams then
		// failed to find e0 twice on a busy machine (1 run in 16 under
		// oversubscription). The bound is not what this scenario tests;
		// a floor above everything that can be in flight (8 load
		// requests, 12 streams) keeps it out of the way.
		cfg.Node = func(_ int, nc *node.Config) { nc.Route.ConsistentHash.MinCapacity = 64 }
	})
	ctx := context.Background()
	n := t.Scale(300, 2000)
	lc := loadConfig(c, "scale", n)
	lc.Target = liveTarget(c)
	lc.MaxTokens = 100
	lc.Concurrency = 8
	// least-request, so that an added engine gets traffic at once (with
	// prefix-cache every tenant already has a home).
	lc.Header = func(_ int, h http.Header) { h.Set(node.HeaderStrategy, "least-request") }
	load, err := cluster.StartLoad(ctx, lc)
	require.NoError(t, err)
	defer load.Stop()
	step := func(k int) {
		require.Eventually(t, func() bool { return load.Completed() >= k*n/6 }, 60*time.Second, 5*time.Millisecond)
	}
	var catch time.Duration

	// Gateways 3 → 5.
	step(1)
	var added []*cluster.Gateway
	for range 2 {
		g, err := c.AddGateway(ctx)
		require.NoError(t, err)
		added = append(added, g)
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	require.NoError(t, c.WaitReady(rctx))
	cancel()
	for _, g := range added {
		start := time.Now()
		awaitWithin1pct(t, c, g.Name, start.Add(5*time.Second))
		catch = max(catch, time.Since(start))
	}

	// Engine scale-out through the raft config.
	step(2)
	ne, err := c.AddEngine(ctx)
	require.NoError(t, err)
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	v, err := c.AddReplicaToConfig(wctx, ne)
	cancel()
	require.NoError(t, err)
	awaitVersion(t, c, v)
	// Every gateway routes to it: a few random-strategy requests through
	// each until one lands there (the load may already be past its middle
	// on a fast machine).
	for _, g := range c.Gateways() {
		got := false
		for k := 0; k < 60 && !got; k++ {
			h := http.Header{}
			h.Set(node.HeaderStrategy, "random")
			rep, err := c.CompleteWithHeader(ctx, g.URL(), prompt("probe-"+g.Name, k), 1, h)
			require.NoError(t, err)
			got = rep == ne.Name
		}
		require.True(t, got, "gateway %s routes to the added engine %s", g.Name, ne.Name)
	}

	// Gateways 5 → 3: the two added ones leave gracefully (the first
	// three are the raft voters).
	step(3)
	stopped := map[string]time.Time{} // URL -> when its stop began
	for _, g := range added {
		sctx, cancel := context.WithTimeout(ctx, 15*time.Second) // see TestGatewayKillAndRestart
		stopped[g.URL()] = time.Now()
		require.NoError(t, c.StopGateway(sctx, g))
		cancel()
	}

	// Engine scale-in: e0 leaves the config while long streams it serves
	// are running; they finish completely, and nothing new goes there.
	// e0 holds them after their first chunk until the removal has applied
	// everywhere, so they are in flight at the gateways then however long
	// the removal takes (sim.Server.HoldStreams).
	step(4)
	gone := c.Engines()[0]
	session := sessionOn(t, c, gone)
	release := gone.Server().HoldStreams(drainTokens)
	defer release() // on a failure before the removal applied
	long := startDrainStreams(t, c, gone, session)
	wctx, cancel = context.WithTimeout(ctx, 20*time.Second)
	v, err = c.RemoveReplicaFromConfig(wctx, gone)
	cancel()
	require.NoError(t, err)
	removedAt := awaitVersion(t, c, v)
	// The session that mapped to the removed engine now maps elsewhere on
	// every gateway.
	for _, g := range c.Gateways() {
		h := http.Header{}
		h.Set(node.HeaderStrategy, "consistent-hash")
		h.Set(node.HeaderSession, session)
		rep, err := c.CompleteWithHeader(ctx, g.URL(), prompt("after-removal-"+g.Name, 1), 1, h)
		require.NoError(t, err)
		require.NotEqual(t, gone.Name, rep, "gateway %s routes to %s after its removal applied", g.Name, gone.Name)
	}
	release()
	drained := long.wait(t, removedAt)

	res := load.Wait()
	require.Zero(t, res.Lost, res.String())
	// A graceful gateway stop can refuse a request that reused a keep-alive
	// connection the stopping server was just closing (HTTP/1.1's
	// idle-close race, as in TestGatewayKillAndRestart): no response
	// header came back, the client sees the error, nothing is lost. It was
	// seen about once in 20 runs under -race on a loaded machine. Any
	// other failure (on a live gateway, after a response began, or on the
	// removed engine) fails the scenario.
	idleClose := 0
	for _, r := range res.Results {
		if r.Outcome == cluster.OK {
			continue
		}
		st, onStopped := stopped[r.Target]
		if onStopped && r.Outcome == cluster.Failed && r.Reason == "conn_error" && r.Replica == "" && !r.Start.Add(r.Duration).Before(st) {
			idleClose++
			continue
		}
		at := "a live gateway"
		if onStopped {
			at = fmt.Sprintf("a gateway whose stop began %v after the request started", st.Sub(r.Start).Round(time.Millisecond))
		}
		t.Errorf("request %d %s/%s via %s (%s), replica %q: started %v before the engine removal applied, took %v",
			r.I, r.Outcome, r.Reason, r.Target, at, r.Replica, removedAt.Sub(r.Start).Round(time.Millisecond), r.Duration.Round(time.Millisecond))
	}
	require.False(t, t.Failed(), "scale-out and scale-in break no request: %s", res)
	toNew, toGoneAfter := 0, 0
	for _, r := range res.Results {
		if r.Replica == gone.Name && r.Start.Before(removedAt) && r.Start.Add(r.Duration).After(removedAt) {
			drained.load++ // a load request in flight when the removal applied, and ended ok
		}
		if r.Replica == ne.Name {
			toNew++
		}
		if r.Replica == gone.Name && r.Start.After(removedAt) {
			toGoneAfter++
		}
	}
	require.Zero(t, toGoneAfter, "no request routed to the removed engine after the removal applied")
	res.Add(drained.res)

	settleWithin(t, c, "after scaling", 20*time.Second)
	s, took := awaitWithin(t, c, "after scaling", 5*time.Second, c.Exact)
	require.Eventually(t, c.ConfigConverged, 10*time.Second, 5*time.Millisecond, c.ConfigVersions())
	// row() would refuse the idle-close failures as broken connections; the
	// checks above explained each of them.
	r := cluster.Row{
		Scenario: "5 scale-out/in", Load: res, Precision: s.MinPrecision, Recall: s.MinRecall, Converge: max(took, catch),
		ConfigVersions: c.ConfigVersions(),
		Note: fmt.Sprintf("gateways 3->5->3 (%d requests refused by a stopping gateway's idle-close race), engine %s added (%d load requests; every gateway routes to it), %s removed while serving %d long streams (each %d tokens, in flight %v past the removal, all complete with [DONE] and usage) and %d load requests (finished ok), 0 routed after; new gateways within 1%% of peers after <= %v",
			idleClose, ne.Name, toNew, gone.Name, drained.onGone, drainTokens, drained.minAfter.Round(time.Millisecond), drained.load, catch.Round(time.Millisecond)),
	}
	t.report.Add(r)
	t.Log(r.Line())
	require.Zero(t, r.Load.Lost, "lost requests: %s", r.Load)
}

// drainTokens is the length of the streams the engine scale-in drains.
// The engine holds them after their first chunk until the removal has
// applied; the other 499 chunks are then relayed from a replica that is
// no longer in the config. They used to be long enough to outlast the
// removal (3,000 tokens, 4.5 s on the slowed engine), until one ended
// 0.26 s before the removal applied in a CI run at load 30.
const drainTokens = 500

// sessionOn finds a consistent-hash session key that every gateway routes
// to e (the ring is the same on every gateway) and returns it.
func sessionOn(t *R, c *cluster.Cluster, e *cluster.Engine) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for k := range 200 {
		session := fmt.Sprintf("drain-session-%d", k)
		all := true
		for _, g := range c.Gateways() {
			h := http.Header{}
			h.Set(node.HeaderStrategy, "consistent-hash")
			h.Set(node.HeaderSession, session)
			rep, err := c.CompleteWithHeader(ctx, g.URL(), prompt("session-probe", k), 1, h)
			require.NoError(t, err)
			if rep != e.Name {
				all = false
				break
			}
		}
		if all {
			return session
		}
	}
	t.Fatalf("no consistent-hash session maps to %s", e.Name)
	return ""
}

// streamResult is how one long stream went.
type streamResult struct {
	gateway        string
	replica        string // x-kvmesh-replica; set before started closes
	firstChunk     time.Time
	end            time.Time
	chunks, tokens int // content chunks, usage.completion_tokens
	done           bool
	err            error
}

// drainStreams are long streams pinned to one engine; wait collects them.
// Its goroutines are owned by wait.
type drainStreams struct {
	e       *cluster.Engine
	tr      *http.Transport
	wg      sync.WaitGroup
	results []*streamResult
}

// drained sums a drain: streams on the removed engine, the shortest time
// one of them ran past the removal, load requests in flight then, and
// every long stream as load figures.
type drained struct {
	onGone, load int
	minAfter     time.Duration
	res          cluster.LoadResult
}

// startDrainStreams starts streams of drainTokens tokens, through the
// gateways in turn, with the consistent-hash session that maps to e, each
// once the previous one has received its first chunk. Consistent-hash
// bounds a replica's load, so a stream may land elsewhere where the bound
// is in reach (scaleOutAndIn raises its floor out of reach); it starts up
// to 12 streams until two are served by e, and fails the test otherwise.
func startDrainStreams(t *R, c *cluster.Cluster, e *cluster.Engine, session string) *drainStreams {
	t.Helper()
	d := &drainStreams{e: e, tr: &http.Transport{}}
	onE := 0
	for i := 0; i < 12 && onE < 2; i++ {
		gs := c.Gateways()
		g := gs[i%len(gs)]
		r := &streamResult{gateway: g.Name}
		d.results = append(d.results, r)
		started := make(chan struct{})
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			longStream(d.tr, g.URL(), c.Config().Model, session, prompt("drain-"+g.Name, i), r, started)
		}()
		select {
		case <-started:
		case <-time.After(20 * time.Second):
			d.wg.Wait() // bounded by the stream's own 60 s deadline
			t.Fatalf("stream %d through %s: no first chunk within 20 s", i, g.Name)
		}
		if r.replica == e.Name {
			onE++
		}
	}
	if onE < 2 {
		d.wg.Wait()
		t.Fatalf("only %d of %d streams with %s's session were served by it", onE, len(d.results), e.Name)
	}
	return d
}

// wait waits for every stream, checks each is complete (every token, a
// usage chunk, [DONE]) and that those served by the removed engine were
// still running when its removal applied at removedAt.
func (d *drainStreams) wait(t *R, removedAt time.Time) drained {
	t.Helper()
	d.wg.Wait()
	d.tr.CloseIdleConnections()
	out := drained{minAfter: time.Hour}
	for i, r := range d.results {
		out.res.Sent++
		require.NoError(t, r.err, "long stream %d via %s on %s", i, r.gateway, r.replica)
		require.True(t, r.done, "long stream %d via %s on %s ends with [DONE]", i, r.gateway, r.replica)
		require.Equal(t, drainTokens, r.chunks, "long stream %d via %s on %s: every token arrives", i, r.gateway, r.replica)
		require.Equal(t, drainTokens, r.tokens, "long stream %d via %s on %s: usage", i, r.gateway, r.replica)
		out.res.OK++
		if r.replica != d.e.Name {
			continue
		}
		out.onGone++
		require.True(t, r.end.After(removedAt),
			"long stream %d on %s ended %v before the removal applied: too short to test the drain", i, r.replica, removedAt.Sub(r.end))
		out.minAfter = min(out.minAfter, r.end.Sub(removedAt))
	}
	return out
}

// longStream sends one streaming completion of drainTokens tokens with
// the consistent-hash session and reads it to its end into r. It closes
// started once the first content chunk arrived (or the stream failed).
func longStream(tr *http.Transport, base, model, session, text string, r *streamResult, started chan struct{}) {
	once := sync.OnceFunc(func() { close(started) })
	defer once()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	body, err := json.Marshal(map[string]any{"model": model, "prompt": text, "max_tokens": drainTokens, "stream": true,
		"stream_options": map[string]bool{"include_usage": true}})
	if err != nil {
		r.err = err
		return
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		r.err = err
		return
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(node.HeaderStrategy, "consistent-hash")
	req.Header.Set(node.HeaderSession, session)
	resp, err := tr.RoundTrip(req)
	if err != nil {
		r.err = err
		return
	}
	defer resp.Body.Close()
	r.replica = resp.Header.Get(node.HeaderReplica)
	if resp.StatusCode != http.StatusOK {
		r.err = fmt.Errorf("status %d", resp.StatusCode)
		return
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			r.done = true
			continue
		}
		var chunk struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
			Usage *struct {
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
			Error json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			r.err = fmt.Errorf("chunk %q: %w", data, err)
			return
		}
		if chunk.Error != nil {
			r.err = fmt.Errorf("stream error event: %s", chunk.Error)
			return
		}
		if len(chunk.Choices) > 0 {
			r.chunks++
			if r.chunks == 1 {
				r.firstChunk = time.Now()
				once()
			}
		}
		if chunk.Usage != nil {
			r.tokens = chunk.Usage.CompletionTokens
		}
	}
	r.end = time.Now()
	if err := sc.Err(); err != nil {
		r.err = err
	}
}
