package config

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/sync/trust"
)

// StoreConfig configures a Store. Start from DefaultStoreConfig
// (production) or LocalStoreConfig (tests: short raft timeouts), then set
// NodeID, DataDir and Membership.
type StoreConfig struct {
	// NodeID is this gateway's stable id: its raft server id and its
	// Member.ID in Membership. Required.
	NodeID string
	// DataDir holds the raft log and stable store (raft-wal, in
	// DataDir/raft/wal) and the config snapshots (DataDir/raft/snapshots).
	// Reusing it across restarts keeps the config. Required.
	DataDir string
	// RaftBindAddr is the raft TCP listen address. Default
	// "127.0.0.1:9301"; port 0 picks a free port (see Store.RaftAddr).
	// An unspecified IP (":9301", "0.0.0.0:9301") needs RaftAdvertiseAddr.
	RaftBindAddr string
	// RaftAdvertiseAddr is the address peers dial, when it differs from
	// the bind address (NAT, containers). Default "" (the bound address).
	RaftAdvertiseAddr string
	// RaftTLS, when enabled, runs raft over mutual TLS with the
	// operator's certificates: every node needs CertFile and KeyFile, and
	// CAFile to verify its peers. It takes precedence over Trust. Default
	// off.
	RaftTLS TLSFiles
	// Trust, when set (and RaftTLS is not), runs raft over mutual TLS
	// under the cluster CA derived from the cluster key: a connection
	// that does not prove the key is closed before raft reads a command
	// and counted as kvmesh_config_raft_transport_errors_total{kind=
	// "unauthenticated"}. Neither: plaintext raft, which anyone who
	// reaches RaftBindAddr can drive (node allows it only with
	// --insecure). Default nil.
	Trust *trust.Ring
	// Transport replaces the TCP transport, e.g. with raft's
	// InmemTransport to simulate partitions in tests. The caller owns it
	// (Shutdown does not close it). Default nil.
	Transport raft.Transport
	// BootstrapExpect is the number of voters. A fresh cluster forms when
	// nodes see this many members: the BootstrapExpect members with the
	// smallest IDs become the voters (the smallest of them bootstraps);
	// later gateways join as non-voters, and the leader promotes
	// non-voters to keep this many voters. Start the first
	// BootstrapExpect gateways before any others. Default 3 (tolerates one
	// failure). Must be ≥ 1.
	BootstrapExpect int
	// BootstrapSettle is how long the candidate voter set must stay
	// unchanged before the bootstrapping node acts, so gateways that start
	// together are all seen. Default 2s (a few gossip rounds).
	BootstrapSettle time.Duration
	// Membership is the live-member source. Required.
	Membership Membership
	// Seed, when set, is proposed by the first leader of a cluster whose
	// config is still empty (compare-and-set on version 0, so only one
	// seed ever applies): gateways can start from their flags or YAML.
	// It must be valid. Default nil.
	Seed *RoutingConfig
	// Forward authenticates and secures this node's calls to peers' admin
	// services (forwarded writes, bootstrap probes). The admin token is
	// shared by the cluster. Default: no token, plaintext.
	Forward ClientOptions
	// ApplyTimeout bounds a write end to end, including waiting for a
	// leader and forwarding; past it the write fails with ErrNoQuorum.
	// Default 10s: several election rounds. Must be positive.
	ApplyTimeout time.Duration
	// HeartbeatTimeout, ElectionTimeout, LeaderLeaseTimeout and
	// CommitTimeout are raft's (see raft.Config). Defaults 1s, 1s, 500ms,
	// 50ms: raft's own defaults, conservative for a WAN-ish data centre.
	HeartbeatTimeout   time.Duration
	ElectionTimeout    time.Duration
	LeaderLeaseTimeout time.Duration
	CommitTimeout      time.Duration
	// DeadServerGrace is how long a raft server may be missing from
	// Membership before the leader removes it (and promotes a non-voter in
	// a voter's place). Default 30s: longer than a gateway restart, so a
	// rolling restart never shrinks the voter set.
	DeadServerGrace time.Duration
	// ReconcileInterval is how often the leader reconciles raft servers
	// with membership besides reacting to membership changes. Default 5s.
	ReconcileInterval time.Duration
	// SnapshotThreshold and SnapshotInterval: raft snapshots when this many
	// entries accumulated, checked every SnapshotInterval. Defaults 64
	// entries, 2 min: each entry is a whole document, so the log stays
	// small. SnapshotRetain is how many snapshots to keep (default 2).
	SnapshotThreshold uint64
	SnapshotInterval  time.Duration
	SnapshotRetain    int
	// RaftLogLevel is the level of raft's own log lines forwarded to
	// Logger: "debug", "info", "warn" or "error". Default "warn".
	RaftLogLevel string
	// Logger receives the store's logs. Default slog.Default().
	Logger *slog.Logger
	// Registerer receives the store's metrics (see metrics.go). Default
	// nil: metrics are kept but not registered.
	Registerer prometheus.Registerer
}

// DefaultStoreConfig returns the production defaults documented on each
// field.
func DefaultStoreConfig() StoreConfig {
	return StoreConfig{
		RaftBindAddr:       "127.0.0.1:9301",
		BootstrapExpect:    3,
		BootstrapSettle:    2 * time.Second,
		ApplyTimeout:       10 * time.Second,
		HeartbeatTimeout:   time.Second,
		ElectionTimeout:    time.Second,
		LeaderLeaseTimeout: 500 * time.Millisecond,
		CommitTimeout:      50 * time.Millisecond,
		DeadServerGrace:    30 * time.Second,
		ReconcileInterval:  5 * time.Second,
		SnapshotThreshold:  64,
		SnapshotInterval:   2 * time.Minute,
		SnapshotRetain:     2,
		RaftLogLevel:       "warn",
	}
}

// LocalStoreConfig is the preset for tests and single-machine clusters:
// loopback port 0 and raft timeouts of a few hundred milliseconds (short,
// but not so short that a loaded 2-core CI machine flaps leaders).
func LocalStoreConfig() StoreConfig {
	c := DefaultStoreConfig()
	c.RaftBindAddr = "127.0.0.1:0"
	c.ApplyTimeout = 3 * time.Second
	c.BootstrapSettle = 100 * time.Millisecond
	c.HeartbeatTimeout = 200 * time.Millisecond
	c.ElectionTimeout = 200 * time.Millisecond
	c.LeaderLeaseTimeout = 100 * time.Millisecond
	c.CommitTimeout = 5 * time.Millisecond
	c.DeadServerGrace = time.Second
	c.ReconcileInterval = 100 * time.Millisecond
	c.SnapshotInterval = time.Second
	c.RaftLogLevel = "error"
	return c
}

// Validate reports the first invalid field, wrapped in
// ErrInvalidStoreConfig.
func (c *StoreConfig) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidStoreConfig}, args...)...)
	}
	switch {
	case c.NodeID == "":
		return bad("NodeID is empty")
	case c.DataDir == "":
		return bad("DataDir is empty")
	case c.Transport == nil && c.RaftBindAddr == "":
		return bad("RaftBindAddr is empty")
	case c.BootstrapExpect < 1:
		return bad("BootstrapExpect %d must be ≥ 1", c.BootstrapExpect)
	case c.Membership == nil:
		return bad("Membership is nil")
	case c.ApplyTimeout <= 0:
		return bad("ApplyTimeout %v must be positive", c.ApplyTimeout)
	case c.BootstrapSettle < 0:
		return bad("BootstrapSettle %v is negative", c.BootstrapSettle)
	case c.DeadServerGrace <= 0 || c.ReconcileInterval <= 0:
		return bad("DeadServerGrace and ReconcileInterval must be positive")
	case c.SnapshotRetain < 1:
		return bad("SnapshotRetain %d must be ≥ 1", c.SnapshotRetain)
	}
	switch c.RaftLogLevel {
	case "debug", "info", "warn", "error":
	default:
		return bad("RaftLogLevel %q (want debug, info, warn or error)", c.RaftLogLevel)
	}
	if c.Seed != nil {
		if err := c.Seed.Validate(); err != nil {
			return fmt.Errorf("%w: Seed: %w", ErrInvalidStoreConfig, err)
		}
	}
	rc := c.raftConfig()
	if err := raft.ValidateConfig(rc); err != nil {
		return bad("%v", err)
	}
	return nil
}

func (c *StoreConfig) raftConfig() *raft.Config {
	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(c.NodeID)
	rc.HeartbeatTimeout = c.HeartbeatTimeout
	rc.ElectionTimeout = c.ElectionTimeout
	rc.LeaderLeaseTimeout = c.LeaderLeaseTimeout
	rc.CommitTimeout = c.CommitTimeout
	rc.SnapshotThreshold = c.SnapshotThreshold
	rc.SnapshotInterval = c.SnapshotInterval
	rc.TrailingLogs = 256
	// A removed server stays up so it can be added back when it returns.
	rc.ShutdownOnRemove = false
	return rc
}
