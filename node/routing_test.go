package node

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/route"
)

// queuedPeers is a PeerLoad whose peers also report queued prefill.
type queuedPeers struct {
	inflight, queued map[string]int
}

func (q queuedPeers) InFlight(name string) int      { return q.inflight[name] }
func (q queuedPeers) QueuedPrefill(name string) int { return q.queued[name] }

var _ PeerQueuedPrefill = queuedPeers{}

// TestPeerQueuedPrefillSteersCost: peers' queued prefill reaches the cost
// strategy as Candidate.PeerQueuedPrefillTokens. Two idle replicas hold
// nothing of the prompt and peers have one request in flight on each;
// whichever has 20,000 tokens of the peers' prefill queued (about 7 s at
// the prior rate) is avoided, every time.
func TestPeerQueuedPrefillSteersCost(t *testing.T) {
	a := newFakeEngine(t, "a")
	b := newFakeEngine(t, "b")
	n := startNode(t, nil, rc("a", a.url()), rc("b", b.url()))
	prompt := strings.Repeat("abcdefgh", 64)
	pick := func() string {
		t.Helper()
		resp, err := http.Get("http://" + n.HTTPAddr() + "/debug/route?model=m&strategy=cost&prompt=" + prompt)
		require.NoError(t, err)
		body := readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode, body)
		var rep debugReport
		require.NoError(t, json.Unmarshal([]byte(body), &rep))
		return rep.Pick
	}
	inflight := map[string]int{"a": 1, "b": 1}
	for _, busy := range []string{"a", "b"} {
		n.SetPeerLoad(queuedPeers{inflight: inflight, queued: map[string]int{busy: 20000}})
		for range 10 {
			assert.NotEqual(t, busy, pick(), "peers have 20,000 prefill tokens queued on %s", busy)
		}
	}
	// A PeerLoad without QueuedPrefill leaves the figure unknown: both
	// replicas are picked.
	n.SetPeerLoad(fixedPeers(inflight))
	seen := map[string]bool{}
	for i := 0; i < 64 && len(seen) < 2; i++ {
		seen[pick()] = true
	}
	assert.Len(t, seen, 2)
}

// TestStreamTokensTimeTheStep: the tokens a stream relays tell the load
// view when the replica's engine step ends (route.Candidate.LastTokenAt,
// StepNanos). Content events count; the usage event and [DONE] after them
// do not, so the last token is the last content event's read, which the
// client receives after the gateway read it (one clock: one process).
func TestStreamTokensTimeTheStep(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.chunks.Store(4)
	e.chunkDelay.Store(int64(20 * time.Millisecond))
	e.tailDelay.Store(int64(300 * time.Millisecond))
	n := startNode(t, nil, rc("a", e.url()))
	r := n.tbl.Load().byName["a"]
	require.Zero(t, r.lastToken.Load(), "no stream yet")

	start := time.Now().UnixNano()
	resp, err := http.Post("http://"+n.HTTPAddr()+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"m","prompt":"hello","stream":true}`))
	require.NoError(t, err)
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	var lastContent int64 // when the client read the last content event
	for {
		line, err := br.ReadString('\n')
		if strings.Contains(line, `"text":"tok3"`) {
			lastContent = time.Now().UnixNano()
		}
		if err != nil {
			break
		}
	}
	require.NotZero(t, lastContent, "the stream carried tok3")
	end := time.Now().UnixNano()

	last, step := r.lastToken.Load(), r.stepNanos.Load()
	assert.GreaterOrEqual(t, last, start)
	assert.LessOrEqual(t, last, lastContent, "the last token is the last content event, not the usage event 300 ms later")
	assert.Positive(t, step, "a gap between two tokens of the stream")
	assert.Less(t, step, end-start)

	s := &scratch{reps: []*replica{r}}
	var c route.Candidate
	s.Candidate(0, &c)
	assert.Equal(t, last, c.LastTokenAt)
	assert.Equal(t, step, c.StepNanos)
}

// TestScrapeRecordsInFlightBaseline: a scrape records the gateway's own
// in-flight count beside the engine's figures, and the load view passes
// it on only without peers' reports (route.Candidate.ScrapedInFlight):
// with peers, whose reports are stale by another amount, the cost model
// takes the larger count instead.
func TestScrapeRecordsInFlightBaseline(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.chunks.Store(3)
	e.chunkDelay.Store(int64(time.Hour)) // the stream stays open
	e.running.Store(5)
	n := startNode(t, nil, rc("a", e.url()))
	r := n.tbl.Load().byName["a"]

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+n.HTTPAddr()+"/v1/completions",
		strings.NewReader(`{"model":"m","prompt":"hello","stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	_, err = bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	require.EqualValues(t, 1, r.inflight.Load())
	require.Eventually(t, func() bool { return r.scrapedInFlight.Load() == 1 && r.running.Load() == 5 },
		10*time.Second, 5*time.Millisecond, "a scrape while the stream is open records it")

	s := &scratch{reps: []*replica{r}}
	var c route.Candidate
	s.Candidate(0, &c)
	assert.True(t, c.ScrapedInFlightKnown)
	assert.Equal(t, 1, c.ScrapedInFlight)
	assert.Equal(t, 5, c.Running)

	s.peers = queuedPeers{inflight: map[string]int{"a": 2}}
	c = route.Candidate{}
	s.Candidate(0, &c)
	assert.False(t, c.ScrapedInFlightKnown, "peers report their load")
	assert.Equal(t, 3, c.InFlight)
}

// TestScrapeRecordsQueuedPrefill: a scrape records the prefill queued when
// it was read, this gateway's and the peers' reported, and the load view
// passes it on as it was then (route.Candidate.ScrapedQueuedPrefillTokens),
// while QueuedPrefillTokens follows the prefill queued now.
func TestScrapeRecordsQueuedPrefill(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.running.Store(2)
	e.waiting.Store(1)
	n := startNode(t, func(c *Config) { c.ScrapeInterval = 0 }, rc("a", e.url())) // scraped here only
	r := n.tbl.Load().byName["a"]
	view := func() route.Candidate {
		var c route.Candidate
		s := &scratch{reps: []*replica{r}, peers: n.peerLoad()}
		s.peerQueued, _ = s.peers.(PeerQueuedPrefill)
		s.Candidate(0, &c)
		return c
	}

	r.queuedPrefill.Store(5000)
	n.scrape(t.Context(), r)
	r.queuedPrefill.Store(0) // the prompt's first token came
	c := view()
	assert.Zero(t, c.QueuedPrefillTokens)
	assert.Equal(t, 5000, c.ScrapedQueuedPrefillTokens, "queued when the scrape was read")
	assert.Equal(t, 1, c.Waiting)

	n.scrape(t.Context(), r)
	assert.Zero(t, view().ScrapedQueuedPrefillTokens, "the next scrape finds none queued")

	n.SetPeerLoad(queuedPeers{inflight: map[string]int{"a": 1}, queued: map[string]int{"a": 700}})
	r.queuedPrefill.Store(300)
	n.scrape(t.Context(), r)
	c = view()
	assert.Equal(t, 1000, c.ScrapedQueuedPrefillTokens, "this gateway's and the peers'")
	assert.Equal(t, 700, c.PeerQueuedPrefillTokens)
}

// TestScrapeNewsResetsUnshownSends: vLLM's gauges are as of the engine's
// last step, so a scrape that reads the same figures with no token from
// the replica since the last one says nothing of the requests sent since:
// they stay counted as unshown (route.Candidate.UnshownSent) beside the
// in-flight count of the last news. Changed figures, or a token since the
// last scrape (a step ended), are news and reset both.
func TestScrapeNewsResetsUnshownSends(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.running.Store(2)
	n := startNode(t, func(c *Config) { c.ScrapeInterval = 0 }, rc("a", e.url())) // scraped here only
	r := n.tbl.Load().byName["a"]
	view := func() route.Candidate {
		var c route.Candidate
		(&scratch{reps: []*replica{r}}).Candidate(0, &c)
		require.True(t, c.ScrapedInFlightKnown)
		return c
	}
	n.scrape(t.Context(), r)
	require.Zero(t, view().UnshownSent)

	send := func(body string) {
		t.Helper()
		resp := post(t, n, "/v1/completions", body, nil)
		readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	send(`{"model":"m","prompt":"hello"}`) // no stream: no token timing
	send(`{"model":"m","prompt":"hello"}`)
	n.scrape(t.Context(), r)
	c := view()
	assert.Equal(t, 2, c.UnshownSent, "the same figures and no token: the sends are not shown yet")
	assert.Zero(t, c.ScrapedInFlight)

	e.running.Store(3)
	n.scrape(t.Context(), r)
	assert.Zero(t, view().UnshownSent, "changed figures are news")

	send(`{"model":"m","prompt":"hello","stream":true}`)
	require.NotZero(t, r.lastToken.Load())
	assert.Equal(t, 1, view().UnshownSent)
	n.scrape(t.Context(), r)
	assert.Zero(t, view().UnshownSent, "a token since the last scrape: a step ended")

	// A step of 100 ms ended now. Requests sent before it began show in
	// the news; those sent since may not (route.SendLog.Unshown).
	ms := int64(time.Millisecond)
	require.Zero(t, r.sends.Len(), "the requests above ended")
	now := nowNanos()
	sent := []int64{now - 300*ms, now - 50*ms, now - 10*ms}
	for _, at := range sent { // three requests in flight, sent at these times
		r.inflight.Add(1)
		r.sent(at, 0)
	}
	r.sawToken(now, now-100*ms)
	n.scrape(t.Context(), r)
	c = view()
	assert.Equal(t, 2, c.UnshownSent, "sent during the step that ended with the last token")
	assert.Equal(t, 3, c.ScrapedInFlight, "all three count as this gateway's")
	for _, at := range sent[1:] {
		r.inflight.Add(-1)
		r.ended(at, 0, true)
	}
	r.sawToken(nowNanos(), now-100*ms)
	n.scrape(t.Context(), r)
	assert.Equal(t, 0, view().UnshownSent, "only those still in flight")
	r.inflight.Add(-1)
	r.ended(sent[0], 0, true)
}

// TestProxyLogsSendsInFlight: the candidate carries when this gateway
// sent the requests it has in flight to the replica and the prompt each
// left to compute there (route.Candidate.Sends, which cost reads for a
// full running set's slot wait): each proxied request from its send
// until its stream ends, whether the stream completes or the client goes
// away.
func TestProxyLogsSendsInFlight(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.firstDelay.Store(int64(time.Hour)) // streams stay open until cancelled
	n := startNode(t, nil, rc("a", e.url()))
	r := n.tbl.Load().byName["a"]
	before := nowNanos()
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() { postDrained(ctx, t, n, streamReq) })
	}
	<-e.started
	<-e.started
	l := candidateSends(r)
	require.NotNil(t, l)
	require.Equal(t, 2, l.Len(), "both requests in flight")
	// No first token yet: the prompts the two decisions left to compute
	// are what the log carries, and all that is queued there.
	queued := int(r.queuedPrefill.Load())
	require.Positive(t, queued)
	_, since, ok := l.Recent(2)
	require.True(t, ok)
	require.Equal(t, queued, since, "the log carries each decision's uncached prompt")
	for j := 1; j <= 2; j++ {
		at, _, ok := l.Recent(j)
		require.True(t, ok)
		require.GreaterOrEqual(t, at, before)
		require.LessOrEqual(t, at, nowNanos())
	}
	cancel()
	wg.Wait()
	require.Eventually(t, func() bool { return l.Len() == 0 && r.inflight.Load() == 0 }, 10*time.Second, time.Millisecond,
		"the streams ended: nothing in flight")

	e.firstDelay.Store(0)
	resp := post(t, n, "/v1/completions", streamReq, nil)
	readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Eventually(t, func() bool { return l.Len() == 0 }, 10*time.Second, time.Millisecond, "a completed stream leaves too")
}

// postDrained posts body to n's /v1/completions under ctx and reads the
// answer, if one comes, to its end: ctx's cancellation is the client
// leaving.
func postDrained(ctx context.Context, t testing.TB, n *Node, body string) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+n.HTTPAddr()+"/v1/completions", strings.NewReader(body))
	if !assert.NoError(t, err) {
		return
	}
	if resp, err := http.DefaultClient.Do(req); err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

// candidateSends is the send log the cost model reads for r
// (route.Candidate.Sends).
func candidateSends(r *replica) *route.SendLog {
	var c route.Candidate
	(&scratch{reps: []*replica{r}}).Candidate(0, &c)
	return c.Sends
}

// TestProxyTakesBackPromptsNeverComputed: while a request waits for its
// first token, the prompts of requests sent after it count as prefill the
// replica computed meanwhile (route.SendLog.Recent, cost's slot wait)
// once a successful response began, but not when the engine answered
// with an error or the client left before the first token: the replica
// never computed those.
func TestProxyTakesBackPromptsNeverComputed(t *testing.T) {
	e := newFakeEngine(t, "a")
	e.firstDelay.Store(int64(time.Hour))
	n := startNode(t, nil, rc("a", e.url()))
	r := n.tbl.Load().byName["a"]
	l := candidateSends(r)
	// body is a streaming request for a prompt of its own, named.
	body := func(name string) string {
		return fmt.Sprintf(`{"model":"m","prompt":"%s, a prompt long enough to fill a block or two of characters for the index","stream":true,"max_tokens":5}`, name)
	}
	// stream sends body(name) and returns once the engine has it; cancel
	// ends it, done tells when its response was read.
	stream := func(name string) (cancel context.CancelFunc, done <-chan struct{}) {
		ctx, cancel := context.WithCancel(t.Context())
		ch := make(chan struct{})
		go func() {
			defer close(ch)
			postDrained(ctx, t, n, body(name))
		}()
		<-e.started
		return cancel, ch
	}
	since := func() int {
		t.Helper()
		require.Equal(t, 1, l.Len(), "the waiting request alone in flight")
		_, since, ok := l.Recent(1)
		require.True(t, ok)
		return since
	}

	cancelWaiting, _ := stream("waiting")
	defer cancelWaiting()
	own := int(r.queuedPrefill.Load())
	require.Positive(t, own)
	require.Equal(t, own, since())

	// The client leaves before the first token.
	cancelLeft, left := stream("left")
	cancelLeft()
	<-left
	require.Eventually(t, func() bool { return l.Len() == 1 }, 10*time.Second, time.Millisecond)
	require.Equal(t, own, since(), "a request that left before its first token is taken back")

	// The engine answers with an error.
	e.status.Store(http.StatusBadRequest)
	resp := post(t, n, "/v1/completions", body("refused"), nil)
	readAll(t, resp)
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
	<-e.started // the engine had it
	e.status.Store(0)
	require.Eventually(t, func() bool { return l.Len() == 1 }, 10*time.Second, time.Millisecond)
	require.Equal(t, own, since(), "an error answer's prompt is taken back")

	// A stream that gets its first token, then waits: its prompt was
	// computed, and still counts once the client leaves.
	e.firstDelay.Store(0)
	e.chunkDelay.Store(int64(time.Hour))
	e.tailDelay.Store(int64(time.Hour))
	cancelServed, served := stream("served")
	require.Eventually(t, func() bool { return r.queuedPrefill.Load() == int64(own) }, 10*time.Second, time.Millisecond,
		"the first token came: its queued prefill is released")
	_, other, ok := l.Recent(1)
	require.True(t, ok)
	require.Positive(t, other, "its own prompt")
	cancelServed()
	<-served
	require.Eventually(t, func() bool { return l.Len() == 1 }, 10*time.Second, time.Millisecond)
	require.Equal(t, own+other, since(), "a served stream's prompt counts for the request sent before it")
}
