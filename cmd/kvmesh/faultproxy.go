package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvmesh/kvmesh/chaos/faultctl"
)

// faultproxyFlags are kvmesh faultproxy's flags.
type faultproxyFlags struct {
	control   string
	tokenFile string
	tcp, zmq  []string
	logLevel  string
}

func newFaultproxyCmd() *cobra.Command {
	f := &faultproxyFlags{}
	cmd := &cobra.Command{
		Use:   "faultproxy",
		Short: "Run fault-injecting TCP and ZMQ relays with an HTTP control API",
		Long: `Run fault-injecting relays to put between gateways and engines (HTTP and
KV-event ports) or in front of NATS, and a control API to add and remove
faults while they run.

	--tcp NAME,LISTEN,TARGET        a TCP relay: LISTEN host:port to TARGET host:port
	--zmq NAME,LISTEN,UPSTREAM      a ZMQ PUB/SUB relay: subscribes to the PUB at
	                                UPSTREAM and republishes on LISTEN (tcp://host:port)

Point the gateway at LISTEN instead of the engine: --replica
e0=http://127.0.0.1:18001,kv=tcp://127.0.0.1:15557,replay=tcp://127.0.0.1:5558
(replay goes straight to the engine: the ZMQ relay carries PUB/SUB only).

The control API (--control-addr) needs the bearer token from --token-file or
$KVMESH_FAULTPROXY_TOKEN on every route but /healthz:

	curl -H "Authorization: Bearer $KVMESH_FAULTPROXY_TOKEN" 127.0.0.1:8474/v1/proxies
	curl -H "Authorization: Bearer $KVMESH_FAULTPROXY_TOKEN" -d '{"type":"drop","count":3}' \
	    127.0.0.1:8474/v1/proxies/e0-events/faults
	curl -X DELETE -H "Authorization: Bearer $KVMESH_FAULTPROXY_TOKEN" \
	    127.0.0.1:8474/v1/proxies/e0-events/faults

TCP faults: latency (latency_ms, jitter_ms), bandwidth (rate_bytes_per_s),
drop, each with direction up|down|both; refuse; hold. Actions: POST
.../cut, .../half-open. ZMQ faults: drop, duplicate, reorder, garble, with
probability, count and seed. Details and the difference from Toxiproxy:
go doc github.com/kvmesh/kvmesh/chaos/faultctl.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return runFaultproxy(cmd, f) },
	}
	fl := cmd.Flags()
	fl.StringVar(&f.control, "control-addr", "127.0.0.1:8474", "control API listen address")
	fl.StringVar(&f.tokenFile, "token-file", "", "file holding the control API token (default $KVMESH_FAULTPROXY_TOKEN)")
	fl.StringArrayVar(&f.tcp, "tcp", nil, "a TCP relay NAME,LISTEN,TARGET (repeatable)")
	fl.StringArrayVar(&f.zmq, "zmq", nil, "a ZMQ PUB/SUB relay NAME,LISTEN,UPSTREAM (repeatable)")
	fl.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	return cmd
}

// ErrNoControlToken: kvmesh faultproxy refuses to serve its control API
// without a token.
var ErrNoControlToken = errors.New("faultproxy: no control token: set $KVMESH_FAULTPROXY_TOKEN or --token-file")

func (f *faultproxyFlags) controlToken() (string, error) {
	if f.tokenFile != "" {
		b, err := os.ReadFile(f.tokenFile)
		if err != nil {
			return "", fmt.Errorf("faultproxy: --token-file: %w", err)
		}
		if t := strings.TrimSpace(string(b)); t != "" {
			return t, nil
		}
		return "", fmt.Errorf("%w (%s is empty)", ErrNoControlToken, f.tokenFile)
	}
	if t := strings.TrimSpace(os.Getenv("KVMESH_FAULTPROXY_TOKEN")); t != "" {
		return t, nil
	}
	return "", ErrNoControlToken
}

// parseRelay reads NAME,LISTEN,UPSTREAM.
func parseRelay(kind, s string) (faultctl.ProxySpec, error) {
	parts := strings.Split(s, ",")
	if len(parts) != 3 || parts[0] == "" || parts[2] == "" {
		return faultctl.ProxySpec{}, fmt.Errorf("faultproxy: --%s %q: want NAME,LISTEN,TARGET", kind, s)
	}
	return faultctl.ProxySpec{Name: parts[0], Kind: kind, Listen: parts[1], Upstream: parts[2]}, nil
}

func runFaultproxy(cmd *cobra.Command, f *faultproxyFlags) error {
	token, err := f.controlToken()
	if err != nil {
		return err
	}
	logger, err := newLogger(f.logLevel, "text", cmd.ErrOrStderr())
	if err != nil {
		return err
	}
	var specs []faultctl.ProxySpec
	for _, s := range f.tcp {
		p, err := parseRelay(faultctl.KindTCP, s)
		if err != nil {
			return err
		}
		specs = append(specs, p)
	}
	for _, s := range f.zmq {
		p, err := parseRelay(faultctl.KindZMQ, s)
		if err != nil {
			return err
		}
		specs = append(specs, p)
	}
	m := faultctl.NewManager(logger)
	defer func() { _ = m.Close() }()
	for _, s := range specs {
		if _, err := m.Create(s); err != nil {
			return err
		}
	}
	h, err := faultctl.Handler(m, token)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", f.control)
	if err != nil {
		return fmt.Errorf("faultproxy: --control-addr: %w", err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	logger.Info("faultproxy control API listening", "addr", ln.Addr().String(), "proxies", len(specs))
	fmt.Fprintf(cmd.OutOrStdout(), "control\thttp://%s\n", ln.Addr())
	for _, p := range m.List() {
		fmt.Fprintf(cmd.OutOrStdout(), "%s\t%s\t%s -> %s\n", p.Name, p.Kind, p.Addr, p.Upstream)
	}
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return errors.Join(srv.Shutdown(sctx), m.Close())
}
