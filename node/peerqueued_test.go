package node

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	gosync "sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/route"
)

// gatedEngine is a fake engine whose completions wait, before the engine
// answers at all, until gate closes: a prefill that has not produced its
// first token. Everything else is the fake engine's.
func gatedEngine(t testing.TB, name string, gate <-chan struct{}) string {
	e := newFakeEngine(t, name)
	e.chunks.Store(2)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/completions") {
			select {
			case <-gate:
			case <-r.Context().Done():
				return
			}
		}
		e.srv.Config.Handler.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// candidateOf routes prompt on n as a request would (least-request, no
// side effects) and returns the route.Candidate the strategy saw for
// replica.
func candidateOf(t testing.TB, n *Node, replica, prompt string) route.Candidate {
	t.Helper()
	tbl := n.tbl.Load()
	p := tbl.models["m"].pool
	strat, err := p.set.Get(route.NameLeastRequest)
	require.NoError(t, err)
	h := n.Index().Hasher()
	keys := h.AppendKeysString(nil, h.Root("m", "", ""), prompt)
	s := getScratch()
	defer putScratch(s)
	rr := route.Request{TotalBlocks: len(keys), BlockTokens: 16, PromptTokens: len(prompt), Now: time.Now().UnixNano()}
	_, _, err = n.routeOnce(p, strat, keys, &rr, s, nil, nil)
	require.NoError(t, err)
	for _, c := range s.core.Candidates() {
		if c.Name == replica {
			return c
		}
	}
	t.Fatalf("replica %s is not a candidate on %s", replica, n.NodeID())
	return route.Candidate{}
}

// TestPeerQueuedPrefillAcrossGateways: a request whose prefill is queued on
// a replica through gateway A shows up, through the cluster's load reports,
// as PeerQueuedPrefillTokens of that replica in gateway B's routing
// candidates, equal to A's own figure, and drops to 0 once the engine's
// first token came back (while the request is still in flight).
func TestPeerQueuedPrefillAcrossGateways(t *testing.T) {
	gate := make(chan struct{})
	var closeGate gosync.Once
	open := func() { closeGate.Do(func() { close(gate) }) }
	reps := []ReplicaConfig{rc("e", gatedEngine(t, "e", gate)), rc("f", gatedEngine(t, "f", gate))}
	a, _ := startGateway(t, gwConfig("gw-a", t.TempDir(), nil, 2, reps...))
	b, _ := startGateway(t, gwConfig("gw-b", t.TempDir(), []string{a.Cluster().GossipAddr()}, 2, reps...))
	waitReady(t, a, b)
	// Cleanups run last-in first-out: the gate opens before the gateways
	// and engines stop, so a failing test does not leave a handler blocked.
	t.Cleanup(open)
	for _, g := range []*Node{a, b} {
		require.Eventually(t, func() bool { return len(g.Cluster().Members()) == 2 }, 10*time.Second, time.Millisecond)
	}

	prompt := "Queued prefill\n" + strings.Repeat("A peer's prefill is queued work. ", 40)
	for _, name := range []string{"e", "f"} {
		require.Zero(t, candidateOf(t, b, name, prompt).PeerQueuedPrefillTokens)
	}

	// A streaming request through A; its engine holds it before the first
	// token.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	body := fmt.Sprintf(`{"model":"m","prompt":%q,"stream":true,"max_tokens":2}`, prompt)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+a.HTTPAddr()+"/v1/completions", strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	type result struct {
		resp *http.Response
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		done <- result{resp, err}
	}()

	target, other := "", ""
	require.Eventually(t, func() bool {
		for _, name := range []string{"e", "f"} {
			if a.tbl.Load().byName[name].queuedPrefill.Load() > 0 {
				target, other = name, map[string]string{"e": "f", "f": "e"}[name]
				return true
			}
		}
		return false
	}, 10*time.Second, time.Millisecond, "A counts the request's prefill as queued")
	repA := a.tbl.Load().byName[target]
	want := int(repA.queuedPrefill.Load())
	require.Eventually(t, func() bool {
		c := candidateOf(t, b, target, prompt)
		return c.PeerQueuedPrefillTokens == want && c.InFlight == 1 && c.LocalInFlight == 0
	}, 10*time.Second, time.Millisecond, "B sees A's queued prefill on %s", target)
	require.Zero(t, candidateOf(t, b, other, prompt).PeerQueuedPrefillTokens, "only the replica it was sent to")
	require.Zero(t, candidateOf(t, a, target, prompt).PeerQueuedPrefillTokens, "A does not count its own as a peer's")
	t.Logf("A queued %d prefill tokens on %s; B sees them as a peer's", want, target)

	// First token: A's queued prefill is released and B's view follows,
	// while the request is still in flight.
	open()
	var res result
	select {
	case res = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("no response headers from A")
	}
	require.NoError(t, res.err)
	defer res.resp.Body.Close()
	require.Equal(t, http.StatusOK, res.resp.StatusCode)
	line, err := bufio.NewReader(res.resp.Body).ReadString('\n')
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(line, "data: "), line)
	require.Eventually(t, func() bool { return repA.queuedPrefill.Load() == 0 }, 10*time.Second, time.Millisecond)
	require.Eventually(t, func() bool { return candidateOf(t, b, target, prompt).PeerQueuedPrefillTokens == 0 },
		10*time.Second, time.Millisecond, "B drops A's queued prefill after the first token")
}
