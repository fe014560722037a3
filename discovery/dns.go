package discovery

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"
)

// DNS discovers engines from a name's address records: a Kubernetes
// headless Service resolves to its ready pods' IPs (unready pods are left
// out unless the Service publishes them), so a gateway without API access
// follows the pods. It polls: DNS has no watch.
type DNS struct {
	// Name is the name to resolve, e.g. vllm.inference.svc.cluster.local.
	Name string
	// Port is the engines' HTTP port.
	Port int
	// Interval between lookups. Default 1 s.
	Interval time.Duration
	// Server, if set, is the DNS server (host:port) asked instead of the
	// system's resolver.
	Server string
	// Timeout bounds one lookup. Default 2 s.
	Timeout time.Duration
	// OnError, if set, is told about failed lookups (the last snapshot
	// stays in force meanwhile).
	OnError func(error)
}

// ParseDNS reads "dns:<name>:<port>" (the --discovery flag's form).
func ParseDNS(spec string) (*DNS, error) {
	rest, ok := strings.CutPrefix(spec, "dns:")
	if !ok {
		return nil, fmt.Errorf("%w: %q is not dns:<name>:<port>", ErrInvalid, spec)
	}
	name, port, err := net.SplitHostPort(rest)
	if err != nil || name == "" {
		return nil, fmt.Errorf("%w: %q is not dns:<name>:<port>", ErrInvalid, spec)
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 1 || p > 65535 {
		return nil, fmt.Errorf("%w: port %q", ErrInvalid, port)
	}
	return &DNS{Name: name, Port: p}, nil
}

func (d *DNS) String() string { return fmt.Sprintf("dns:%s:%d", d.Name, d.Port) }

// Run resolves Name every Interval and reports each change.
func (d *DNS) Run(ctx context.Context, update func([]Endpoint)) error {
	interval := d.Interval
	if interval <= 0 {
		interval = time.Second
	}
	timeout := d.Timeout
	if timeout <= 0 {
		timeout = 2 * time.Second
	}
	r := net.DefaultResolver
	if d.Server != "" {
		r = &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var dl net.Dialer
			return dl.DialContext(ctx, network, d.Server)
		}}
	}
	var last []Endpoint
	first := true
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		lctx, cancel := context.WithTimeout(ctx, timeout)
		ips, err := r.LookupIPAddr(lctx, d.Name)
		cancel()
		var dnsErr *net.DNSError
		switch {
		case err == nil:
		case errors.As(err, &dnsErr) && dnsErr.IsNotFound:
			// No ready pod: the Service has no records. An empty pool is
			// the truth, not an error.
			ips, err = nil, nil
		case ctx.Err() != nil:
			return nil
		}
		if err != nil {
			if d.OnError != nil {
				d.OnError(err)
			}
			t.Reset(interval)
			continue
		}
		eps := make([]Endpoint, 0, len(ips))
		for _, ip := range ips {
			s := ip.IP.String()
			eps = append(eps, Endpoint{Name: addrName(s, d.Port), IP: s, Port: d.Port})
		}
		eps = sortEndpoints(eps)
		if first || !slices.Equal(eps, last) {
			first = false
			last = eps
			update(slices.Clone(eps))
		}
		t.Reset(interval)
	}
}
