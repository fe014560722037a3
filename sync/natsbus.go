package sync

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/sync/trust"
)

// subjects are this cluster's NATS subjects (see the package doc).
type subjects struct {
	prefix    string // kvmesh.<cluster>
	decisions string // kvmesh.<cluster>.delta.decisions
	kvAll     string // kvmesh.<cluster>.kv.>
	loadAll   string // kvmesh.<cluster>.load.*
	queuedAll string // kvmesh.<cluster>.queued.*
	digest    string // kvmesh.<cluster>.digest
}

func newSubjects(cluster string) subjects {
	p := "kvmesh." + cluster
	return subjects{prefix: p, decisions: p + ".delta.decisions", kvAll: p + ".kv.>",
		loadAll: p + ".load.*", queuedAll: p + ".queued.*", digest: p + ".digest"}
}

func (s subjects) kv(replica string) string { return s.prefix + ".kv." + subjectToken(replica) }
func (s subjects) load(node string) string  { return s.prefix + ".load." + subjectToken(node) }
func (s subjects) queued(node string) string {
	return s.prefix + ".queued." + subjectToken(node)
}

// subjectToken maps a name to one NATS subject token: bytes other than
// letters, digits, '-' and '_' become '_'. The name itself travels in the
// payload, so collisions only share a subject.
func subjectToken(s string) string {
	if validToken(s) {
		return s
	}
	b := []byte(s)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			b[i] = '_'
		}
	}
	if len(b) == 0 {
		return "_"
	}
	return string(b)
}

// bus is the gateway's NATS side: an optional embedded server clustered
// with the peers' servers, and one client connection.
type bus struct {
	cfg      Config
	log      *slog.Logger
	subj     subjects
	rejected *prometheus.CounterVec // kvmesh_sync_nats_rejected_total{port, reason}
	drops    prometheus.Counter     // kvmesh_sync_nats_disconnects_total

	mu     sync.Mutex
	srv    *server.Server
	opts   *server.Options // as built at first start, with resolved ports
	routes map[string]*url.URL
	nc     *nats.Conn
}

func newBus(cfg Config, log *slog.Logger, rejected *prometheus.CounterVec, drops prometheus.Counter) *bus {
	return &bus{cfg: cfg, log: log.With("component", "nats"), subj: newSubjects(cfg.ClusterName),
		routes: make(map[string]*url.URL), rejected: rejected, drops: drops}
}

// natsUser is the user name a route presents to a peer's embedded server;
// the password is derived from the cluster key.
const natsUser = "kvmesh"

// natsAuth is the embedded server's authentication of one port with the
// cluster key: on the client port a token, on the route port user
// natsUser and a password, derived for label under any ring key. (A client
// with a user name that is in no configured user list would be closed by
// nats-server at every reload of the route list, as "moved to another
// account": the client port therefore takes a token.) A refusal is
// counted before nats-server closes the connection; nats-server calls
// Check concurrently.
type natsAuth struct {
	ring     *trust.Ring
	label    string
	port     string
	token    bool // client port: ClientOpts.Token; route port: Username/Password
	rejected *prometheus.CounterVec
}

var _ server.Authentication = natsAuth{}

func (a natsAuth) Check(c server.ClientAuthentication) bool {
	o := c.GetOpts()
	switch {
	case o == nil:
	case a.token && o.Username == "" && a.ring.CheckSecret(a.label, o.Token):
		return true
	case !a.token && o.Username == natsUser && a.ring.CheckSecret(a.label, o.Password):
		return true
	}
	a.rejected.WithLabelValues(a.port, "unauthenticated").Inc()
	return false
}

// natsLogger passes nats-server's warnings and errors to slog and counts
// failed TLS handshakes on the route port (nats-server logs them and has
// no other hook): a route that does not speak TLS, or whose certificate
// no cluster CA issued.
type natsLogger struct {
	log      *slog.Logger
	rejected *prometheus.CounterVec
}

var _ server.Logger = natsLogger{}

func (l natsLogger) Noticef(string, ...any) {}
func (l natsLogger) Debugf(string, ...any)  {}
func (l natsLogger) Tracef(string, ...any)  {}
func (l natsLogger) Warnf(f string, v ...any) {
	l.log.Debug(fmt.Sprintf(f, v...))
}
func (l natsLogger) Fatalf(f string, v ...any) { l.log.Error(fmt.Sprintf(f, v...)) }
func (l natsLogger) Errorf(f string, v ...any) {
	msg := fmt.Sprintf(f, v...)
	if strings.Contains(msg, "TLS route handshake error") {
		l.rejected.WithLabelValues("route", "handshake").Inc()
	}
	l.log.Debug(msg)
}

// startServer starts the embedded server (first start or after stopServer).
func (b *bus) startServer() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.opts == nil {
		cl, err := splitHostPort(b.cfg.NATSClientAddr)
		if err != nil {
			return fmt.Errorf("%w: NATSClientAddr: %w", ErrInvalidConfig, err)
		}
		rt, err := splitHostPort(b.cfg.NATSClusterAddr)
		if err != nil {
			return fmt.Errorf("%w: NATSClusterAddr: %w", ErrInvalidConfig, err)
		}
		// Port 0 lets the server's own listeners pick the ports
		// (RANDOM_PORT); they are read back below. Resolving them
		// beforehand with a throwaway listener raced every other bind(0)
		// on the host between its close and the server's listen, and a
		// server whose port was taken never becomes ready.
		for _, hp := range []*hostPort{&cl, &rt} {
			if hp.port == 0 {
				hp.port = server.RANDOM_PORT
			}
		}
		b.opts = &server.Options{
			ServerName: b.cfg.NodeName,
			Host:       cl.host,
			Port:       cl.port,
			NoLog:      true,
			NoSigs:     true,
			MaxPayload: MaxMessageBytes,
			Cluster: server.ClusterOpts{
				Name:      b.cfg.ClusterName,
				Host:      rt.host,
				Port:      rt.port,
				Advertise: b.cfg.AdvertiseNATSClusterAddr,
				// Clients must not learn peers' client URLs (loopback).
				NoAdvertise: true,
				// One route connection per peer, as before nats-server
				// 2.10's route pools. All our subjects are in one account,
				// so a pool (three connections by default) carries them on
				// one connection anyway; and after a peer restarted under
				// the same name on new ports, a pool's connections were
				// seen closing one another as duplicates every second or
				// so, for seconds, with no message getting through (see
				// TestOneRouteConnectionPerPeer). Peers that still pool
				// fall back to one connection with this server.
				PoolSize: -1,
			},
		}
		if r := b.cfg.Trust; r != nil {
			b.opts.CustomClientAuthentication = natsAuth{ring: r, label: trust.LabelNATSClient, port: "client", token: true, rejected: b.rejected}
			b.opts.CustomRouterAuthentication = natsAuth{ring: r, label: trust.LabelNATSRoute, port: "route", rejected: b.rejected}
			b.opts.Cluster.TLSConfig = r.TLSConfig()
			b.opts.Cluster.TLSTimeout = 5
			// What nats-server sends on routes it learns from peers
			// (implicit routes); incoming routes are checked by natsAuth.
			b.opts.Cluster.Username = natsUser
			b.opts.Cluster.Password = r.Secret(trust.LabelNATSRoute)
		}
	}
	opts := b.opts.Clone()
	opts.Routes = b.routeList()
	s, err := server.NewServer(opts)
	if err != nil {
		return fmt.Errorf("sync: embedded NATS: %w", err)
	}
	s.SetLoggerV2(natsLogger{log: b.log, rejected: b.rejected}, false, false, false)
	s.Start()
	if !s.ReadyForConnections(10 * time.Second) {
		s.Shutdown()
		s.WaitForShutdown()
		return fmt.Errorf("sync: embedded NATS did not start on %s:%d", opts.Host, opts.Port)
	}
	// Keep the resolved ports: a restart (after stopServer) binds the same
	// ones, so the client reconnects and peers' routes still point here,
	// and nats-server refuses to reload a changed cluster port.
	if b.opts.Port == server.RANDOM_PORT {
		b.opts.Port = s.Addr().(*net.TCPAddr).Port
	}
	if b.opts.Cluster.Port == server.RANDOM_PORT {
		b.opts.Cluster.Port = s.ClusterAddr().Port
	}
	b.srv = s
	return nil
}

// stopServer shuts the embedded server down (Shutdown, or a test's outage).
func (b *bus) stopServer() {
	b.mu.Lock()
	s := b.srv
	b.srv = nil
	b.mu.Unlock()
	if s != nil {
		s.Shutdown()
		s.WaitForShutdown()
	}
}

func (b *bus) routeList() []*url.URL {
	keys := make([]string, 0, len(b.routes))
	for k := range b.routes {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	out := make([]*url.URL, len(keys))
	for i, k := range keys {
		out[i] = b.routes[k]
	}
	return out
}

// clientURL is the URL the gateway's own connection dials.
func (b *bus) clientURL() string {
	if b.cfg.NATSURL != "" {
		return b.cfg.NATSURL
	}
	return "nats://" + net.JoinHostPort(b.opts.Host, strconv.Itoa(b.opts.Port))
}

// routeURL is the route URL advertised to peers ("" without an embedded
// server). advertiseHost replaces an unspecified bind host.
func (b *bus) routeURL(advertiseHost string) string {
	if b.opts == nil {
		return ""
	}
	if b.cfg.AdvertiseNATSClusterAddr != "" {
		return "nats-route://" + b.cfg.AdvertiseNATSClusterAddr
	}
	h := b.opts.Cluster.Host
	if ip := net.ParseIP(h); h == "" || ip != nil && ip.IsUnspecified() {
		h = advertiseHost
	}
	return "nats-route://" + net.JoinHostPort(h, strconv.Itoa(b.opts.Cluster.Port))
}

// setRoutes makes the embedded server route to exactly the given peers'
// route URLs (a config reload adds and removes routes live).
func (b *bus) setRoutes(urls []string) {
	if b.cfg.NATSURL != "" {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	next := make(map[string]*url.URL, len(urls))
	for _, s := range urls {
		u, err := url.Parse(s)
		if err != nil {
			b.log.Warn("ignoring bad NATS route URL", "url", s, "err", err)
			continue
		}
		if b.cfg.Trust != nil {
			u.User = url.UserPassword(natsUser, b.cfg.Trust.Secret(trust.LabelNATSRoute))
		}
		next[s] = u
	}
	same := len(next) == len(b.routes)
	for k := range next {
		if _, ok := b.routes[k]; !ok {
			same = false
		}
	}
	if same {
		return
	}
	b.routes = next
	if b.srv == nil {
		return
	}
	opts := b.opts.Clone()
	opts.Routes = b.routeList()
	if err := b.srv.ReloadOptions(opts); err != nil {
		b.log.Warn("updating NATS routes", "err", err)
	}
}

// numRemotes is the number of peer servers the embedded server routes to
// (0 without one).
func (b *bus) numRemotes() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.srv == nil {
		return 0
	}
	return b.srv.NumRemotes()
}

// connect opens the client connection. It reconnects forever; connected
// reports the state (the kvmesh_sync_nats_connected gauge reads it).
func (b *bus) connect() error {
	wait := 250 * time.Millisecond
	if b.cfg.GossipProfile == ProfileLocal {
		wait = 50 * time.Millisecond
	}
	opts := []nats.Option{nats.Name("kvmesh-" + b.cfg.NodeName)}
	switch {
	case b.cfg.NATSURL == "" && b.cfg.Trust != nil:
		opts = append(opts, nats.Token(b.cfg.Trust.Secret(trust.LabelNATSClient)))
	case b.cfg.NATSURL != "":
		if b.cfg.NATSCredentialsFile != "" {
			opts = append(opts, nats.UserCredentials(b.cfg.NATSCredentialsFile))
		}
		tc, err := b.cfg.NATSTLS.ClientConfig()
		if err != nil {
			return fmt.Errorf("%w: NATSTLS: %w", ErrInvalidConfig, err)
		}
		if tc != nil {
			opts = append(opts, nats.Secure(tc))
		}
	}
	nc, err := nats.Connect(b.clientURL(), append(opts,
		nats.NoEcho(),
		// Peers' client URLs are loopback addresses on their own hosts:
		// the gateway only ever talks to its own (or the external) server.
		nats.IgnoreDiscoveredServers(),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(wait),
		nats.ReconnectJitter(wait/5, wait/5),
		nats.RetryOnFailedConnect(true),
		// Deltas published while disconnected go to gossip instead; a
		// small buffer only covers the instant of the disconnect.
		nats.ReconnectBufSize(1<<20),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err == nil {
				return // our own Close
			}
			b.drops.Inc()
			b.log.Warn("NATS disconnected", "err", err)
		}),
		nats.ReconnectHandler(func(*nats.Conn) {
			b.log.Info("NATS reconnected")
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			b.log.Warn("NATS async error", "err", err)
		}),
	)...)
	if err != nil {
		return fmt.Errorf("sync: NATS connect %s: %w", b.clientURL(), err)
	}
	b.mu.Lock()
	b.nc = nc
	b.mu.Unlock()
	return nil
}

func (b *bus) conn() *nats.Conn {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.nc
}

// connected reports whether publishing on NATS reaches peers now.
func (b *bus) connected() bool {
	nc := b.conn()
	return nc != nil && nc.IsConnected()
}

// subscribe registers h for subject; nats.go calls h from one goroutine
// per subscription, in order.
func (b *bus) subscribe(subject string, h func([]byte)) error {
	nc := b.conn()
	if nc == nil {
		return ErrNotStarted
	}
	sub, err := nc.Subscribe(subject, func(m *nats.Msg) { h(m.Data) })
	if err != nil {
		return fmt.Errorf("sync: subscribe %s: %w", subject, err)
	}
	// Bound what nats.go buffers for a slow handler (handlers only decode
	// and enqueue, so hitting this means the process is starved).
	if err := sub.SetPendingLimits(1<<16, 256<<20); err != nil {
		return fmt.Errorf("sync: subscribe %s: %w", subject, err)
	}
	return nil
}

// flushSubscriptions waits until the server has registered the
// subscriptions (so that interest reaches the routes).
func (b *bus) flushSubscriptions(timeout time.Duration) error {
	nc := b.conn()
	if nc == nil {
		return ErrNotStarted
	}
	return nc.FlushTimeout(timeout)
}

var errNotConnected = errors.New("sync: NATS not connected")

// publish sends data on subject if connected; it never blocks on the
// network (nats.go buffers writes).
func (b *bus) publish(subject string, data []byte) error {
	nc := b.conn()
	if nc == nil || !nc.IsConnected() {
		return errNotConnected
	}
	return nc.Publish(subject, data)
}

// close drains nothing: deltas in flight are lost like any crash's, and
// anti-entropy repairs peers.
func (b *bus) close() {
	b.mu.Lock()
	nc := b.nc
	b.nc = nil
	b.mu.Unlock()
	if nc != nil {
		nc.Close()
	}
	b.stopServer()
}
