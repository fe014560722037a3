package cluster

import (
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/hashicorp/raft"

	"github.com/kvmesh/kvmesh/chaos/faultproxy"
	kvsync "github.com/kvmesh/kvmesh/sync"
)

// Link is a set of gateway-to-gateway links a partition cuts.
type Link uint8

const (
	// LinkGossip: memberlist (failure detection, metadata, the decision
	// fallback while NATS is down), over a sync.MemNetwork.
	LinkGossip Link = 1 << iota
	// LinkRaft: the config store's raft RPCs, over raft.InmemTransport.
	LinkRaft
	// LinkNATS: a gateway's connection to the shared NATS server, through
	// its own faultproxy.Proxy (Gateway.NATSLink). NATS is one server, so
	// this link is cut per gateway, not per pair. Needs ExternalNATS.
	LinkNATS
	// LinkAll is every link above: a gateway cut off from its peers
	// (clients and engines still reach it, as in a partition between
	// racks that leaves the clients' side intact).
	LinkAll = LinkGossip | LinkRaft | LinkNATS
)

func (l Link) String() string {
	var parts []string
	for _, x := range []struct {
		l    Link
		name string
	}{{LinkGossip, "gossip"}, {LinkRaft, "raft"}, {LinkNATS, "nats"}} {
		if l&x.l != 0 {
			parts = append(parts, x.name)
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, "+")
}

// mesh is the partitionable network between gateways (Config.Partitionable):
// the in-memory gossip network, each gateway's current raft transport by
// gateway name, and which links are cut. Cuts are kept by gateway name, so
// a gateway restarted during a partition stays cut.
type mesh struct {
	gossip kvsync.MemNetwork

	mu      sync.Mutex
	raft    map[string]*raftLink // live gateways' raft transports, by name
	raftCut map[[2]string]bool   // unordered pairs of gateway names
	natsCut map[string]bool      // gateways cut from NATS
	nats    map[string]*faultproxy.Proxy
}

func newMesh() *mesh {
	return &mesh{
		raft:    map[string]*raftLink{},
		raftCut: map[[2]string]bool{},
		natsCut: map[string]bool{},
		nats:    map[string]*faultproxy.Proxy{},
	}
}

// raftLink is a gateway's raft.InmemTransport with pipelined replication
// off, as the config store runs its own TCP transport (hashicorp/raft
// v1.8.0's pipeline can deadlock a leader's Shutdown; see sync/config).
// Every other method, including Connect and Disconnect, is InmemTransport's.
type raftLink struct{ *raft.InmemTransport }

var _ raft.WithPeers = raftLink{}

// AppendEntriesPipeline reports that pipelining is not supported.
func (raftLink) AppendEntriesPipeline(raft.ServerID, raft.ServerAddress) (raft.AppendPipeline, error) {
	return nil, raft.ErrPipelineReplicationNotSupported
}

// raftAddr is gateway name's raft address, the same across restarts: raft
// keeps a server's address in its configuration, and the InmemTransport
// dials that address, not one membership resolves.
func raftAddr(name string) raft.ServerAddress { return raft.ServerAddress("inmem-raft/" + name) }

func pairOf(a, b string) [2]string {
	if a > b {
		a, b = b, a
	}
	return [2]string{a, b}
}

// attachRaft creates gateway name's raft transport and connects it both
// ways to every attached peer it is not cut from.
func (m *mesh) attachRaft(name string) *raftLink {
	_, t := raft.NewInmemTransport(raftAddr(name))
	rl := &raftLink{t}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.raft[name] = rl
	for peer, pt := range m.raft {
		if peer == name || m.raftCut[pairOf(name, peer)] {
			continue
		}
		rl.Connect(raftAddr(peer), pt.InmemTransport)
		pt.Connect(raftAddr(name), rl.InmemTransport)
	}
	return rl
}

// detachRaft disconnects rl from every peer (as a stopped process's port
// refuses) and closes it, unless a newer transport replaced it.
func (m *mesh) detachRaft(name string, rl *raftLink) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.raft[name] == rl {
		delete(m.raft, name)
		for _, pt := range m.raft {
			pt.Disconnect(raftAddr(name))
		}
	}
	_ = rl.Close()
}

// cutPair cuts gossip and raft between a and b as links says.
func (m *mesh) cutPair(a, b string, links Link) {
	if links&LinkGossip != 0 {
		m.gossip.Partition(a, b)
	}
	if links&LinkRaft == 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.raftCut[pairOf(a, b)] = true
	if ta, tb := m.raft[a], m.raft[b]; ta != nil && tb != nil {
		ta.Disconnect(raftAddr(b))
		tb.Disconnect(raftAddr(a))
	}
}

// cutNATS cuts gateway name from NATS: its proxy refuses new connections
// and drops the open ones (the client sees a broken connection and keeps
// retrying).
func (m *mesh) cutNATS(name string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.natsCut[name] = true
	if p := m.nats[name]; p != nil {
		if err := p.SetRefuse(true); err != nil {
			return err
		}
		p.Cut()
	}
	return nil
}

// heal reconnects every pair and every gateway's NATS link.
func (m *mesh) heal() error {
	m.gossip.Heal()
	m.mu.Lock()
	defer m.mu.Unlock()
	clear(m.raftCut)
	for a, ta := range m.raft {
		for b, tb := range m.raft {
			if a != b {
				ta.Connect(raftAddr(b), tb.InmemTransport)
			}
		}
	}
	clear(m.natsCut)
	var err error
	for _, p := range m.nats {
		if e := p.Heal(); e != nil && err == nil {
			err = e
		}
	}
	return err
}

// attachNATS records gateway name's NATS proxy, refusing at once when the
// gateway is cut from NATS.
func (m *mesh) attachNATS(name string, p *faultproxy.Proxy) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.nats[name] = p
	if m.natsCut[name] {
		return p.SetRefuse(true)
	}
	return nil
}

// detachNATS forgets p (a newer proxy may have replaced it) and closes it.
func (m *mesh) detachNATS(name string, p *faultproxy.Proxy) error {
	m.mu.Lock()
	if m.nats[name] == p {
		delete(m.nats, name)
	}
	m.mu.Unlock()
	return p.Close()
}

// Partition cuts links between every gateway of a and every gateway of b
// (both directions) until Heal. LinkNATS cuts each gateway of b from the
// NATS server (the server stays on a's side); it needs ExternalNATS. Cuts
// outlive restarts: a gateway restarted with the same name stays cut.
// Clients and engines keep reaching every gateway.
func (c *Cluster) Partition(links Link, a, b []*Gateway) error {
	if c.mesh == nil {
		return fmt.Errorf("%w: partitions need Config.Partitionable", ErrInvalidConfig)
	}
	if links&LinkNATS != 0 && c.NATS == nil {
		return fmt.Errorf("%w: a NATS cut needs Config.ExternalNATS", ErrInvalidConfig)
	}
	for _, x := range a {
		for _, y := range b {
			if x.Name != y.Name {
				c.mesh.cutPair(x.Name, y.Name, links)
			}
		}
	}
	if links&LinkNATS != 0 {
		for _, y := range b {
			if err := c.mesh.cutNATS(y.Name); err != nil {
				return err
			}
		}
	}
	c.log.Info("partition", "links", links.String(), "a", gatewayNames(a), "b", gatewayNames(b))
	return nil
}

// Isolate cuts g's links to every other live gateway (and, with LinkNATS,
// g from NATS): Partition(links, others, {g}).
func (c *Cluster) Isolate(g *Gateway, links Link) error {
	var others []*Gateway
	for _, o := range c.Gateways() {
		if o.Name != g.Name {
			others = append(others, o)
		}
	}
	return c.Partition(links, others, []*Gateway{g})
}

// Heal removes every partition: gossip and raft reconnect pairwise and
// every gateway's NATS link accepts again. Convergence (membership merge,
// raft catch-up, NATS reconnects, index repair) is the gateways' work;
// poll for it.
func (c *Cluster) Heal() error {
	if c.mesh == nil {
		return fmt.Errorf("%w: partitions need Config.Partitionable", ErrInvalidConfig)
	}
	c.log.Info("partition healed")
	return c.mesh.heal()
}

func gatewayNames(gs []*Gateway) string {
	names := make([]string, len(gs))
	for i, g := range gs {
		names[i] = g.Name
	}
	return strings.Join(names, ",")
}

// attachLinks gives gateway name its partitionable links before it starts
// (Config.Partitionable): a gossip transport on the mesh, a raft
// transport connected to its peers, and with ExternalNATS its own proxy
// to the NATS server. It returns a function that detaches and closes them
// after the gateway stopped.
func (c *Cluster) attachLinks(name string, g *Gateway) (func() error, error) {
	m := c.mesh
	cc := &g.cfg.Cluster
	cc.GossipTransport = m.gossip.NewTransport(name)
	rl := m.attachRaft(name)
	cc.RaftTransport = rl
	var p *faultproxy.Proxy
	if c.NATS != nil {
		var err error
		if p, err = startProxy(name+"/nats", c.NATS.Addr(), c.log); err != nil {
			m.detachRaft(name, rl)
			return nil, err
		}
		if err := m.attachNATS(name, p); err != nil {
			m.detachRaft(name, rl)
			return nil, errors.Join(err, m.detachNATS(name, p))
		}
		cc.NATSURL = "nats://" + p.Addr()
		g.NATSLink = p
	}
	var once sync.Once
	var err error
	return func() error {
		once.Do(func() {
			m.detachRaft(name, rl)
			if p != nil {
				err = m.detachNATS(name, p)
			}
		})
		return err
	}, nil
}
