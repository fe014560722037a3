package suite

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/cluster"
)

// partitionRound is one cut of scenario 6: which gateway, which links.
type partitionRound struct {
	// leader: cut the raft leader (else a follower).
	leader bool
	links  cluster.Link
}

func (r partitionRound) String() string {
	who := "follower"
	if r.leader {
		who = "leader"
	}
	return who + " cut from " + r.links.String()
}

// Partition (scenario 6): three clustered gateways whose gossip and
// raft links run in memory and whose NATS connections each pass a fault
// proxy (cluster.Config.Partitionable), two engines, streaming client load
// spread over every gateway, clients and engines reachable from both sides.
// Each round cuts one gateway from its peers and checks, polling against
// deadlines:
//
//   - every client request is answered completely, on the cut gateway too
//     (it routes on its own view);
//   - a gateway cut from gossip sees itself alone and, by sync's
//     rendezvous ownership over the members it sees, owns every engine: it
//     subscribes to all of them, so its confirmed index keeps tracking
//     every engine (exact once the engines are quiet); the majority moves
//     the cut gateway's engines among its members and stays exact too;
//   - cut from NATS only, ownership does not move (gossip still sees
//     everyone): each engine's owner stays exact, the other views of it go
//     stale (nothing travels between the cut gateway and the others);
//   - cut from raft, a config write through the cut gateway (admin HTTP
//     API) is refused with 503 no_quorum within the store's apply timeout
//     and its config stays at its last version, while a write through the
//     majority commits on every majority gateway; cut from NATS only, a
//     write through it commits (raft is intact).
//
// Heal restores every link; then every gateway sees every member, every
// NATS connection is back, the raft configuration again has three voters,
// every gateway applies the same config version (the majority's write, not
// the refused one), and every gateway's confirmed index equals each
// engine's cached block set. The time from the heal to the last of these
// is the row's convergence figure.
func partition(t *R) {
	cfg := cluster.DefaultConfig()
	cfg.Gateways, cfg.Engines = 3, 2
	cfg.ClusterMode, cfg.ExternalNATS, cfg.Partitionable = true, true, true
	cfg.DataDir = t.TempDir()
	c := startCluster(t, cfg)

	rounds := []partitionRound{{leader: true, links: cluster.LinkAll}, {links: cluster.LinkNATS}}
	if t.Long {
		rounds = append(rounds,
			partitionRound{links: cluster.LinkAll},
			partitionRound{leader: true, links: cluster.LinkGossip | cluster.LinkRaft},
			partitionRound{leader: true, links: cluster.LinkAll},
			partitionRound{links: cluster.LinkNATS},
		)
	}
	var total cluster.LoadResult
	var worst time.Duration
	var notes []string
	var last cluster.Summary
	var failed error
	for i, r := range rounds {
		out := partitionOnce(t, c, i, r)
		total.Add(out.load)
		worst = max(worst, out.converge)
		last = out.after
		notes = append(notes, out.note)
		if out.err != nil {
			failed = out.err
			ps, _ := c.Compare()
			last = cluster.Summarize(ps)
			for _, p := range ps {
				t.Logf("after the heal %s/%s: %s", p.Gateway, p.Engine, p.Comparison)
			}
			t.Logf("config versions %s; NATS connected %d", c.ConfigVersions(), natsConnected(c))
			break
		}
	}
	res := cluster.Row{
		Scenario: "6 partition", Load: total, Precision: last.MinPrecision, Recall: last.MinRecall,
		Converge: worst, ConfigVersions: c.ConfigVersions(),
		Note: fmt.Sprintf("%d cuts; converge = heal to full membership, NATS, 3 raft voters, one config version and exact views; %s",
			len(notes), strings.Join(notes, "; ")),
	}
	if failed != nil {
		res.Note = "NOT CONVERGED after a heal; " + res.Note
	}
	t.Row(res)
	require.NoError(t, failed, "the cluster did not converge after a heal")
}

type partitionOutcome struct {
	load     cluster.LoadResult
	converge time.Duration
	after    cluster.Summary
	note     string
	err      error // the heal did not converge
}

func partitionOnce(t *R, c *cluster.Cluster, round int, r partitionRound) partitionOutcome {
	t.Helper()
	ctx := context.Background()
	gws := c.Gateways()
	awaitHealthy(t, c, "before the cut")
	settle(t, c, fmt.Sprintf("round %d: before the cut", round))

	g := pickGateway(t, c, r.leader, round)
	var majority []*cluster.Gateway
	for _, o := range gws {
		if o != g {
			majority = append(majority, o)
		}
	}
	before := g.Node.ConfigVersion()
	gossiped := func() float64 {
		return cluster.CounterSum(g.Node.Registry(), "kvmesh_sync_messages_published_total",
			map[string]string{"kind": "decisions", "transport": "gossip"})
	}
	gossipedBefore := gossiped()
	require.NoError(t, c.Isolate(g, r.links))
	cutAt := time.Now()
	t.Logf("round %d: %s (%s)", round, r, g.Name)

	// Config writes carry values unique per round, so the config every
	// gateway applies after the heal tells which writes won.
	inflightValue, refusedValue, majorityValue := 1000+3*round, 1001+3*round, 1002+3*round
	var refusal []string
	if r.leader && r.links&cluster.LinkRaft != 0 {
		// A write through the cut leader at once, while it still believes
		// it leads: it appends the entry, cannot commit it, steps down at
		// its lease timeout and answers no_quorum ("may still apply"); the
		// heal then overwrites the entry with the majority's log.
		start := time.Now()
		status, code, _, err := adminPatch(g, imbalancePatch(inflightValue))
		took := time.Since(start)
		require.NoError(t, err)
		require.Equal(t, http.StatusServiceUnavailable, status, "a write through the leader just cut off is refused (code %q)", code)
		require.Equal(t, "no_quorum", code)
		require.Less(t, took, 8*time.Second)
		refusal = append(refusal, fmt.Sprintf("write at the cut refused in %v", took.Round(time.Millisecond)))
	}

	// Client load over every gateway for the whole cut, paced so that it
	// outlasts the checks below; stopped once they are done.
	lc := loadConfig(c, fmt.Sprintf("partition-%d", round), t.Scale(2000, 6000))
	lc.MaxDuration = 45 * time.Second
	lc.Pace = pace(15 * time.Millisecond)
	load, err := cluster.StartLoad(ctx, lc)
	require.NoError(t, err)
	defer load.Stop()

	// The cut takes effect.
	if r.links&cluster.LinkGossip != 0 {
		require.Eventually(t, func() bool {
			if names := memberNames(g); len(names) != 1 || names[0] != g.Node.NodeID() {
				return false
			}
			for _, o := range majority {
				if slices.Contains(memberNames(o), g.Node.NodeID()) {
					return false
				}
			}
			return true
		}, 15*time.Second, 5*time.Millisecond, "the sides of the gossip cut declare each other failed")
	}
	if r.links&cluster.LinkNATS != 0 {
		require.Eventually(t, func() bool { return !g.Node.Cluster().NATSConnected() }, 10*time.Second, 5*time.Millisecond,
			"%s notices it lost NATS", g.Name)
	}
	detected := time.Since(cutAt)

	// Ownership: alone in its gossip view, the cut gateway owns (and
	// subscribes to) every engine; the majority owns every engine among
	// itself. Cut from NATS only, nothing moves.
	engines := c.Engines()
	if r.links&cluster.LinkGossip != 0 {
		require.Eventually(t, func() bool {
			for _, e := range engines {
				if !g.Node.Cluster().OwnsKV(e.Name) {
					return false
				}
				for _, o := range majority {
					if owner := o.Node.Cluster().KVOwner(e.Name); owner == g.Node.NodeID() || owner == "" {
						return false
					}
				}
			}
			return true
		}, 10*time.Second, 5*time.Millisecond, "the cut gateway owns every engine; the majority owns them among itself")
	}

	if r.links&cluster.LinkRaft != 0 {
		// The cut gateway forgets the leader (a cut leader steps down
		// after its lease; a cut follower's heartbeat times out), and the
		// majority elects or keeps one of its own.
		require.Eventually(t, func() bool {
			id, _ := g.Node.ConfigStore().Leader()
			return id == "" && leaderOf(majority) != nil
		}, 15*time.Second, 5*time.Millisecond, "the cut gateway loses the raft leader; the majority has one")
		start := time.Now()
		status, code, _, err := adminPatch(g, imbalancePatch(refusedValue))
		took := time.Since(start)
		require.NoError(t, err)
		require.Equal(t, http.StatusServiceUnavailable, status, "a config write through the raft minority is refused (code %q)", code)
		require.Equal(t, "no_quorum", code)
		// The store's apply timeout (3 s locally) plus scheduling slack on
		// a loaded machine.
		require.Less(t, took, 8*time.Second, "the refusal comes within the apply timeout")
		require.Equal(t, before, g.Node.ConfigVersion(), "the minority keeps its last config version")
		refusal = append(refusal, fmt.Sprintf("write in the minority refused in %v", took.Round(time.Millisecond)))
	}
	via := majority[0]
	if l := leaderOf(majority); l == via {
		via = majority[1] // a majority follower: the write is forwarded
	}
	v := adminPatchRetry(t, via, imbalancePatch(majorityValue), 15*time.Second)
	for _, o := range majority {
		require.Eventually(t, func() bool { return appliedValue(o, v) == majorityValue }, 10*time.Second, 5*time.Millisecond,
			"majority gateway %s applies the majority's write", o.Name)
	}
	if r.links&cluster.LinkRaft != 0 {
		require.Equal(t, before, g.Node.ConfigVersion(), "the minority did not apply the majority's write during the cut")
	} else {
		require.Eventually(t, func() bool { return appliedValue(g, v) == majorityValue }, 10*time.Second, 5*time.Millisecond,
			"cut from NATS only, %s still gets config through raft", g.Name)
		refusal = append(refusal, "the majority's write reached it over raft")
	}

	// Serving: let the load run on the cut gateway, then stop it and check
	// that every request was answered completely.
	// The load goes round robin over the three gateways: a third of it
	// reaches the cut one.
	servedBefore := load.Completed()
	require.Eventually(t, func() bool { return load.Completed() >= servedBefore+3*t.Scale(40, 200) }, 30*time.Second, 5*time.Millisecond)
	res := load.Stop()
	onCut := 0
	for _, x := range res.Results {
		if x.Target == g.URL() {
			require.Equal(t, cluster.OK, x.Outcome, "request %d to the cut gateway %s: %s", x.I, g.Name, x.Reason)
			onCut++
		}
	}
	require.Equal(t, res.Sent, res.OK, "every request answered completely during the cut: %s", res)
	require.Positive(t, onCut)

	// The views during the cut, with the engines quiet.
	var during cluster.Summary
	if r.links&cluster.LinkGossip != 0 {
		// Each side owns every engine: every view is exact.
		during, _ = settleWithin(t, c, fmt.Sprintf("round %d: every view exact during the gossip cut", round), 15*time.Second)
	} else {
		ps, err := c.Compare()
		require.NoError(t, err)
		during = cluster.Summarize(ps)
		awaitOwnersExact(t, c)
		// Gossip is intact: the cut gateway's routing decisions travel
		// over it instead of NATS.
		n := gossiped() - gossipedBefore
		require.Positive(t, n, "decision batches gossiped by %s while cut from NATS", g.Name)
		refusal = append(refusal, fmt.Sprintf("%.0f decision batches gossiped", n))
	}

	// Heal, then measure convergence. A step that misses its deadline
	// ends the round: the row is recorded as NOT CONVERGED, then the test
	// fails.
	require.NoError(t, c.Heal())
	healAt := time.Now()
	var steps []string
	out := partitionOutcome{load: res}
	step := func(what string, d time.Duration, cond func() bool) bool {
		if err := pollUntil(d, cond); err != nil {
			out.err = fmt.Errorf("round %d (%s): %s %w", round, r, what, err)
			return false
		}
		steps = append(steps, fmt.Sprintf("%s %v", what, time.Since(healAt).Round(time.Millisecond)))
		return true
	}
	healed := step("members", 20*time.Second, func() bool {
		for _, o := range gws {
			if len(memberNames(o)) != len(gws) {
				return false
			}
		}
		return true
	}) && step("nats", 20*time.Second, func() bool { return natsConnected(c) == len(gws) }) &&
		step("raft", 20*time.Second, func() bool { return votersSeen(c) == len(gws) }) &&
		step("config", 20*time.Second, func() bool {
			return c.ConfigConverged() && appliedValue(g, g.Node.ConfigVersion()) == majorityValue
		})
	if healed {
		var err error
		if out.after, _, err = trySettle(t, c, 20*time.Second); err != nil {
			out.err = fmt.Errorf("round %d (%s): exact views: %w", round, r, err)
		}
	}
	out.converge = time.Since(healAt)
	if out.err != nil {
		out.note = fmt.Sprintf("[%s: %s: %v after %v (%s)]", r, g.Name, out.err, out.converge.Round(time.Millisecond), strings.Join(steps, ", "))
		return out
	}
	steps = append(steps, fmt.Sprintf("exact %v", out.converge.Round(time.Millisecond)))
	for _, o := range gws {
		require.Equal(t, majorityValue, appliedValue(o, o.Node.ConfigVersion()),
			"the refused writes (%d, %d) never applied on %s", inflightValue, refusedValue, o.Name)
	}
	truncations := c.GatewayCounter("kvmesh_config_raft_log_tail_truncations_total", nil)
	out.note = fmt.Sprintf("[%s: %s; detected %v; %s; %d requests to it all ok; during: precision %.4f recall %.4f; after heal: %s; raft log tail truncations so far %.0f]",
		r, g.Name, detected.Round(time.Millisecond), strings.Join(refusal, ", "), onCut, during.MinPrecision, during.MinRecall,
		strings.Join(steps, ", "), truncations)
	t.Log(out.note)
	return out
}

// pollUntil polls cond every 5 ms until it holds (nil) or d passes
// (ErrNotConverged-like error naming d).
func pollUntil(d time.Duration, cond func() bool) error {
	deadline := time.Now().Add(d)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			return fmt.Errorf("not reached within %v", d)
		}
		<-tick.C
	}
	return nil
}

// awaitHealthy waits until every gateway sees every member, is connected
// to NATS and applies one config version, and the leader counts every
// gateway as a voter.
func awaitHealthy(t *R, c *cluster.Cluster, step string) {
	t.Helper()
	n := len(c.Gateways())
	require.Eventually(t, func() bool {
		for _, g := range c.Gateways() {
			if len(memberNames(g)) != n {
				return false
			}
		}
		return natsConnected(c) == n && votersSeen(c) == n && c.ConfigConverged()
	}, 20*time.Second, 5*time.Millisecond, "%s: cluster healthy (%s)", step, c.ConfigVersions())
}

// pickGateway returns the raft leader, or a follower (which one turns
// with round).
func pickGateway(t *R, c *cluster.Cluster, leader bool, round int) *cluster.Gateway {
	t.Helper()
	var l *cluster.Gateway
	require.Eventually(t, func() bool { l = leaderOf(c.Gateways()); return l != nil }, 10*time.Second, 5*time.Millisecond)
	if leader {
		return l
	}
	var followers []*cluster.Gateway
	for _, g := range c.Gateways() {
		if g != l {
			followers = append(followers, g)
		}
	}
	require.NotEmpty(t, followers)
	return followers[round%len(followers)]
}

// leaderOf returns the gateway of gs that leads raft, or nil.
func leaderOf(gs []*cluster.Gateway) *cluster.Gateway {
	for _, g := range gs {
		if st := g.Node.ConfigStore(); st != nil && st.IsLeader() {
			return g
		}
	}
	return nil
}

// votersSeen is the number of alive voters in the raft leader's view (0
// without a leader).
func votersSeen(c *cluster.Cluster) int {
	l := leaderOf(c.Gateways())
	if l == nil {
		return 0
	}
	n := 0
	for _, m := range l.Node.ConfigStore().Members() {
		if m.Alive && m.Suffrage == "voter" {
			n++
		}
	}
	return n
}

// memberNames is g's gossip view.
func memberNames(g *cluster.Gateway) []string {
	var out []string
	for _, m := range g.Node.Cluster().Members() {
		out = append(out, m.Name)
	}
	return out
}

// appliedValue is the imbalance_abs_count g's store holds, if its version
// is at least v (else -1).
func appliedValue(g *cluster.Gateway, v uint64) int {
	cur := g.Node.ConfigStore().Current()
	if cur == nil || cur.Config == nil || cur.Version < v {
		return -1
	}
	return cur.Config.PrefixCache.ImbalanceAbsCount
}

// awaitOwnersExact waits until each engine's owner holds exactly its
// cached blocks (every gateway agrees on the owner: gossip is intact).
func awaitOwnersExact(t *R, c *cluster.Cluster) {
	t.Helper()
	owners := map[string]string{}
	for _, e := range c.Engines() {
		owners[e.Name] = c.Gateways()[0].Node.Cluster().KVOwner(e.Name)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	_, _, err := c.AwaitTruth(ctx, 5*time.Millisecond, func(p cluster.Pair) bool {
		return owners[p.Engine] != p.Gateway || c.Exact(p)
	})
	require.NoError(t, err, "each engine's owner is exact while one gateway is cut from NATS (owners %v)", owners)
}

func imbalancePatch(v int) string {
	return fmt.Sprintf(`{"prefix_cache":{"imbalance_abs_count":%d}}`, v)
}

// adminPatch sends one PATCH /admin/v1/config to g's HTTP port and returns
// the status, the error code of a refusal, and the version of a success.
func adminPatch(g *cluster.Gateway, body string) (status int, code string, version uint64, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPatch, "http://"+g.Node.HTTPAddr()+"/admin/v1/config", strings.NewReader(body))
	if err != nil {
		return 0, "", 0, err
	}
	req.Header.Set("Authorization", "Bearer "+cluster.AdminToken)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", 0, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, "", 0, err
	}
	var out struct {
		Version uint64 `json:"version"`
		Error   struct {
			Code string `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal(raw, &out); err != nil {
		return 0, "", 0, fmt.Errorf("admin answer %q: %w", raw, err)
	}
	return resp.StatusCode, out.Error.Code, out.Version, nil
}

// adminPatchRetry sends the patch through g until it commits, retrying a
// 503 no_quorum (an election in progress) until d passes. The patch sets
// a value, so a retry of a write that did apply changes nothing.
func adminPatchRetry(t *R, g *cluster.Gateway, body string, d time.Duration) uint64 {
	t.Helper()
	deadline := time.Now().Add(d)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		status, code, v, err := adminPatch(g, body)
		require.NoError(t, err)
		if status == http.StatusOK {
			require.NotZero(t, v)
			return v
		}
		require.Equal(t, http.StatusServiceUnavailable, status, "config write through %s: code %q", g.Name, code)
		require.True(t, time.Now().Before(deadline), "config write through %s still refused after %v: %q", g.Name, d, code)
		<-tick.C
	}
}

// pace returns a LoadConfig.Pace that spaces requests by d.
func pace(d time.Duration) func(context.Context, int) {
	return func(ctx context.Context, _ int) {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-ctx.Done():
		case <-t.C:
		}
	}
}
