package sync

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/kvmesh/kvmesh/sync/config"
	"github.com/kvmesh/kvmesh/sync/trust"
)

// Gossip profiles accepted by Config.GossipProfile.
const (
	// ProfileLAN is memberlist's DefaultLANConfig: 1 s probes, 500 ms probe
	// timeout, suspicion multiplier 4 (a failed gateway is declared dead
	// in about 5 s on a small cluster).
	ProfileLAN = "lan"
	// ProfileLocal is memberlist's DefaultLocalConfig (loopback, tests):
	// 1 s probes, 200 ms probe timeout, suspicion multiplier 3.
	ProfileLocal = "local"
)

// KVSource is an engine whose KV-event stream the cluster ingests through
// exactly one owner gateway. Every gateway of a cluster must list the same
// sources (they come from the shared replica pools).
type KVSource struct {
	// Replica is the engine's cluster-wide name (the index replica name).
	Replica string
	// Model is the model the engine serves; with the LoRA name and cache
	// salt of a parentless event it gives that event's root key
	// (Hasher.Root(Model, lora, salt), as kvevents.StoredForIndex does).
	Model string
	// Endpoint is the engine's ZMQ PUB address, dialled by the owner
	// (tcp://10.0.0.5:5557). Engines whose publisher connects to a bound
	// gateway socket (kv_bind) cannot move between gateways: the node keeps
	// those subscribers itself.
	Endpoint string
	// ReplayEndpoint is the engine's replay ROUTER ("" = none).
	ReplayEndpoint string
}

// Config configures a Cluster. Build it from DefaultConfig (production) or
// LocalConfig (loopback tests) and change what you need.
type Config struct {
	// ClusterName namespaces NATS subjects and is checked in node metadata
	// and by the peer service: gateways of another cluster are ignored.
	// Letters, digits, '-' and '_' only (it is a NATS subject token).
	// Default "kvmesh".
	ClusterName string

	// NodeName is this gateway's unique name in the cluster (memberlist
	// node name, origin of its deltas). Default: the host name.
	NodeName string

	// Version is the gateway version advertised in metadata (for mixed
	// version rollouts and `kvmesh members`). Default "dev".
	Version string

	// GossipAddr is the memberlist bind address host:port (UDP and TCP).
	// Default "0.0.0.0:7946", memberlist's conventional port. Ignored when
	// the Cluster is given a Transport.
	GossipAddr string

	// AdvertiseAddr is the host:port peers use to reach the gossip port,
	// when it differs from GossipAddr (NAT, 0.0.0.0 binds). Default "":
	// memberlist picks a private address of the host.
	AdvertiseAddr string

	// Join lists seed gateways (gossip host:port) contacted at Start. Empty:
	// this gateway starts a new cluster and waits for others to join it.
	// A failed join is logged and retried every JoinRetry, never fatal:
	// the first gateway of a cluster has nobody to join.
	Join []string

	// JoinRetry is the interval between join attempts while no seed
	// answered. Default 2s.
	JoinRetry time.Duration

	// ReconnectInterval is how often this gateway tries to rejoin members
	// the failure detector declared dead (they may be alive behind a
	// healed partition). Default 10s; LocalConfig 500ms.
	ReconnectInterval time.Duration

	// ReconnectTimeout is how long a failed member keeps being retried.
	// Default 1h: longer than any partition worth healing automatically.
	ReconnectTimeout time.Duration

	// Trust is this gateway's credentials derived from the cluster key
	// (trust.New; package trust). With it, gossip is encrypted and
	// authenticated with the ring's gossip keys (memberlist's keyring, so
	// a key rotation works), the peer gRPC service and the embedded NATS
	// server's route port require mutual TLS under the cluster CA (and the
	// route port the derived route password), and the embedded server's
	// client port requires the derived client token. Nothing is sent to
	// a peer before it proved the key. nil requires Insecure. Default nil.
	Trust *trust.Ring

	// Insecure runs the cluster without a key: gossip in clear text, the
	// peer service and NATS without authentication (unless PeerTLS,
	// PeerToken or SecretKey say otherwise). Anyone who reaches the ports
	// can join, read the index and forge deltas. Only an explicit opt-out
	// (kvmesh serve --insecure) sets it. Default false.
	Insecure bool

	// SecretKey, when set, encrypts gossip (AES-GCM, 16, 24 or 32 bytes)
	// instead of Trust's derived key (the older per-use gossip key; every
	// gateway must use the same). Default none.
	SecretKey []byte

	// GossipProfile selects memberlist's timing preset: "lan" (default,
	// production) or "local" (tests on loopback).
	GossipProfile string

	// ProbeInterval, ProbeTimeout and SuspicionMult override the profile's
	// failure detector when non-zero. Failure detection time is about
	// SuspicionMult * ProbeInterval on small clusters, and bounds how fast
	// KV ownership moves off a crashed gateway.
	ProbeInterval time.Duration
	ProbeTimeout  time.Duration
	SuspicionMult int

	// GossipInterval overrides the profile's gossip interval when non-zero;
	// it paces memberlist broadcasts (the NATS-outage fallback).
	GossipInterval time.Duration

	// PushPullInterval overrides the profile's full state exchange with a
	// random member when non-zero. Membership otherwise spreads by gossip,
	// sent a handful of times over UDP; a member whose every copy was lost
	// learns of a join only at the next push-pull (memberlist's local
	// profile: 15 s, LAN: 30 s).
	PushPullInterval time.Duration

	// HTTPAddr, RaftAddr and AdminAddr (admin gRPC) are advertised in
	// metadata only (for `kvmesh members` and the config store). Default "".
	HTTPAddr  string
	RaftAddr  string
	AdminAddr string

	// IndexModes is advertised in metadata (e.g. "history" or
	// "m1=hybrid,m2=history"); informational. Default "".
	IndexModes string

	// PeerAddr is the listen address of the gRPC peer service that serves
	// index snapshots to joining gateways. Default "0.0.0.0:7947". Port 0
	// picks a free port (see Cluster.PeerAddr).
	PeerAddr string

	// AdvertisePeerAddr is the address peers dial for snapshots when it
	// differs from the listener's (0.0.0.0 binds). Default "": the
	// listener's address with the gossip advertise host when unspecified.
	AdvertisePeerAddr string

	// PeerToken, when set, is a bearer token the peer service requires on
	// every call besides its transport security ("authorization: Bearer
	// <token>", compared in constant time) and that this gateway sends
	// when it pulls a snapshot. node never sets it: gateways prove the
	// cluster key by mutual TLS (Trust), and the operators' admin token
	// never travels between gateways. Default "".
	PeerToken string

	// PeerTLS serves the peer service over TLS and dials peers with it,
	// instead of Trust's cluster mutual TLS, for operators who run their
	// own CA (the admin API's config.TLSFiles: cert_file and key_file are this
	// gateway's, required for TLS; ca_file verifies peers and, on the
	// server side, requires their client certificates: mutual TLS). Peers'
	// certificates must name the address they advertise (PeerAddr or
	// AdvertisePeerAddr), unless PeerTLSServerName is set. Every gateway
	// of a cluster must agree on TLS. Default zero: plaintext.
	PeerTLS config.TLSFiles

	// PeerTLSServerName, when set, is the name peers' certificates are
	// verified against instead of the dialled host (a cluster whose
	// gateways share a certificate for one service name). Default "".
	PeerTLSServerName string

	// NATSURL selects an external NATS cluster ("nats://h1:4222,nats://h2:4222").
	// Default "": every gateway embeds a nats-server and the embedded
	// servers form a NATS cluster through routes to the peers memberlist
	// discovers.
	NATSURL string

	// NATSCredentialsFile is a NATS credentials file (JWT + nkey seed,
	// nats.UserCredentials) for an external NATSURL. User and password
	// may also be given in the URL. Default "".
	NATSCredentialsFile string

	// NATSTLS secures the connection to an external NATSURL: ca_file
	// verifies the servers, cert_file and key_file are a client
	// certificate. Default off.
	NATSTLS config.TLSFiles

	// NATSClientAddr is the embedded server's client listen address.
	// Default "127.0.0.1:4222": only the local gateway connects to it
	// (with Trust, with the derived client token). Port 0 picks a free
	// port.
	NATSClientAddr string

	// NATSClusterAddr is the embedded server's route listen address, which
	// peers' servers dial. Default "0.0.0.0:6222" (NATS's conventional route
	// port): peers on other hosts must reach it, and with Trust a route
	// must prove the key (mutual TLS and the derived route password).
	// Port 0 picks a free port.
	NATSClusterAddr string

	// AdvertiseNATSClusterAddr is the route address advertised to peers when
	// it differs from NATSClusterAddr (0.0.0.0 binds). Default "": the bound
	// address, with the gossip advertise host when unspecified.
	AdvertiseNATSClusterAddr string

	// FlushInterval bounds how long a routing decision waits before its
	// batch is published. Default 2ms: far below the 50 ms propagation
	// target, and at 2,000 decisions/s batches hold a few entries.
	FlushInterval time.Duration

	// FlushEntries publishes a batch as soon as it holds this many
	// decisions. Default 256.
	FlushEntries int

	// MaxPendingEntries bounds decisions waiting to be published; beyond it
	// new decisions are dropped and counted (the publisher is stuck).
	// Default 65536.
	MaxPendingEntries int

	// ApplyQueue bounds peer messages decoded but not yet applied to the
	// index. A full queue drops the message, counts it and schedules an
	// anti-entropy repair. Default 8192.
	ApplyQueue int

	// BootstrapBuffer bounds messages buffered while a snapshot is pulled.
	// Default 262144 (a few seconds of a busy cluster).
	BootstrapBuffer int

	// BootstrapTimeout bounds the snapshot pull at Start (and each repair).
	// Default 30s. A failed bootstrap is logged; the gateway routes from an
	// empty index and anti-entropy retries.
	BootstrapTimeout time.Duration

	// RouteWait bounds how long Start waits for the embedded NATS server
	// to route to a peer before pulling a snapshot, so that no delta
	// published in between is missed. Default 5s.
	RouteWait time.Duration

	// LoadInterval is how often this gateway publishes its per-replica
	// in-flight counts. Default 25ms. Between reports every gateway ranks
	// replicas on the same stale counts and they herd onto the cheapest:
	// in the discrete-event 64-replica table (chaos/des TestTable64,
	// default seed, engines' gauges shown from a step's end as vLLM's),
	// cost behind 8 synced gateways passed 1,533 more SLOs over its 8
	// cells (of 24,576 requests) with 25ms than with 100ms, and on hot90
	// every strategy gained 221 or more of 3,072 (1,519 and 200 when the
	// gauges showed a step's result from its start).
	LoadInterval time.Duration

	// LoadTTL expires a peer's load report not refreshed within it (a
	// silent or dead peer stops counting). Default 1s: forty missed reports.
	LoadTTL time.Duration

	// DigestInterval is the anti-entropy period: each gateway publishes its
	// per-source watermarks and compares the peers'. Default 5s.
	DigestInterval time.Duration

	// RepairMinInterval spaces snapshot repairs. Default 10s.
	RepairMinInterval time.Duration

	// OwnRing is how many of this gateway's own recent decision batches are
	// kept to re-apply after a repair restores a peer's snapshot that
	// lacks them. Default 4096.
	OwnRing int

	// KVSources are the engines whose KV events the cluster ingests from
	// the start; Cluster.SetKVSources replaces them while it runs.
	KVSources []KVSource

	// KVQueueSize and KVReplayTimeout configure the owners' subscribers
	// (kvevents.SubscriberConfig.QueueSize/ReplayTimeout); 0 = kvevents
	// defaults.
	KVQueueSize     int
	KVReplayTimeout time.Duration
}

// DefaultConfig returns the production defaults documented on Config.
func DefaultConfig() Config {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "kvmesh"
	}
	return Config{
		ClusterName:       "kvmesh",
		NodeName:          host,
		Version:           "dev",
		GossipAddr:        "0.0.0.0:7946",
		JoinRetry:         2 * time.Second,
		ReconnectInterval: 10 * time.Second,
		ReconnectTimeout:  time.Hour,
		GossipProfile:     ProfileLAN,
		PushPullInterval:  10 * time.Second, // memberlist LAN: 30 s; a gateway cluster is small
		PeerAddr:          "0.0.0.0:7947",
		NATSClientAddr:    "127.0.0.1:4222",
		NATSClusterAddr:   "0.0.0.0:6222",
		FlushInterval:     2 * time.Millisecond,
		FlushEntries:      256,
		MaxPendingEntries: 65536,
		ApplyQueue:        8192,
		BootstrapBuffer:   262144,
		BootstrapTimeout:  30 * time.Second,
		RouteWait:         5 * time.Second,
		LoadInterval:      25 * time.Millisecond,
		LoadTTL:           time.Second,
		DigestInterval:    5 * time.Second,
		RepairMinInterval: 10 * time.Second,
		OwnRing:           4096,
	}
}

// LocalConfig returns a preset for one of several gateways on loopback
// (tests, kvbench): every listener on 127.0.0.1 port 0, memberlist's local
// profile with a fast failure detector (about 1-2 s, tolerant of a loaded
// 2-core machine), short intervals.
func LocalConfig(nodeName string) Config {
	c := DefaultConfig()
	c.NodeName = nodeName
	c.GossipAddr = "127.0.0.1:0"
	c.GossipProfile = ProfileLocal
	c.ProbeInterval = 200 * time.Millisecond
	c.ProbeTimeout = 200 * time.Millisecond
	c.SuspicionMult = 3
	c.GossipInterval = 50 * time.Millisecond
	c.PushPullInterval = 2 * time.Second
	c.JoinRetry = 200 * time.Millisecond
	c.ReconnectInterval = 500 * time.Millisecond
	c.PeerAddr = "127.0.0.1:0"
	c.NATSClientAddr = "127.0.0.1:0"
	c.NATSClusterAddr = "127.0.0.1:0"
	c.BootstrapTimeout = 10 * time.Second
	c.DigestInterval = time.Second
	c.RepairMinInterval = time.Second
	return c
}

// Validate reports the first invalid field, wrapped in ErrInvalidConfig.
func (c Config) Validate() error {
	bad := func(field, format string, args ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, args...))
	}
	if !validToken(c.ClusterName) {
		return bad("ClusterName", "%q must be non-empty letters, digits, '-' or '_'", c.ClusterName)
	}
	if c.NodeName == "" || len(c.NodeName) > 128 {
		return bad("NodeName", "must be 1..128 bytes")
	}
	if _, err := splitHostPort(c.GossipAddr); err != nil {
		return bad("GossipAddr", "%v", err)
	}
	if c.AdvertiseAddr != "" {
		if _, err := splitHostPort(c.AdvertiseAddr); err != nil {
			return bad("AdvertiseAddr", "%v", err)
		}
	}
	switch n := len(c.SecretKey); n {
	case 0, 16, 24, 32:
	default:
		return bad("SecretKey", "must be 16, 24 or 32 bytes, got %d", n)
	}
	if c.Trust == nil && !c.Insecure {
		return bad("Trust", "a cluster key is required (trust.New), or Insecure set explicitly")
	}
	if c.NATSURL == "" && (c.NATSCredentialsFile != "" || c.NATSTLS.Enabled()) {
		return bad("NATSCredentialsFile/NATSTLS", "apply to an external NATSURL only")
	}
	if c.GossipProfile != ProfileLAN && c.GossipProfile != ProfileLocal {
		return bad("GossipProfile", "%q is not %q or %q", c.GossipProfile, ProfileLAN, ProfileLocal)
	}
	if c.ProbeInterval < 0 || c.ProbeTimeout < 0 || c.SuspicionMult < 0 || c.GossipInterval < 0 || c.PushPullInterval < 0 {
		return bad("ProbeInterval/ProbeTimeout/SuspicionMult/GossipInterval/PushPullInterval", "must not be negative")
	}
	if _, err := splitHostPort(c.PeerAddr); err != nil {
		return bad("PeerAddr", "%v", err)
	}
	if c.PeerTLS.Enabled() && (c.PeerTLS.CertFile == "" || c.PeerTLS.KeyFile == "") {
		return bad("PeerTLS", "cert_file and key_file are required for TLS")
	}
	if c.NATSURL == "" {
		if _, err := splitHostPort(c.NATSClientAddr); err != nil {
			return bad("NATSClientAddr", "%v", err)
		}
		if _, err := splitHostPort(c.NATSClusterAddr); err != nil {
			return bad("NATSClusterAddr", "%v", err)
		}
	}
	pos := []struct {
		name string
		d    time.Duration
	}{
		{"JoinRetry", c.JoinRetry}, {"FlushInterval", c.FlushInterval},
		{"ReconnectInterval", c.ReconnectInterval}, {"ReconnectTimeout", c.ReconnectTimeout},
		{"BootstrapTimeout", c.BootstrapTimeout}, {"RouteWait", c.RouteWait},
		{"LoadInterval", c.LoadInterval}, {"LoadTTL", c.LoadTTL},
		{"DigestInterval", c.DigestInterval}, {"RepairMinInterval", c.RepairMinInterval},
	}
	for _, p := range pos {
		if p.d <= 0 {
			return bad(p.name, "must be positive, got %v", p.d)
		}
	}
	if c.LoadTTL < c.LoadInterval {
		return bad("LoadTTL", "%v is shorter than LoadInterval %v", c.LoadTTL, c.LoadInterval)
	}
	ints := []struct {
		name string
		v    int
	}{
		{"FlushEntries", c.FlushEntries}, {"MaxPendingEntries", c.MaxPendingEntries},
		{"ApplyQueue", c.ApplyQueue}, {"BootstrapBuffer", c.BootstrapBuffer}, {"OwnRing", c.OwnRing},
	}
	for _, p := range ints {
		if p.v <= 0 {
			return bad(p.name, "must be positive, got %d", p.v)
		}
	}
	if c.FlushEntries > maxEntries {
		return bad("FlushEntries", "must be at most %d", maxEntries)
	}
	if c.KVQueueSize < 0 || c.KVReplayTimeout < 0 {
		return bad("KVQueueSize/KVReplayTimeout", "must not be negative")
	}
	return validateKVSources(c.KVSources)
}

// validateKVSources checks a list of KV sources (Config.KVSources,
// Cluster.SetKVSources).
func validateKVSources(srcs []KVSource) error {
	bad := func(field, format string, args ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, args...))
	}
	seen := make(map[string]bool, len(srcs))
	for i, s := range srcs {
		if s.Replica == "" || len(s.Replica) > maxName {
			return bad(fmt.Sprintf("KVSources[%d].Replica", i), "must be 1..%d bytes", maxName)
		}
		if seen[s.Replica] {
			return bad(fmt.Sprintf("KVSources[%d].Replica", i), "%q listed twice", s.Replica)
		}
		seen[s.Replica] = true
		if s.Endpoint == "" {
			return bad(fmt.Sprintf("KVSources[%d].Endpoint", i), "must be set")
		}
	}
	return nil
}

// validToken reports whether s is usable as one NATS subject token.
func validToken(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		b := s[i]
		if !(b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == '-' || b == '_') {
			return false
		}
	}
	return true
}

// splitHostPort parses host:port with a numeric port.
func splitHostPort(addr string) (hostPort, error) {
	h, p, err := net.SplitHostPort(addr)
	if err != nil {
		return hostPort{}, err
	}
	n, err := strconv.Atoi(p)
	if err != nil || n < 0 || n > 65535 {
		return hostPort{}, fmt.Errorf("bad port %q", p)
	}
	return hostPort{host: h, port: n}, nil
}

type hostPort struct {
	host string
	port int
}
