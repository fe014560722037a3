package des

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvmesh/kvmesh/route"
	kvsync "github.com/kvmesh/kvmesh/sync"
)

// TestDefaultsFollowTheLoadInterval: how stale the cost model takes peers'
// load to be (route.DefaultPeerLoadDelaySeconds) and how stale the DES
// makes it (Options.LoadDelay) are both the interval at which gateways
// publish their load (sync.Config.LoadInterval); a change to one that
// forgets the others fails here.
func TestDefaultsFollowTheLoadInterval(t *testing.T) {
	interval := kvsync.DefaultConfig().LoadInterval
	require.Equal(t, interval, DefaultOptions().LoadDelay, "des.Options.LoadDelay")
	require.Equal(t, interval, time.Duration(route.DefaultPeerLoadDelaySeconds*float64(time.Second)), "route.DefaultPeerLoadDelaySeconds")
}
