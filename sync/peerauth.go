package sync

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"fmt"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/kvmesh/kvmesh/sync/config"
)

// peerSecurity is the peer service's authentication and transport
// security, built once from Config.Trust, PeerTLS and PeerToken: the
// operator's PeerTLS files when given, else mutual TLS under the cluster
// CA (Trust), else (Insecure) plaintext. A failed handshake is counted as
// kvmesh_sync_peer_rejected_total{reason="handshake"}; no call reaches a
// handler without it.
type peerSecurity struct {
	token    string
	want     [32]byte // sha256 of token
	server   *tls.Config
	client   *tls.Config
	rejected prometheus.Counter
	input    *prometheus.CounterVec // {reason}
}

func newPeerSecurity(cfg Config, rejected prometheus.Counter, input *prometheus.CounterVec) (*peerSecurity, error) {
	ps := &peerSecurity{token: cfg.PeerToken, want: sha256.Sum256([]byte(cfg.PeerToken)), rejected: rejected, input: input}
	var err error
	if ps.server, err = cfg.PeerTLS.ServerConfig(); err != nil {
		return nil, fmt.Errorf("%w: PeerTLS: %w", ErrInvalidConfig, err)
	}
	if ps.client, err = cfg.PeerTLS.ClientConfig(); err != nil {
		return nil, fmt.Errorf("%w: PeerTLS: %w", ErrInvalidConfig, err)
	}
	if ps.client != nil && cfg.PeerTLSServerName != "" {
		ps.client.ServerName = cfg.PeerTLSServerName
	}
	if ps.server == nil && cfg.Trust != nil {
		ps.server, ps.client = cfg.Trust.TLSConfig(), cfg.Trust.TLSConfig()
	}
	return ps, nil
}

// serverOptions are the peer gRPC server's credentials, rejected-input
// counting (kvmesh_sync_peer_rejected_total) and interceptors.
func (ps *peerSecurity) serverOptions() []grpc.ServerOption {
	var creds credentials.TransportCredentials
	if ps.server != nil {
		creds = credentials.NewTLS(ps.server)
	}
	opts := config.GuardedServerOptions(creds, func(reason string) {
		ps.input.WithLabelValues(reason).Inc()
		if reason == config.RejectHandshake && ps.server != nil && ps.server.ClientAuth == tls.RequireAndVerifyClientCert {
			// Mutual TLS: a failed handshake is a caller that did not
			// prove its identity.
			ps.rejected.Inc()
		}
	})
	if ps.token != "" {
		opts = append(opts,
			grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
				if err := ps.check(ctx); err != nil {
					return nil, err
				}
				return h(ctx, req)
			}),
			grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
				if err := ps.check(ss.Context()); err != nil {
					return err
				}
				return h(srv, ss)
			}))
	}
	return opts
}

// check verifies the caller's bearer token in constant time (both sides
// hashed first, so the comparison leaks neither content nor length).
func (ps *peerSecurity) check(ctx context.Context) error {
	var header string
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		if v := md.Get("authorization"); len(v) > 0 {
			header = v[0]
		}
	}
	tok, ok := strings.CutPrefix(header, "Bearer ")
	got := sha256.Sum256([]byte(tok))
	if !ok || tok == "" || subtle.ConstantTimeCompare(got[:], ps.want[:]) != 1 {
		ps.rejected.Inc()
		ps.input.WithLabelValues(config.RejectUnauthenticated).Inc()
		return status.Error(codes.Unauthenticated, ErrUnauthenticated.Error())
	}
	return nil
}

// dialOptions are a snapshot pull's credentials.
func (ps *peerSecurity) dialOptions() []grpc.DialOption {
	creds := insecure.NewCredentials()
	if ps.client != nil {
		creds = credentials.NewTLS(ps.client)
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(creds)}
	if ps.token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(peerBearer(ps.token)))
	}
	return opts
}

// peerBearer sends the cluster's peer token on every call. It is allowed
// without TLS (like the admin API's token) so that a cluster can turn
// authentication on before it has certificates.
type peerBearer string

func (b peerBearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

func (peerBearer) RequireTransportSecurity() bool { return false }
