// Package cluster runs a kvmesh cluster in one process for the chaos suite:
// N gateways (node.Node), M simulated vLLM engines (sim.Server), optional
// fault points on every gateway-to-engine link, a bounded client load
// generator, and ground-truth checks.
//
// Links and their fault points (Config.Faults):
//   - HTTP: gateways reach each engine's API through a faultproxy.Proxy
//     (Engine.HTTP), so delay, blackhole, cut and refusal hit every gateway.
//   - KV events: either a faultproxy.Proxy on the engine's ZMQ PUB link
//     (Engine.KV: TCP faults, cuts force resubscription) or a
//     faultproxy.Relay (Engine.Relay: lost, duplicated, reordered, garbled
//     batches with framing intact). Replay goes to the engine's ROUTER
//     directly, so a gap can be filled while the live link is faulty.
//
// Partitions between gateways (Config.Partitionable, partition.go): each
// gateway's gossip runs over one in-memory sync.MemNetwork and its raft
// over a raft.InmemTransport (handed to the node through
// node.ClusterConfig.GossipTransport and RaftTransport), and with
// ExternalNATS each gateway reaches the shared NATS server through its own
// faultproxy.Proxy (Gateway.NATSLink). Partition(links, a, b) and
// Isolate(g, links) cut any of LinkGossip, LinkRaft and LinkNATS; cuts are
// kept by gateway name (a restarted gateway stays cut); Heal restores
// every link. Clients, engines, the peer gRPC and admin gRPC links are not
// cut.
//
// Ground truth (truth package): Compare measures each gateway's confirmed
// index for each engine against the engine's real cached block set
// (precision and recall); AwaitTruth polls until every pair satisfies a
// predicate. In ClusterMode, ConfigVersions lists each gateway's applied
// raft config version and ConfigConverged reports whether they agree.
//
// Load (load.go) sends bounded streaming requests and classifies every one:
// ok (a complete stream), failed (an error the client can see: an HTTP
// error status, an SSE error event, a refused connection) or lost (no
// response, a hang past the deadline, or a stream that ends without [DONE]
// and without an error event). The chaos suite requires lost == 0.
//
// Report (report.go) formats one line of figures per scenario and a final
// table.
//
// Lifecycle: Start builds and starts everything and returns; Shutdown stops
// gateways, then proxies and relays, then engines, and waits for all of
// them; it is idempotent. Every goroutine the package starts (load workers)
// is owned by a Load and ends in its Wait.
package cluster
