// Package discovery finds a model's engine replicas from a source that
// changes on its own: a headless Service's DNS records (this package), or
// the Kubernetes API (discovery/kube). A Source reports full snapshots of
// the ready endpoints; the gateway turns each into its pool's replicas
// with a Template (node.Node.Discover).
package discovery

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
)

// ErrInvalid is returned for a malformed source spec or template.
var ErrInvalid = errors.New("discovery: invalid")

// Endpoint is one ready engine.
type Endpoint struct {
	// Name is the replica's stable name: the pod's name where the source
	// knows it, else the address with ':' written as '-'.
	Name string
	// IP and Port are where the engine's HTTP API listens.
	IP   string
	Port int
}

// Addr is ip:port.
func (e Endpoint) Addr() string { return net.JoinHostPort(e.IP, strconv.Itoa(e.Port)) }

// Source watches a discovery source. Run calls update with every change,
// each time with the full set of ready endpoints (sorted by name), the
// first time once the source answered; it returns when ctx is done, or
// with an error the source cannot recover from.
type Source interface {
	Run(ctx context.Context, update func([]Endpoint)) error
	// String names the source for logs, metrics and `kvmesh explain`.
	String() string
}

// Template makes an endpoint's replica: its engine URL and its KV-event
// and replay endpoints. In KV and Replay, {ip} stands for the endpoint's
// IP (bracketed when IPv6) and {name} for its name; "" turns the feature
// off for discovered replicas.
type Template struct {
	// Scheme of the engine URL: http (default) or https.
	Scheme string
	// KV is the engine's KV-event publisher to connect to, e.g.
	// tcp://{ip}:5557 (vLLM publishing on tcp://*:5557).
	KV string
	// Replay is the engine's replay ROUTER, e.g. tcp://{ip}:5558.
	Replay string
}

// Replica is what Template makes of an endpoint.
type Replica struct {
	Name, URL, KV, Replay string
}

// Validate checks the template's placeholders.
func (t Template) Validate() error {
	if t.Scheme != "" && t.Scheme != "http" && t.Scheme != "https" {
		return fmt.Errorf("%w: scheme %q (want http or https)", ErrInvalid, t.Scheme)
	}
	for _, s := range []string{t.KV, t.Replay} {
		if s != "" && !strings.Contains(s, "{ip}") && !strings.Contains(s, "{name}") {
			return fmt.Errorf("%w: endpoint template %q names neither {ip} nor {name}: every engine would share it", ErrInvalid, s)
		}
	}
	if t.Replay != "" && t.KV == "" {
		return fmt.Errorf("%w: a replay template without a KV template", ErrInvalid)
	}
	return nil
}

// Replica applies the template to e.
func (t Template) Replica(e Endpoint) Replica {
	scheme := t.Scheme
	if scheme == "" {
		scheme = "http"
	}
	ip := e.IP
	if strings.Contains(ip, ":") {
		ip = "[" + ip + "]"
	}
	fill := func(s string) string {
		return strings.NewReplacer("{ip}", ip, "{name}", e.Name).Replace(s)
	}
	return Replica{Name: e.Name, URL: scheme + "://" + e.Addr(), KV: fill(t.KV), Replay: fill(t.Replay)}
}

// sortEndpoints orders endpoints by name and drops duplicate names.
func sortEndpoints(eps []Endpoint) []Endpoint {
	slices.SortFunc(eps, func(a, b Endpoint) int { return strings.Compare(a.Name, b.Name) })
	return slices.CompactFunc(eps, func(a, b Endpoint) bool { return a.Name == b.Name })
}

// addrName names an endpoint known only by its address.
func addrName(ip string, port int) string {
	return strings.ReplaceAll(ip, ":", "-") + "-" + strconv.Itoa(port)
}
