package discovery

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// dnsServer is a real DNS server on loopback (miekg/dns) answering A
// records for one name from a set the test changes.
type dnsServer struct {
	mu   sync.Mutex
	name string
	ips  []string
	addr string
	fail bool
}

func startDNS(t *testing.T, name string, ips ...string) *dnsServer {
	t.Helper()
	s := &dnsServer{name: dns.Fqdn(name), ips: ips}
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	s.addr = pc.LocalAddr().String()
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(s.serve)}
	started := make(chan struct{})
	srv.NotifyStartedFunc = func() { close(started) }
	go func() { _ = srv.ActivateAndServe() }()
	<-started
	t.Cleanup(func() { _ = srv.Shutdown() })
	return s
}

func (s *dnsServer) set(ips ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ips = ips
}

func (s *dnsServer) serve(w dns.ResponseWriter, r *dns.Msg) {
	s.mu.Lock()
	defer s.mu.Unlock()
	m := new(dns.Msg)
	m.SetReply(r)
	if s.fail {
		m.Rcode = dns.RcodeServerFailure
		_ = w.WriteMsg(m)
		return
	}
	q := r.Question[0]
	switch {
	case q.Name != s.name:
		m.Rcode = dns.RcodeNameError
	case q.Qtype == dns.TypeA:
		for _, ip := range s.ips {
			m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET}, A: net.ParseIP(ip)})
		}
		if len(s.ips) == 0 {
			m.Rcode = dns.RcodeNameError // a headless Service without ready pods
		}
	}
	_ = w.WriteMsg(m)
}

func TestParseDNS(t *testing.T) {
	d, err := ParseDNS("dns:vllm.ns.svc.cluster.local:8000")
	require.NoError(t, err)
	assert.Equal(t, "vllm.ns.svc.cluster.local", d.Name)
	assert.Equal(t, 8000, d.Port)
	assert.Equal(t, "dns:vllm.ns.svc.cluster.local:8000", d.String())
	for _, bad := range []string{"vllm:8000", "dns:vllm", "dns::80", "dns:vllm:0", "dns:vllm:x"} {
		_, err := ParseDNS(bad)
		assert.ErrorIs(t, err, ErrInvalid, bad)
	}
}

func TestDNSFollowsTheRecords(t *testing.T) {
	srv := startDNS(t, "vllm.test", "127.0.0.11", "127.0.0.12")
	d := &DNS{Name: "vllm.test", Port: 8000, Interval: 20 * time.Millisecond, Server: srv.addr}
	ctx, cancel := context.WithCancel(context.Background())
	snaps := make(chan []Endpoint, 16)
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx, func(e []Endpoint) { snaps <- e }) }()
	next := func() []Endpoint {
		select {
		case e := <-snaps:
			return e
		case <-time.After(10 * time.Second):
			t.Fatal("no snapshot")
			return nil
		}
	}
	assert.Equal(t, []Endpoint{
		{Name: "127.0.0.11-8000", IP: "127.0.0.11", Port: 8000},
		{Name: "127.0.0.12-8000", IP: "127.0.0.12", Port: 8000},
	}, next())

	srv.set("127.0.0.12", "127.0.0.13") // a pod replaced
	assert.Equal(t, []string{"127.0.0.12", "127.0.0.13"}, ips(next()))

	// A failing server keeps the last snapshot (nothing is reported).
	srv.mu.Lock()
	srv.fail = true
	srv.mu.Unlock()
	select {
	case e := <-snaps:
		t.Fatalf("a failed lookup reported %v", e)
	case <-time.After(100 * time.Millisecond):
	}
	srv.mu.Lock()
	srv.fail = false
	srv.mu.Unlock()

	srv.set() // every pod gone: an empty pool, not an error
	assert.Empty(t, next())
	cancel()
	require.NoError(t, <-done)
}

func ips(eps []Endpoint) []string {
	var out []string
	for _, e := range eps {
		out = append(out, e.IP)
	}
	return out
}

func TestTemplate(t *testing.T) {
	tm := Template{KV: "tcp://{ip}:5557", Replay: "tcp://{ip}:5558"}
	require.NoError(t, tm.Validate())
	assert.Equal(t, Replica{Name: "p", URL: "http://10.0.0.5:8000", KV: "tcp://10.0.0.5:5557", Replay: "tcp://10.0.0.5:5558"},
		tm.Replica(Endpoint{Name: "p", IP: "10.0.0.5", Port: 8000}))
	assert.Equal(t, "tcp://[fd00::5]:5557", tm.Replica(Endpoint{Name: "p", IP: "fd00::5", Port: 8000}).KV)
	for _, bad := range []Template{{KV: "tcp://10.0.0.1:5557"}, {Replay: "tcp://{ip}:5558"}, {Scheme: "ftp"}} {
		assert.ErrorIs(t, bad.Validate(), ErrInvalid)
	}
}
