package trust

import (
	"crypto/tls"
	"net"
	"testing"
)

// BenchmarkNew: deriving a gateway's ring (gossip key, CA, leaf) at start.
func BenchmarkNew(b *testing.B) {
	k, _ := Generate()
	keys, _ := ParseKeys(k)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := New(keys, "gw"); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkMutualTLSHandshake: one cluster connection's cost (both ends,
// in-memory pipe), what every raft, peer and NATS route connection pays
// once.
func BenchmarkMutualTLSHandshake(b *testing.B) {
	k, _ := Generate()
	keys, _ := ParseKeys(k)
	srv, _ := New(keys, "srv")
	cli, _ := New(keys, "cli")
	scfg, ccfg := srv.TLSConfig(), cli.TLSConfig()
	b.ReportAllocs()
	for b.Loop() {
		a, c := net.Pipe()
		errc := make(chan error, 1)
		go func() { errc <- tls.Server(a, scfg).Handshake() }()
		if err := tls.Client(c, ccfg).Handshake(); err != nil {
			b.Fatal(err)
		}
		if err := <-errc; err != nil {
			b.Fatal(err)
		}
		_ = a.Close()
		_ = c.Close()
	}
}

// BenchmarkCheckSecret: a NATS connection's password check (every ring key).
func BenchmarkCheckSecret(b *testing.B) {
	k, _ := Generate()
	keys, _ := ParseKeys(k)
	r, _ := New(keys, "gw")
	s := r.Secret(LabelNATSRoute)
	b.ReportAllocs()
	for b.Loop() {
		if !r.CheckSecret(LabelNATSRoute, s) {
			b.Fatal("refused")
		}
	}
}
