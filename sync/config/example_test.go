package config_test

import (
	"context"
	"log"
	"net"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/sync/config"
)

// Example shows how a gateway wires the store and the admin API: open the
// store, advertise its raft address, subscribe to applies, serve gRPC and
// HTTP, and stop in order. (Compiled, not run: it binds ports.)
func Example() {
	token, err := config.LoadToken("", "/var/lib/kvmesh/admin-token") // flag, else $KVMESH_ADMIN_TOKEN, else file
	if err != nil {
		log.Fatal(err)
	}
	adminLis, err := net.Listen("tcp", "10.0.0.5:9090")
	if err != nil {
		log.Fatal(err)
	}

	// The memberlist layer supplies members; a FuncMembership adapts it.
	var members []config.Member // filled from sync.Cluster.Members() in a real gateway
	mem := config.NewFuncMembership(func() []config.Member { return members })

	seed := config.DefaultRoutingConfig() // from flags/YAML: used only if the cluster has no config yet
	seed.Models["qwen"] = config.ModelConfig{Replicas: []config.ReplicaConfig{{Name: "e0", URL: "http://10.0.1.1:8000"}}}

	cfg := config.DefaultStoreConfig()
	cfg.NodeID = "gw-a"
	cfg.DataDir = "/var/lib/kvmesh"
	cfg.RaftBindAddr = "10.0.0.5:9301"
	cfg.BootstrapExpect = 3
	cfg.Membership = mem
	cfg.Seed = &seed
	cfg.Forward = config.ClientOptions{Token: token}
	cfg.Registerer = prometheus.DefaultRegisterer
	store, err := config.Open(cfg)
	if err != nil {
		log.Fatal(err)
	}
	// Advertise store.RaftAddr() and adminLis.Addr() in the node metadata,
	// then call mem.Notify() on every membership event.

	cancel := store.OnApply(func(v *config.Versioned) {
		// Build a new router from v.Config and swap it in atomically.
		_ = v.Config.Route()
	})
	defer cancel()

	srv, err := config.NewServer(store, config.ServerConfig{Token: token /* Index, Explainer, Snapshotter: node's providers */})
	if err != nil {
		log.Fatal(err)
	}
	gs, err := config.NewGRPCServer(srv, config.TLSFiles{})
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = gs.Serve(adminLis) }()
	mux := http.NewServeMux()
	mux.Handle("/admin/", srv.Handler())

	// A write from any node: forwarded to the leader, returns the version.
	if _, err := store.Patch(context.Background(), []byte(`{"prefix_cache":{"imbalance_abs_count":8}}`), nil); err != nil {
		log.Print(err) // ErrNoQuorum in a minority partition
	}

	// Shutdown order: leadership away, stop serving, then the store.
	_ = store.Leave()
	gs.GracefulStop()
	_ = store.Shutdown()
}
