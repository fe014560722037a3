package sync

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
)

// MemNetwork is an in-memory network for memberlist transports, the
// in-process twin of UDP/TCP gossip for tests and the chaos suite. Unlike
// memberlist's MockNetwork it never blocks a sender (a full or stopped
// receiver drops packets, as UDP would), it is safe for concurrent use,
// and it can partition. The zero value is ready to use.
type MemNetwork struct {
	mu      sync.Mutex
	port    int
	byAddr  map[string]*MemTransport
	byName  map[string]*MemTransport
	blocked map[[2]string]bool // unordered pair of node names
}

// ErrUnreachable is returned by a MemTransport dialling a stopped,
// unknown or partitioned peer.
var ErrUnreachable = errors.New("sync: memnet: unreachable")

// NewTransport returns a transport for node name with a unique loopback
// address on the network.
func (n *MemNetwork) NewTransport(name string) *MemTransport {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.byAddr == nil {
		n.byAddr = make(map[string]*MemTransport)
		n.byName = make(map[string]*MemTransport)
		n.blocked = make(map[[2]string]bool)
	}
	n.port++
	t := &MemTransport{
		net:     n,
		name:    name,
		addr:    net.JoinHostPort("127.0.0.1", strconv.Itoa(n.port)),
		packets: make(chan *memberlist.Packet, 1024),
		streams: make(chan net.Conn, 64),
		done:    make(chan struct{}),
	}
	n.byAddr[t.addr] = t
	n.byName[name] = t
	return t
}

// Partition cuts traffic between nodes a and b (both directions).
func (n *MemNetwork) Partition(a, b string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.blocked[pair(a, b)] = true
}

// Heal removes every partition.
func (n *MemNetwork) Heal() {
	n.mu.Lock()
	defer n.mu.Unlock()
	clear(n.blocked)
}

func pair(a, b string) [2]string {
	if a > b {
		a, b = b, a
	}
	return [2]string{a, b}
}

func (n *MemNetwork) peer(from *MemTransport, a memberlist.Address) (*MemTransport, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	var dst *MemTransport
	if a.Name != "" {
		dst = n.byName[a.Name]
	} else {
		dst = n.byAddr[a.Addr]
	}
	if dst == nil || dst.stopped() || n.blocked[pair(from.name, dst.name)] {
		return nil, fmt.Errorf("%w: %s", ErrUnreachable, a.Addr)
	}
	return dst, nil
}

// MemTransport is one node's memberlist.Transport on a MemNetwork.
type MemTransport struct {
	net     *MemNetwork
	name    string
	addr    string
	packets chan *memberlist.Packet
	streams chan net.Conn
	done    chan struct{}
	once    sync.Once
}

var _ memberlist.NodeAwareTransport = (*MemTransport)(nil)

func (t *MemTransport) stopped() bool {
	select {
	case <-t.done:
		return true
	default:
		return false
	}
}

// FinalAdvertiseAddr implements memberlist.Transport.
func (t *MemTransport) FinalAdvertiseAddr(string, int) (net.IP, int, error) {
	host, port, err := net.SplitHostPort(t.addr)
	if err != nil {
		return nil, 0, err
	}
	p, err := strconv.Atoi(port)
	return net.ParseIP(host), p, err
}

// WriteTo implements memberlist.Transport.
func (t *MemTransport) WriteTo(b []byte, addr string) (time.Time, error) {
	return t.WriteToAddress(b, memberlist.Address{Addr: addr})
}

// WriteToAddress implements memberlist.NodeAwareTransport: like UDP, a
// packet to an unreachable or overloaded peer is silently lost.
func (t *MemTransport) WriteToAddress(b []byte, a memberlist.Address) (time.Time, error) {
	now := time.Now()
	dst, err := t.net.peer(t, a)
	if err != nil {
		return now, nil
	}
	p := &memberlist.Packet{Buf: append([]byte(nil), b...), From: memAddr(t.addr), Timestamp: now}
	select {
	case dst.packets <- p:
	default:
	}
	return now, nil
}

// PacketCh implements memberlist.Transport.
func (t *MemTransport) PacketCh() <-chan *memberlist.Packet { return t.packets }

// IngestPacket implements memberlist.NodeAwareTransport.
func (t *MemTransport) IngestPacket(conn net.Conn, addr net.Addr, now time.Time, shouldClose bool) error {
	return fmt.Errorf("%w: IngestPacket is not supported", ErrUnreachable)
}

// DialTimeout implements memberlist.Transport.
func (t *MemTransport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	return t.DialAddressTimeout(memberlist.Address{Addr: addr}, timeout)
}

// DialAddressTimeout implements memberlist.NodeAwareTransport.
func (t *MemTransport) DialAddressTimeout(a memberlist.Address, timeout time.Duration) (net.Conn, error) {
	dst, err := t.net.peer(t, a)
	if err != nil {
		return nil, err
	}
	p1, p2 := net.Pipe()
	select {
	case dst.streams <- p1:
		return p2, nil
	case <-dst.done:
	case <-time.After(timeout):
	}
	_ = p1.Close()
	_ = p2.Close()
	return nil, fmt.Errorf("%w: %s", ErrUnreachable, a.Addr)
}

// StreamCh implements memberlist.Transport.
func (t *MemTransport) StreamCh() <-chan net.Conn { return t.streams }

// IngestStream implements memberlist.NodeAwareTransport.
func (t *MemTransport) IngestStream(conn net.Conn) error {
	select {
	case t.streams <- conn:
		return nil
	case <-t.done:
		return fmt.Errorf("%w: stopped", ErrUnreachable)
	}
}

// Shutdown implements memberlist.Transport: the node becomes unreachable.
func (t *MemTransport) Shutdown() error {
	t.once.Do(func() { close(t.done) })
	return nil
}

type memAddr string

func (a memAddr) Network() string { return "mem" }
func (a memAddr) String() string  { return string(a) }
