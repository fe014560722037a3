package node

import (
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"os"
	"regexp"
	"strings"
	"time"

	sockaddr "github.com/hashicorp/go-sockaddr"
	"github.com/hashicorp/memberlist"
	"github.com/hashicorp/raft"

	kvsync "github.com/kvmesh/kvmesh/sync"
	"github.com/kvmesh/kvmesh/sync/config"
	"github.com/kvmesh/kvmesh/sync/trust"
)

// GossipKeyEnv is the environment variable holding the base64 gossip
// encryption key when ClusterConfig.GossipKeyFile is not set.
const GossipKeyEnv = "KVMESH_GOSSIP_KEY"

// ClusterKeyEnv is the environment variable holding the cluster key when
// ClusterConfig.ClusterKeyFile is not set (trust.KeyEnv).
const ClusterKeyEnv = trust.KeyEnv

// ErrNoClusterKey is returned by New for a cluster-mode gateway with
// neither a cluster key nor Insecure; its message says how to make a key.
var ErrNoClusterKey = errors.New("node: cluster mode needs a cluster key: make one with " +
	"`kvmesh keygen > cluster.key` and start every gateway with --cluster-key-file cluster.key " +
	"(or export KVMESH_CLUSTER_KEY=$(kvmesh keygen) and give every gateway the same value); " +
	"--insecure runs without one, and then anyone who reaches the cluster ports can join, read the index and change the config")

// Cluster timing profiles accepted by ClusterConfig.Profile.
const (
	// ProfileLAN is production timing: memberlist's LAN failure detector
	// (a dead gateway is noticed in about 5 s) and raft's default
	// timeouts (1 s heartbeat and election).
	ProfileLAN = "lan"
	// ProfileLocal is loopback timing for tests and one-machine clusters:
	// failure detection in about a second, raft timeouts of 200 ms.
	ProfileLocal = "local"
)

// ClusterConfig makes the gateway one member of a cluster (DESIGN §2,
// flows 3 and 4). Left disabled (the default), the gateway is standalone
// exactly as before: it opens no port besides HTTPAddr, routes on its own
// index and its own Config. Enabled, it gossips membership, shares its
// index and load through NATS, ingests only the KV-event streams it owns,
// keeps the routing config in raft and serves the admin API. YAML key
// "cluster".
type ClusterConfig struct {
	// Enabled turns cluster mode on. `kvmesh serve` sets it when any of
	// --cluster, --join or --bootstrap-expect is given. Default false.
	Enabled bool `yaml:"enabled"`

	// NoSync keeps the gateway isolated even when Enabled is set: no
	// gossip, no NATS, no raft, no admin API; it routes on its own index
	// exactly as a standalone gateway (the study's `--no-sync` baseline
	// that shows what replication buys). Default false.
	NoSync bool `yaml:"no_sync"`

	// Name namespaces the cluster (NATS subjects, memberlist metadata):
	// gateways of another cluster are ignored. Letters, digits, '-' and
	// '_'. Default "kvmesh".
	Name string `yaml:"name"`

	// NodeID is this gateway's unique, stable id: memberlist node name and
	// raft server id. Default "": the host name (gateways on one host must
	// set distinct ids).
	NodeID string `yaml:"node_id"`

	// Profile is the timing preset: "lan" (default) or "local" (loopback).
	Profile string `yaml:"profile"`

	// GossipAddr is the memberlist bind address (UDP and TCP). Default
	// "0.0.0.0:7946", memberlist's conventional port.
	GossipAddr string `yaml:"gossip_addr"`

	// AdvertiseAddr is the host:port peers use to reach GossipAddr when it
	// differs (NAT, 0.0.0.0 binds). Its host is also advertised for the
	// peer gRPC and NATS route ports. Default "": a private address of the
	// host.
	AdvertiseAddr string `yaml:"advertise_addr"`

	// Join lists seed gateways' gossip addresses. Empty: this gateway
	// starts the cluster and waits for others. Failed joins are retried in
	// the background. Default none.
	Join []string `yaml:"join"`

	// ClusterKeyFile holds the cluster key (`kvmesh keygen`; one base64
	// key per line, the first the primary, older ones accepted during a
	// rotation: SECURITY.md). Every gateway of a cluster needs the same.
	// From it each gateway derives the gossip key, a cluster CA and its
	// own certificate (mutual TLS on raft, the peer port and NATS routes)
	// and the NATS credentials (package sync/trust). When empty,
	// KVMESH_CLUSTER_KEY is read. Cluster mode refuses to start without a
	// key unless Insecure is set. Default "".
	ClusterKeyFile string `yaml:"cluster_key_file"`

	// ClusterKey is key text as in ClusterKeyFile, for embedders and
	// tests (chaos harnesses generate one per cluster). Not read from
	// YAML: keys stay out of config files. Default "".
	ClusterKey string `yaml:"-"`

	// Insecure is the explicit opt-out of the cluster key: gossip in clear
	// text, raft, the peer port and NATS without authentication; anyone
	// who reaches them can join, read the index and rewrite the config.
	// The gateway logs a warning at start and exports kvmesh_insecure 1,
	// and cluster ports left at their defaults bind to 127.0.0.1 instead
	// of all interfaces. A key, when also given, wins. Default false.
	Insecure bool `yaml:"insecure"`

	// GossipKeyFile holds a base64 AES key (16, 24 or 32 bytes decoded)
	// that encrypts gossip instead of the one derived from the cluster key
	// (older deployments). When empty the KVMESH_GOSSIP_KEY environment
	// variable is read. Default "".
	GossipKeyFile string `yaml:"gossip_key_file"`

	// NATSURL selects an external NATS cluster (nats://h1:4222,...).
	// Default "": an embedded nats-server per gateway, clustered through
	// routes to the peers memberlist discovers.
	NATSURL string `yaml:"nats_url"`

	// NATSCredentialsFile authenticates to an external NATSURL (a NATS
	// .creds file: JWT and nkey seed). Default "".
	NATSCredentialsFile string `yaml:"nats_credentials_file"`

	// NATSTLS secures the connection to an external NATSURL (ca_file
	// verifies the servers; cert_file and key_file are a client
	// certificate). Default off.
	NATSTLS config.TLSFiles `yaml:"nats_tls"`

	// NATSClientAddr is the embedded server's client listen address (only
	// this gateway connects, with a token derived from the cluster
	// key). Default "127.0.0.1:4222": nothing else needs it.
	NATSClientAddr string `yaml:"nats_client_addr"`

	// NATSClusterAddr is the embedded server's route listen address, which
	// peers' servers dial. Default "0.0.0.0:6222": peers on other hosts
	// must reach it, and every route must prove the cluster key (mutual
	// TLS and a derived password).
	NATSClusterAddr string `yaml:"nats_cluster_addr"`

	// PeerAddr is the gRPC listen address of the peer service (index
	// snapshots for joining gateways, forwarded config writes). Default
	// "0.0.0.0:7947": peers must reach it, and every connection must
	// prove the cluster key (mutual TLS).
	PeerAddr string `yaml:"peer_addr"`

	// AdminAddr is the gRPC listen address of the admin service (config
	// reads and writes, members, explain, snapshots); followers forward
	// config writes to the leader's. The same API over HTTP/JSON is
	// mounted on HTTPAddr under /admin/v1/. Default "0.0.0.0:7948": for
	// operators' tools, every call needs the admin token (gateways no
	// longer call it: they forward through the peer port).
	AdminAddr string `yaml:"admin_addr"`

	// AdvertiseAdminAddr is the admin address peers dial when it differs
	// from AdminAddr (0.0.0.0 binds). Default "": AdminAddr with the
	// gossip advertise host when its host is unspecified.
	AdvertiseAdminAddr string `yaml:"advertise_admin_addr"`

	// RaftAddr is the raft TCP listen address. Default "0.0.0.0:7949":
	// peers must reach it, and every connection must prove the cluster
	// key (mutual TLS) before raft reads a byte. An unspecified host is
	// advertised with AdvertiseAddr's host (or the loopback address when
	// that is unset too).
	RaftAddr string `yaml:"raft_addr"`

	// RaftAdvertiseAddr is the raft address peers dial, when it differs
	// from RaftAddr. Default "" (derived as above).
	RaftAdvertiseAddr string `yaml:"raft_advertise_addr"`

	// DataDir holds the raft log, stable store and config snapshots; keep
	// it across restarts so the config survives. Default "kvmesh-data"
	// (relative to the working directory).
	DataDir string `yaml:"data_dir"`

	// BootstrapExpect is the number of raft voters: the first N gateways
	// to meet form the config cluster; later ones join as non-voters.
	// Default 3 (tolerates one failure). Until N gateways met, config
	// writes are refused and every gateway routes on its own Config.
	BootstrapExpect int `yaml:"bootstrap_expect"`

	// AdminToken is the bearer token of the admin API (operators only:
	// gateways never send it to each other). When empty, the
	// KVMESH_ADMIN_TOKEN environment variable, then AdminTokenFile, are
	// read; cluster mode refuses to start without a token. Prefer the file
	// or the environment to a flag (visible in ps). Default "".
	AdminToken string `yaml:"admin_token"`

	// AdminTokenFile holds the admin token on its first line. Default "".
	AdminTokenFile string `yaml:"admin_token_file"`

	// AdminTLS secures the admin gRPC service (and the forwarding client)
	// when set. Default off.
	AdminTLS config.TLSFiles `yaml:"admin_tls"`

	// RaftTLS runs raft over mutual TLS with the operator's own
	// certificates instead of the cluster key's. Default off.
	RaftTLS config.TLSFiles `yaml:"raft_tls"`

	// PeerTLS serves the peer service over TLS with the operator's own
	// certificates instead of the cluster key's, and dials peers with it:
	// cert_file and key_file are this gateway's (required), ca_file
	// verifies peers and requires their client certificates (mutual TLS).
	// Peers' certificates must name the address they advertise for the
	// peer service unless PeerTLSServerName is set. Every gateway of a
	// cluster must agree. Default off.
	PeerTLS config.TLSFiles `yaml:"peer_tls"`

	// PeerTLSServerName, when set, is the name peers' certificates are
	// verified against instead of the dialled host (gateways sharing one
	// certificate for a service name). Default "".
	PeerTLSServerName string `yaml:"peer_tls_server_name"`

	// StartTimeout bounds joining, the index snapshot bootstrap and
	// serving at Start. Default 60s.
	StartTimeout time.Duration `yaml:"start_timeout"`

	// LeaveTimeout bounds the graceful gossip leave at Shutdown. Default
	// 2s.
	LeaveTimeout time.Duration `yaml:"leave_timeout"`

	// GossipTransport, when set, replaces memberlist's UDP/TCP transport:
	// GossipAddr is not bound, and peers join this gateway at the address
	// the transport advertises (Node.Cluster().GossipAddr()). A hook for
	// tests and embedders, such as the chaos suite's partitionable
	// sync.MemNetwork; it is not read from YAML. memberlist shuts it down
	// when the gateway stops; a transport serves one Node start. Default
	// nil: the real transport on GossipAddr.
	GossipTransport memberlist.Transport `yaml:"-"`

	// RaftTransport, when set, replaces the raft TCP transport: RaftAddr,
	// RaftAdvertiseAddr and RaftTLS are unused, and the transport's
	// LocalAddr is what this gateway advertises in its gossip metadata
	// and what enters the raft configuration. A hook for tests and
	// embedders (raft.InmemTransport, connected and disconnected by the
	// caller to simulate partitions); it is not read from YAML. The caller
	// owns it and closes it after Shutdown. Default nil: the TCP transport
	// on RaftAddr.
	RaftTransport raft.Transport `yaml:"-"`
}

// DefaultClusterConfig returns the production defaults documented on each
// field (cluster mode off).
func DefaultClusterConfig() ClusterConfig {
	return ClusterConfig{
		Name:            "kvmesh",
		Profile:         ProfileLAN,
		GossipAddr:      "0.0.0.0:7946",
		NATSClientAddr:  "127.0.0.1:4222",
		NATSClusterAddr: "0.0.0.0:6222",
		PeerAddr:        "0.0.0.0:7947",
		AdminAddr:       "0.0.0.0:" + config.DefaultAdminPort,
		RaftAddr:        "0.0.0.0:7949",
		DataDir:         "kvmesh-data",
		BootstrapExpect: 3,
		StartTimeout:    60 * time.Second,
		LeaveTimeout:    2 * time.Second,
	}
}

// LocalClusterConfig is the loopback preset (tests, one-machine clusters):
// every listener on 127.0.0.1 port 0, the local timing profile. NodeID,
// DataDir, AdminToken and Enabled are still the caller's.
func LocalClusterConfig() ClusterConfig {
	c := DefaultClusterConfig()
	c.Profile = ProfileLocal
	c.GossipAddr = "127.0.0.1:0"
	c.NATSClientAddr = "127.0.0.1:0"
	c.NATSClusterAddr = "127.0.0.1:0"
	c.PeerAddr = "127.0.0.1:0"
	c.AdminAddr = "127.0.0.1:0"
	c.RaftAddr = "127.0.0.1:0"
	c.StartTimeout = 30 * time.Second
	c.LeaveTimeout = time.Second
	return c
}

// Active reports whether the gateway runs as a cluster member.
func (c *ClusterConfig) Active() bool { return c.Enabled && !c.NoSync }

var clusterNameRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// validate appends cluster-section problems (only when Active).
func (c *ClusterConfig) validate(bad func(string, ...any)) {
	if !c.Active() {
		return
	}
	if !clusterNameRE.MatchString(c.Name) {
		bad("cluster.name %q: letters, digits, '-' and '_' only (1..64)", c.Name)
	}
	if c.Profile != ProfileLAN && c.Profile != ProfileLocal {
		bad("cluster.profile %q unknown (want lan or local)", c.Profile)
	}
	for name, a := range map[string]string{
		"gossip_addr": c.GossipAddr, "peer_addr": c.PeerAddr, "admin_addr": c.AdminAddr,
		"raft_addr": c.RaftAddr,
	} {
		if _, _, err := net.SplitHostPort(a); err != nil {
			bad("cluster.%s %q: want host:port", name, a)
		}
	}
	if c.NATSURL == "" {
		for name, a := range map[string]string{"nats_client_addr": c.NATSClientAddr, "nats_cluster_addr": c.NATSClusterAddr} {
			if _, _, err := net.SplitHostPort(a); err != nil {
				bad("cluster.%s %q: want host:port", name, a)
			}
		}
	}
	if c.DataDir == "" {
		bad("cluster.data_dir is empty")
	}
	if c.NATSURL == "" && (c.NATSCredentialsFile != "" || c.NATSTLS.Enabled()) {
		bad("cluster.nats_credentials_file and cluster.nats_tls apply to an external cluster.nats_url only")
	}
	if c.BootstrapExpect < 1 {
		bad("cluster.bootstrap_expect %d must be at least 1", c.BootstrapExpect)
	}
	if c.StartTimeout <= 0 || c.LeaveTimeout <= 0 {
		bad("cluster.start_timeout and cluster.leave_timeout must be positive")
	}
}

// nodeID resolves NodeID: the configured id, else the host name.
func (c *ClusterConfig) nodeID() (string, error) {
	if c.NodeID != "" {
		return c.NodeID, nil
	}
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "", fmt.Errorf("%w: cluster.node_id is empty and the host name is unknown: %v", ErrInvalidConfig, err)
	}
	return h, nil
}

// gossipKey reads the gossip key from GossipKeyFile or KVMESH_GOSSIP_KEY
// (base64); nil when neither is set.
func (c *ClusterConfig) gossipKey() ([]byte, error) {
	var raw string
	switch {
	case c.GossipKeyFile != "":
		b, err := os.ReadFile(c.GossipKeyFile)
		if err != nil {
			return nil, fmt.Errorf("%w: cluster.gossip_key_file: %w", ErrInvalidConfig, err)
		}
		raw = string(b)
	default:
		raw = os.Getenv(GossipKeyEnv)
	}
	raw = strings.TrimSpace(raw)
	if raw == "" {
		return nil, nil
	}
	key, err := base64.StdEncoding.DecodeString(raw)
	if err != nil {
		return nil, fmt.Errorf("%w: gossip key is not base64: %w", ErrInvalidConfig, err)
	}
	if l := len(key); l != 16 && l != 24 && l != 32 {
		return nil, fmt.Errorf("%w: gossip key is %d bytes, want 16, 24 or 32", ErrInvalidConfig, l)
	}
	return key, nil
}

// clusterKeys resolves the cluster key: ClusterKey, else ClusterKeyFile,
// else KVMESH_CLUSTER_KEY. It returns nil keys only with Insecure;
// without either it returns ErrNoClusterKey.
func (c *ClusterConfig) clusterKeys() ([][]byte, error) {
	var keys [][]byte
	var err error
	if c.ClusterKey != "" {
		keys, err = trust.ParseKeys(c.ClusterKey)
	} else {
		keys, err = trust.LoadKeys(c.ClusterKeyFile)
	}
	switch {
	case errors.Is(err, trust.ErrNoKey) && c.Insecure:
		return nil, nil
	case errors.Is(err, trust.ErrNoKey):
		return nil, ErrNoClusterKey
	case err != nil:
		return nil, fmt.Errorf("%w: cluster key: %w", ErrInvalidConfig, err)
	}
	return keys, nil
}

// insecureBinds moves the cluster listeners an insecure gateway left at
// their all-interfaces defaults to 127.0.0.1: without a key they are
// unauthenticated, and no unauthenticated cluster port listens on every
// interface unless the operator named the address. It returns the fields
// it moved.
func (c *ClusterConfig) insecureBinds() []string {
	def := DefaultClusterConfig()
	var moved []string
	for _, f := range []struct {
		name      string
		cur, dflt *string
	}{
		{"gossip_addr", &c.GossipAddr, &def.GossipAddr}, {"peer_addr", &c.PeerAddr, &def.PeerAddr},
		{"raft_addr", &c.RaftAddr, &def.RaftAddr}, {"nats_cluster_addr", &c.NATSClusterAddr, &def.NATSClusterAddr},
	} {
		if *f.cur == *f.dflt {
			_, port, _ := net.SplitHostPort(*f.dflt)
			*f.cur = net.JoinHostPort("127.0.0.1", port)
			moved = append(moved, f.name)
		}
	}
	return moved
}

// adminToken resolves the admin token (flag/field, env, file).
func (c *ClusterConfig) adminToken() (string, error) {
	tok, err := config.LoadToken(c.AdminToken, c.AdminTokenFile)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if tok == "" {
		return "", fmt.Errorf("%w: cluster mode needs an admin token (cluster.admin_token, %s or cluster.admin_token_file)",
			ErrInvalidConfig, config.TokenEnv)
	}
	return tok, nil
}

// advertiseHost is the host peers use for this gateway's listeners bound
// to an unspecified address: AdvertiseAddr's host, else GossipAddr's when
// it names one, else the host's private IPv4 address (memberlist's own
// choice for a 0.0.0.0 gossip bind), else loopback.
func (c *ClusterConfig) advertiseHost() string {
	for _, a := range []string{c.AdvertiseAddr, c.GossipAddr} {
		if h, _, err := net.SplitHostPort(a); err == nil && h != "" {
			if ip := net.ParseIP(h); ip == nil || !ip.IsUnspecified() {
				return h
			}
		}
	}
	if ip, err := sockaddr.GetPrivateIP(); err == nil && ip != "" {
		return ip
	}
	return "127.0.0.1"
}

// advertised replaces an unspecified host in a bound address.
func advertised(bound, host string) string {
	h, p, err := net.SplitHostPort(bound)
	if err != nil {
		return bound
	}
	if ip := net.ParseIP(h); h == "" || ip != nil && ip.IsUnspecified() {
		return net.JoinHostPort(host, p)
	}
	return bound
}

// syncConfig is the sync.Cluster config for this gateway.
func (c *ClusterConfig) syncConfig(id string) (kvsync.Config, error) {
	sc := kvsync.DefaultConfig()
	if c.Profile == ProfileLocal {
		sc = kvsync.LocalConfig(id)
	}
	sc.ClusterName = c.Name
	sc.NodeName = id
	sc.Version = version()
	sc.GossipAddr = c.GossipAddr
	sc.AdvertiseAddr = c.AdvertiseAddr
	sc.Join = append([]string(nil), c.Join...)
	sc.PeerAddr = c.PeerAddr
	sc.NATSURL = c.NATSURL
	sc.NATSClientAddr = c.NATSClientAddr
	sc.NATSClusterAddr = c.NATSClusterAddr
	sc.PeerTLS = c.PeerTLS
	sc.PeerTLSServerName = c.PeerTLSServerName
	sc.NATSCredentialsFile = c.NATSCredentialsFile
	sc.NATSTLS = c.NATSTLS
	key, err := c.gossipKey()
	if err != nil {
		return sc, err
	}
	sc.SecretKey = key
	return sc, nil
}

// storeConfig is the raft store config for this gateway (NodeID, DataDir,
// Membership, Seed and the token are filled in by the caller).
func (c *ClusterConfig) storeConfig() config.StoreConfig {
	sc := config.DefaultStoreConfig()
	if c.Profile == ProfileLocal {
		sc = config.LocalStoreConfig()
	}
	sc.DataDir = c.DataDir
	sc.RaftBindAddr = c.RaftAddr
	sc.RaftAdvertiseAddr = c.RaftAdvertiseAddr
	if sc.RaftAdvertiseAddr == "" {
		if adv := advertised(c.RaftAddr, c.advertiseHost()); adv != c.RaftAddr {
			sc.RaftAdvertiseAddr = adv
		}
	}
	sc.RaftTLS = c.RaftTLS
	sc.Transport = c.RaftTransport
	sc.BootstrapExpect = c.BootstrapExpect
	return sc
}
