package node

import (
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"

	"github.com/kvmesh/kvmesh/sync/config"
)

// The Node builds the config store's raft transport itself so that it can
// turn off raft's pipelined replication. hashicorp/raft v1.8.0's pipeline
// can deadlock: when a follower answers with a newer term or a failure
// (which a leadership transfer at graceful shutdown provokes), the
// pipeline's decoder returns while the sender still pushes one more
// AppendEntries into a full in-flight channel, nobody drains the response
// channel, and Raft.Shutdown waits forever (seen here as a gateway whose
// Shutdown never returned). Without a pipeline raft replicates with one
// synchronous AppendEntries at a time, which is plenty for a config
// document. Once sync/config's own transport does this, this file goes.

// raftTransportTimeout bounds one raft RPC on the wire (raft's own
// default for the network transport is 10s as well).
const raftTransportTimeout = 10 * time.Second

// noPipelineTransport is a raft NetworkTransport without pipelining.
type noPipelineTransport struct{ *raft.NetworkTransport }

// AppendEntriesPipeline reports that pipelining is not supported, so raft
// replicates synchronously.
func (noPipelineTransport) AppendEntriesPipeline(raft.ServerID, raft.ServerAddress) (raft.AppendPipeline, error) {
	return nil, raft.ErrPipelineReplicationNotSupported
}

// raftAddrs resolves raft server ids to the raft addresses the gossip
// metadata advertises, so a gateway restarting on new ports is still
// reachable.
type raftAddrs struct{ v *memberView }

// ServerAddr implements raft.ServerAddressProvider.
func (a raftAddrs) ServerAddr(id raft.ServerID) (raft.ServerAddress, error) {
	for _, m := range a.v.Members() {
		if m.ID == string(id) {
			return raft.ServerAddress(m.RaftAddr), nil
		}
	}
	return "", fmt.Errorf("node: raft server %q is not a live member", id)
}

// newRaftTransport opens the raft listener for sc (bind and advertise
// addresses, optional mutual TLS) with pipelining off. The caller closes
// it after the store shut down.
func newRaftTransport(sc *config.StoreConfig, members *memberView, log *slog.Logger) (*raft.NetworkTransport, error) {
	var adv net.Addr
	if sc.RaftAdvertiseAddr != "" {
		a, err := net.ResolveTCPAddr("tcp", sc.RaftAdvertiseAddr)
		if err != nil {
			return nil, fmt.Errorf("%w: raft advertise address: %w", ErrInvalidConfig, err)
		}
		adv = a
	}
	hlog := hclog.New(&hclog.LoggerOptions{Name: "raft-transport", Level: hclog.Warn,
		Output: slogLines{log.With("component", "config")}})
	tc := &raft.NetworkTransportConfig{ServerAddressProvider: raftAddrs{members}, MaxPool: 3,
		Timeout: raftTransportTimeout, Logger: hlog}
	if !sc.RaftTLS.Enabled() {
		t, err := raft.NewTCPTransportWithConfig(sc.RaftBindAddr, adv, tc)
		if err != nil {
			return nil, fmt.Errorf("node: raft transport: %w", err)
		}
		return t, nil
	}
	srv, err := sc.RaftTLS.ServerConfig()
	if err != nil {
		return nil, fmt.Errorf("%w: cluster.raft_tls: %w", ErrInvalidConfig, err)
	}
	cli, err := sc.RaftTLS.ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("%w: cluster.raft_tls: %w", ErrInvalidConfig, err)
	}
	if len(cli.Certificates) == 0 {
		cli.Certificates = srv.Certificates // mutual TLS: present our own certificate
	}
	ln, err := net.Listen("tcp", sc.RaftBindAddr)
	if err != nil {
		return nil, fmt.Errorf("node: raft transport: %w", err)
	}
	if adv == nil {
		adv = ln.Addr()
	}
	tc.Stream = &tlsStream{Listener: tls.NewListener(ln, srv), advertise: adv, client: cli}
	return raft.NewNetworkTransportWithConfig(tc), nil
}

// tlsStream is a raft.StreamLayer over TLS.
type tlsStream struct {
	net.Listener
	advertise net.Addr
	client    *tls.Config
}

var _ raft.StreamLayer = (*tlsStream)(nil)

// Addr implements raft.StreamLayer: the advertised address.
func (s *tlsStream) Addr() net.Addr { return s.advertise }

// Dial implements raft.StreamLayer.
func (s *tlsStream) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	return tls.DialWithDialer(&net.Dialer{Timeout: timeout}, "tcp", string(address), s.client)
}

// slogLines forwards hclog's formatted lines to slog at warn level (the
// transport logs only warnings and errors at the level it is given).
type slogLines struct{ log *slog.Logger }

func (w slogLines) Write(p []byte) (int, error) {
	w.log.Warn("raft", "line", strings.TrimSpace(string(p)))
	return len(p), nil
}
