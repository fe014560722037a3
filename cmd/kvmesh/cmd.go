package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvmesh/kvmesh/internal/buildinfo"
	"github.com/kvmesh/kvmesh/internal/logx"
	"github.com/kvmesh/kvmesh/node"
	"github.com/kvmesh/kvmesh/sync/config"
	"github.com/kvmesh/kvmesh/sync/config/admincli"
)

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "kvmesh",
		Short:         "Prefix-cache-aware gateway for vLLM replicas",
		Version:       buildinfo.String("kvmesh"),
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetVersionTemplate("{{.Version}}\n") // kvmesh --version = kvmesh version
	root.AddCommand(newServeCmd(), newExplainCmd(), newDoctorCmd(), newVersionCmd(), newKeygenCmd())
	// kvmesh config get|set|patch|edit and kvmesh members, over the admin
	// gRPC API (--admin-addr, --token).
	admin := admincli.Commands()
	for _, c := range admin {
		if c.Name() == "config" {
			c.AddCommand(newConfigReferenceCmd()) // configref.go
		}
	}
	root.AddCommand(admin...)
	root.AddCommand(newChaosCmd(), newFaultproxyCmd()) // chaos.go, faultproxy.go
	return root
}

// serveFlags are the serve command's flags; each overrides the config file
// only when given.
type serveFlags struct {
	configPath string
	model      string
	replicas   []string
	logLevel   string
	logFormat  string
	cfg        node.Config // flag targets, copied over the file's values when set
	route      []routeFlag // --prefix-cache-*, --consistent-hash-*, --cost-* (routeflags.go)
}

func newServeCmd() *cobra.Command {
	cmd, _ := newServeCmdFlags()
	return cmd
}

// newServeCmdFlags returns the serve command and the flags it fills.
func newServeCmdFlags() (*cobra.Command, *serveFlags) {
	f := &serveFlags{cfg: node.DefaultConfig()}
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run a gateway",
		Long: `Run a gateway in front of vLLM replicas.

Replicas are given as --replica name=url[,kv=endpoint][,kv-bind=endpoint][,replay=endpoint][,model=name][,dp=N]
(repeatable): kv= connects to an engine whose KV-event publisher binds (vLLM with
tcp://*:5557), kv-bind= binds for engines whose publisher connects, replay= is the
engine's replay ROUTER. Replicas without model= serve --model. A YAML file
(--config) can describe several pools; flags given on the command line win.

Without cluster flags the gateway is standalone and opens no port besides
--http-addr. --cluster (or --join / --bootstrap-expect) makes it a cluster
member: memberlist gossip (--gossip-addr), an embedded NATS server (or
--nats-url), the peer snapshot service (--peer-addr), the admin gRPC API
(--admin-addr; the same API over HTTP/JSON is served on --http-addr under
/admin/v1/), raft (--raft-addr, --data-dir). The admin token comes from
--admin-token, $KVMESH_ADMIN_TOKEN or --admin-token-file. Cluster mode needs
the cluster key (kvmesh keygen) from --cluster-key-file or $KVMESH_CLUSTER_KEY:
it encrypts gossip and authenticates raft, the peer port and NATS; --insecure
is the explicit opt-out. SECURITY.md lists every port and what it trusts.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := f.config(cmd.Flags())
			if err != nil {
				return err
			}
			logger, err := newLogger(f.logLevel, f.logFormat, cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			return serve(cmd.Context(), cfg, logger)
		},
	}
	fl := cmd.Flags()
	d := &f.cfg
	fl.StringVar(&f.configPath, "config", "", "YAML config file (flags override it)")
	fl.StringVar(&f.model, "model", "", "model name served by --replica flags that name none")
	fl.StringArrayVar(&f.replicas, "replica", nil, "replica: name=url[,kv=...][,kv-bind=...][,replay=...][,model=...][,dp=N] (repeatable; dp: data-parallel ranks, each its own replica name#r)")
	fl.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fl.StringVar(&f.logFormat, "log-format", "text", "text or json")
	fl.StringVar(&d.HTTPAddr, "http-addr", d.HTTPAddr, "listen address of the API, /metrics and /debug/*; all interfaces by default because it is the ingress clients reach (debug views and the admin API need the admin token)")
	fl.StringVar(&d.Strategy, "strategy", d.Strategy, "default routing strategy: random, least-request, prefix-cache, consistent-hash or cost (the default: best or tied on every scenario of the kvbench study)")
	fl.StringVar(&d.IndexMode, "index-mode", d.IndexMode, "index mode: history, kv-events, hybrid, or auto (the default: hybrid when any --replica has kv= or kv-bind=, or --discovery-kv is set, else history)")
	fl.StringVar(&d.Tokenizer, "tokenizer", d.Tokenizer, "auto, character, tiktoken, remote, or hf:<dir> (the model's own tokenizer.json and tokenizer_config.json, as vLLM applies them)")
	fl.IntVar(&d.MaxKeyTokens, "max-key-tokens", d.MaxKeyTokens, "key at most a prompt's first N tokens (bounds tokenizing work per request; longer prompts keep exact keys for their first N tokens)")
	fl.DurationVar(&d.ResponseTTL, "response-ttl", d.ResponseTTL, "how long a gateway remembers which replica stored a Responses API response (previous_response_id and /v1/responses/{id} go there)")
	fl.IntVar(&d.BlockSize, "block-size", d.BlockSize, "tokens per index block (0: 128 for character, else 16)")
	fl.Uint64Var(&d.HashSeed, "hash-seed", d.HashSeed, "block-key seed; equal on every gateway of a cluster")
	fl.IntVar(&d.IndexCapacity, "index-capacity", d.IndexCapacity, "index capacity in (block, replica) entries")
	fl.DurationVar(&d.HistoryTTL, "history-ttl", d.HistoryTTL, "how long a history entry lives without being touched")
	fl.DurationVar(&d.SpeculativeTTL, "speculative-ttl", d.SpeculativeTTL, "how long a routing decision counts as speculative before a KV event confirms it")
	fl.Float64Var(&d.Route.PeerLoadDelaySeconds, "peer-load-delay-seconds", d.Route.PeerLoadDelaySeconds, "how stale peers' reported load is, in seconds (0: the default 0.025 s, the load-report interval; negative: treat it as fresh)")
	fl.Int64Var(&d.MaxBodyBytes, "max-body-bytes", d.MaxBodyBytes, "largest accepted request body")
	fl.DurationVar(&d.ConnectTimeout, "connect-timeout", d.ConnectTimeout, "upstream connect timeout")
	fl.DurationVar(&d.FirstByteTimeout, "first-byte-timeout", d.FirstByteTimeout, "upstream response-header timeout")
	fl.DurationVar(&d.IdleTimeout, "idle-timeout", d.IdleTimeout, "longest silence between response chunks")
	fl.DurationVar(&d.ScrapeInterval, "scrape-interval", d.ScrapeInterval, "replica /metrics scrape interval (0 disables)")
	fl.DurationVar(&d.SharedScrapeInterval, "shared-scrape-interval", d.SharedScrapeInterval, "scrape every replica this often while, with no peer reporting load, a scrape in the last 100 such intervals showed an engine running requests this gateway did not send (0, or not below --scrape-interval: --scrape-interval)")
	fl.DurationVar(&d.HealthInterval, "health-interval", d.HealthInterval, "replica /health poll interval (0 disables)")
	fl.DurationVar(&d.UnhealthyInterval, "unhealthy-interval", d.UnhealthyInterval, "/health poll interval for a replica whose last poll failed (0: --health-interval)")
	fl.BoolVar(&d.HealthFailOpen, "health-fail-open", d.HealthFailOpen, "when every replica of a model fails its /health polls, route among them anyway (false: answer 503)")
	fl.IntVar(&d.EjectAfter, "eject-after", d.EjectAfter, "consecutive failures that eject a replica")
	fl.DurationVar(&d.EjectBackoff, "eject-backoff", d.EjectBackoff, "first ejection period (doubles per repeat)")
	fl.DurationVar(&d.EjectMaxBackoff, "eject-max-backoff", d.EjectMaxBackoff, "longest ejection period")
	fl.BoolVar(&d.RetryConnectFailures, "retry-connect-failures", d.RetryConnectFailures, "retry once on another replica when connecting fails")
	fl.DurationVar(&d.ShutdownGrace, "shutdown-grace", d.ShutdownGrace, "how long SIGTERM lets streams drain")
	fl.StringVar(&d.TokenizerAgreement, "tokenizer-agreement", d.TokenizerAgreement, "probe each KV-event replica's /tokenize against the gateway's tokenizer: switch (use the engine's on disagreement), probe (report only) or off")
	fl.IntVar(&d.MaxInFlight, "max-in-flight", d.MaxInFlight, "requests this gateway handles at once before answering 429 with Retry-After (0: no limit); the default covers ~16 busy vLLM replicas")
	fl.BoolVar(&d.DebugPublic, "debug-public", d.DebugPublic, "serve /debug/route and /debug/replicas without the admin token (they reveal which prompts are cached)")
	f.route = addRouteFlags(fl, &d.Route)
	addEPPFlags(fl, &d.EPP)
	addDiscoveryFlags(fl, &d.Discovery)

	c := &d.Cluster
	fl.BoolVar(&c.Enabled, "cluster", c.Enabled, "run as a cluster member (implied by --join and --bootstrap-expect)")
	fl.BoolVar(&c.NoSync, "no-sync", c.NoSync, "isolated gateway: no gossip, NATS, raft or admin API even with cluster flags")
	fl.StringVar(&c.Name, "cluster-name", c.Name, "cluster name (namespaces NATS subjects; peers of another cluster are ignored)")
	fl.StringVar(&c.NodeID, "node-id", c.NodeID, "this gateway's unique, stable id (default: the host name)")
	fl.StringVar(&c.Profile, "cluster-profile", c.Profile, "cluster timing: lan, or local for loopback clusters")
	fl.StringVar(&c.GossipAddr, "gossip-addr", c.GossipAddr, "memberlist bind address (UDP and TCP); all interfaces by default because peers on other hosts must reach it, and gossip is encrypted and authenticated with the cluster key")
	fl.StringVar(&c.AdvertiseAddr, "advertise-addr", c.AdvertiseAddr, "gossip address peers use when it differs from --gossip-addr")
	fl.StringSliceVar(&c.Join, "join", c.Join, "seed gateways' gossip addresses (repeatable or comma-separated)")
	fl.StringVar(&c.GossipKeyFile, "gossip-key-file", c.GossipKeyFile, "file with a base64 gossip key used instead of the one derived from the cluster key (else $KVMESH_GOSSIP_KEY)")
	fl.StringVar(&c.NATSURL, "nats-url", c.NATSURL, "external NATS cluster URLs (default: an embedded server per gateway)")
	fl.StringVar(&c.NATSClientAddr, "nats-client-addr", c.NATSClientAddr, "embedded NATS client listen address; loopback by default: only this gateway connects (with a token derived from the cluster key)")
	fl.StringVar(&c.NATSClusterAddr, "nats-cluster-addr", c.NATSClusterAddr, "embedded NATS route listen address; all interfaces by default because peers' servers dial it, and every route must prove the cluster key (mutual TLS and password)")
	fl.StringVar(&c.PeerAddr, "peer-addr", c.PeerAddr, "gRPC peer service (index snapshots, forwarded config writes) listen address; all interfaces by default because peers dial it, and every connection must prove the cluster key (mutual TLS)")
	fl.StringVar(&c.AdminAddr, "admin-addr", c.AdminAddr, "admin gRPC listen address (operators' tools); all interfaces by default, every call needs the admin token")
	fl.StringVar(&c.AdvertiseAdminAddr, "advertise-admin-addr", c.AdvertiseAdminAddr, "admin address peers dial when it differs from --admin-addr")
	fl.StringVar(&c.RaftAddr, "raft-addr", c.RaftAddr, "raft listen address; all interfaces by default because peers dial it, and every connection must prove the cluster key (mutual TLS) before raft reads it")
	fl.StringVar(&c.RaftAdvertiseAddr, "raft-advertise-addr", c.RaftAdvertiseAddr, "raft address peers dial when it differs from --raft-addr")
	fl.StringVar(&c.DataDir, "data-dir", c.DataDir, "raft log and config snapshots (keep across restarts)")
	fl.IntVar(&c.BootstrapExpect, "bootstrap-expect", c.BootstrapExpect, "raft voters: the first N gateways form the config cluster")
	fl.StringVar(&c.AdminToken, "admin-token", c.AdminToken, "admin API bearer token (prefer $KVMESH_ADMIN_TOKEN or --admin-token-file)")
	fl.StringVar(&c.AdminTokenFile, "admin-token-file", c.AdminTokenFile, "file holding the admin token")
	fl.StringVar(&c.AdminTLS.CertFile, "admin-tls-cert", "", "admin gRPC TLS certificate (PEM)")
	fl.StringVar(&c.AdminTLS.KeyFile, "admin-tls-key", "", "admin gRPC TLS key (PEM)")
	fl.StringVar(&c.AdminTLS.CAFile, "admin-tls-ca", "", "CA for admin gRPC peers and clients (PEM)")
	fl.StringVar(&c.RaftTLS.CertFile, "raft-tls-cert", "", "raft mutual-TLS certificate (PEM), your own CA instead of the cluster key's")
	fl.StringVar(&c.RaftTLS.KeyFile, "raft-tls-key", "", "raft mutual-TLS key (PEM)")
	fl.StringVar(&c.RaftTLS.CAFile, "raft-tls-ca", "", "raft mutual-TLS CA (PEM)")
	fl.StringVar(&c.PeerTLS.CertFile, "peer-tls-cert", "", "peer service TLS certificate (PEM), your own CA instead of the cluster key's")
	fl.StringVar(&c.PeerTLS.KeyFile, "peer-tls-key", "", "peer snapshot service TLS key (PEM)")
	fl.StringVar(&c.PeerTLS.CAFile, "peer-tls-ca", "", "CA peers' snapshot-service certificates are verified against; requires client certificates (PEM)")
	fl.StringVar(&c.PeerTLSServerName, "peer-tls-server-name", "", "name peers' snapshot-service certificates are verified against instead of the dialled host")
	addClusterTrustFlags(fl, c)
	return cmd, f
}

// config builds the Config: defaults, then the file, then the flags that
// were given, then the replicas.
func (f *serveFlags) config(fs *pflag.FlagSet) (node.Config, error) {
	cfg := node.DefaultConfig()
	if f.configPath != "" {
		var err error
		if cfg, err = node.LoadConfigFile(f.configPath, cfg); err != nil {
			return cfg, err
		}
	}
	set := func(name string, apply func()) {
		if fs.Changed(name) {
			apply()
		}
	}
	d := &f.cfg
	set("http-addr", func() { cfg.HTTPAddr = d.HTTPAddr })
	set("strategy", func() { cfg.Strategy = d.Strategy })
	set("index-mode", func() { cfg.IndexMode = d.IndexMode })
	set("tokenizer", func() { cfg.Tokenizer = d.Tokenizer })
	set("max-key-tokens", func() { cfg.MaxKeyTokens = d.MaxKeyTokens })
	set("response-ttl", func() { cfg.ResponseTTL = d.ResponseTTL })
	set("block-size", func() { cfg.BlockSize = d.BlockSize })
	set("hash-seed", func() { cfg.HashSeed = d.HashSeed })
	set("index-capacity", func() { cfg.IndexCapacity = d.IndexCapacity })
	set("history-ttl", func() { cfg.HistoryTTL = d.HistoryTTL })
	set("speculative-ttl", func() { cfg.SpeculativeTTL = d.SpeculativeTTL })
	set("peer-load-delay-seconds", func() { cfg.Route.PeerLoadDelaySeconds = d.Route.PeerLoadDelaySeconds })
	set("max-body-bytes", func() { cfg.MaxBodyBytes = d.MaxBodyBytes })
	set("connect-timeout", func() { cfg.ConnectTimeout = d.ConnectTimeout })
	set("first-byte-timeout", func() { cfg.FirstByteTimeout = d.FirstByteTimeout })
	set("idle-timeout", func() { cfg.IdleTimeout = d.IdleTimeout })
	set("scrape-interval", func() { cfg.ScrapeInterval = d.ScrapeInterval })
	set("shared-scrape-interval", func() { cfg.SharedScrapeInterval = d.SharedScrapeInterval })
	set("health-interval", func() { cfg.HealthInterval = d.HealthInterval })
	set("unhealthy-interval", func() { cfg.UnhealthyInterval = d.UnhealthyInterval })
	set("health-fail-open", func() { cfg.HealthFailOpen = d.HealthFailOpen })
	set("eject-after", func() { cfg.EjectAfter = d.EjectAfter })
	set("eject-backoff", func() { cfg.EjectBackoff = d.EjectBackoff })
	set("eject-max-backoff", func() { cfg.EjectMaxBackoff = d.EjectMaxBackoff })
	set("retry-connect-failures", func() { cfg.RetryConnectFailures = d.RetryConnectFailures })
	set("shutdown-grace", func() { cfg.ShutdownGrace = d.ShutdownGrace })
	set("tokenizer-agreement", func() { cfg.TokenizerAgreement = d.TokenizerAgreement })
	set("max-in-flight", func() { cfg.MaxInFlight = d.MaxInFlight })
	set("debug-public", func() { cfg.DebugPublic = d.DebugPublic })
	applyRouteFlags(fs, f.route, &cfg.Route, d.Route)
	applyEPPFlags(set, &cfg.EPP, &d.EPP)
	applyDiscoveryFlags(set, &cfg.Discovery, &d.Discovery)

	c, fc := &cfg.Cluster, &d.Cluster
	set("cluster", func() { c.Enabled = fc.Enabled })
	set("no-sync", func() { c.NoSync = fc.NoSync })
	set("cluster-name", func() { c.Name = fc.Name })
	set("node-id", func() { c.NodeID = fc.NodeID })
	set("cluster-profile", func() { c.Profile = fc.Profile })
	set("gossip-addr", func() { c.GossipAddr = fc.GossipAddr })
	set("advertise-addr", func() { c.AdvertiseAddr = fc.AdvertiseAddr })
	set("join", func() { c.Join, c.Enabled = fc.Join, true })
	set("gossip-key-file", func() { c.GossipKeyFile = fc.GossipKeyFile })
	set("nats-url", func() { c.NATSURL = fc.NATSURL })
	set("nats-client-addr", func() { c.NATSClientAddr = fc.NATSClientAddr })
	set("nats-cluster-addr", func() { c.NATSClusterAddr = fc.NATSClusterAddr })
	set("peer-addr", func() { c.PeerAddr = fc.PeerAddr })
	set("admin-addr", func() { c.AdminAddr = fc.AdminAddr })
	set("advertise-admin-addr", func() { c.AdvertiseAdminAddr = fc.AdvertiseAdminAddr })
	set("raft-addr", func() { c.RaftAddr = fc.RaftAddr })
	set("raft-advertise-addr", func() { c.RaftAdvertiseAddr = fc.RaftAdvertiseAddr })
	set("data-dir", func() { c.DataDir = fc.DataDir })
	set("bootstrap-expect", func() { c.BootstrapExpect, c.Enabled = fc.BootstrapExpect, true })
	set("admin-token", func() { c.AdminToken = fc.AdminToken })
	set("admin-token-file", func() { c.AdminTokenFile = fc.AdminTokenFile })
	set("admin-tls-cert", func() { c.AdminTLS.CertFile = fc.AdminTLS.CertFile })
	set("admin-tls-key", func() { c.AdminTLS.KeyFile = fc.AdminTLS.KeyFile })
	set("admin-tls-ca", func() { c.AdminTLS.CAFile = fc.AdminTLS.CAFile })
	set("raft-tls-cert", func() { c.RaftTLS.CertFile = fc.RaftTLS.CertFile })
	set("raft-tls-key", func() { c.RaftTLS.KeyFile = fc.RaftTLS.KeyFile })
	set("raft-tls-ca", func() { c.RaftTLS.CAFile = fc.RaftTLS.CAFile })
	set("peer-tls-cert", func() { c.PeerTLS.CertFile = fc.PeerTLS.CertFile })
	set("peer-tls-key", func() { c.PeerTLS.KeyFile = fc.PeerTLS.KeyFile })
	set("peer-tls-ca", func() { c.PeerTLS.CAFile = fc.PeerTLS.CAFile })
	set("peer-tls-server-name", func() { c.PeerTLSServerName = fc.PeerTLSServerName })
	applyClusterTrustFlags(set, c, fc)

	for _, spec := range f.replicas {
		r, model, err := node.ParseReplicaSpec(spec)
		if err != nil {
			return cfg, err
		}
		if model == "" {
			model = f.model
		}
		if model == "" {
			return cfg, fmt.Errorf("%w: --replica %q names no model: give --model or model=", node.ErrBadReplicaSpec, r.Name)
		}
		addReplica(&cfg, model, r)
	}
	discoveredModel(&cfg, f.model)
	if f.model != "" && len(f.replicas) == 0 && !hasModel(&cfg, f.model) {
		return cfg, fmt.Errorf("%w: --model %q has no --replica", node.ErrInvalidConfig, f.model)
	}
	return cfg, cfg.Validate()
}

func hasModel(cfg *node.Config, name string) bool {
	for _, m := range cfg.Models {
		if m.Name == name {
			return true
		}
	}
	return false
}

func addReplica(cfg *node.Config, model string, r node.ReplicaConfig) {
	for i := range cfg.Models {
		if cfg.Models[i].Name == model {
			cfg.Models[i].Replicas = append(cfg.Models[i].Replicas, r)
			return
		}
	}
	cfg.Models = append(cfg.Models, node.ModelConfig{Name: model, Replicas: []node.ReplicaConfig{r}})
}

func newLogger(level, format string, w io.Writer) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: %w", level, err)
	}
	opts := &slog.HandlerOptions{Level: l}
	// Dedup: components add their own context (component, replica) to
	// the logger they are given; each key appears once per line.
	switch format {
	case "text":
		return slog.New(logx.Dedup(slog.NewTextHandler(w, opts))), nil
	case "json":
		return slog.New(logx.Dedup(slog.NewJSONHandler(w, opts))), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", format)
}

// serve runs a Node until SIGINT/SIGTERM (or ctx ends), then shuts it down
// within ShutdownGrace.
func serve(ctx context.Context, cfg node.Config, logger *slog.Logger) error {
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()
	n, err := node.New(cfg, logger)
	if err != nil {
		return err
	}
	if src, err := kubeSource(&cfg, logger); err != nil {
		return err
	} else if src != nil {
		n.SetDiscoverySource(src)
	}
	if err := n.Start(ctx); err != nil {
		return err
	}
	<-ctx.Done()
	stop()
	logger.Info("shutting down", "grace", cfg.ShutdownGrace)
	sctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownGrace)
	defer cancel()
	if err := n.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}

func newExplainCmd() *cobra.Command {
	var addr, model, prompt, promptFile, strategy, session, token, tokenFile, path, bodyFile string
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "explain",
		Short: "Show how a gateway would route a prompt (per-replica match, load, score and the pick)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if path != "" {
				// Any routable path, with the request body it would get.
				var body []byte
				if bodyFile != "" {
					b, err := os.ReadFile(bodyFile)
					if err != nil {
						return err
					}
					body = b
				}
				tok, err := config.LoadToken(token, tokenFile)
				if err != nil {
					return err
				}
				q := "?path=" + url.QueryEscape(path)
				if model != "" {
					q += "&model=" + url.QueryEscape(model) // multipart endpoints
				}
				return explainRequest(cmd.Context(), cmd.OutOrStdout(), addr, q, body, strategy, session, tok, asJSON)
			}
			if promptFile != "" {
				b, err := os.ReadFile(promptFile)
				if err != nil {
					return err
				}
				prompt = string(b)
			}
			if model == "" || prompt == "" {
				return errors.New("explain needs --model and --prompt (or --prompt-file)")
			}
			tok, err := config.LoadToken(token, tokenFile)
			if err != nil {
				return err
			}
			return explain(cmd.Context(), cmd.OutOrStdout(), addr, model, prompt, strategy, session, tok, asJSON)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&addr, "addr", "127.0.0.1:8080", "gateway address (host:port or URL)")
	fl.StringVar(&model, "model", "", "model name")
	fl.StringVar(&prompt, "prompt", "", "prompt text")
	fl.StringVar(&promptFile, "prompt-file", "", "read the prompt from a file")
	fl.StringVar(&strategy, "strategy", "", "strategy to explain (default: the gateway's)")
	fl.StringVar(&session, "session", "", "session id (consistent-hash key)")
	fl.BoolVar(&asJSON, "json", false, "print the gateway's JSON report")
	fl.StringVar(&token, "token", "", "admin token for /debug/route (default $KVMESH_ADMIN_TOKEN, then --token-file)")
	fl.StringVar(&tokenFile, "token-file", "", "file holding the admin token")
	fl.StringVar(&path, "path", "", "explain a request to this endpoint (e.g. /v1/embeddings, /v1/responses/<id>) instead of a completions prompt")
	fl.StringVar(&bodyFile, "body-file", "", "with --path: the request body (JSON) the endpoint would get")
	return cmd
}

func explain(ctx context.Context, out io.Writer, addr, model, prompt, strategy, session, token string, asJSON bool) error {
	body, err := json.Marshal(map[string]string{"model": model, "prompt": prompt})
	if err != nil {
		return err
	}
	return explainRequest(ctx, out, addr, "", body, strategy, session, token, asJSON)
}

// explainRequest posts body to /debug/route with query and prints the
// report.
func explainRequest(ctx context.Context, out io.Writer, addr, query string, body []byte, strategy, session, token string, asJSON bool) error {
	if ctx == nil {
		ctx = context.Background()
	}
	base := addr
	if !strings.Contains(base, "://") {
		base = "http://" + base
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(base, "/")+"/debug/route"+query, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	if strategy != "" {
		req.Header.Set(node.HeaderStrategy, strategy)
	}
	if session != "" {
		req.Header.Set(node.HeaderSession, session)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		var uerr *url.Error
		if errors.As(err, &uerr) {
			err = uerr.Err // the URL is in the message below
		}
		return fmt.Errorf("no gateway reachable at %s (--addr; default 127.0.0.1:8080): %w", addr, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("gateway answered %s: %s", resp.Status, strings.TrimSpace(string(data)))
	}
	if asJSON {
		_, err := out.Write(data)
		return err
	}
	var rep struct {
		node.RouteReport
		Explanation *struct {
			ScoreUnit   string  `json:"score_unit"`
			Bound       float64 `json:"bound"`
			PrefixShare float64 `json:"prefix_share"`
			Units       float64 `json:"units_per_token"`
			TTFTTarget  float64 `json:"ttft_target_s"`
			TargetMiss  float64 `json:"target_miss_charge_s"`
			HeldFrom    string  `json:"held_from"`
			HeldWaiting int     `json:"held_waiting_replicas"`
			HotHolders  int     `json:"hot_holders"`
			HotNeeded   float64 `json:"hot_holders_needed"`
			CopiedFrom  string  `json:"copied_from"`
			Unseen      int     `json:"unseen_peer_requests"`
			Replicas    []struct {
				Name          string  `json:"name"`
				Matched       int     `json:"matched_blocks"`
				MatchFraction float64 `json:"match_fraction"`
				InFlight      int     `json:"in_flight"`
				LocalInFlight int     `json:"local_in_flight"`
				Running       int     `json:"running"`
				Waiting       int     `json:"waiting"`
				KVUsage       float64 `json:"kv_usage"`
				Queued        int     `json:"queued_prefill_tokens"`
				PeerQueued    int     `json:"peer_queued_prefill_tokens"`
				StepEndsIn    float64 `json:"step_ends_in_s"`
				EstimatedTTFT float64 `json:"estimated_ttft_s"`
				SlotWait      float64 `json:"slot_wait_s"`
				Capacity      int     `json:"capacity"`
				Score         float64 `json:"score"`
				Filtered      string  `json:"filtered"`
				Picked        bool    `json:"picked"`
			} `json:"replicas"`
		} `json:"explanation"`
	}
	if err := json.Unmarshal(data, &rep); err != nil {
		return fmt.Errorf("cannot read the gateway's report: %w", err)
	}
	if rep.Path != "" {
		fmt.Fprintf(out, "path %s", rep.Path)
		if rep.ResponseOwner != "" {
			fmt.Fprintf(out, "  stored response on %s", rep.ResponseOwner)
		}
		fmt.Fprintln(out)
	}
	fmt.Fprintf(out, "model %s  strategy %s  index %s  tokenizer %s  prompt %d tokens = %d blocks of %d  (hash %s)\n",
		rep.Model, rep.Strategy, rep.IndexMode, rep.Tokenizer, rep.PromptTokens, rep.TotalBlocks, rep.BlockSize, rep.PromptHash)
	if rep.Replicas != "" && rep.Replicas != "config" {
		fmt.Fprintf(out, "replicas from %s (discovery owns this model's replica list; the config's are ignored)\n", rep.Replicas)
	}
	if rep.Batch > 0 || rep.KeyedInPart {
		fmt.Fprintf(out, "keyed in part (batch of %d prompts keyed by the longest, media parts, or no prompt prefix)\n", rep.Batch)
	}
	if rep.Pick == "" {
		fmt.Fprintln(out, "no replica available")
	} else {
		fmt.Fprintf(out, "pick %s (%s)", rep.Pick, rep.Selection)
		if rep.EstimatedTTFT > 0 {
			fmt.Fprintf(out, "  estimated TTFT %.3fs", rep.EstimatedTTFT)
		}
		fmt.Fprintln(out)
	}
	if rep.Explanation != nil && rep.Explanation.PrefixShare > 0 {
		// cost: how much of the recent traffic carries this prefix (a
		// replica that would recompute what another holds is charged the
		// duplicate prefill unless the prefix needs more than one).
		fmt.Fprintf(out, "prefix share %.1f%% of this gateway's recent requests\n", 100*rep.Explanation.PrefixShare)
	}
	if e := rep.Explanation; e != nil && e.Units > 0 {
		// Character keys, converted to engine tokens (cost's token counts)
		// by the ratio learned from the engines' usage (4 until a stream
		// reports it).
		fmt.Fprintf(out, "keys are characters, %.2f a token (as the engines' usage shows; 4 until one reports it)\n", e.Units)
	}
	if e := rep.Explanation; e != nil && e.TTFTTarget > 0 {
		// cost: a replica estimated past the TTFT target pays a charge,
		// while this gateway sees every request on the replicas.
		if e.TargetMiss > 0 {
			fmt.Fprintf(out, "TTFT target %.3gs: a TTFT marked > misses it and adds %.3gs to the score\n", e.TTFTTarget, e.TargetMiss)
		} else {
			fmt.Fprintf(out, "TTFT target %.3gs: not charged (other senders' requests are on these replicas)\n", e.TTFTTarget)
		}
	}
	if e := rep.Explanation; e != nil && e.Unseen > 0 {
		// cost, with other senders: requests they sent that no load
		// figure here shows yet, which decide on the same stale view.
		fmt.Fprintf(out, "spread: %d requests of other senders estimated unseen (their load shows here late); this one took a random place of %d placed alike\n", e.Unseen, e.Unseen+1)
	}
	if e := rep.Explanation; e != nil && e.HotHolders > 0 {
		// cost, isolated: a hot prefix on fewer replicas than its
		// traffic needs, which the stale metrics cannot show full.
		p := 1 - float64(e.HotHolders)/e.HotNeeded
		replicas := "replicas"
		if e.HotHolders == 1 {
			replicas = "replica"
		}
		held := fmt.Sprintf("copy: the hot prefix is held by %d %s, fewer than the %.1f its share of the traffic needs", e.HotHolders, replicas, e.HotNeeded)
		if e.CopiedFrom != "" {
			fmt.Fprintf(out, "%s; this request started a copy instead of joining %s (chance %.0f%%)\n", held, e.CopiedFrom, 100*p)
		} else {
			fmt.Fprintf(out, "%s; this request stayed with them (a copy had a %.0f%% chance)\n", held, 100*p)
		}
	}
	if e := rep.Explanation; e != nil && e.HeldFrom != "" {
		// cost, isolated: the cheapest score was a recompute estimated
		// past the target, which spends a prefill for no SLO, or one
		// where at least half the replicas queue, whose estimate other
		// gateways' prompts overtake.
		why := "misses the TTFT target too"
		if e.HeldWaiting > 0 {
			why = fmt.Sprintf("requests wait at %d of %d replicas, so prefill is what they lack", e.HeldWaiting, len(e.Replicas))
		}
		fmt.Fprintf(out, "held: %s scored cheapest but would recompute the prompt and %s; other senders show only in the engines' metrics, so the request stays with the replicas holding its prefix\n", e.HeldFrom, why)
	}
	if rep.Explanation != nil {
		// The tiers come from the report (every strategy): MATCHED is
		// the GPU match routing uses, CPU and DISK the run after it that
		// the engine holds offloaded (cost prices it as a load).
		tiers := make(map[string]node.ReplicaTiers, len(rep.Tiers))
		for _, t := range rep.Tiers {
			tiers[t.Name] = t
		}
		tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		// SLOTS, SLOT-WAIT and TTFT are cost's: the running-set size it
		// assumed, the wait for a slot that puts on this request, and its
		// TTFT estimate (the score less the delay imposed on others).
		fmt.Fprintf(tw, "\nREPLICA\tMATCHED\tCPU\tDISK\tFRACTION\tINFLIGHT\tLOCAL\tRUNNING\tWAITING\tKV\tQUEUED\tPEER-QUEUED\tSTEP-ENDS\tSLOTS\tSLOT-WAIT\tTTFT\tSCORE(%s)\tFILTERED\tPICK\n", rep.Explanation.ScoreUnit)
		for _, r := range rep.Explanation.Replicas {
			pick := ""
			if r.Picked {
				pick = "*"
			}
			t := tiers[r.Name]
			step := "-" // no stream times the replica's step
			if r.StepEndsIn > 0 {
				step = fmt.Sprintf("%.0fms", 1000*r.StepEndsIn)
			}
			slots, slotWait, ttft := "-", "-", "-" // unknown size, no wait, or not cost
			if r.Capacity > 0 {
				slots = strconv.Itoa(r.Capacity)
			}
			if r.SlotWait > 0 {
				slotWait = fmt.Sprintf("%.3fs", r.SlotWait)
			}
			if r.EstimatedTTFT > 0 {
				ttft = fmt.Sprintf("%.3fs", r.EstimatedTTFT)
				if rep.Explanation.TargetMiss > 0 && r.EstimatedTTFT > rep.Explanation.TTFTTarget {
					ttft += ">"
				}
			}
			fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%.2f\t%d\t%d\t%d\t%d\t%.2f\t%d\t%d\t%s\t%s\t%s\t%s\t%.4g\t%s\t%s\n", r.Name, r.Matched, t.CPU, t.Disk, r.MatchFraction,
				r.InFlight, r.LocalInFlight, r.Running, r.Waiting, r.KVUsage, r.Queued, r.PeerQueued, step, slots, slotWait, ttft, r.Score, r.Filtered, pick)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if len(rep.Confirmed) > 0 {
		fmt.Fprint(out, "confirmed by KV events:")
		for _, c := range rep.Confirmed {
			fmt.Fprintf(out, " %s %d/%d", c.Name, c.Blocks, rep.TotalBlocks)
		}
		fmt.Fprintln(out)
	}
	for _, s := range rep.Suspect {
		fmt.Fprintf(out, "SUSPECT %s: %s on %d of %d recent responses; likely cause: %s\n", s.Replica, s.Reason, s.Failures, s.Samples, s.LikelyCause)
	}
	for _, a := range rep.Agreement {
		if a.Verdict == node.AgreementDisagree {
			fmt.Fprintf(out, "TOKENIZER %s: the gateway's %s tokenizer disagrees with the engine's /tokenize (probe %q: %d vs %d tokens)", a.Replica, a.Tokenizer, a.Probe, a.GatewayTokens, a.EngineTokens)
			if a.EngineTokenizes {
				fmt.Fprint(out, "; the model's prompts are tokenized by the engine")
			}
			fmt.Fprintln(out)
		}
	}
	if rep.FailOpen {
		fmt.Fprintln(out, "FAIL OPEN: no replica passes its health checks; the pick is among those failing them (health_fail_open)")
	}
	for _, u := range rep.Unavailable {
		fmt.Fprintf(out, "unavailable: %s", u.Name)
		if u.Down {
			fmt.Fprint(out, " (health check failing)")
		}
		if !u.Until.IsZero() {
			fmt.Fprintf(out, " (ejected until %s)", u.Until.Format(time.RFC3339))
		}
		fmt.Fprintln(out)
	}
	return nil
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run: func(cmd *cobra.Command, _ []string) {
			fmt.Fprintln(cmd.OutOrStdout(), buildinfo.String("kvmesh"))
		},
	}
}
