// Package faultproxy is a TCP proxy that injects network faults on one link:
// it listens on a loopback port, forwards every accepted connection to a
// target, and applies faults switchable at run time.
//
// Faults, per direction (Up: client to target, Down: target to client):
//   - Delay: each chunk of bytes is held for the delay before it is written
//     (a delay line, so throughput is kept and only latency grows).
//   - Jitter: a uniform random extra delay per chunk, order kept.
//   - Bandwidth: each connection's bytes paced at a rate.
//   - Drop: bytes read in that direction are discarded (a blackhole; on a
//     framed protocol such as ZMTP or HTTP the stream is corrupted from
//     there on, as with a middlebox that loses data). Drop on one direction
//     only is a one-way partition.
//
// Link-wide:
//   - Cut closes every connection open now (both sides see a reset or EOF);
//     new connections are accepted as usual.
//   - Refuse closes the listener, so new connections are refused by the
//     kernel (the target looks down), until turned off, which listens on
//     the same address again.
//   - Hold makes new connections wait, neither forwarded nor closed, until
//     the hold is lifted (a partition that blackholes connection set-up).
//   - HalfOpen closes the target side of every connection open now and
//     keeps the client's, swallowing what it sends (a peer that vanished
//     without a FIN).
//
// SetTarget points the connections accepted from then on at another
// target (an address that outlives what serves it: a Service in front of
// a restarted pod); open ones keep theirs.
//
// The proxy works on any TCP protocol: HTTP, ZMQ, NATS, raft, gRPC,
// memberlist's TCP stream (not its UDP gossip). Every goroutine it starts is
// owned by the Proxy and ends in Close, which is idempotent; Close waits
// for them.
//
// Relay is the message-level counterpart for ZMQ PUB/SUB links (vLLM's KV
// events): it subscribes to a PUB and republishes on its own PUB, and a
// Fault chosen per message drops, duplicates, swaps (reorders) or garbles
// it, with ZMTP framing intact, so consumers see exactly lost, repeated,
// reordered or corrupt batches. Stats count both.
//
// chaos/faultctl serves both behind an HTTP control API (kvmesh faultproxy).
package faultproxy
