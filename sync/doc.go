// Package sync makes N kvmesh gateways behave like one: they share
// membership (hashicorp/memberlist), the prefix index (routing-decision
// deltas and normalized KV events over NATS, snapshots over gRPC) and a
// cluster-wide load view. Callers import it as kvsync.
package sync
