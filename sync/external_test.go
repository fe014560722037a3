package sync

import (
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/index"
)

// TestExternalNATS runs two gateways against one standalone NATS server
// (Config.NATSURL) instead of embedded ones.
func TestExternalNATS(t *testing.T) {
	s, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, NoLog: true, NoSigs: true,
		MaxPayload: MaxMessageBytes})
	require.NoError(t, err)
	s.Start()
	require.True(t, s.ReadyForConnections(10*time.Second))
	t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })

	gws := startCluster(t, 2, nil, func(c *Config) { c.NATSURL = s.ClientURL() })
	for _, m := range gws[0].c.Members() {
		require.Empty(t, m.Meta.NATSRoute, "no embedded server to route to")
	}
	keys := decide(t, gws[1], 1, 2, index.History)
	require.Eventually(t, func() bool { return matchOn(gws[0], keys, 2, index.ModeHistory) == len(keys) },
		converge, 5*time.Millisecond)
	gws[1].load.set("r1", 5)
	require.Eventually(t, func() bool { return gws[0].c.InFlight("r1") == 5 }, converge, 5*time.Millisecond)
}
