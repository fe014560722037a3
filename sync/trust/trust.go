package trust

import (
	"bytes"
	"crypto/ed25519"
	"crypto/hkdf"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"math/big"
	"os"
	"strings"
	"time"
)

// KeyEnv is the environment variable read when no key file is given.
const KeyEnv = "KVMESH_CLUSTER_KEY"

// ServerName is the DNS name in every gateway's leaf certificate. Clients
// verify peers against the cluster CA and this name, never against the
// dialled host: any holder of the key is a gateway of the cluster,
// whatever address it has.
const ServerName = "gateway.kvmesh.internal"

// MinKeyBytes is the shortest accepted key (decoded). Generate makes 32.
const MinKeyBytes = 16

// Derivation labels (HKDF info strings). Changing one changes every
// credential derived from it: they are part of the wire contract between
// gateway versions.
const (
	labelGossip     = "kvmesh gossip"
	labelCA         = "kvmesh ca"
	labelCASerial   = "kvmesh ca serial"
	labelID         = "kvmesh key id"
	LabelNATSClient = "kvmesh nats client"
	LabelNATSRoute  = "kvmesh nats route"
)

// caValidity is the fixed validity of the derived CA: every gateway must
// build byte-identical certificates, so it cannot depend on the clock.
var (
	caNotBefore = time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)
	caNotAfter  = time.Date(2124, 1, 1, 0, 0, 0, 0, time.UTC)
)

// Generate returns a new random 32-byte key as base64 text (one line,
// no newline).
func Generate() (string, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("trust: random: %w", err)
	}
	return base64.StdEncoding.EncodeToString(b), nil
}

// ParseKeys parses key text: one base64 key per line, the first the
// primary. It returns ErrNoKey for text without a key.
func ParseKeys(text string) ([][]byte, error) {
	var keys [][]byte
	for i, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, err := decodeKey(line)
		if err != nil {
			return nil, fmt.Errorf("%w: line %d: %w", ErrBadKey, i+1, err)
		}
		if len(k) < MinKeyBytes {
			return nil, fmt.Errorf("%w: line %d: %d bytes, want at least %d (kvmesh keygen makes 32)", ErrBadKey, i+1, len(k), MinKeyBytes)
		}
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return nil, ErrNoKey
	}
	return keys, nil
}

func decodeKey(s string) ([]byte, error) {
	for _, enc := range []*base64.Encoding{base64.StdEncoding, base64.RawStdEncoding, base64.URLEncoding, base64.RawURLEncoding} {
		if b, err := enc.DecodeString(s); err == nil {
			return b, nil
		}
	}
	return nil, fmt.Errorf("not base64")
}

// LoadKeys reads the keys from file when it is not empty, else from
// KVMESH_CLUSTER_KEY (lines separated by newlines, or by commas in the
// environment). It returns ErrNoKey when neither has one.
func LoadKeys(file string) ([][]byte, error) {
	if file != "" {
		b, err := os.ReadFile(file)
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadKey, err)
		}
		keys, err := ParseKeys(string(b))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		return keys, nil
	}
	v := os.Getenv(KeyEnv)
	if strings.TrimSpace(v) == "" {
		return nil, ErrNoKey
	}
	keys, err := ParseKeys(strings.ReplaceAll(v, ",", "\n"))
	if err != nil {
		return nil, fmt.Errorf("$%s: %w", KeyEnv, err)
	}
	return keys, nil
}

// derive is HKDF-SHA256(key, label) of n bytes (no salt: the key is
// uniformly random, HKDF's extract step needs none).
func derive(key []byte, label string, n int) []byte {
	out, err := hkdf.Key(sha256.New, key, nil, label, n)
	if err != nil {
		panic(fmt.Sprintf("trust: hkdf: %v", err)) // only for n > 255*32
	}
	return out
}

// Ring is the credentials of one gateway derived from the cluster keys.
// Immutable after New; safe for concurrent use.
type Ring struct {
	keys   [][]byte
	gossip [][]byte
	cas    []*x509.Certificate
	pool   *x509.CertPool
	leaf   tls.Certificate
	id     string
}

// New derives the ring for the gateway named node (its leaf's common
// name) from keys, keys[0] the primary.
func New(keys [][]byte, node string) (*Ring, error) {
	if len(keys) == 0 {
		return nil, ErrNoKey
	}
	r := &Ring{pool: x509.NewCertPool()}
	var caKey ed25519.PrivateKey
	for i, k := range keys {
		if len(k) < MinKeyBytes {
			return nil, fmt.Errorf("%w: key %d is %d bytes", ErrBadKey, i, len(k))
		}
		r.keys = append(r.keys, bytes.Clone(k))
		r.gossip = append(r.gossip, derive(k, labelGossip, 32))
		ca, priv, err := buildCA(k)
		if err != nil {
			return nil, err
		}
		r.cas = append(r.cas, ca)
		r.pool.AddCert(ca)
		if i == 0 {
			caKey = priv
		}
	}
	r.id = KeyID(keys[0])
	leaf, err := mintLeaf(r.cas[0], caKey, node)
	if err != nil {
		return nil, err
	}
	r.leaf = leaf
	return r, nil
}

// KeyID is a short public fingerprint of a key, for logs and `kvmesh
// keygen --id` (8 hex digits of a derived value: it reveals nothing of
// the key).
func KeyID(key []byte) string { return hex.EncodeToString(derive(key, labelID, 4)) }

// buildCA derives the cluster CA of key: the same certificate on every
// gateway.
func buildCA(key []byte) (*x509.Certificate, ed25519.PrivateKey, error) {
	priv := ed25519.NewKeyFromSeed(derive(key, labelCA, ed25519.SeedSize))
	serial := new(big.Int).SetBytes(derive(key, labelCASerial, 16))
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{Organization: []string{"kvmesh"}, CommonName: "kvmesh cluster CA " + KeyID(key)},
		NotBefore:             caNotBefore,
		NotAfter:              caNotAfter,
		IsCA:                  true,
		BasicConstraintsValid: true,
		MaxPathLenZero:        true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, priv.Public(), priv)
	if err != nil {
		return nil, nil, fmt.Errorf("trust: CA: %w", err)
	}
	ca, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, fmt.Errorf("trust: CA: %w", err)
	}
	return ca, priv, nil
}

// mintLeaf makes this gateway's certificate: a fresh key, signed by ca.
func mintLeaf(ca *x509.Certificate, caKey ed25519.PrivateKey, node string) (tls.Certificate, error) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("trust: leaf key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("trust: leaf serial: %w", err)
	}
	now := time.Now()
	if len(node) > 64 {
		node = node[:64]
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{Organization: []string{"kvmesh"}, CommonName: node},
		DNSNames:     []string{ServerName},
		NotBefore:    now.Add(-time.Hour), // peers' clocks may be a little behind
		NotAfter:     now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, pub, caKey)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("trust: leaf: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("trust: leaf: %w", err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: priv, Leaf: leaf}, nil
}

// ID is the primary key's KeyID.
func (r *Ring) ID() string { return r.id }

// GossipKeys returns memberlist's keys, the primary's first (32 bytes
// each: AES-256-GCM). The slices are the Ring's: do not modify them.
func (r *Ring) GossipKeys() [][]byte { return r.gossip }

// CAPEM returns the cluster CA certificates in PEM, the primary's first
// (for operators who want to inspect them; nothing needs them on disk).
func (r *Ring) CAPEM() []byte {
	var b bytes.Buffer
	for _, ca := range r.cas {
		_ = pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: ca.Raw})
	}
	return b.Bytes()
}

// Certificate returns this gateway's leaf certificate.
func (r *Ring) Certificate() tls.Certificate { return r.leaf }

// Verify checks that a peer's certificate chain (leaf first, as TLS
// presents it) was issued by one of the ring's CAs for ServerName. It is
// the check both ends of every cluster TLS connection run; it wraps
// ErrUntrusted.
func (r *Ring) Verify(chain []*x509.Certificate) error {
	if len(chain) == 0 {
		return fmt.Errorf("%w: no certificate", ErrUntrusted)
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{Roots: r.pool, Intermediates: inter, DNSName: ServerName,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return fmt.Errorf("%w: %w", ErrUntrusted, err)
	}
	return nil
}

// TLSConfig returns a mutual-TLS config for both ends of a cluster
// connection: it presents this gateway's leaf, requires the peer's, and
// accepts only a peer whose certificate a ring CA issued (Verify),
// whatever host name was dialled (nats-server sets the dialled host as
// ServerName; the name check is Verify's). TLS 1.3 only. A new Config
// per call: callers may set fields.
func (r *Ring) TLSConfig() *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{r.leaf},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    r.pool,
		RootCAs:      r.pool,
		ServerName:   ServerName,
		// The server side verifies client certificates with ClientCAs; the
		// client side skips the dialled-host check and runs Verify in
		// VerifyConnection instead (which both sides run).
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			return r.Verify(cs.PeerCertificates)
		},
	}
}

// Secret returns the credential for label derived from the primary key
// (base64, 43 characters), e.g. the NATS password this gateway sends.
func (r *Ring) Secret(label string) string {
	return base64.RawURLEncoding.EncodeToString(derive(r.keys[0], label, 32))
}

// CheckSecret reports whether got is label's credential under any ring
// key, in constant time per key (both sides hashed, so neither content
// nor length leaks).
func (r *Ring) CheckSecret(label, got string) bool {
	g := sha256.Sum256([]byte(got))
	ok := 0
	for _, k := range r.keys {
		w := sha256.Sum256([]byte(base64.RawURLEncoding.EncodeToString(derive(k, label, 32))))
		ok |= subtle.ConstantTimeCompare(g[:], w[:])
	}
	return ok == 1
}
