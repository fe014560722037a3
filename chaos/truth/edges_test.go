package truth_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/chaos/truth"
	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node"
)

// The edges real engines reach (issue 16), end to end over real HTTP and
// real ZMQ: a hybrid-attention engine, an engine with a CPU offload tier,
// and a data-parallel engine. In each the index must end equal to the
// engine's own state: its GPU group-0 blocks and engine hashes
// (awaitExact), its offload tier's blocks (CompareTier), and, for every
// prompt sent, the hit the engine itself would compute right now
// (CompareHits against sim.Server.PrefixHit: vLLM's hybrid rule, the
// offload tier's load).

// awaitHits waits until, for every replica, the index's match of every
// prompt (the engine's tokens) equals the engine's own hit.
func awaitHits(t *testing.T, step string, es *engines, cons *consumer, toks [][]uint32) []truth.HitComparison {
	t.Helper()
	out := make([]truth.HitComparison, len(cons.ids))
	for i, id := range cons.ids {
		s := es.get(i)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		c, took, err := truth.AwaitHits(ctx, 5*time.Millisecond, func() (truth.HitComparison, error) {
			return truth.CompareHits(s, s.Config().BlockSize, cons.ix, id, cons.root, toks)
		})
		cancel()
		require.NoError(t, err, "%s: replica %d", step, i)
		t.Logf("%s: replica %d converged after %v: %s", step, i, took.Round(time.Millisecond), c)
		out[i] = c
	}
	return out
}

// warmUp sends prompts straight to each engine until its events reach
// the index (PUB/SUB drops what precedes the subscription).
func warmUp(t *testing.T, cl *client, rng *rand.Rand, es *engines, cons *consumer) {
	t.Helper()
	for i := range cons.ids {
		warm := prompts(rng, fmt.Sprintf("warm-%d", i), 200)
		sent := 0
		require.Eventually(t, func() bool {
			if sent < len(warm) {
				cl.complete(es.get(i).URL(), warm[sent])
				sent++
			}
			return len(cons.ix.AppendEngineHashes(nil, cons.ids[i])) > 0
		}, 10*time.Second, 5*time.Millisecond, "replica %d's events reach the index", i)
	}
}

// tokensOf returns the engine's tokens of each prompt (its /tokenize).
func tokensOf(cl *client, s *sim.Server, ps []string) [][]uint32 {
	out := make([][]uint32, len(ps))
	for i, p := range ps {
		out[i] = cl.tokenize(s.URL(), p)
	}
	return out
}

func TestEndToEndHybridHitSet(t *testing.T) {
	for _, gw := range []bool{false, true} {
		t.Run(map[bool]string{false: "bare", true: "gateway"}[gw], func(t *testing.T) {
			tc := e2eCase{gateway: gw, engineBlock: 16, indexBlock: 16, encoding: "map", replayForm: "with-topic", numGPUBlocks: 160}
			cfg := simConfig(tc)
			// A 64-token window (4 blocks) over prompts of up to 25
			// blocks, and a window pool much smaller than the full one:
			// the window group evicts blocks the full group keeps.
			cfg.HybridSlidingWindow, cfg.HybridWindowBlocks = 64, 48
			runEdge(t, tc, cfg, func(t *testing.T, es *engines, cons *consumer, cl *client, toks [][]uint32) {
				cut := 0
				for i := range cons.ids {
					s := es.get(i)
					tr, err := truth.FromBlocks(s.CachedBlocks(), cons.ix.Hasher(), cons.root)
					require.NoError(t, err)
					for _, p := range toks {
						keys := cons.ix.Hasher().AppendKeys(nil, cons.root, p)[:(len(p)-1)/16]
						full := 0
						for full < len(keys) {
							if _, ok := tr.Keys[keys[full]]; !ok {
								break
							}
							full++
						}
						if gpu, _ := s.PrefixHit(p); gpu < full {
							cut++
						}
					}
				}
				t.Logf("%d prompt hits cut by the window group", cut)
				require.Positive(t, cut, "the window group limited some hit below the full-attention group's run")
			})
		})
	}
}

func TestEndToEndOffloadTier(t *testing.T) {
	for _, gw := range []bool{false, true} {
		t.Run(map[bool]string{false: "bare", true: "gateway"}[gw], func(t *testing.T) {
			tc := e2eCase{gateway: gw, engineBlock: 16, indexBlock: 16, encoding: "map", replayForm: "with-topic", numGPUBlocks: 64}
			cfg := simConfig(tc)
			cfg.KVOffloadBlocks = 96
			runEdge(t, tc, cfg, func(t *testing.T, es *engines, cons *consumer, cl *client, toks [][]uint32) {
				// Through the gateway the split of prompts over the replicas
				// follows their load, so on a busy machine one replica may
				// receive too few to fill its CPU tier; one full tier is
				// enough to exercise CPU evictions, and every tier is
				// compared exactly below.
				loaded, full := 0, 0
				for i, id := range cons.ids {
					s := es.get(i)
					off := s.OffloadedBlocks()
					require.LessOrEqual(t, len(off), 96, "replica %d's CPU tier holds at most its 96 blocks", i)
					if len(off) == 96 {
						full++
					}
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					c, _, err := truth.Await(ctx, 5*time.Millisecond, func() (truth.Comparison, error) {
						return truth.CompareTier(s.OffloadedBlocks(), cons.ix, id, cons.root, index.TierCPU)
					}, truth.IsExact)
					cancel()
					require.NoError(t, err)
					t.Logf("replica %d CPU tier: %s", i, c)
					h, err := truth.CompareHits(s, 16, cons.ix, id, cons.root, toks)
					require.NoError(t, err)
					loaded += h.OffloadBlocks
				}
				require.Positive(t, full, "a CPU tier filled (it evicted too)")
				require.Positive(t, loaded, "some prompts would load offloaded blocks")
			})
		})
	}
}

// runEdge runs two engines of cfg behind the consumer tc describes:
// prompts that fit, then eviction pressure, then the first prompts again;
// after each phase the index must equal every engine (awaitExact and
// awaitHits), and check runs at the end.
func runEdge(t *testing.T, tc e2eCase, cfg sim.Config, check func(*testing.T, *engines, *consumer, *client, [][]uint32)) {
	const replicas = 2
	rng := rand.New(rand.NewPCG(7, uint64(cfg.NumGPUBlocks)))
	es := &engines{}
	for range replicas {
		es.srvs = append(es.srvs, startSim(t, cfg))
	}
	defer func() {
		for i := range replicas {
			stopSim(t, es.get(i))
		}
	}()
	var cons *consumer
	if tc.gateway {
		cons = gatewayConsumer(t, tc, es, replicas)
	} else {
		cons = bareConsumer(t, tc, es, replicas)
	}
	defer cons.close()
	cl := newClient(t)
	defer cl.hc.CloseIdleConnections()
	warmUp(t, cl, rng, es, cons)

	first := prompts(rng, "fill", 6)
	cl.run(cons.url, first)
	toks := tokensOf(cl, es.get(0), first)
	awaitExact(t, "fill", es, cons)
	awaitHits(t, "fill", es, cons, toks)

	evict := prompts(rng, "evict", 60)
	cl.run(cons.url, evict)
	toks = append(toks, tokensOf(cl, es.get(0), evict)...)
	awaitExact(t, "evict", es, cons)
	awaitHits(t, "evict", es, cons, toks)

	cl.run(cons.url, first) // hits, partial hits, loads
	awaitExact(t, "again", es, cons)
	hs := awaitHits(t, "again", es, cons, toks)
	total := 0
	for _, h := range hs {
		total += h.GPUBlocks
	}
	require.Positive(t, total, "some prompts hit")
	check(t, es, cons, cl, toks)
}

// consecutivePorts returns a port p on 127.0.0.1 such that p..p+n-1 were
// free a moment ago (a data-parallel engine binds rank r on p+r).
func consecutivePorts(t *testing.T, n int) int {
	t.Helper()
	for range 50 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		p := ln.Addr().(*net.TCPAddr).Port
		lns := []net.Listener{ln}
		ok := p+n-1 <= 65535
		for r := 1; ok && r < n; r++ {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p+r))
			if err != nil {
				ok = false
				break
			}
			lns = append(lns, l)
		}
		for _, l := range lns {
			_ = l.Close()
		}
		if ok {
			return p
		}
	}
	t.Fatal("no free consecutive ports")
	return 0
}

// TestEndToEndDataParallelRanks: one vLLM server of data-parallel size 2
// (real ZMQ: rank r publishes on port + r). The consumer subscribes to
// each rank as its own replica; requests go through the server's front
// (its balancer spreads them) or, with the gateway, through the gateway
// (which names the rank in X-data-parallel-rank). Each rank replica must
// end equal to that rank's engine.
func TestEndToEndDataParallelRanks(t *testing.T) {
	for _, gw := range []bool{false, true} {
		t.Run(map[bool]string{false: "bare", true: "gateway"}[gw], func(t *testing.T) {
			tc := e2eCase{gateway: gw, engineBlock: 16, indexBlock: 16, encoding: "map", replayForm: "with-topic", numGPUBlocks: 96}
			cfg := simConfig(tc)
			cfg.DataParallelSize = 2
			// Rank r publishes on port+r and replays on port+2+r.
			port := consecutivePorts(t, 4)
			cfg.KVEvents.Endpoint = fmt.Sprintf("tcp://127.0.0.1:%d", port)
			cfg.KVEvents.ReplayEndpoint = fmt.Sprintf("tcp://127.0.0.1:%d", port+2)
			d, err := sim.NewDPServer(cfg)
			require.NoError(t, err)
			require.NoError(t, d.Start(context.Background()))
			defer func() {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				require.NoError(t, d.Shutdown(ctx))
			}()
			es := &engines{srvs: []*sim.Server{d.Rank(0), d.Rank(1)}}
			var cons *consumer
			if gw {
				gc := node.LocalConfig()
				gc.IndexMode = "kv-events"
				gc.Tokenizer = node.TokenizerCharacter
				gc.BlockSize = 16
				gc.Models = []node.ModelConfig{{Name: model, Replicas: []node.ReplicaConfig{{
					Name: "e", URL: d.URL(), KVEndpoint: cfg.KVEvents.Endpoint, ReplayEndpoint: cfg.KVEvents.ReplayEndpoint,
					DataParallelSize: 2}}}}
				g, err := node.New(gc, testLogger())
				require.NoError(t, err)
				require.NoError(t, g.Start(context.Background()))
				var ids []index.ReplicaID
				for r := range 2 {
					id, ok := g.ReplicaID(fmt.Sprintf("e#%d", r))
					require.True(t, ok)
					ids = append(ids, id)
				}
				cons = &consumer{gw: g, ix: g.Index(), ids: ids, root: g.Index().Hasher().Root(model, "", ""),
					url: func(int) string { return "http://" + g.HTTPAddr() },
					close: func() {
						ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
						defer cancel()
						require.NoError(t, g.Shutdown(ctx))
					}}
			} else {
				cons = bareConsumer(t, tc, es, 2)
				cons.url = func(int) string { return d.URL() }
			}
			defer cons.close()
			cl := newClient(t)
			defer cl.hc.CloseIdleConnections()
			rng := rand.New(rand.NewPCG(11, 2))
			warmUp(t, cl, rng, es, cons)

			first := prompts(rng, "fill", 8)
			cl.run(cons.url, first)
			toks := tokensOf(cl, es.get(0), first)
			awaitExact(t, "fill", es, cons)
			awaitHits(t, "fill", es, cons, toks)
			evict := prompts(rng, "evict", 60)
			cl.run(cons.url, evict)
			toks = append(toks, tokensOf(cl, es.get(0), evict)...)
			cmp := awaitExact(t, "evict", es, cons)
			awaitHits(t, "evict", es, cons, toks)
			for r := range 2 {
				require.Positive(t, cmp[r].TruthKeys, "rank %d served requests", r)
			}
			// The ranks hold different blocks: residency is per rank.
			a := cons.ix.AppendReplicaKeys(nil, cons.ids[0], index.Confirmed)
			b := map[index.BlockKey]bool{}
			for _, k := range cons.ix.AppendReplicaKeys(nil, cons.ids[1], index.Confirmed) {
				b[k] = true
			}
			only0 := 0
			for _, k := range a {
				if !b[k] {
					only0++
				}
			}
			require.Positive(t, only0, "rank 0 holds blocks rank 1 does not")
		})
	}
}
