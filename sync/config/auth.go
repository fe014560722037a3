package config

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// TokenEnv is the environment variable LoadToken reads.
const TokenEnv = "KVMESH_ADMIN_TOKEN"

// LoadToken resolves the admin token: flag if non-empty, else the
// KVMESH_ADMIN_TOKEN environment variable, else the first line of file
// (when file is non-empty). It returns "" when none is set.
func LoadToken(flag, file string) (string, error) {
	if flag != "" {
		return flag, nil
	}
	if v := os.Getenv(TokenEnv); v != "" {
		return v, nil
	}
	if file == "" {
		return "", nil
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("config: token file: %w", err)
	}
	line, _, _ := strings.Cut(string(data), "\n")
	return strings.TrimSpace(line), nil
}

// EnsureTokenFile returns the token in file, creating the file (mode
// 0600) with a random 256-bit token when it does not exist. A single-node
// or development gateway uses it so the admin API is never open.
func EnsureTokenFile(file string) (string, error) {
	if tok, err := LoadToken("", file); err == nil && tok != "" {
		return tok, nil
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", err
	}
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	tok := hex.EncodeToString(b[:])
	if err := os.WriteFile(file, []byte(tok+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("config: token file: %w", err)
	}
	return tok, nil
}

// authenticator checks bearer tokens in constant time (both sides are
// hashed first, so the comparison does not leak the token's length).
type authenticator struct {
	want       [32]byte
	allowReads bool
}

func newAuthenticator(token string, allowReads bool) *authenticator {
	return &authenticator{want: sha256.Sum256([]byte(token)), allowReads: allowReads}
}

// check verifies an Authorization header value; write says whether the
// call changes state.
func (a *authenticator) check(header string, write bool) error {
	if !write && a.allowReads {
		return nil
	}
	tok, ok := strings.CutPrefix(header, "Bearer ")
	if !ok || tok == "" {
		return fmt.Errorf("%w: missing bearer token", ErrUnauthenticated)
	}
	got := sha256.Sum256([]byte(tok))
	if subtle.ConstantTimeCompare(got[:], a.want[:]) != 1 {
		return fmt.Errorf("%w: wrong token", ErrUnauthenticated)
	}
	return nil
}

// adminService is the full gRPC service name; only its methods are
// checked by the interceptors, so a grpc.Server shared with other services
// is unaffected.
const adminService = "/kvmesh.admin.v1.Admin/"

// writeMethods change state; the rest are reads.
var writeMethods = map[string]bool{
	adminService + "SetConfig":     true,
	adminService + "PatchConfig":   true,
	adminService + "AddReplica":    true,
	adminService + "RemoveReplica": true,
	adminService + "Forward":       true,
}

func (a *authenticator) checkGRPC(ctx context.Context, method string) error {
	if !strings.HasPrefix(method, adminService) {
		return nil
	}
	var header string
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		if v := md.Get("authorization"); len(v) > 0 {
			header = v[0]
		}
	}
	if err := a.check(header, writeMethods[method]); err != nil {
		return toStatus(err)
	}
	return nil
}

func (a *authenticator) unary() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if err := a.checkGRPC(ctx, info.FullMethod); err != nil {
			return nil, err
		}
		return handler(ctx, req)
	}
}

func (a *authenticator) stream() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if err := a.checkGRPC(ss.Context(), info.FullMethod); err != nil {
			return err
		}
		return handler(srv, ss)
	}
}
