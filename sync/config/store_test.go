package config

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestWriteViaFollowerReachesAll(t *testing.T) {
	c := newCluster(t, 3, 3, false, steadyRaft) // each write must commit in one go
	c.waitLeader(10 * time.Second)

	var mu sync.Mutex
	seen := map[string][]uint64{}
	for _, nd := range c.nodes {
		cancel := nd.store.OnApply(func(v *Versioned) {
			mu.Lock()
			seen[nd.id] = append(seen[nd.id], v.Version)
			mu.Unlock()
		})
		t.Cleanup(cancel)
	}

	f := c.follower()
	cfg := testConfig()
	v1, err := f.client(t, testToken).SetConfig(ctxT(t, 5*time.Second), &cfg, Version(0))
	require.NoError(t, err)
	require.NotZero(t, v1)
	c.waitVersion(v1, c.nodes...)
	for _, nd := range c.nodes {
		got := nd.store.Current()
		require.Equal(t, cfg, *got.Config, nd.id)
	}

	// Error kinds survive forwarding: a stale compare-and-set.
	_, err = f.client(t, testToken).SetConfig(ctxT(t, 5*time.Second), &cfg, Version(v1-1))
	require.ErrorIs(t, err, ErrVersionConflict)
	_, err = f.store.RemoveReplica(ctxT(t, 5*time.Second), "nope", "r0")
	require.ErrorIs(t, err, ErrNotFound)

	// A second write through the same follower, by a helper command.
	v2, err := f.store.AddReplica(ctxT(t, 5*time.Second), "chat", ReplicaConfig{Name: "r2", URL: "http://127.0.0.1:8002"})
	require.NoError(t, err)
	require.Greater(t, v2, v1)
	c.waitVersion(v2, c.nodes...)

	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, nd := range c.nodes {
			s := seen[nd.id]
			if len(s) == 0 || s[len(s)-1] != v2 {
				return false
			}
		}
		return true
	}, 5*time.Second, 5*time.Millisecond, "every subscriber ends at the last version")
	mu.Lock()
	for id, s := range seen {
		for i := 1; i < len(s); i++ {
			require.Greater(t, s[i], s[i-1], "%s: versions delivered in order", id)
		}
	}
	mu.Unlock()

	require.GreaterOrEqual(t, metricValue(t, f.store.metrics.forwarded.WithLabelValues("ok")), 2.0)
	leaders := 0.0
	for _, nd := range c.nodes {
		require.Equal(t, float64(v2), metricValue(t, nd.store.metrics.version))
		leaders += metricValue(t, nd.store.metrics.leader)
	}
	require.Equal(t, 1.0, leaders)
	require.Eventually(t, func() bool { return metricValue(t, f.store.metrics.voters) == 3 }, 2*time.Second, 10*time.Millisecond)
}

func TestLeaderKilledNewLeaderWritesResume(t *testing.T) {
	c := newCluster(t, 3, 3, false, nil)
	cfg := testConfig()
	v1 := writeEventually(t, 10*time.Second, func() (uint64, error) {
		return c.waitLeader(10*time.Second).store.Set(ctxT(t, 5*time.Second), cfg, nil)
	})
	c.waitVersion(v1, c.nodes...)
	old := c.waitLeader(10 * time.Second) // a retried write may have moved leadership

	killed := time.Now()
	c.stop(old)
	bound := electionBound(old.store.cfg)
	next := c.waitLeader(bound)
	took := time.Since(killed)
	t.Logf("new leader %s after %v (election timeout %v, bound %v)", next.id, took, old.store.cfg.ElectionTimeout, bound)
	require.NotEqual(t, old.id, next.id)

	// The patch must change the strategy: the default is already cost,
	// and a retry that finds its first attempt applied reads the version
	// from the strategy (a CI run read v1's "cost" and took v1 for v2).
	f := c.follower()
	v2 := writeEventually(t, 10*time.Second, func() (uint64, error) {
		v, err := f.client(t, testToken).PatchConfig(ctxT(t, 5*time.Second), []byte(`{"strategy":"least-request"}`), Version(v1))
		if errors.Is(err, ErrVersionConflict) {
			// A compare-and-set retried after an attempt that did apply:
			// nothing else writes here, so the version moved on by it.
			return appliedVersion(t, c, "least-request"), nil
		}
		return v, err
	})
	require.Greater(t, v2, v1)
	c.waitVersion(v2, c.live()...)
	require.Equal(t, "least-request", f.store.Current().Config.Strategy)
}

// partition cuts nd off from every other node of an in-memory cluster.
func (c *testCluster) partition(nd *testNode) {
	nd.trans.DisconnectAll()
	for _, o := range c.nodes {
		if o != nd {
			o.trans.Disconnect(nd.trans.LocalAddr())
		}
	}
}

func (c *testCluster) heal() {
	for _, a := range c.nodes {
		for _, b := range c.nodes {
			if a != b {
				a.trans.Connect(b.trans.LocalAddr(), b.trans)
			}
		}
	}
}

// writeEventually calls write until it succeeds, again while it fails
// with ErrNoQuorum, for up to within, and returns the version it applied.
// It is for steps that assert that a quorum takes writes at all: with the
// 100 ms lease of LocalStoreConfig, one stall of the leader on a loaded
// machine makes it step down mid-write ("leadership lost while committing",
// which the store reports and never resends, since the write may still
// apply), and that election is not what such a step tests. Only idempotent
// writes go through it, so one that did apply before a retry changes
// nothing but the version.
func writeEventually(t *testing.T, within time.Duration, write func() (uint64, error)) uint64 {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		v, err := write()
		if err == nil {
			return v
		}
		if !errors.Is(err, ErrNoQuorum) || time.Now().After(deadline) {
			require.NoError(t, err)
		}
		t.Logf("write refused, retrying: %v", err)
		time.Sleep(20 * time.Millisecond) // backoff between attempts, not a wait for a condition
	}
}

// appliedVersion waits until a live node has applied a config with the
// given strategy and returns that config's version.
func appliedVersion(t *testing.T, c *testCluster, strategy string) uint64 {
	t.Helper()
	var v uint64
	require.Eventually(t, func() bool {
		for _, nd := range c.live() {
			if cur := nd.store.Current(); cur != nil && cur.Config != nil && cur.Config.Strategy == strategy {
				v = cur.Version
				return true
			}
		}
		return false
	}, 10*time.Second, 10*time.Millisecond, "no node applied strategy %q", strategy)
	return v
}

func TestMinorityPartitionRefusesWrites(t *testing.T) {
	c := newCluster(t, 3, 3, true, func(cfg *StoreConfig) { cfg.ApplyTimeout = time.Second })
	leader := c.waitLeader(10 * time.Second)
	cfg := testConfig()
	v1 := writeEventually(t, 10*time.Second, func() (uint64, error) {
		return leader.store.Set(ctxT(t, 5*time.Second), cfg, nil)
	})
	c.waitVersion(v1, c.nodes...)

	// A follower alone: it loses its leader and cannot elect itself.
	minority := c.follower()
	c.partition(minority)
	require.Eventually(t, func() bool { id, _ := minority.store.Leader(); return id == "" }, 5*time.Second, 5*time.Millisecond)

	start := time.Now()
	_, err := minority.store.Patch(context.Background(), []byte(`{"strategy":"random"}`), nil)
	require.ErrorIs(t, err, ErrNoQuorum)
	require.Contains(t, err.Error(), "no raft quorum")
	require.Less(t, time.Since(start), 3*time.Second, "refused within the bounded timeout")

	// The same over gRPC: Unavailable with the reason in the message.
	_, err = minority.client(t, testToken).PatchConfig(ctxT(t, 5*time.Second), []byte(`{"strategy":"random"}`), nil)
	require.ErrorIs(t, err, ErrNoQuorum)
	require.Equal(t, codes.Unavailable, status.Code(err))
	require.Contains(t, err.Error(), "no raft quorum")

	// And over HTTP: 503 with the stable code no_quorum.
	h := httptest.NewServer(minority.srv.Handler())
	defer h.Close()
	r := do(t, h.URL, testToken, "PATCH", "/admin/v1/config", `{"strategy":"random"}`, nil)
	require.Equal(t, http.StatusServiceUnavailable, r.code)
	require.Equal(t, "no_quorum", errCode(t, r))

	// The minority keeps serving the last applied config.
	require.Equal(t, v1, minority.store.Current().Version)
	require.Equal(t, cfg, *minority.store.Current().Config)

	// The majority still takes writes.
	var majority []*testNode
	for _, nd := range c.nodes {
		if nd != minority {
			majority = append(majority, nd)
		}
	}
	v2 := writeEventually(t, 10*time.Second, func() (uint64, error) {
		return majority[0].store.Patch(ctxT(t, 5*time.Second), []byte(`{"strategy":"least-request"}`), nil)
	})
	c.waitVersion(v2, majority...)
	require.Equal(t, v1, minority.store.Current().Version)

	// Heal: the minority catches up.
	c.heal()
	c.waitVersion(v2, c.nodes...)

	// Now isolate the leader itself: it steps down and refuses too.
	leader = c.waitLeader(10 * time.Second)
	c.partition(leader)
	_, err = leader.store.Patch(context.Background(), []byte(`{"strategy":"random"}`), nil)
	require.ErrorIs(t, err, ErrNoQuorum)
	require.Equal(t, "least-request", leader.store.Current().Config.Strategy)
	c.heal()
	c.waitLeader(10 * time.Second)
}

func TestRestartAllKeepsConfig(t *testing.T) {
	if testing.Short() {
		t.Skip("restarts a whole cluster; run without -short")
	}
	seed := testConfig()
	seed.Strategy = route_cost
	c := newCluster(t, 3, 3, false, func(cfg *StoreConfig) {
		steadyRaft(cfg) // each of the three writes must commit in one go
		cfg.Seed = &seed
		cfg.SnapshotThreshold = 2
	})
	leader := c.waitLeader(10 * time.Second)
	// The seed is applied once by the first leader.
	require.Eventually(t, func() bool { return leader.store.Current().Version > 0 }, 5*time.Second, 5*time.Millisecond)
	require.Equal(t, seed, *leader.store.Current().Config)

	v, err := leader.store.Patch(ctxT(t, 5*time.Second), []byte(`{"prefix_cache":{"imbalance_abs_count":5}}`), nil)
	require.NoError(t, err)
	c.waitVersion(v, c.nodes...)
	// Snapshot on every node, then write once more so the restart needs
	// both the snapshot and the log after it.
	for _, nd := range c.nodes {
		require.NoError(t, nd.store.raft.Snapshot().Error())
	}
	f := c.follower()
	v, err = f.store.RemoveReplica(ctxT(t, 5*time.Second), "chat", "r0")
	require.NoError(t, err)
	c.waitVersion(v, c.nodes...)
	want := *leader.store.Current().Config

	for _, nd := range c.nodes {
		c.stop(nd)
	}
	for _, nd := range c.nodes {
		c.start(nd) // same data dir, new ports: membership carries them
	}
	for _, nd := range c.nodes {
		require.NoError(t, nd.store.WaitLeader(ctxT(t, 10*time.Second)))
	}
	c.waitVersion(v, c.nodes...)
	for _, nd := range c.nodes {
		require.Equal(t, want, *nd.store.Current().Config, nd.id)
	}
	require.Equal(t, 5, want.PrefixCache.ImbalanceAbsCount)
	require.Len(t, want.Models["chat"].Replicas, 1)
	// And writes work after the restart.
	_, err = c.follower().store.Patch(ctxT(t, 5*time.Second), []byte(`{"hash_seed":7}`), Version(v))
	require.NoError(t, err)
}

const route_cost = "cost"

func TestInvalidConfigRejected(t *testing.T) {
	// The invalid entry below goes to raft directly, as an old node's
	// would, with no store retry around it: a heartbeat stall on a busy
	// machine must not cost the leader its lease while it commits (CI
	// once: "leadership lost while committing log", three CI runs at once).
	c := newCluster(t, 3, 3, false, steadyRaft)
	leader := c.waitLeader(10 * time.Second)
	good := testConfig()
	v1, err := leader.store.Set(ctxT(t, 5*time.Second), good, nil)
	require.NoError(t, err)
	c.waitVersion(v1, c.nodes...)

	bad := testConfig()
	bad.Models["chat"].Replicas[1].URL = "not a url"
	f := c.follower()
	_, err = f.client(t, testToken).SetConfig(ctxT(t, 5*time.Second), &bad, nil)
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), `models["chat"].replicas[1].url`)
	_, err = f.store.Set(ctxT(t, 5*time.Second), bad, nil)
	require.ErrorIs(t, err, ErrInvalidConfig)
	// A patch whose result is invalid is refused by the leader's check.
	_, err = f.store.Patch(ctxT(t, 5*time.Second), []byte(`{"prefix_cache":{"stddev_factor":-3}}`), nil)
	require.ErrorIs(t, err, ErrInvalidConfig)
	require.Contains(t, err.Error(), "prefix_cache")
	// Nothing reached the raft log: once every node has applied what the
	// leader holds, no FSM has applied a command since v1, rejected or
	// not. (The log's last index is no measure: on a busy machine an
	// election appends the new leader's no-op entry.)
	leader = c.waitLeader(10 * time.Second)
	require.NoError(t, leader.store.raft.Barrier(5*time.Second).Error())
	end := leader.store.raft.LastIndex()
	for _, nd := range c.nodes {
		require.Eventually(t, func() bool { return nd.store.raft.AppliedIndex() >= end }, 5*time.Second, 5*time.Millisecond, nd.id)
		require.Zero(t, metricValue(t, nd.store.metrics.applies.WithLabelValues("rejected")), "nothing reached the raft log (%s)", nd.id)
		require.Equal(t, v1, nd.store.Current().Version, nd.id)
	}

	// An invalid entry that does reach the log (here: proposed straight to
	// raft, as an old or buggy node might) is rejected by every FSM.
	data, err := encodeCommand(SetCommand(bad, nil))
	require.NoError(t, err)
	fut := leader.store.raft.Apply(data, time.Second)
	require.NoError(t, fut.Error())
	res := fut.Response().(applyResult)
	require.ErrorIs(t, res.err, ErrInvalidConfig)
	for _, nd := range c.nodes {
		require.Eventually(t, func() bool {
			return metricValue(t, nd.store.metrics.applies.WithLabelValues("rejected")) == 1
		}, 5*time.Second, 5*time.Millisecond, nd.id)
		require.Equal(t, v1, nd.store.Current().Version)
		require.Equal(t, good, *nd.store.Current().Config)
	}
}

func TestDeadVoterReplacedAndLateJoiner(t *testing.T) {
	c := newCluster(t, 4, 3, false, steadyRaft) // one leader throughout; it kills a follower
	leader := c.waitLeader(10 * time.Second)
	voters := func(nd *testNode) (v, nv int) {
		f := nd.store.raft.GetConfiguration()
		require.NoError(t, f.Error())
		for _, s := range f.Configuration().Servers {
			if s.Suffrage == raft.Voter {
				v++
			} else {
				nv++
			}
		}
		return v, nv
	}
	// n0..n2 bootstrap as voters; n3 joins as a non-voter.
	require.Eventually(t, func() bool { v, nv := voters(leader); return v == 3 && nv == 1 }, 5*time.Second, 10*time.Millisecond)

	cfg := testConfig()
	v1, err := c.nodes[3].store.Set(ctxT(t, 5*time.Second), cfg, nil)
	require.NoError(t, err, "a non-voter forwards writes too")
	c.waitVersion(v1, c.nodes...)

	// Kill a voter that is not the leader: after the grace period it is
	// removed and n3 promoted, so there are 3 voters again.
	var victim *testNode
	for _, nd := range c.nodes[:3] {
		if nd != leader {
			victim = nd
			break
		}
	}
	c.stop(victim)
	require.Eventually(t, func() bool {
		f := leader.store.raft.GetConfiguration()
		if f.Error() != nil {
			return false
		}
		v := 0
		for _, s := range f.Configuration().Servers {
			if s.ID == raft.ServerID(victim.id) {
				return false
			}
			if s.Suffrage == raft.Voter {
				v++
			}
		}
		return v == 3
	}, 10*time.Second, 20*time.Millisecond, "dead voter replaced")

	// A late gateway whose ID sorts first does not bootstrap a second
	// cluster: it sees the formed peers and waits to be added.
	late := &testNode{id: "a-late", dir: t.TempDir()}
	c.nodes = append(c.nodes, late)
	c.start(late)
	c.waitVersion(v1, late)
	require.Equal(t, cfg, *late.store.Current().Config)
	st := late.store.Status()
	require.True(t, st.InConfiguration)
	require.Equal(t, c.waitLeader(10*time.Second).id, st.LeaderID)
	ms := leader.store.Members()
	require.Len(t, ms, 4)
	for _, m := range ms {
		require.True(t, m.Alive)
		require.NotEqual(t, SuffrageNone, m.Suffrage, m.ID)
	}
}

func TestSingleNodeAndOnApplyOrder(t *testing.T) {
	c := newCluster(t, 1, 1, false, nil)
	nd := c.waitLeader(10 * time.Second)
	var got []uint64
	var mu sync.Mutex
	cancel := nd.store.OnApply(func(v *Versioned) {
		mu.Lock()
		got = append(got, v.Version)
		mu.Unlock()
	})
	defer cancel()
	var last uint64
	for i := range 20 {
		v, err := nd.store.Patch(ctxT(t, 5*time.Second), []byte(`{"hash_seed":`+strconv.Itoa(i)+`,"models":{"m":{"replicas":[{"name":"a","url":"http://h:1"}]}}}`), nil)
		require.NoError(t, err)
		require.Greater(t, v, last)
		last = v
	}
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(got) > 0 && got[len(got)-1] == last
	}, 5*time.Second, 5*time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	for i := 1; i < len(got); i++ {
		require.Greater(t, got[i], got[i-1])
	}
	// Version conflicts are reported, not retried.
	_, err := nd.store.Patch(ctxT(t, 5*time.Second), []byte(`{"hash_seed":1}`), Version(last-1))
	require.ErrorIs(t, err, ErrVersionConflict)
}

func TestOnlySmallestBootstraps(t *testing.T) {
	// a0 sorts first but is not running: nobody else may bootstrap while
	// it is a member, or two initial configurations could exist.
	ghost := Member{ID: "a0", RaftAddr: "127.0.0.1:1", AdminAddr: "127.0.0.1:1"}
	c := &testCluster{expect: 3, members: NewStaticMembership(ghost)}
	newClusterWith(t, c, 3)
	require.Never(t, func() bool {
		for _, nd := range c.nodes {
			if nd.store.raft.LastIndex() > 0 {
				return true
			}
		}
		return false
	}, 500*time.Millisecond, 20*time.Millisecond, "a node bootstrapped while the smallest member was away")

	// a0 is declared dead: n0 is now the smallest and bootstraps all three.
	c.members.Remove("a0")
	leader := c.waitLeader(10 * time.Second)
	f := leader.store.raft.GetConfiguration()
	require.NoError(t, f.Error())
	var ids []string
	for _, s := range f.Configuration().Servers {
		require.Equal(t, raft.Voter, s.Suffrage)
		ids = append(ids, string(s.ID))
	}
	require.ElementsMatch(t, []string{"n0", "n1", "n2"}, ids)
}

func TestLeaveTransfersLeadership(t *testing.T) {
	// Steady timeouts: the transfer must finish within one ElectionTimeout
	// and the two nodes left must commit without an election of their own.
	c := newCluster(t, 3, 3, false, steadyRaft)
	old := c.waitLeader(20 * time.Second)
	require.NoError(t, old.store.Leave())
	require.Eventually(t, func() bool {
		id, _ := old.store.Leader()
		return id != "" && id != old.id
	}, 10*time.Second, 5*time.Millisecond)
	require.NoError(t, c.follower().store.Leave(), "a follower's Leave is a no-op")
	c.stop(old)
	cfg := testConfig()
	_, err := c.live()[0].store.Set(ctxT(t, 5*time.Second), cfg, nil)
	require.NoError(t, err)
}

// The store's own transport never pipelines (raft v1.8.0's pipeline can
// deadlock a leader's Shutdown): raft falls back to synchronous
// AppendEntries.
func TestOwnTransportHasNoPipeline(t *testing.T) {
	c := newCluster(t, 1, 1, false, nil)
	nd := c.waitLeader(10 * time.Second)
	_, err := nd.store.trans.AppendEntriesPipeline("n9", "127.0.0.1:1")
	require.ErrorIs(t, err, raft.ErrPipelineReplicationNotSupported)
	_, ok := nd.store.trans.(raft.WithPreVote)
	require.True(t, ok, "the wrapper keeps the network transport's other capabilities")
}

// TestRestartedFollowerCatchesUp: a follower restarted from its data
// directory applies its own snapshot first, versions behind the cluster;
// it counts as caught up only once a leader has brought it to the
// cluster's version (a gateway's readiness waits for that).
func TestRestartedFollowerCatchesUp(t *testing.T) {
	c := newCluster(t, 3, 3, true, func(cfg *StoreConfig) {
		cfg.SnapshotThreshold = 2
		// The writes below commit with one voter stopped: a stall on a
		// busy machine must not cost the leader its lease (CI once:
		// "leadership lost while committing" at load average 15).
		steadyRaft(cfg)
	})
	leader := c.waitLeader(10 * time.Second)
	v, err := leader.store.Set(ctxT(t, 5*time.Second), testConfig(), nil)
	require.NoError(t, err)
	c.waitVersion(v, c.nodes...)
	require.Eventually(t, leader.store.CaughtUp, 5*time.Second, 5*time.Millisecond, "the leader is caught up")
	f := c.follower()
	require.Eventually(t, f.store.CaughtUp, 5*time.Second, 5*time.Millisecond, "a follower the leader reached is caught up")
	require.NoError(t, f.store.raft.Snapshot().Error())

	c.stop(f)
	for _, patch := range []string{`{"hash_seed":7}`, `{"hash_seed":8}`} {
		v, err = leader.store.Patch(ctxT(t, 5*time.Second), []byte(patch), nil)
		require.NoError(t, err)
	}
	c.start(f) // same data dir; in memory it stays cut off until heal
	require.Less(t, f.store.Current().Version, v, "the restarted follower starts from its own snapshot")
	require.False(t, f.store.CaughtUp(), "no leader has reached it yet")

	c.heal()
	var at uint64
	require.Eventually(t, func() bool {
		if !f.store.CaughtUp() {
			return false
		}
		at = f.store.Current().Version
		return true
	}, 10*time.Second, time.Millisecond)
	require.Equal(t, v, at, "caught up means holding the cluster's version")
}
