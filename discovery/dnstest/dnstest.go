// Package dnstest is a real DNS server on loopback (miekg/dns) for tests:
// it answers one name's A records from a set the test changes, as a
// Kubernetes headless Service does for its ready pods.
package dnstest

import (
	"net"
	"sync"
	"testing"

	"github.com/miekg/dns"
)

// Server answers A queries for its name.
type Server struct {
	mu   sync.Mutex
	name string
	ips  []string
	fail bool
	// Addr is the server's UDP address (host:port).
	Addr string
}

// Start starts a server for name with ips; it stops at the test's end.
func Start(t testing.TB, name string, ips ...string) *Server {
	t.Helper()
	s := &Server{name: dns.Fqdn(name), ips: ips}
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.Addr = pc.LocalAddr().String()
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(s.serve)}
	started := make(chan struct{})
	srv.NotifyStartedFunc = func() { close(started) }
	go func() { _ = srv.ActivateAndServe() }()
	<-started
	t.Cleanup(func() { _ = srv.Shutdown() })
	return s
}

// Set replaces the name's addresses; none makes the name NXDOMAIN, as a
// headless Service without ready pods.
func (s *Server) Set(ips ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ips = ips
}

// Fail makes every answer SERVFAIL while on.
func (s *Server) Fail(on bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.fail = on
}

func (s *Server) serve(w dns.ResponseWriter, r *dns.Msg) {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := new(dns.Msg)
	m.SetReply(r)
	q := r.Question[0]
	switch {
	case s.fail:
		m.Rcode = dns.RcodeServerFailure
	case q.Name != s.name || len(s.ips) == 0:
		m.Rcode = dns.RcodeNameError
	case q.Qtype == dns.TypeA:
		for _, ip := range s.ips {
			m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET}, A: net.ParseIP(ip)})
		}
	}
	_ = w.WriteMsg(m)
}
