//go:build race

package cluster_test

// deadlineScale stretches convergence deadlines under the race detector,
// which slows every gateway 5-10x: with mutual TLS on raft, the peer port
// and NATS routes (the cluster key), a loaded 2-core machine then starves
// gossip probes and TLS handshakes, memberlist declares live gateways dead,
// KV ownership moves back and forth, and anti-entropy repairs that take
// 50 ms normally take seconds. The views still converge; they need longer.
const deadlineScale = 3
