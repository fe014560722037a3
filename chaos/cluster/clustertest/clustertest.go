// Package clustertest starts a chaos/cluster Cluster for a test and shuts
// it down when the test ends.
package clustertest

import (
	"context"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/chaos/cluster"
)

// ShutdownTimeout bounds the cleanup's Cluster.Shutdown.
const ShutdownTimeout = 20 * time.Second

// Start starts cfg's cluster (with DataDir in a fresh t.TempDir when cfg
// runs in cluster mode without one) and registers its shutdown as a
// cleanup that fails t if it errs. It fails t at once when the cluster
// does not start.
func Start(t testing.TB, cfg cluster.Config) *cluster.Cluster {
	t.Helper()
	if cfg.ClusterMode && cfg.DataDir == "" {
		cfg.DataDir = t.TempDir()
	}
	c, err := cluster.Start(context.Background(), cfg)
	if err != nil {
		t.Fatalf("starting the cluster: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), ShutdownTimeout)
		defer cancel()
		if err := c.Shutdown(ctx); err != nil {
			t.Errorf("shutting the cluster down: %v", err)
		}
	})
	return c
}

// Partitionable is cluster.DefaultConfig with gateways gateways and
// engines engines in cluster mode, on an external NATS server, with every
// gateway's gossip, raft and NATS links behind fault points that
// Cluster.Partition, Isolate and Heal cut and mend.
func Partitionable(gateways, engines int) cluster.Config {
	cfg := cluster.DefaultConfig()
	cfg.Gateways, cfg.Engines = gateways, engines
	cfg.ClusterMode, cfg.ExternalNATS, cfg.Partitionable = true, true, true
	return cfg
}
