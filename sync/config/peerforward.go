package config

import (
	"context"

	"github.com/kvmesh/kvmesh/proto/adminpb"
)

// PeerForwarder is the part of the admin service gateways call on each
// other, Forward (a follower's write, applied by the leader) and Status
// (bootstrap probes), for registration on a port that authenticates
// gateways itself: the sync peer port, where only a gateway that proved
// the cluster key gets a call through. Every other admin method answers
// Unimplemented there. Gateways then never need the operators' admin token
// (Member.ForwardAddr).
type PeerForwarder struct {
	adminpb.UnimplementedAdminServer
	s *Server
}

var _ adminpb.AdminServer = (*PeerForwarder)(nil)

// NewPeerForwarder returns s's gateway-to-gateway subset.
func NewPeerForwarder(s *Server) *PeerForwarder { return &PeerForwarder{s: s} }

// Forward implements adminpb.AdminServer.
func (f *PeerForwarder) Forward(ctx context.Context, req *adminpb.ForwardRequest) (*adminpb.ApplyResponse, error) {
	return f.s.Forward(ctx, req)
}

// Status implements adminpb.AdminServer.
func (f *PeerForwarder) Status(ctx context.Context, req *adminpb.StatusRequest) (*adminpb.StatusResponse, error) {
	return f.s.Status(ctx, req)
}
