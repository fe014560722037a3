// Package suite is kvmesh's chaos suite: each scenario is a function that
// starts an in-process cluster (chaos/cluster), drives client load, injects
// one kind of fault, and checks the invariants after every step: no client
// request lost (a complete stream or an error the client sees), every
// gateway's confirmed index within bounds of the engines' true block sets
// and converged within a deadline.
//
// Each scenario records one line of figures (a cluster.Row) and a run ends
// with a table. The same code runs in two harnesses: the go test package
// chaos/scenarios (one test per scenario, on *testing.T) and the command
// kvmesh chaos (Run, on a T of its own that fails a scenario as testing
// would). Scenarios (kvmesh chaos list):
//
//	1 eviction      KV eviction pressure: precision >= 0.99 within 1 s
//	2 restart/reset engine restart (sequence rewind) and cache reset:
//	                confirmed entries dropped within 1 s; stale
//	                speculative affinity measured and bounded by its TTL
//	3 zmq           lost, duplicated and reordered KV-event batches, and
//	                a gap larger than the replay buffer: replayed or reset,
//	                the index converges
//	4 gateway kill  clustered gateways killed (clients' connections cut)
//	                or stopped gracefully under load and restarted: no
//	                request lost, restarted index within 1 % of peers in
//	                5 s; plus a shutdown whose grace ran out
//	5 scale         gateways 3 -> 5 -> 3, an engine added and one removed
//	                through the raft config, under load; streams running on
//	                the removed engine finish (drain) and nothing is routed
//	                there once the removal applied
//	6 partition     one gateway cut from gossip, raft and NATS (the raft
//	                leader, in the long form a follower too) or from NATS
//	                only, under load: the cut gateway keeps serving on its
//	                own view (alone, it owns and ingests every engine), a
//	                config write through the raft minority is refused
//	                (503 no_quorum) while the majority's commits; after the
//	                heal membership, NATS, raft voters, config version and
//	                every view converge
//	7 nats          NATS outage and recovery (external NATS behind a
//	                fault proxy)
//	8 bad-input     malformed HTTP bodies and raw bytes to the gateway,
//	                garbled KV-event payloads, garbage on the engine's
//	                replay port and a bound SUB; in a 3-gateway cluster,
//	                junk on the peer-sync gRPC, admin gRPC and HTTP, raft
//	                and NATS ports: rejected, counted in a metric, nothing
//	                crashes, and the cluster still serves, commits config
//	                and matches the engines afterwards
//
// Scenario 6 cuts gossip and raft in memory (memberlist also gossips over
// UDP, which a TCP fault proxy cannot cut): cluster.Config.Partitionable
// hands each node a sync.MemNetwork transport and a raft.InmemTransport.
//
// A scenario that does not converge marks its row NOT CONVERGED in the
// table and fails.
// The short form (go test -short ./chaos/scenarios, kvmesh chaos run
// --short) runs in CI in under a minute (about two under -race). The long
// form runs more requests and rounds:
//
//	kvmesh chaos run --long
//	KVMESH_CHAOS_LONG=1 go test ./chaos/scenarios -run . -v
//
// Size.Factor scales either form's request and round counts.
//
// Every scenario waits by polling conditions with deadlines; nothing sleeps.
package suite
