package discovery

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/discovery/dnstest"
)

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
	srv := dnstest.Start(t, "vllm.test", "127.0.0.11", "127.0.0.12")
	d := &DNS{Name: "vllm.test", Port: 8000, Interval: 20 * time.Millisecond, Server: srv.Addr}
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

	srv.Set("127.0.0.12", "127.0.0.13") // a pod replaced
	assert.Equal(t, []string{"127.0.0.12", "127.0.0.13"}, ips(next()))

	// A failing server keeps the last snapshot (nothing is reported).
	srv.Fail(true)
	select {
	case e := <-snaps:
		t.Fatalf("a failed lookup reported %v", e)
	case <-time.After(100 * time.Millisecond):
	}
	srv.Fail(false)

	srv.Set() // every pod gone: an empty pool, not an error
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
