package node

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
