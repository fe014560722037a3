package sync

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/prometheus/client_golang/prometheus"
)

// MemberEventKind says what happened to a member.
type MemberEventKind uint8

// Member event kinds.
const (
	// MemberJoin: a gateway of this cluster became alive (or this gateway
	// started).
	MemberJoin MemberEventKind = iota + 1
	// MemberUpdate: a member's metadata changed.
	MemberUpdate
	// MemberLeave: a member left gracefully (Leave/Shutdown).
	MemberLeave
	// MemberFail: the failure detector declared a member dead.
	MemberFail
)

func (k MemberEventKind) String() string {
	switch k {
	case MemberJoin:
		return "join"
	case MemberUpdate:
		return "update"
	case MemberLeave:
		return "leave"
	case MemberFail:
		return "fail"
	}
	return "unknown"
}

// Member is a live gateway of the cluster as this gateway sees it.
type Member struct {
	Name string
	Addr string // gossip host:port
	Meta NodeMeta
	Self bool
}

// MemberEvent is one membership change.
type MemberEvent struct {
	Kind   MemberEventKind
	Member Member
}

// MemberListener receives membership changes. The Cluster calls every
// listener from one goroutine, in event order, never concurrently and never
// from memberlist's own goroutines; a listener should return quickly (it
// delays later events, not gossip).
type MemberListener interface {
	MemberEvent(ev MemberEvent)
}

// MemberListenerFunc adapts a function to MemberListener.
type MemberListenerFunc func(MemberEvent)

// MemberEvent implements MemberListener.
func (f MemberListenerFunc) MemberEvent(ev MemberEvent) { f(ev) }

// maxQueuedEvents bounds membership events waiting for listeners; beyond it
// events are dropped and counted (listeners resynchronise from Members on
// the next event).
const maxQueuedEvents = 4096

// broadcastLimit is the largest user message queued for gossip: memberlist
// packs broadcasts into UDP packets of UDPBufferSize (1400) with overhead.
const broadcastLimit = 1200

// membership wraps memberlist: it keeps the view of live members of this
// cluster, fans events out to listeners from its own goroutine, and carries
// the NATS-outage fallback broadcasts.
type membership struct {
	cfg    Config
	log    *slog.Logger
	m      *metrics
	onMsg  func([]byte) // user messages (fallback deltas); must not block
	ml     *memberlist.Memberlist
	queue  *memberlist.TransmitLimitedQueue
	meta   []byte
	metaMu sync.RWMutex

	mu        sync.Mutex
	members   map[string]Member
	events    []MemberEvent
	listeners []MemberListener
	signal    chan struct{}
	changed   chan struct{} // closed and replaced at every change
	failed    map[string]failedMember
	leaving   map[string]time.Time // members that announced a leave (leaveIntentPrefix)
}

// leaveIntentPrefix starts the user message a gateway sends every member
// over memberlist's reliable (TCP) channel just before it leaves,
// followed by its name. Metadata with Leaving set says the same, but it
// spreads by gossip, and memberlist's own leave message replaces a
// metadata broadcast still queued for the same node: on a loaded machine
// peers then saw the leave without the metadata and took it for a crash.
// The leading 0 byte never starts a sync message, so peers of the previous
// release count it as one malformed gossip message and go on.
const leaveIntentPrefix = "\x00kvmesh/leave\x00"

var leaveIntentMsg = []byte(leaveIntentPrefix)

// leaveIntentTTL bounds how long an announced leave waits for the member
// to go; a member that announced and then stayed is treated as usual.
const leaveIntentTTL = time.Minute

// failedMember is a member the failure detector declared dead, which the
// reconnect loop keeps trying (it may be alive behind a healed partition).
type failedMember struct {
	addr string
	// route is the member's NATS route URL ("" if it advertised none),
	// which Cluster keeps for natsRouteHold after the failure.
	route string
	at    time.Time
}

func newMembership(cfg Config, log *slog.Logger, m *metrics, onMsg func([]byte)) *membership {
	return &membership{
		cfg:     cfg,
		log:     log,
		m:       m,
		onMsg:   onMsg,
		members: make(map[string]Member),
		signal:  make(chan struct{}, 1),
		changed: make(chan struct{}),
		failed:  make(map[string]failedMember),
		leaving: make(map[string]time.Time),
	}
}

// memberlistConfig builds memberlist's config from cfg.
func (ms *membership) memberlistConfig(transport memberlist.Transport) (*memberlist.Config, error) {
	var mc *memberlist.Config
	if ms.cfg.GossipProfile == ProfileLocal {
		mc = memberlist.DefaultLocalConfig()
	} else {
		mc = memberlist.DefaultLANConfig()
	}
	mc.Name = ms.cfg.NodeName
	if transport != nil {
		mc.Transport = transport
	} else {
		hp, err := splitHostPort(ms.cfg.GossipAddr)
		if err != nil {
			return nil, fmt.Errorf("%w: GossipAddr: %w", ErrInvalidConfig, err)
		}
		mc.BindAddr, mc.BindPort = hp.host, hp.port
		mc.AdvertisePort = hp.port
	}
	if ms.cfg.AdvertiseAddr != "" {
		hp, err := splitHostPort(ms.cfg.AdvertiseAddr)
		if err != nil {
			return nil, fmt.Errorf("%w: AdvertiseAddr: %w", ErrInvalidConfig, err)
		}
		mc.AdvertiseAddr, mc.AdvertisePort = hp.host, hp.port
	}
	if ms.cfg.ProbeInterval > 0 {
		mc.ProbeInterval = ms.cfg.ProbeInterval
	}
	if ms.cfg.ProbeTimeout > 0 {
		mc.ProbeTimeout = ms.cfg.ProbeTimeout
	}
	if ms.cfg.SuspicionMult > 0 {
		mc.SuspicionMult = ms.cfg.SuspicionMult
	}
	if ms.cfg.GossipInterval > 0 {
		mc.GossipInterval = ms.cfg.GossipInterval
	}
	if ms.cfg.PushPullInterval > 0 {
		mc.PushPullInterval = ms.cfg.PushPullInterval
	}
	// memberlist sends each membership message RetransmitMult *
	// ceil(log10(n+1)) times in all: 2 in the local profile for a small
	// cluster, so two lost datagrams on a loaded machine hid a join until
	// the next push-pull. The LAN profile's 4 costs a few small packets.
	mc.RetransmitMult = max(mc.RetransmitMult, 4)
	switch {
	case len(ms.cfg.SecretKey) > 0:
		mc.SecretKey = ms.cfg.SecretKey
	case ms.cfg.Trust != nil:
		// The primary key encrypts; every ring key decrypts (rotation).
		keys := ms.cfg.Trust.GossipKeys()
		kr, err := memberlist.NewKeyring(keys, keys[0])
		if err != nil {
			return nil, fmt.Errorf("%w: gossip keyring: %w", ErrInvalidConfig, err)
		}
		mc.Keyring = kr
	}
	// Encrypted gossip refuses clear-text and wrong-key packets and
	// streams (GossipVerifyIncoming, memberlist's default).
	mc.GossipVerifyIncoming, mc.GossipVerifyOutgoing = true, true
	mc.Delegate = (*mlDelegate)(ms)
	mc.Events = (*mlEvents)(ms)
	mc.Logger = slog.NewLogLogger(gossipLogHandler{inner: ms.log.With("component", "memberlist").Handler(),
		rejected: ms.m.gossipRejected}, slog.LevelDebug)
	return mc, nil
}

// start creates the memberlist (binding its sockets). Bind port 0 is
// resolved: the advertised port is the bound one.
func (ms *membership) start(meta []byte, transport memberlist.Transport) error {
	ms.setMeta(meta)
	mc, err := ms.memberlistConfig(transport)
	if err != nil {
		return err
	}
	ml, err := memberlist.Create(mc)
	if err != nil {
		return fmt.Errorf("sync: memberlist: %w", err)
	}
	ms.ml = ml
	ms.queue = &memberlist.TransmitLimitedQueue{
		NumNodes: ml.NumMembers,
		// Probes piggyback broadcasts too, so a few transmits can all go
		// to one peer: at least 4 (above).
		RetransmitMult: mc.RetransmitMult,
	}
	return nil
}

// join contacts the seeds once; it reports how many answered.
func (ms *membership) join(seeds []string) (int, error) {
	if len(seeds) == 0 {
		return 0, nil
	}
	n, err := ms.ml.Join(seeds)
	if err != nil && n == 0 {
		return 0, fmt.Errorf("sync: join %v: %w", seeds, err)
	}
	return n, nil
}

// joinLoop retries the seeds while this gateway is alone, and every
// ReconnectInterval tries to rejoin members the failure detector declared
// dead within ReconnectTimeout: memberlist alone never merges two sides of
// a healed partition (each holds the other dead at the same incarnation),
// but a push-pull with a failed member makes both refute and revive.
func (ms *membership) joinLoop(ctx context.Context) {
	t := time.NewTicker(ms.cfg.JoinRetry)
	defer t.Stop()
	lastReconnect := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if ms.ml.NumMembers() <= 1 && len(ms.cfg.Join) > 0 {
			if _, err := ms.join(ms.cfg.Join); err != nil {
				ms.log.Debug("join retry failed", "err", err)
			}
		}
		if time.Since(lastReconnect) < ms.cfg.ReconnectInterval {
			continue
		}
		lastReconnect = time.Now()
		var addrs []string
		ms.mu.Lock()
		for name, f := range ms.failed {
			if time.Since(f.at) > ms.cfg.ReconnectTimeout {
				delete(ms.failed, name)
				continue
			}
			addrs = append(addrs, f.addr)
		}
		ms.mu.Unlock()
		for _, a := range addrs {
			if ctx.Err() != nil {
				return
			}
			if _, err := ms.ml.Join([]string{a}); err != nil {
				ms.log.Debug("reconnect to failed member", "addr", a, "err", err)
			}
		}
	}
}

// eventLoop delivers queued events to listeners until ctx ends.
func (ms *membership) eventLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-ms.signal:
		}
		for {
			ms.mu.Lock()
			evs := ms.events
			ms.events = nil
			ls := ms.listeners
			ms.mu.Unlock()
			if len(evs) == 0 {
				break
			}
			for _, ev := range evs {
				for _, l := range ls {
					l.MemberEvent(ev)
				}
			}
		}
	}
}

func (ms *membership) changedCh() <-chan struct{} {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	return ms.changed
}

func (ms *membership) addListener(l MemberListener) {
	ms.mu.Lock()
	ms.listeners = append(ms.listeners, l)
	ms.mu.Unlock()
}

func (ms *membership) setMeta(b []byte) {
	ms.metaMu.Lock()
	ms.meta = b
	ms.metaMu.Unlock()
}

// updateMeta changes this gateway's metadata and gossips it.
func (ms *membership) updateMeta(b []byte, timeout time.Duration) error {
	ms.setMeta(b)
	if ms.ml == nil {
		return nil
	}
	return ms.ml.UpdateNode(timeout)
}

// snapshot returns the live members sorted by name.
func (ms *membership) snapshot() []Member {
	ms.mu.Lock()
	out := make([]Member, 0, len(ms.members))
	for _, m := range ms.members {
		out = append(out, m)
	}
	ms.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

func (ms *membership) member(name string) (Member, bool) {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	m, ok := ms.members[name]
	return m, ok
}

// broadcast sends msg to every live member at once (one UDP packet each)
// and queues it for gossip, whose retransmits to random members cover lost
// packets; receivers drop the duplicates. msg must be at most
// broadcastLimit bytes and is kept.
func (ms *membership) broadcast(msg []byte) {
	for _, n := range ms.peerNodes() {
		if err := ms.ml.SendBestEffort(n, msg); err != nil {
			ms.log.Debug("gossip send", "to", n.Name, "err", err)
		}
	}
	ms.queue.QueueBroadcast(userBroadcast(msg))
	// Keep the queue bounded: a long outage at a high decision rate must
	// not grow it without limit. Oldest, most retransmitted go first.
	if ms.queue.NumQueued() > 4096 {
		ms.queue.Prune(4096)
	}
}

// peerNodes returns the other live members as memberlist nodes to send
// to, built from our own copy of the membership (snapshot). memberlist's
// Members returns pointers to its live node records, which its packet
// handler rewrites (a member's address on an alive message) without a
// lock we could take: reading them races (the race detector caught
// broadcast doing so under load).
func (ms *membership) peerNodes() []*memberlist.Node {
	members := ms.snapshot()
	out := make([]*memberlist.Node, 0, len(members))
	for _, m := range members {
		if m.Self {
			continue
		}
		host, port, err := net.SplitHostPort(m.Addr)
		p, perr := strconv.ParseUint(port, 10, 16)
		if err != nil || perr != nil {
			continue
		}
		out = append(out, &memberlist.Node{Name: m.Name, Addr: net.ParseIP(host), Port: uint16(p)})
	}
	return out
}

// announceLeave tells every member, over memberlist's reliable channel,
// that this gateway is about to leave, waiting up to timeout for the
// answers (a member that does not answer learns of the leave by gossip
// and may count it as a failure).
func (ms *membership) announceLeave(timeout time.Duration) {
	if ms.ml == nil {
		return
	}
	msg := []byte(leaveIntentPrefix + ms.cfg.NodeName)
	var wg sync.WaitGroup
	for _, n := range ms.peerNodes() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := ms.ml.SendReliable(n, msg); err != nil {
				ms.log.Debug("announcing leave", "to", n.Name, "err", err)
			}
		}()
	}
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		ms.log.Debug("announcing leave: not every member answered in time", "timeout", timeout)
	}
}

// noteLeaving records a member's announced leave.
func (ms *membership) noteLeaving(name string) {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	now := time.Now()
	for n, at := range ms.leaving {
		if now.Sub(at) > leaveIntentTTL {
			delete(ms.leaving, n)
		}
	}
	if len(ms.leaving) < maxQueuedEvents {
		ms.leaving[name] = now
	}
}

// leave broadcasts a graceful leave and waits up to timeout for it to spread.
func (ms *membership) leave(timeout time.Duration) error {
	if ms.ml == nil {
		return nil
	}
	return ms.ml.Leave(timeout)
}

func (ms *membership) shutdown() error {
	if ms.ml == nil {
		return nil
	}
	return ms.ml.Shutdown()
}

// handle records a memberlist node event and queues it for listeners.
// Called by memberlist with its state lock held: it must not block.
func (ms *membership) handle(kind MemberEventKind, n *memberlist.Node) {
	meta, err := decodeMeta(n.Meta)
	if err != nil {
		ms.m.malformed.WithLabelValues("meta").Inc()
		ms.log.Warn("ignoring member with malformed metadata", "member", n.Name, "err", err)
		return
	}
	if meta.Cluster != ms.cfg.ClusterName {
		ms.log.Warn("ignoring member of another cluster", "member", n.Name, "cluster", meta.Cluster)
		return
	}
	mem := Member{
		Name: n.Name,
		Addr: net.JoinHostPort(n.Addr.String(), strconv.Itoa(int(n.Port))),
		Meta: meta,
		Self: n.Name == ms.cfg.NodeName,
	}
	ms.mu.Lock()
	switch kind {
	case MemberJoin, MemberUpdate:
		ms.members[n.Name] = mem
		delete(ms.failed, n.Name)
		if kind == MemberJoin {
			delete(ms.leaving, n.Name) // back: a later death is a failure again
		}
	default:
		// memberlist does not say whether a node left or died (Node.State
		// is not updated): a gateway that leaves gracefully first gossips
		// metadata with Leaving set and announces it to every member.
		at, announced := ms.leaving[n.Name]
		announced = announced && time.Since(at) <= leaveIntentTTL
		delete(ms.leaving, n.Name)
		if old, ok := ms.members[n.Name]; !(ok && old.Meta.Leaving) && !meta.Leaving && !announced {
			kind = MemberFail
		}
		delete(ms.members, n.Name)
		if kind == MemberFail && !mem.Self {
			ms.failed[n.Name] = failedMember{addr: mem.Addr, route: mem.Meta.NATSRoute, at: time.Now()}
		} else {
			delete(ms.failed, n.Name)
		}
	}
	ms.m.members.Set(float64(len(ms.members)))
	close(ms.changed)
	ms.changed = make(chan struct{})
	if len(ms.events) < maxQueuedEvents {
		ms.events = append(ms.events, MemberEvent{Kind: kind, Member: mem})
	} else {
		ms.m.eventsDropped.Inc()
	}
	ms.mu.Unlock()
	select {
	case ms.signal <- struct{}{}:
	default:
	}
}

// heldRoutes returns the NATS route URLs of members the failure detector
// declared dead less than hold ago (and that have not come back), and when
// the first of them is due to go (zero when none is held).
func (ms *membership) heldRoutes(now time.Time, hold time.Duration) (routes []string, next time.Time) {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	for _, f := range ms.failed {
		end := f.at.Add(hold)
		if f.route == "" || !now.Before(end) {
			continue
		}
		routes = append(routes, f.route)
		if next.IsZero() || end.Before(next) {
			next = end
		}
	}
	return routes, next
}

// mlDelegate implements memberlist.Delegate.
type mlDelegate membership

var _ memberlist.Delegate = (*mlDelegate)(nil)

func (d *mlDelegate) NodeMeta(limit int) []byte {
	ms := (*membership)(d)
	ms.metaMu.RLock()
	defer ms.metaMu.RUnlock()
	if len(ms.meta) > limit {
		return nil
	}
	return ms.meta
}

func (d *mlDelegate) NotifyMsg(b []byte) {
	if name, ok := bytes.CutPrefix(b, leaveIntentMsg); ok {
		(*membership)(d).noteLeaving(string(name))
		return
	}
	if len(b) > 0 && d.onMsg != nil {
		d.onMsg(b)
	}
}

func (d *mlDelegate) GetBroadcasts(overhead, limit int) [][]byte {
	if d.queue == nil {
		return nil
	}
	return d.queue.GetBroadcasts(overhead, limit)
}

func (d *mlDelegate) LocalState(bool) []byte        { return nil }
func (d *mlDelegate) MergeRemoteState([]byte, bool) {}

// mlEvents implements memberlist.EventDelegate.
type mlEvents membership

var _ memberlist.EventDelegate = (*mlEvents)(nil)

func (e *mlEvents) NotifyJoin(n *memberlist.Node)   { (*membership)(e).handle(MemberJoin, n) }
func (e *mlEvents) NotifyLeave(n *memberlist.Node)  { (*membership)(e).handle(MemberLeave, n) }
func (e *mlEvents) NotifyUpdate(n *memberlist.Node) { (*membership)(e).handle(MemberUpdate, n) }

// userBroadcast is a fallback message gossiped by memberlist; it never
// invalidates another (each batch has its own sequence number).
type userBroadcast []byte

func (b userBroadcast) Invalidates(memberlist.Broadcast) bool { return false }
func (b userBroadcast) Message() []byte                       { return b }
func (b userBroadcast) Finished()                             {}

// gossipLogHandler counts memberlist's refusals of gossip that is not
// encrypted with a cluster key (kvmesh_sync_gossip_rejected_total) before
// passing its log lines on: memberlist has no other hook for a packet or
// stream it could not decrypt. memberlist logs through a log.Logger at one
// level, so every line reaches Handle and the inner handler's level
// decides what is written.
type gossipLogHandler struct {
	inner    slog.Handler
	rejected prometheus.Counter
}

// gossipRefusals are the parts of memberlist v0.7.0's log lines for a
// refused packet ("Decrypt packet failed") or stream ("failed to receive:
// encryption is configured but remote state is not encrypted", "... no
// installed keys could decrypt the message"). TestGossipIntruderCounted
// pins them.
var gossipRefusals = []string{"Decrypt packet failed", "remote state is not encrypted", "could decrypt", "cannot decrypt", "to decrypt"}

func (h gossipLogHandler) Enabled(context.Context, slog.Level) bool { return true }

func (h gossipLogHandler) Handle(ctx context.Context, r slog.Record) error {
	for _, s := range gossipRefusals {
		if strings.Contains(r.Message, s) {
			h.rejected.Inc()
			break
		}
	}
	if !h.inner.Enabled(ctx, r.Level) {
		return nil
	}
	return h.inner.Handle(ctx, r)
}

func (h gossipLogHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return gossipLogHandler{inner: h.inner.WithAttrs(as), rejected: h.rejected}
}

func (h gossipLogHandler) WithGroup(name string) slog.Handler {
	return gossipLogHandler{inner: h.inner.WithGroup(name), rejected: h.rejected}
}
