package config

import (
	"errors"
	"io"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
)

// Reasons a gRPC server refuses input, as counted by GuardedServerOptions
// and the admin API (label values of the rejected-input counters).
const (
	// RejectBadPreface: a connection whose first bytes are not an HTTP/2
	// client connection preface (the 24-byte magic followed by a SETTINGS
	// frame), or that ended inside it. gRPC closes such a connection
	// without telling anyone.
	RejectBadPreface = "bad_preface"
	// RejectHandshake: a failed TLS handshake (not a client that hung up
	// before sending anything).
	RejectHandshake = "handshake"
	// RejectMalformed: a request message that does not decode as the
	// method's protobuf message.
	RejectMalformed = "malformed"
	// RejectUnauthenticated: a call without the right bearer token.
	RejectUnauthenticated = "unauthenticated"
)

// RejectFunc counts one refused input; reason is one of the Reject*
// constants (or an admin error code). It is called concurrently from
// gRPC's connection and stream goroutines and must not block.
type RejectFunc func(reason string)

// GuardedServerOptions returns the options that make a gRPC server count
// the bad input it otherwise drops silently (it only logs it through
// grpclog): connections that do not start with an HTTP/2 preface, failed
// TLS handshakes, and request messages that fail to decode. creds are the
// server's transport credentials (nil: plaintext); the options include
// them, so the caller must not pass grpc.Creds itself. The server's codec
// is protobuf (ForceServerCodecV2), as for every kvmesh service.
func GuardedServerOptions(creds credentials.TransportCredentials, reject RejectFunc) []grpc.ServerOption {
	if creds == nil {
		creds = insecure.NewCredentials()
	}
	return []grpc.ServerOption{
		grpc.Creds(guardedCreds{TransportCredentials: creds, reject: reject}),
		grpc.ForceServerCodecV2(guardedCodec{CodecV2: encoding.GetCodecV2("proto"), reject: reject}),
	}
}

// guardedCreds counts failed server handshakes and wraps the handshaken
// connection in a preface check.
type guardedCreds struct {
	credentials.TransportCredentials
	reject RejectFunc
}

func (g guardedCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := g.TransportCredentials.ServerHandshake(raw)
	if err != nil {
		if !errors.Is(err, io.EOF) && !errors.Is(err, credentials.ErrConnDispatched) {
			g.reject(RejectHandshake)
		}
		return conn, info, err
	}
	return &prefaceConn{Conn: conn, reject: g.reject}, info, nil
}

func (g guardedCreds) Clone() credentials.TransportCredentials {
	return guardedCreds{TransportCredentials: g.TransportCredentials.Clone(), reject: g.reject}
}

// http2Preface is the client connection preface's magic (RFC 9113 §3.4);
// a SETTINGS frame header must follow it.
const http2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// prefaceLen covers the magic and the first frame header (9 bytes).
const prefaceLen = len(http2Preface) + 9

// frameTypeSettings is the HTTP/2 SETTINGS frame type; the type is the
// fourth byte of a frame header.
const frameTypeSettings = 0x4

// prefaceConn watches the first bytes gRPC reads from a connection and
// counts one RejectBadPreface when they are not a client preface. gRPC
// reads a connection from one goroutine at a time, so the state needs no
// lock; after the preface a Read costs one branch more.
type prefaceConn struct {
	net.Conn
	reject RejectFunc
	done   bool // verdict given
	seen   int  // bytes checked so far
}

func (c *prefaceConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if c.done {
		return n, err
	}
	for _, b := range p[:n] {
		if !prefaceByteOK(c.seen, b) {
			c.verdict(false)
			return n, err
		}
		c.seen++
		if c.seen == prefaceLen {
			c.verdict(true)
			return n, err
		}
	}
	// A connection that ends inside the preface was cut short; one that
	// ends before any byte is a probe (a TCP health check) and not counted.
	if errors.Is(err, io.EOF) && c.seen > 0 {
		c.verdict(false)
	}
	return n, err
}

func (c *prefaceConn) verdict(ok bool) {
	c.done = true
	if !ok {
		c.reject(RejectBadPreface)
	}
}

// prefaceByteOK checks byte i of a connection against the preface: the
// magic, then a frame header whose type is SETTINGS (length and flags are
// free, the stream id must be 0).
func prefaceByteOK(i int, b byte) bool {
	switch {
	case i < len(http2Preface):
		return b == http2Preface[i]
	case i == len(http2Preface)+3:
		return b == frameTypeSettings
	case i >= len(http2Preface)+5:
		return b == 0 // stream identifier 0 (the reserved bit included)
	}
	return true
}

// guardedCodec is the protobuf codec counting requests that fail to
// decode.
type guardedCodec struct {
	encoding.CodecV2
	reject RejectFunc
}

func (c guardedCodec) Unmarshal(data mem.BufferSlice, v any) error {
	err := c.CodecV2.Unmarshal(data, v)
	if err != nil {
		c.reject(RejectMalformed)
	}
	return err
}
