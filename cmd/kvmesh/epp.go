package main

import (
	"github.com/spf13/pflag"

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
