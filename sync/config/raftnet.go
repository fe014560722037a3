package config

import (
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	"github.com/prometheus/client_golang/prometheus"
)

// Messages hashicorp/raft v1.8.0's NetworkTransport logs at error level
// (net_transport.go); all are about the receiving side of the raft port.
// TestRaftPortGarbageCounted pins them: a raft upgrade that rewords one
// moves its errors to kind "other", and the test notices.
const (
	raftMsgDecode = "failed to decode incoming command"
	raftMsgAccept = "failed to accept connection"
	raftMsgFlush  = "failed to flush response"
)

// transportLogger is the hclog.Logger given to raft's NetworkTransport. The
// transport has no other hook for a connection that sends junk (it logs
// and closes it), so every error it logs is counted in
// kvmesh_config_raft_transport_errors_total{kind} before being logged.
type transportLogger struct {
	hclog.Logger
	errs *prometheus.CounterVec
}

var _ hclog.Logger = transportLogger{}

func (l transportLogger) count(msg string) {
	kind := "other"
	switch msg {
	case raftMsgDecode:
		kind = "decode"
	case raftMsgAccept:
		kind = "accept"
	case raftMsgFlush:
		kind = "flush"
	}
	l.errs.WithLabelValues(kind).Inc()
}

// Error counts, then logs.
func (l transportLogger) Error(msg string, args ...any) {
	l.count(msg)
	l.Logger.Error(msg, args...)
}

// Log counts error-level records, then logs.
func (l transportLogger) Log(level hclog.Level, msg string, args ...any) {
	if level >= hclog.Error {
		l.count(msg)
	}
	l.Logger.Log(level, msg, args...)
}

// With and Named keep the counting (the transport does not call them
// today; a future raft might).
func (l transportLogger) With(args ...any) hclog.Logger {
	return transportLogger{Logger: l.Logger.With(args...), errs: l.errs}
}

func (l transportLogger) Named(name string) hclog.Logger {
	return transportLogger{Logger: l.Logger.Named(name), errs: l.errs}
}

func (l transportLogger) ResetNamed(name string) hclog.Logger {
	return transportLogger{Logger: l.Logger.ResetNamed(name), errs: l.errs}
}

// tcpStreamLayer is raft's plain TCP stream layer (what
// raft.NewTCPTransport builds), written out so that countingLayer can wrap
// it.
type tcpStreamLayer struct {
	net.Listener
	advertise net.Addr
}

var _ raft.StreamLayer = (*tcpStreamLayer)(nil)

func newTCPStreamLayer(bind string, advertise net.Addr) (*tcpStreamLayer, error) {
	ln, err := net.Listen("tcp", bind)
	if err != nil {
		return nil, err
	}
	if advertise == nil {
		advertise = ln.Addr()
	}
	if a, ok := advertise.(*net.TCPAddr); !ok || a.IP == nil || a.IP.IsUnspecified() {
		_ = ln.Close()
		return nil, fmt.Errorf("%w: raft address %v is not advertisable (set RaftAdvertiseAddr)", ErrInvalidStoreConfig, advertise)
	}
	return &tcpStreamLayer{Listener: ln, advertise: advertise}, nil
}

func (l *tcpStreamLayer) Addr() net.Addr { return l.advertise }

func (l *tcpStreamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	return net.DialTimeout("tcp", string(address), timeout)
}

// countingLayer wraps the raft port's accepted connections in rpcConn, so
// that a connection that ends in the middle of an RPC is counted
// (kind "truncated"): raft's transport treats that end like any other
// io.EOF and says nothing.
type countingLayer struct {
	raft.StreamLayer
	errs *prometheus.CounterVec
}

func (l countingLayer) Accept() (net.Conn, error) {
	c, err := l.StreamLayer.Accept()
	if err != nil {
		return c, err
	}
	return &rpcConn{Conn: c, errs: l.errs}, nil
}

// rpcConn tracks the bytes received since the last answer. The raft
// protocol answers every RPC (and the transport reads and answers from one
// goroutine), so a connection that ends while bytes are unanswered ended
// inside a request: a truncated message, or junk the decoder was still
// waiting on. A peer that closes between RPCs ends with nothing pending.
type rpcConn struct {
	net.Conn
	errs    *prometheus.CounterVec
	pending int
	counted bool
}

func (c *rpcConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.pending += n
	if err != nil && c.pending > 0 && !c.counted && !errors.Is(err, net.ErrClosed) {
		c.counted = true
		c.errs.WithLabelValues("truncated").Inc()
	}
	return n, err
}

func (c *rpcConn) Write(p []byte) (int, error) {
	c.pending = 0
	return c.Conn.Write(p)
}
