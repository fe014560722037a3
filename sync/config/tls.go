package config

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvmesh/kvmesh/sync/trust"
)

// TLSFiles names PEM files for a TLS endpoint. The zero value means no TLS.
type TLSFiles struct {
	// CertFile and KeyFile are this node's certificate and key. Required
	// for a server; for a client they enable mutual TLS.
	CertFile string `yaml:"cert_file" json:"cert_file,omitempty"`
	KeyFile  string `yaml:"key_file" json:"key_file,omitempty"`
	// CAFile holds the CA certificates peers are verified against. On a
	// server it turns on client-certificate verification (mutual TLS); on
	// a client it replaces the system roots.
	CAFile string `yaml:"ca_file" json:"ca_file,omitempty"`
}

// Enabled reports whether any file is set.
func (t TLSFiles) Enabled() bool { return t.CertFile != "" || t.KeyFile != "" || t.CAFile != "" }

// ServerConfig loads a server-side tls.Config (nil when not Enabled).
func (t TLSFiles) ServerConfig() (*tls.Config, error) {
	if !t.Enabled() {
		return nil, nil
	}
	if t.CertFile == "" || t.KeyFile == "" {
		return nil, fmt.Errorf("%w: tls: a server needs cert_file and key_file", ErrInvalidStoreConfig)
	}
	cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("%w: tls: %w", ErrInvalidStoreConfig, err)
	}
	c := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if t.CAFile != "" {
		pool, err := loadPool(t.CAFile)
		if err != nil {
			return nil, err
		}
		c.ClientCAs = pool
		c.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return c, nil
}

// ClientConfig loads a client-side tls.Config (nil when not Enabled).
func (t TLSFiles) ClientConfig() (*tls.Config, error) {
	if !t.Enabled() {
		return nil, nil
	}
	c := &tls.Config{MinVersion: tls.VersionTLS12}
	if t.CAFile != "" {
		pool, err := loadPool(t.CAFile)
		if err != nil {
			return nil, err
		}
		c.RootCAs = pool
	}
	if t.CertFile != "" && t.KeyFile != "" {
		cert, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("%w: tls: %w", ErrInvalidStoreConfig, err)
		}
		c.Certificates = []tls.Certificate{cert}
	}
	return c, nil
}

func loadPool(file string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("%w: tls: %w", ErrInvalidStoreConfig, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%w: tls: no certificate in %s", ErrInvalidStoreConfig, file)
	}
	return pool, nil
}

// tlsStreamLayer is a raft.StreamLayer over TLS: raft's network transport
// with a TLS listener and dialer. The listener (trust.Listener) completes
// each handshake before raft sees the connection: a peer without a valid
// certificate is closed before raft reads a command, and counted by
// reject.
type tlsStreamLayer struct {
	net.Listener
	advertise net.Addr
	client    *tls.Config
}

var _ raft.StreamLayer = (*tlsStreamLayer)(nil)

func newTLSStreamLayer(bind string, advertise net.Addr, server, client *tls.Config, reject func(error)) (*tlsStreamLayer, error) {
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
	return &tlsStreamLayer{Listener: trust.NewListener(ln, server, 0, reject), advertise: advertise, client: client}, nil
}

func (l *tlsStreamLayer) Addr() net.Addr { return l.advertise }

func (l *tlsStreamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := &net.Dialer{Timeout: timeout}
	return tls.DialWithDialer(d, "tcp", string(address), l.client)
}
