package node

import (
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/discovery"
)

// DiscoverySourceKubernetes is DiscoveryConfig.Source for the Kubernetes
// API; the command wires it (SetDiscoverySource) so that this package
// does not depend on client-go.
const DiscoverySourceKubernetes = "kubernetes"

// DiscoveryConfig follows one model's replicas from a source that changes
// on its own (pods that come and go) instead of a fixed list.
//
// Discovery owns the replica list of its model and nothing else: the
// replicas a config (flags, YAML or the raft routing config) lists for
// that model are ignored, with a warning, while strategy, index mode,
// tokenizer and every other setting of the model still come from the
// config. Each gateway follows the source itself, so the gateways of a
// cluster agree as soon as they have seen the same change.
type DiscoveryConfig struct {
	// Source is "" (off), "dns:<name>:<port>" (a headless Service's
	// address records, for clusters that grant no API access) or
	// "kubernetes" (pods of an InferencePool or a label selector).
	Source string `yaml:"source"`
	// Model is the model whose replicas are discovered.
	Model string `yaml:"model"`
	// Scheme of a discovered engine's URL: http (default) or https.
	Scheme string `yaml:"scheme"`
	// KV is a discovered engine's KV-event publisher ({ip} and {name} are
	// filled in, see discovery.Template), e.g. "tcp://{ip}:5557" for vLLM
	// publishing on tcp://*:5557. Empty: no KV events.
	KV string `yaml:"kv"`
	// Replay is a discovered engine's replay ROUTER, e.g.
	// "tcp://{ip}:5558". Empty: gaps reset the engine's confirmed entries.
	Replay string `yaml:"replay"`
	// Interval between DNS lookups. Default 1 s.
	Interval time.Duration `yaml:"interval"`
	// DNSServer (host:port) is asked instead of the system's resolver.
	DNSServer string `yaml:"dns_server"`
	// Kubernetes says which pods are the engines for source "kubernetes".
	Kubernetes KubernetesDiscovery `yaml:"kubernetes"`
}

// KubernetesDiscovery selects engine pods (discovery/kube): an
// InferencePool's, or a label selector's with the engines' port.
type KubernetesDiscovery struct {
	// Namespace of the pods; default: the gateway's own (in a cluster),
	// else "default".
	Namespace string `yaml:"namespace"`
	// InferencePool names a pool (inference.networking.k8s.io/v1) whose
	// selector and first target port define the engines.
	InferencePool string `yaml:"inference_pool"`
	// Selector is a label selector of the engine pods, instead of a pool.
	Selector string `yaml:"selector"`
	// Port is the engines' HTTP port, with Selector.
	Port int `yaml:"port"`
	// Kubeconfig is a kubeconfig path for a gateway outside the cluster;
	// "" uses the in-cluster service account.
	Kubeconfig string `yaml:"kubeconfig"`
}

func (c *DiscoveryConfig) template() discovery.Template {
	return discovery.Template{Scheme: c.Scheme, KV: c.KV, Replay: c.Replay}
}

func (c *DiscoveryConfig) owns(model string) bool { return c.Source != "" && c.Model == model }

func (c *DiscoveryConfig) validate(bad func(string, ...any)) {
	if c.Source == "" {
		return
	}
	if c.Model == "" {
		bad("discovery.model is required with discovery.source")
	}
	if c.Source != DiscoverySourceKubernetes {
		if _, err := discovery.ParseDNS(c.Source); err != nil {
			bad("discovery.source %q: want dns:<name>:<port> or kubernetes", c.Source)
		}
	} else if k := &c.Kubernetes; (k.InferencePool == "") == (k.Selector == "") {
		bad("discovery.kubernetes: give an inference_pool or a selector (with port), not both or neither")
	} else if k.Selector != "" && (k.Port < 1 || k.Port > 65535) {
		bad("discovery.kubernetes.port %d: a selector needs the engines' port", k.Port)
	}
	if err := c.template().Validate(); err != nil {
		bad("discovery: %v", err)
	}
	if c.Interval < 0 {
		bad("discovery.interval %s is negative", c.Interval)
	}
}

// discoveryState is the Node's discovered replicas (guarded by reloadMu).
type discoveryState struct {
	src  discovery.Source
	reps []ReplicaConfig // the last snapshot, as replicas
	seen atomic.Bool     // a snapshot was applied (Ready waits for it)
	// warned: the config's own replicas of the model were reported as
	// ignored for this spec version.
	warned  uint64
	updates prometheus.Counter
	size    prometheus.Gauge
}

// SetDiscoverySource installs the source of DiscoveryConfig.Source
// "kubernetes" (discovery/kube). Call before Start.
func (n *Node) SetDiscoverySource(src discovery.Source) {
	n.disc.src = src
}

// initDiscovery makes the DNS source of the config, if any, and the
// discovery metrics.
func (n *Node) initDiscovery() error {
	c := &n.cfg.Discovery
	if c.Source == "" {
		return nil
	}
	if strings.HasPrefix(c.Source, "dns:") {
		d, err := discovery.ParseDNS(c.Source)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
		}
		d.Interval, d.Server = c.Interval, c.DNSServer
		d.OnError = func(err error) {
			n.log.Warn("discovery lookup failed; keeping the last endpoints", "source", d.String(), "err", err)
		}
		n.disc.src = d
	}
	n.disc.updates = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvmesh_discovery_updates_total", Help: "Endpoint snapshots applied from the discovery source."})
	n.disc.size = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kvmesh_discovery_endpoints", Help: "Ready endpoints in the discovery source's last snapshot."})
	n.m.reg.MustRegister(n.disc.updates, n.disc.size)
	return nil
}

// checkDiscovery fails Start when the configured source has no
// implementation wired.
func (n *Node) checkDiscovery() error {
	if c := &n.cfg.Discovery; c.Source != "" && n.disc.src == nil {
		return fmt.Errorf("%w: discovery source %q has no implementation wired (SetDiscoverySource)", ErrInvalidConfig, c.Source)
	}
	return nil
}

// startDiscovery follows the source until the Node stops.
func (n *Node) startDiscovery() {
	c := &n.cfg.Discovery
	if c.Source == "" {
		return
	}
	src := n.disc.src
	tmpl := c.template()
	n.goFunc(func() {
		err := src.Run(n.bgCtx, func(eps []discovery.Endpoint) {
			reps := make([]ReplicaConfig, 0, len(eps))
			for _, e := range eps {
				r := tmpl.Replica(e)
				reps = append(reps, ReplicaConfig{Name: r.Name, URL: r.URL, KVEndpoint: r.KV, ReplayEndpoint: r.Replay})
			}
			n.applyDiscovered(reps)
		})
		if err != nil {
			n.log.Error("discovery stopped: the pool keeps its last endpoints", "source", src.String(), "err", err)
		}
	})
	n.log.Info("discovering replicas", "model", c.Model, "source", src.String(), "kv", c.KV, "replay", c.Replay)
}

// applyDiscovered makes reps the discovered model's replicas and rebuilds
// the table: added engines get probes and KV subscribers, removed ones
// get no new requests while their streams finish, as on a config
// scale-in.
func (n *Node) applyDiscovered(reps []ReplicaConfig) {
	n.reloadMu.Lock()
	defer n.reloadMu.Unlock()
	prev := n.disc.reps
	n.disc.reps = reps
	if err := n.applySpecLocked(n.baseSpec); err != nil {
		n.log.Error("discovered endpoints not applied", "model", n.cfg.Discovery.Model, "err", err)
		n.disc.reps = prev
		return
	}
	n.disc.seen.Store(true)
	n.disc.updates.Inc()
	n.disc.size.Set(float64(len(reps)))
	names := make([]string, len(reps))
	for i, r := range reps {
		names[i] = r.Name
	}
	n.log.Info("discovered endpoints applied", "model", n.cfg.Discovery.Model, "replicas", len(reps), "names", strings.Join(names, ","))
}

// withDiscovered is spec with the discovered model's replicas replaced by
// the discovered ones (the model is added when the config has none).
// Called under reloadMu.
func (n *Node) withDiscovered(spec routingSpec) routingSpec {
	c := &n.cfg.Discovery
	if c.Source == "" {
		return spec
	}
	models := slices.Clone(spec.models)
	i := slices.IndexFunc(models, func(m ModelConfig) bool { return m.Name == c.Model })
	if i < 0 {
		models = append(models, ModelConfig{Name: c.Model})
		i = len(models) - 1
	}
	if len(models[i].Replicas) > 0 && n.disc.warned != spec.version+1 {
		n.disc.warned = spec.version + 1
		n.log.Warn("discovery owns this model's replicas: the config's are ignored", "model", c.Model,
			"configured", len(models[i].Replicas), "source", c.Source)
	}
	models[i].Replicas = n.disc.reps
	spec.models = models
	return spec
}
