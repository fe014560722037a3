// Package config is kvmesh's raft-replicated routing config and the admin
// API that reads and writes it.
//
// # The document
//
// RoutingConfig holds everything that must be identical on every gateway:
// per model the default strategy, index mode and replica pool; prefix-cache
// thresholds, block size and tokenizer; consistent-hash and cost-model
// parameters; index capacity and TTLs; the hash seed; SLO targets. Its JSON
// form (snake_case) is the contract of the admin API. Validate reports every
// invalid field as a *FieldError named by its JSON path
// (models["chat"].replicas[1].url) wrapping ErrInvalidConfig; strategy and
// index parameters are checked by route's and index's own Validate.
//
// # The store
//
// Store runs a hashicorp/raft node whose FSM holds the document, with the
// log and stable store in raft-wal and file snapshots under DataDir, so the
// config survives a restart of every gateway. Commands are: set (whole
// document), patch (RFC 7386 merge patch), add and remove replica, each
// optionally a compare-and-set on the version. The version is the raft
// index of the entry that produced the config, so it only grows.
//
// Validation happens twice: before a command enters the log (Store.Apply
// rejects an invalid document, and the leader checks the result against its
// current config), and again in the FSM on apply, where a failing entry is
// recorded as rejected (kvmesh_config_applies_total{result="rejected"}) and
// never changes the config. The FSM check is deterministic, so every node
// reaches the same verdict.
//
// Readers never block: Current returns the last applied *Versioned (an
// atomic pointer swapped on apply), and OnApply delivers every new version
// to a callback in order, from one store goroutine, so the gateway swaps
// its router atomically and no request sees half a config.
//
// Writes may be sent to any node. A follower forwards the encoded command to
// the leader's Member.ForwardAddr (node: its peer port, authenticated by the
// cluster key's mutual TLS; PeerForwarder serves Forward and Status there),
// or, without one, its admin gRPC address with StoreConfig.Forward's
// credentials; a node that receives a forward but is
// no longer leader answers ErrNotLeader and the sender re-resolves. When no
// leader can commit within ApplyTimeout (a minority partition, a cluster
// still forming) the write fails with ErrNoQuorum (gRPC Unavailable,
// HTTP 503 no_quorum) and the node keeps serving its last applied config.
//
// # Cluster formation
//
// Membership (declared here, implemented by sync's memberlist layer;
// StaticMembership for tests) supplies live members with their raft and
// admin addresses. With BootstrapExpect = N, a fresh node waits until it
// sees N members; the N with the smallest IDs are the voters, and the
// smallest of them alone bootstraps (once the set has been stable for
// BootstrapSettle, and unless a peer reports through the Status RPC that it
// already belongs to a cluster), so differing momentary views cannot write
// two initial configurations. Later gateways are
// added by the leader as non-voters. The leader reconciles on every
// membership change and every ReconcileInterval: servers missing from
// membership for DeadServerGrace are removed, non-voters are promoted
// (smallest ID first) while there are fewer than N voters. Raft dials
// peers through Membership (a ServerAddressProvider), so a gateway that
// restarts on new ports is reached under its id; the configuration keeps
// the address it was added with, as a fallback.
//
// The store's own TCP (or mutual-TLS) transport runs with raft's pipelined
// replication off: hashicorp/raft v1.8.0's pipeline can deadlock a
// leader's Shutdown after a follower rejects an AppendEntries (as a
// leadership transfer provokes), so raft sends one AppendEntries at a time,
// which is plenty for a config document. A StoreConfig.Transport given by
// the caller is used as is.
//
// raft-wal v0.4.0 (hashicorp/raft-wal#31, fixed in the v0.4.1 the store
// uses): when raft deleted a suffix of the log (a follower whose
// uncommitted entries conflict with a new leader's, e.g. a leader that
// accepted a write just before it was partitioned away), raft-wal sealed
// the segment without writing its index block, and after a restart
// raft-wal's reader failed every read in it (raft panicked in NewRaft). A
// data directory written by an earlier kvmesh may still hold such a
// segment; the store reads it by scanning its frames (wal.go).
// kvmesh_config_raft_log_tail_truncations_total counts the truncations.
//
// # Admin API
//
// Server serves the Admin gRPC service (proto/admin.proto: GetConfig,
// SetConfig, PatchConfig, AddReplica, RemoveReplica, Forward, Members,
// Status, IndexStats, ExplainRoute, Snapshot) and the same operations as
// HTTP/JSON under /admin/v1/ (see Server.Handler). Index stats, route
// explanations and index snapshots come from small provider interfaces the
// gateway implements. Every call needs "authorization: Bearer <token>",
// compared in constant time; reads may be opened with
// AllowUnauthenticatedReads, writes never. gRPC and raft can run over TLS
// (TLSFiles; raft uses mutual TLS). Client is the Go client (used for
// forwarding and by the admincli commands).
//
// # Bad input is counted
//
// Every refused admin input is counted in
// kvmesh_config_admin_rejected_total{api="grpc"|"http",reason}: the client
// errors the API answers (reason is the stable code: unauthenticated,
// invalid_config, bad_request, version_conflict, not_found,
// body_too_large) and what gRPC drops before any handler runs
// (GuardedServerOptions: bad_preface, handshake, malformed). A refused
// write a follower forwards is counted on the leader too. The raft port's
// junk, which raft's NetworkTransport only logs (or, for a connection cut
// inside a request, ignores), is counted in
// kvmesh_config_raft_transport_errors_total{kind} (decode, truncated,
// accept, flush, other) by a counting logger and stream layer around the
// store's own transport (raftnet.go); a caller's StoreConfig.Transport is
// not instrumented.
//
// # Concurrency and ownership
//
// Open starts three kinds of goroutines, all owned by the Store: raft's
// own, the run loop (bootstrap, leader duties, gauges) and the notifier
// (OnApply callbacks). Shutdown stops raft, waits for both loops and closes
// the log, the transport it created and its peer clients; it is
// idempotent. Server owns no goroutines; the caller serves the grpc.Server
// and the http.Handler and stops them before Store.Shutdown.
//
// # Tests
//
// The tests run 3-node clusters of real raft over loopback TCP, with
// raft's InmemTransport where a partition is needed; `go test -short`
// skips the slowest (TLS cluster, restart with snapshots).
package config
