package config

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvmesh/kvmesh/proto/adminpb"
)

// errorDomain is the ErrorInfo domain of kvmesh admin errors.
const errorDomain = "config.kvmesh"

// wireErrors maps each sentinel to its gRPC code and ErrorInfo reason. The
// reason, not the code, is what a client maps back (several sentinels share
// a code, and a transport failure is also Unavailable).
var wireErrors = []struct {
	err    error
	code   codes.Code
	reason string
}{
	{ErrInvalidConfig, codes.InvalidArgument, "INVALID_CONFIG"},
	{ErrBadCommand, codes.InvalidArgument, "BAD_COMMAND"},
	{ErrVersionConflict, codes.Aborted, "VERSION_CONFLICT"},
	{ErrNotFound, codes.NotFound, "NOT_FOUND"},
	{ErrNoQuorum, codes.Unavailable, "NO_QUORUM"},
	{ErrNotLeader, codes.FailedPrecondition, "NOT_LEADER"},
	{ErrUnauthenticated, codes.Unauthenticated, "UNAUTHENTICATED"},
	{ErrUnavailable, codes.Unimplemented, "NOT_WIRED"},
	{ErrClosed, codes.Unavailable, "CLOSED"},
	{ErrBadRequest, codes.InvalidArgument, "BAD_REQUEST"},
}

// toStatus turns a package error into a gRPC status error carrying an
// ErrorInfo reason. Unknown errors become codes.Internal; context errors
// keep their codes. The first sentinel of wireErrors that err wraps
// decides, before any gRPC status err also wraps: "no quorum after 3s:
// <the leader's answer: not the leader>" is a NO_QUORUM write, not the
// inner NOT_LEADER, which would tell a client something else.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	}
	for _, w := range wireErrors {
		if errors.Is(err, w.err) {
			st := status.New(w.code, err.Error())
			if d, derr := st.WithDetails(&errdetails.ErrorInfo{Reason: w.reason, Domain: errorDomain}); derr == nil {
				st = d
			}
			return st.Err()
		}
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Error(codes.Internal, err.Error())
}

// fromStatus turns a gRPC error back into one wrapping the sentinel its
// ErrorInfo names (the server's message is kept). Errors without a known
// reason are returned unchanged (test them with status.Code).
func fromStatus(err error) error {
	st, ok := status.FromError(err)
	if !ok || err == nil {
		return err
	}
	for _, d := range st.Details() {
		info, ok := d.(*errdetails.ErrorInfo)
		if !ok || info.Domain != errorDomain {
			continue
		}
		for _, w := range wireErrors {
			if w.reason == info.Reason {
				return &remoteError{sentinel: w.err, msg: st.Message(), st: err}
			}
		}
	}
	return err
}

// remoteError is an error received from a remote node: its message is the
// remote's text, and it wraps the matching sentinel.
type remoteError struct {
	sentinel error
	msg      string
	st       error
}

func (e *remoteError) Error() string   { return e.msg }
func (e *remoteError) Unwrap() []error { return []error{e.sentinel, e.st} }

// GRPCStatus keeps status.Code working on a converted error.
func (e *remoteError) GRPCStatus() *status.Status { s, _ := status.FromError(e.st); return s }

// ClientOptions configures a Client.
type ClientOptions struct {
	// Token is sent as "authorization: Bearer <token>" on every call.
	Token string
	// TLS, when non-nil, secures the connection; nil means plaintext.
	TLS *tls.Config
}

// Client talks to one node's admin gRPC service. Safe for concurrent use.
type Client struct {
	conn *grpc.ClientConn
	api  adminpb.AdminClient
}

// Dial returns a Client for addr (host:port). The connection is made
// lazily, on the first call.
func Dial(addr string, opts ClientOptions) (*Client, error) {
	creds := insecure.NewCredentials()
	if opts.TLS != nil {
		creds = credentials.NewTLS(opts.TLS)
	}
	dopts := []grpc.DialOption{grpc.WithTransportCredentials(creds)}
	if opts.Token != "" {
		dopts = append(dopts, grpc.WithPerRPCCredentials(bearer{token: opts.Token}))
	}
	conn, err := grpc.NewClient(addr, dopts...)
	if err != nil {
		return nil, fmt.Errorf("config: dial %s: %w", addr, err)
	}
	return &Client{conn: conn, api: adminpb.NewAdminClient(conn)}, nil
}

// Close releases the connection.
func (c *Client) Close() error { return c.conn.Close() }

// API exposes the raw generated client.
func (c *Client) API() adminpb.AdminClient { return c.api }

// GetConfig returns the node's applied config.
func (c *Client) GetConfig(ctx context.Context) (*Versioned, error) {
	resp, err := c.api.GetConfig(ctx, &adminpb.GetConfigRequest{})
	if err != nil {
		return nil, fromStatus(err)
	}
	v := &Versioned{Version: resp.Version}
	if len(resp.ConfigJson) > 0 {
		cfg, err := decodeDocument(resp.ConfigJson)
		if err != nil {
			return nil, err
		}
		v.Config = &cfg
	}
	return v, nil
}

// SetConfig replaces the config; expected, if non-nil, makes it a
// compare-and-set. Returns the applied version.
func (c *Client) SetConfig(ctx context.Context, cfg *RoutingConfig, expected *uint64) (uint64, error) {
	doc, err := json.Marshal(cfg)
	if err != nil {
		return 0, err
	}
	return c.SetConfigJSON(ctx, doc, expected)
}

// SetConfigJSON is SetConfig with the document as JSON.
func (c *Client) SetConfigJSON(ctx context.Context, doc []byte, expected *uint64) (uint64, error) {
	resp, err := c.api.SetConfig(ctx, &adminpb.SetConfigRequest{ConfigJson: doc, ExpectedVersion: expected})
	if err != nil {
		return 0, fromStatus(err)
	}
	return resp.Version, nil
}

// PatchConfig applies a JSON merge patch.
func (c *Client) PatchConfig(ctx context.Context, patch []byte, expected *uint64) (uint64, error) {
	resp, err := c.api.PatchConfig(ctx, &adminpb.PatchConfigRequest{MergePatchJson: patch, ExpectedVersion: expected})
	if err != nil {
		return 0, fromStatus(err)
	}
	return resp.Version, nil
}

// AddReplica adds r to model's pool.
func (c *Client) AddReplica(ctx context.Context, model string, r ReplicaConfig) (uint64, error) {
	resp, err := c.api.AddReplica(ctx, &adminpb.AddReplicaRequest{Model: model, Replica: replicaToPB(r)})
	if err != nil {
		return 0, fromStatus(err)
	}
	return resp.Version, nil
}

// RemoveReplica removes a replica from model's pool.
func (c *Client) RemoveReplica(ctx context.Context, model, name string) (uint64, error) {
	resp, err := c.api.RemoveReplica(ctx, &adminpb.RemoveReplicaRequest{Model: model, Name: name})
	if err != nil {
		return 0, fromStatus(err)
	}
	return resp.Version, nil
}

// Members lists the cluster's gateways.
func (c *Client) Members(ctx context.Context) (*adminpb.MembersResponse, error) {
	resp, err := c.api.Members(ctx, &adminpb.MembersRequest{})
	return resp, fromStatus(err)
}

// Status returns the node's raft view.
func (c *Client) Status(ctx context.Context) (*adminpb.StatusResponse, error) {
	resp, err := c.api.Status(ctx, &adminpb.StatusRequest{})
	return resp, fromStatus(err)
}

// IndexStats returns the node's index summary.
func (c *Client) IndexStats(ctx context.Context) (*adminpb.IndexStatsResponse, error) {
	resp, err := c.api.IndexStats(ctx, &adminpb.IndexStatsRequest{})
	return resp, fromStatus(err)
}

// ExplainRoute returns the node's route report as JSON.
func (c *Client) ExplainRoute(ctx context.Context, req *adminpb.ExplainRouteRequest) ([]byte, error) {
	resp, err := c.api.ExplainRoute(ctx, req)
	if err != nil {
		return nil, fromStatus(err)
	}
	return resp.ReportJson, nil
}

// Snapshot copies the node's index snapshot into w and returns the bytes
// written.
func (c *Client) Snapshot(ctx context.Context, w io.Writer) (int64, error) {
	stream, err := c.api.Snapshot(ctx, &adminpb.SnapshotRequest{})
	if err != nil {
		return 0, fromStatus(err)
	}
	var n int64
	for {
		chunk, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return n, nil
		}
		if err != nil {
			return n, fromStatus(err)
		}
		k, err := w.Write(chunk.Data)
		n += int64(k)
		if err != nil {
			return n, err
		}
	}
}

func (c *Client) forward(ctx context.Context, cmd []byte) (uint64, error) {
	resp, err := c.api.Forward(ctx, &adminpb.ForwardRequest{Command: cmd})
	if err != nil {
		return 0, fromStatus(err)
	}
	return resp.Version, nil
}

func replicaToPB(r ReplicaConfig) *adminpb.Replica {
	return &adminpb.Replica{Name: r.Name, Url: r.URL, Kv: r.KV, KvBind: r.KVBind, Replay: r.Replay}
}

func replicaFromPB(r *adminpb.Replica) ReplicaConfig {
	if r == nil {
		return ReplicaConfig{}
	}
	return ReplicaConfig{Name: r.Name, URL: r.Url, KV: r.Kv, KVBind: r.KvBind, Replay: r.Replay}
}

// bearer is per-RPC credentials carrying the admin token.
type bearer struct{ token string }

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

// RequireTransportSecurity is false so a loopback or private-network admin
// port works without TLS; turn TLS on wherever the network is not trusted.
func (b bearer) RequireTransportSecurity() bool { return false }
