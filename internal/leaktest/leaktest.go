// Package leaktest is a TestMain for packages whose goroutines end on their
// own a little after the code that owns them shut down: goleak's
// VerifyTestMain gives them about a second, which a loaded machine can
// exceed. Imported by tests only.
package leaktest

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Grace is how long Main waits for leftover goroutines to end. A
// memberlist probe in flight when its Memberlist shuts down, for one, only
// returns at its probe deadline (ProbeTimeout scaled by memberlist's health
// awareness, up to 8x), and the race detector on a busy 2-core machine
// stretches that further.
const Grace = 10 * time.Second

// Main runs the tests and, if they passed, fails the run unless every
// goroutine not matched by opts has ended within Grace. It calls os.Exit.
func Main(m *testing.M, opts ...goleak.Option) {
	code := m.Run()
	if code == 0 {
		if err := await(Grace, opts...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// await polls goleak.Find (which itself retries for about a second) until
// it finds nothing or within has passed, and returns its last error.
func await(within time.Duration, opts ...goleak.Option) error {
	deadline := time.Now().Add(within)
	for {
		err := goleak.Find(opts...)
		if err == nil || !time.Now().Before(deadline) {
			return err
		}
	}
}
