package leaktest

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// TestAwaitWaitsForAGoroutineThatEndsLate: a goroutine that ends after
// goleak's own ~1 s of retries is not reported; one that outlives the
// grace is.
func TestAwaitWaitsForAGoroutineThatEndsLate(t *testing.T) {
	base := goleak.IgnoreCurrent()
	late := make(chan struct{})
	go func() {
		timer := time.NewTimer(2 * time.Second)
		defer timer.Stop()
		<-timer.C
		close(late)
	}()
	require.NoError(t, await(Grace, base))
	<-late

	stop := make(chan struct{})
	go func() { <-stop }()
	err := await(100*time.Millisecond, base)
	close(stop)
	require.Error(t, err, "a goroutine still running after the grace is a leak")
}
