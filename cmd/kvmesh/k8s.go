package main

import (
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/spf13/pflag"
	"k8s.io/klog/v2"

	"github.com/kvmesh/kvmesh/discovery/kube"
	"github.com/kvmesh/kvmesh/node"
)

// addEPPFlags registers the endpoint-picker flags (node.EPPConfig).
func addEPPFlags(fl *pflag.FlagSet, e *node.EPPConfig) {
	fl.StringVar(&e.Addr, "epp-addr", e.Addr, "serve as a Gateway API Inference Extension endpoint picker (Envoy ext_proc gRPC) on this address besides the proxy; every gateway of a cluster is an active picker over the shared index")
	fl.StringVar(&e.CertFile, "epp-tls-cert", e.CertFile, "endpoint picker TLS certificate (PEM); without it and --epp-tls-key the picker makes a self-signed one, as Envoy Gateway expects of a picker")
	fl.StringVar(&e.KeyFile, "epp-tls-key", e.KeyFile, "endpoint picker TLS key (PEM)")
	fl.BoolVar(&e.Plaintext, "epp-plaintext", e.Plaintext, "serve the endpoint picker without TLS (a service mesh wraps it in its own mTLS)")
	fl.IntVar(&e.Fallbacks, "epp-fallbacks", e.Fallbacks, "further endpoints after the pick in x-gateway-destination-endpoint, in the strategy's order, for the data plane's retries")
}

// applyEPPFlags copies the endpoint-picker flags that were given.
func applyEPPFlags(set func(string, func()), c, fc *node.EPPConfig) {
	set("epp-addr", func() { c.Addr = fc.Addr })
	set("epp-tls-cert", func() { c.CertFile = fc.CertFile })
	set("epp-tls-key", func() { c.KeyFile = fc.KeyFile })
	set("epp-plaintext", func() { c.Plaintext = fc.Plaintext })
	set("epp-fallbacks", func() { c.Fallbacks = fc.Fallbacks })
}

// addDiscoveryFlags registers the discovery flags (node.DiscoveryConfig).
func addDiscoveryFlags(fl *pflag.FlagSet, d *node.DiscoveryConfig) {
	fl.StringVar(&d.Source, "discovery", d.Source, "follow the model's engines instead of fixed --replica flags: dns:<name>:<port> (a headless Service) or kubernetes (--k8s-inference-pool or --k8s-selector)")
	fl.StringVar(&d.Model, "discovery-model", d.Model, "the model whose engines are discovered (default: --model)")
	fl.StringVar(&d.KV, "discovery-kv", d.KV, "a discovered engine's KV-event publisher, e.g. tcp://{ip}:5557 ({ip} and {name} are filled in); empty: no KV events")
	fl.StringVar(&d.Replay, "discovery-replay", d.Replay, "a discovered engine's replay endpoint, e.g. tcp://{ip}:5558")
	fl.StringVar(&d.Scheme, "discovery-scheme", d.Scheme, "scheme of discovered engines' URLs: http or https")
	fl.DurationVar(&d.Interval, "discovery-interval", d.Interval, "DNS discovery's lookup interval (default 1s)")
	fl.StringVar(&d.DNSServer, "discovery-dns-server", d.DNSServer, "DNS server host:port for dns: discovery (default: the system resolver)")
	k := &d.Kubernetes
	fl.StringVar(&k.Namespace, "k8s-namespace", k.Namespace, "namespace of the engine pods (default: the gateway's own, else default)")
	fl.StringVar(&k.InferencePool, "k8s-inference-pool", k.InferencePool, "InferencePool (inference.networking.k8s.io/v1) whose selector and target port define the engines")
	fl.StringVar(&k.Selector, "k8s-selector", k.Selector, "label selector of the engine pods, instead of an InferencePool (with --k8s-port)")
	fl.IntVar(&k.Port, "k8s-port", k.Port, "the engines' HTTP port, with --k8s-selector")
	fl.StringVar(&k.Kubeconfig, "kubeconfig", k.Kubeconfig, "kubeconfig for a gateway outside the cluster (default: the in-cluster service account)")
}

// applyDiscoveryFlags copies the discovery flags that were given.
func applyDiscoveryFlags(set func(string, func()), c, fc *node.DiscoveryConfig) {
	set("discovery", func() { c.Source = fc.Source })
	set("discovery-model", func() { c.Model = fc.Model })
	set("discovery-kv", func() { c.KV = fc.KV })
	set("discovery-replay", func() { c.Replay = fc.Replay })
	set("discovery-scheme", func() { c.Scheme = fc.Scheme })
	set("discovery-interval", func() { c.Interval = fc.Interval })
	set("discovery-dns-server", func() { c.DNSServer = fc.DNSServer })
	k, fk := &c.Kubernetes, &fc.Kubernetes
	set("k8s-namespace", func() { k.Namespace = fk.Namespace })
	set("k8s-inference-pool", func() { k.InferencePool = fk.InferencePool })
	set("k8s-selector", func() { k.Selector = fk.Selector })
	set("k8s-port", func() { k.Port = fk.Port })
	set("kubeconfig", func() { k.Kubeconfig = fk.Kubeconfig })
}

// discoveredModel completes the discovery settings: the discovered model
// defaults to --model and is added (with no replicas: discovery owns
// them) when the config does not name it.
func discoveredModel(cfg *node.Config, model string) {
	d := &cfg.Discovery
	if d.Source == "" {
		return
	}
	if d.Model == "" {
		d.Model = model
	}
	if d.Model != "" && !hasModel(cfg, d.Model) {
		cfg.Models = append(cfg.Models, node.ModelConfig{Name: d.Model})
	}
}

// kubeSource makes the Kubernetes discovery source of cfg, if it asks for
// one; client-go's own logs (klog) go to the gateway's logger.
func kubeSource(cfg *node.Config, logger *slog.Logger) (*kube.Source, error) {
	d := &cfg.Discovery
	if d.Source != node.DiscoverySourceKubernetes {
		return nil, nil
	}
	klog.SetSlogLogger(logger.With("component", "client-go"))
	k := d.Kubernetes
	ns := k.Namespace
	if ns == "" {
		ns = "default"
		if b, err := os.ReadFile("/var/run/secrets/kubernetes.io/serviceaccount/namespace"); err == nil {
			ns = strings.TrimSpace(string(b))
		}
	}
	src, err := kube.NewFromEnvironment(kube.Config{Namespace: ns, Pool: k.InferencePool, Selector: k.Selector, Port: k.Port}, k.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("kubernetes discovery: %w", err)
	}
	return src, nil
}
