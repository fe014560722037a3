package trust

import (
	"bytes"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"
)

func mustKeys(t *testing.T, texts ...string) [][]byte {
	t.Helper()
	var all string
	for _, s := range texts {
		all += s + "\n"
	}
	k, err := ParseKeys(all)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func genKey(t *testing.T) string {
	t.Helper()
	k, err := Generate()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func mustRing(t *testing.T, node string, keys [][]byte) *Ring {
	t.Helper()
	r, err := New(keys, node)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestParseKeys(t *testing.T) {
	k := genKey(t)
	if _, err := ParseKeys(""); !errors.Is(err, ErrNoKey) {
		t.Fatalf("empty: %v", err)
	}
	if _, err := ParseKeys("# only a comment\n\n"); !errors.Is(err, ErrNoKey) {
		t.Fatalf("comment: %v", err)
	}
	if _, err := ParseKeys("not base64!"); !errors.Is(err, ErrBadKey) {
		t.Fatalf("junk: %v", err)
	}
	if _, err := ParseKeys("c2hvcnQ="); !errors.Is(err, ErrBadKey) { // "short"
		t.Fatalf("short: %v", err)
	}
	keys, err := ParseKeys("# rotation\n" + k + "\n\n" + genKey(t) + "\n")
	if err != nil || len(keys) != 2 || len(keys[0]) != 32 {
		t.Fatalf("two keys: %d %v", len(keys), err)
	}
}

func TestLoadKeysEnvAndFile(t *testing.T) {
	k1, k2 := genKey(t), genKey(t)
	t.Setenv(KeyEnv, "")
	if _, err := LoadKeys(""); !errors.Is(err, ErrNoKey) {
		t.Fatalf("nothing: %v", err)
	}
	t.Setenv(KeyEnv, k1+","+k2)
	keys, err := LoadKeys("")
	if err != nil || len(keys) != 2 {
		t.Fatalf("env: %d %v", len(keys), err)
	}
	f := t.TempDir() + "/key"
	if err := writeFile(f, k2+"\n"); err != nil {
		t.Fatal(err)
	}
	keys, err = LoadKeys(f) // the file wins over the environment
	if err != nil || len(keys) != 1 || KeyID(keys[0]) != KeyID(mustKeys(t, k2)[0]) {
		t.Fatalf("file: %v", err)
	}
}

// Every gateway derives the byte-identical CA from the same key; another
// key gives another CA and other secrets.
func TestDerivationDeterministic(t *testing.T) {
	k := mustKeys(t, genKey(t))
	a, b := mustRing(t, "a", k), mustRing(t, "b", k)
	if !bytes.Equal(a.CAPEM(), b.CAPEM()) {
		t.Fatal("two rings of one key built different CAs")
	}
	if !bytes.Equal(a.GossipKeys()[0], b.GossipKeys()[0]) || a.Secret(LabelNATSRoute) != b.Secret(LabelNATSRoute) {
		t.Fatal("derived secrets differ")
	}
	if a.Secret(LabelNATSRoute) == a.Secret(LabelNATSClient) || bytes.Equal(a.GossipKeys()[0], k[0]) {
		t.Fatal("two uses share bytes")
	}
	if bytes.Equal(a.Certificate().Certificate[0], b.Certificate().Certificate[0]) {
		t.Fatal("leaves must be per gateway")
	}
	o := mustRing(t, "o", mustKeys(t, genKey(t)))
	if bytes.Equal(a.CAPEM(), o.CAPEM()) || a.CheckSecret(LabelNATSRoute, o.Secret(LabelNATSRoute)) {
		t.Fatal("another key is accepted")
	}
	if !a.CheckSecret(LabelNATSRoute, b.Secret(LabelNATSRoute)) || a.CheckSecret(LabelNATSRoute, "") {
		t.Fatal("CheckSecret")
	}
}

// handshake runs a TLS handshake between a client config and a Listener
// with the server config; it returns the client's error and how many
// connections the listener refused.
func handshake(t *testing.T, server *tls.Config, client func(net.Conn) error) (int64, error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var refused atomic.Int64
	rejected := make(chan struct{}, 1)
	l := NewListener(ln, server, 2*time.Second, func(error) {
		refused.Add(1)
		rejected <- struct{}{}
	})
	defer l.Close()
	accepted := make(chan struct{}, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			// The accepted connection carries data both ways.
			_, _ = c.Write([]byte("ok"))
			_ = c.Close()
			accepted <- struct{}{}
		}
	}()
	raw, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	cerr := client(raw)
	select {
	case <-accepted:
		if cerr != nil {
			t.Fatalf("server accepted, client failed: %v", cerr)
		}
		return refused.Load(), nil
	case <-rejected:
		return refused.Load(), cerr
	case <-time.After(5 * time.Second):
		t.Fatal("neither accepted nor refused")
	}
	return 0, cerr
}

func tlsClient(cfg *tls.Config) func(net.Conn) error {
	return func(raw net.Conn) error {
		c := tls.Client(raw, cfg)
		_ = c.SetDeadline(time.Now().Add(3 * time.Second))
		if err := c.Handshake(); err != nil {
			return err
		}
		// TLS 1.3: a client certificate refused by the server shows on
		// the first read.
		_, err := io.ReadAll(c)
		return err
	}
}

func TestListenerMutualTLS(t *testing.T) {
	k := mustKeys(t, genKey(t))
	srv, peer := mustRing(t, "srv", k), mustRing(t, "peer", k)
	other := mustRing(t, "intruder", mustKeys(t, genKey(t)))

	if n, err := handshake(t, srv.TLSConfig(), tlsClient(peer.TLSConfig())); err != nil || n != 0 {
		t.Fatalf("same key: err %v refused %d", err, n)
	}
	if n, err := handshake(t, srv.TLSConfig(), tlsClient(other.TLSConfig())); err == nil || n != 1 {
		t.Fatalf("wrong key: err %v refused %d", err, n)
	}
	noCert := peer.TLSConfig()
	noCert.Certificates = nil
	if n, err := handshake(t, srv.TLSConfig(), tlsClient(noCert)); err == nil || n != 1 {
		t.Fatalf("no client certificate: err %v refused %d", err, n)
	}
	plain := func(c net.Conn) error {
		_, _ = c.Write([]byte("\x00\x00\x00\x01plain raft bytes\n"))
		_, err := io.ReadAll(c)
		return err
	}
	if n, _ := handshake(t, srv.TLSConfig(), plain); n != 1 {
		t.Fatalf("plaintext: refused %d", n)
	}
	// The client refuses a server of another cluster too.
	if _, err := handshake(t, other.TLSConfig(), tlsClient(peer.TLSConfig())); err == nil {
		t.Fatal("client trusted a server of another key")
	}
}

// Rotation goes [old] -> [old, new] -> [new, old] -> [new], one rolling
// restart per step: gateways of adjacent steps trust each other both
// ways; [old] and [new] alone do not.
func TestRotation(t *testing.T) {
	oldK, newK := genKey(t), genKey(t)
	steps := []*Ring{
		mustRing(t, "s0", mustKeys(t, oldK)),
		mustRing(t, "s1", mustKeys(t, oldK, newK)),
		mustRing(t, "s2", mustKeys(t, newK, oldK)),
		mustRing(t, "s3", mustKeys(t, newK)),
	}
	for i := 0; i+1 < len(steps); i++ {
		a, b := steps[i], steps[i+1]
		if _, err := handshake(t, a.TLSConfig(), tlsClient(b.TLSConfig())); err != nil {
			t.Fatalf("step %d server, step %d client: %v", i, i+1, err)
		}
		if _, err := handshake(t, b.TLSConfig(), tlsClient(a.TLSConfig())); err != nil {
			t.Fatalf("step %d server, step %d client: %v", i+1, i, err)
		}
		if !a.CheckSecret(LabelNATSRoute, b.Secret(LabelNATSRoute)) || !b.CheckSecret(LabelNATSRoute, a.Secret(LabelNATSRoute)) {
			t.Fatalf("steps %d and %d refuse each other's NATS password", i, i+1)
		}
	}
	if _, err := handshake(t, steps[3].TLSConfig(), tlsClient(steps[0].TLSConfig())); err == nil {
		t.Fatal("disjoint keys trusted each other")
	}
}

func writeFile(name, s string) error { return os.WriteFile(name, []byte(s), 0o600) }
