package config

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/proto/adminpb"
)

// MembersProvider lists the cluster's gateways. *Store implements it from
// its Membership and raft configuration; node may supply a richer one.
// Called concurrently; must not block long.
type MembersProvider interface {
	Members() []MemberStatus
}

// IndexStat summarises one prefix index.
type IndexStat struct {
	// Name identifies the index (e.g. its model).
	Name string
	// Mode is its index mode (history, kv-events, hybrid).
	Mode string
	// Capacity is its configured capacity in (block, replica) entries.
	Capacity int
	// Stats is index.Index.Stats().
	Stats index.Stats
}

// IndexStatsProvider reports the node's prefix index(es). Called
// concurrently; must not block long.
type IndexStatsProvider interface {
	IndexStats(ctx context.Context) ([]IndexStat, error)
}

// ExplainRequest asks how a prompt would be routed.
type ExplainRequest struct {
	Model    string
	Prompt   string
	Strategy string
	// Body, when non-empty, is a full completions or chat request body
	// and takes precedence over Model and Prompt.
	Body []byte
}

// RouteExplainer explains a routing decision without sending the request.
// It returns the report as JSON (node's RouteReport). Errors for bad input
// (unknown model, empty prompt) should wrap ErrBadRequest or ErrNotFound.
// Called concurrently.
type RouteExplainer interface {
	ExplainRoute(ctx context.Context, req ExplainRequest) ([]byte, error)
}

// IndexSnapshotter writes the node's index snapshot (index's binary
// snapshot format). Called concurrently; w is only valid during the call.
type IndexSnapshotter interface {
	WriteIndexSnapshot(ctx context.Context, w io.Writer) error
}

// ServerConfig configures the admin API server.
type ServerConfig struct {
	// Token is the bearer token every admin call must carry (compared in
	// constant time). Required: an admin API without a token is refused
	// by Validate (use EnsureTokenFile for a generated one).
	Token string
	// AllowUnauthenticatedReads lets reads (GetConfig, Members, Status,
	// IndexStats, ExplainRoute, Snapshot) through without the token.
	// Writes always need it. Default false.
	AllowUnauthenticatedReads bool
	// Members defaults to the store.
	Members MembersProvider
	// Index, Explainer and Snapshotter are node's providers; a nil one
	// makes its call answer ErrUnavailable.
	Index       IndexStatsProvider
	Explainer   RouteExplainer
	Snapshotter IndexSnapshotter
	// MaxBodyBytes bounds an HTTP request body. Default 4 MiB.
	MaxBodyBytes int64
	// SnapshotChunkBytes is the size of Snapshot stream chunks. Default
	// 256 KiB (well under gRPC's 4 MiB message limit).
	SnapshotChunkBytes int
	// Logger defaults to slog.Default().
	Logger *slog.Logger
}

// Validate reports the first invalid field.
func (c *ServerConfig) Validate() error {
	switch {
	case c.Token == "":
		return fmt.Errorf("%w: admin Token is empty (set --admin-token, %s or a token file)", ErrInvalidStoreConfig, TokenEnv)
	case c.MaxBodyBytes < 0 || c.SnapshotChunkBytes < 0:
		return fmt.Errorf("%w: MaxBodyBytes and SnapshotChunkBytes must not be negative", ErrInvalidStoreConfig)
	}
	return nil
}

// Server serves the admin API over gRPC (Register) and HTTP/JSON
// (Handler) for one Store. Safe for concurrent use; it owns no goroutines.
type Server struct {
	adminpb.UnimplementedAdminServer
	store *Store
	cfg   ServerConfig
	auth  *authenticator
	log   *slog.Logger
}

var _ adminpb.AdminServer = (*Server)(nil)

// NewServer returns the admin server for store.
func NewServer(store *Store, cfg ServerConfig) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Members == nil {
		cfg.Members = store
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = 4 << 20
	}
	if cfg.SnapshotChunkBytes == 0 {
		cfg.SnapshotChunkBytes = 256 << 10
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Server{store: store, cfg: cfg, auth: newAuthenticator(cfg.Token, cfg.AllowUnauthenticatedReads), log: log.With("component", "admin")}, nil
}

// Register adds the Admin service to gs. gs must have been built with
// ServerOptions (or chain UnaryInterceptor and StreamInterceptor), or the
// service is unauthenticated.
func (s *Server) Register(gs *grpc.Server) { adminpb.RegisterAdminServer(gs, s) }

// UnaryInterceptor checks the bearer token on Admin methods (other
// services on the same grpc.Server pass through).
func (s *Server) UnaryInterceptor() grpc.UnaryServerInterceptor { return s.auth.unary() }

// StreamInterceptor is UnaryInterceptor for streaming methods.
func (s *Server) StreamInterceptor() grpc.StreamServerInterceptor { return s.auth.stream() }

// ServerOptions returns the interceptors as grpc.ServerOptions: the
// rejection counter (kvmesh_config_admin_rejected_total{api="grpc"}) around
// the token check.
func (s *Server) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(s.countUnary, s.UnaryInterceptor()),
		grpc.ChainStreamInterceptor(s.countStream, s.StreamInterceptor()),
	}
}

// countUnary counts an Admin call answered with a client error.
func (s *Server) countUnary(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	resp, err := h(ctx, req)
	s.countGRPCError(info.FullMethod, err)
	return resp, err
}

// countStream is countUnary for streaming calls.
func (s *Server) countStream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	err := h(srv, ss)
	s.countGRPCError(info.FullMethod, err)
	return err
}

// countGRPCError counts err when it is a client error of an Admin method,
// by the stable code the HTTP API would answer.
func (s *Server) countGRPCError(method string, err error) {
	if err == nil || !strings.HasPrefix(method, adminService) {
		return
	}
	if code, name := httpStatusOf(fromStatus(err)); code >= 400 && code < 500 {
		s.reject("grpc", name)
	}
}

// reject counts one refused admin input.
func (s *Server) reject(api, reason string) {
	s.store.metrics.adminRejected.WithLabelValues(api, reason).Inc()
}

// NewGRPCServer builds a grpc.Server with the auth interceptors, TLS when
// tlsFiles is enabled, the rejected-input counters (GuardedServerOptions;
// extra must not set grpc.Creds or a codec), and the Admin service
// registered. The caller runs
// Serve and GracefulStop/Stop.
func NewGRPCServer(s *Server, tlsFiles TLSFiles, extra ...grpc.ServerOption) (*grpc.Server, error) {
	opts := append(s.ServerOptions(), extra...)
	tc, err := tlsFiles.ServerConfig()
	if err != nil {
		return nil, err
	}
	var creds credentials.TransportCredentials
	if tc != nil {
		creds = credentials.NewTLS(tc)
	}
	// Junk connections, failed handshakes and undecodable requests are
	// counted too (api="grpc", reasons bad_preface, handshake, malformed).
	opts = append(opts, GuardedServerOptions(creds, func(reason string) { s.reject("grpc", reason) })...)
	gs := grpc.NewServer(opts...)
	s.Register(gs)
	return gs, nil
}

func (s *Server) configResponse() (*adminpb.ConfigResponse, error) {
	v := s.store.Current()
	resp := &adminpb.ConfigResponse{Version: v.Version}
	if v.Config != nil {
		doc, err := json.Marshal(v.Config)
		if err != nil {
			return nil, err
		}
		resp.ConfigJson = doc
	}
	return resp, nil
}

// GetConfig implements adminpb.AdminServer.
func (s *Server) GetConfig(context.Context, *adminpb.GetConfigRequest) (*adminpb.ConfigResponse, error) {
	resp, err := s.configResponse()
	return resp, toStatus(err)
}

// SetConfig implements adminpb.AdminServer.
func (s *Server) SetConfig(ctx context.Context, req *adminpb.SetConfigRequest) (*adminpb.ApplyResponse, error) {
	cfg, err := decodeDocument(req.ConfigJson)
	if err != nil {
		return nil, toStatus(err)
	}
	return s.applied(s.store.Set(ctx, cfg, req.ExpectedVersion))
}

// PatchConfig implements adminpb.AdminServer.
func (s *Server) PatchConfig(ctx context.Context, req *adminpb.PatchConfigRequest) (*adminpb.ApplyResponse, error) {
	return s.applied(s.store.Patch(ctx, req.MergePatchJson, req.ExpectedVersion))
}

// AddReplica implements adminpb.AdminServer.
func (s *Server) AddReplica(ctx context.Context, req *adminpb.AddReplicaRequest) (*adminpb.ApplyResponse, error) {
	if req.Replica == nil {
		return nil, toStatus(fmt.Errorf("%w: replica is missing", ErrBadRequest))
	}
	return s.applied(s.store.AddReplica(ctx, req.Model, replicaFromPB(req.Replica)))
}

// RemoveReplica implements adminpb.AdminServer.
func (s *Server) RemoveReplica(ctx context.Context, req *adminpb.RemoveReplicaRequest) (*adminpb.ApplyResponse, error) {
	return s.applied(s.store.RemoveReplica(ctx, req.Model, req.Name))
}

// Forward implements adminpb.AdminServer.
func (s *Server) Forward(_ context.Context, req *adminpb.ForwardRequest) (*adminpb.ApplyResponse, error) {
	return s.applied(s.store.ApplyForwarded(req.Command))
}

func (s *Server) applied(v uint64, err error) (*adminpb.ApplyResponse, error) {
	if err != nil {
		return nil, toStatus(err)
	}
	return &adminpb.ApplyResponse{Version: v}, nil
}

// Members implements adminpb.AdminServer.
func (s *Server) Members(context.Context, *adminpb.MembersRequest) (*adminpb.MembersResponse, error) {
	resp := &adminpb.MembersResponse{}
	for _, m := range s.cfg.Members.Members() {
		resp.Members = append(resp.Members, memberToPB(m))
		if m.Leader {
			resp.LeaderId = m.ID
		}
	}
	return resp, nil
}

func memberToPB(m MemberStatus) *adminpb.Member {
	suf := adminpb.Suffrage_SUFFRAGE_NONE
	switch m.Suffrage {
	case SuffrageVoter:
		suf = adminpb.Suffrage_SUFFRAGE_VOTER
	case SuffrageNonvoter:
		suf = adminpb.Suffrage_SUFFRAGE_NONVOTER
	}
	return &adminpb.Member{Id: m.ID, RaftAddr: m.RaftAddr, AdminAddr: m.AdminAddr, Alive: m.Alive, Suffrage: suf, Leader: m.Leader, Meta: m.Meta}
}

// Status implements adminpb.AdminServer.
func (s *Server) Status(context.Context, *adminpb.StatusRequest) (*adminpb.StatusResponse, error) {
	st := s.store.Status()
	return &adminpb.StatusResponse{
		NodeId: st.NodeID, State: st.State, LeaderId: st.LeaderID, LeaderRaftAddr: st.LeaderRaftAddr,
		AppliedIndex: st.AppliedIndex, ConfigVersion: st.ConfigVersion, InConfiguration: st.InConfiguration,
	}, nil
}

// IndexStats implements adminpb.AdminServer.
func (s *Server) IndexStats(ctx context.Context, _ *adminpb.IndexStatsRequest) (*adminpb.IndexStatsResponse, error) {
	if s.cfg.Index == nil {
		return nil, toStatus(fmt.Errorf("%w: index stats", ErrUnavailable))
	}
	stats, err := s.cfg.Index.IndexStats(ctx)
	if err != nil {
		return nil, toStatus(err)
	}
	sort.Slice(stats, func(i, j int) bool { return stats[i].Name < stats[j].Name })
	resp := &adminpb.IndexStatsResponse{}
	for _, st := range stats {
		resp.Indexes = append(resp.Indexes, indexStatToPB(st))
	}
	return resp, nil
}

func indexStatToPB(st IndexStat) *adminpb.IndexStat {
	return &adminpb.IndexStat{
		Name:               st.Name,
		Mode:               st.Mode,
		HistoryEntries:     int64(st.Stats.Entries[index.History]),
		SpeculativeEntries: int64(st.Stats.Entries[index.Speculative]),
		ConfirmedEntries:   int64(st.Stats.Entries[index.Confirmed]),
		Blocks:             int64(st.Stats.Blocks),
		EngineHashes:       int64(st.Stats.EngineHashes),
		Evictions:          st.Stats.Evictions,
		Expired:            st.Stats.Expired,
		Promoted:           st.Stats.Promoted,
		ApproxBytes:        st.Stats.ApproxBytes,
		Capacity:           int64(st.Capacity),
	}
}

// ExplainRoute implements adminpb.AdminServer.
func (s *Server) ExplainRoute(ctx context.Context, req *adminpb.ExplainRouteRequest) (*adminpb.ExplainRouteResponse, error) {
	if s.cfg.Explainer == nil {
		return nil, toStatus(fmt.Errorf("%w: route explanation", ErrUnavailable))
	}
	if len(req.RequestJson) == 0 && req.Model == "" {
		return nil, toStatus(fmt.Errorf("%w: model or request_json is required", ErrBadRequest))
	}
	rep, err := s.cfg.Explainer.ExplainRoute(ctx, ExplainRequest{Model: req.Model, Prompt: req.Prompt, Strategy: req.Strategy, Body: req.RequestJson})
	if err != nil {
		return nil, toStatus(err)
	}
	return &adminpb.ExplainRouteResponse{ReportJson: rep}, nil
}

// Snapshot implements adminpb.AdminServer.
func (s *Server) Snapshot(_ *adminpb.SnapshotRequest, stream grpc.ServerStreamingServer[adminpb.SnapshotChunk]) error {
	if s.cfg.Snapshotter == nil {
		return toStatus(fmt.Errorf("%w: index snapshot", ErrUnavailable))
	}
	w := &chunkWriter{size: s.cfg.SnapshotChunkBytes, send: func(b []byte) error {
		return stream.Send(&adminpb.SnapshotChunk{Data: b})
	}}
	if err := s.cfg.Snapshotter.WriteIndexSnapshot(stream.Context(), w); err != nil {
		return toStatus(err)
	}
	return toStatus(w.flush())
}

// chunkWriter buffers writes into chunks of size bytes.
type chunkWriter struct {
	size int
	buf  []byte
	send func([]byte) error
}

func (w *chunkWriter) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		k := min(w.size-len(w.buf), len(p))
		w.buf = append(w.buf, p[:k]...)
		p = p[k:]
		if len(w.buf) == w.size {
			if err := w.flush(); err != nil {
				return n - len(p), err
			}
		}
	}
	return n, nil
}

func (w *chunkWriter) flush() error {
	if len(w.buf) == 0 {
		return nil
	}
	err := w.send(w.buf)
	w.buf = make([]byte, 0, w.size) // the sent slice belongs to the message now
	return err
}
