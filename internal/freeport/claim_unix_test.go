//go:build unix

package freeport

import (
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A port Ports hands out is claimed for the test's duration against every
// other claim, this process's own second claim included (flock locks
// belong to the open file, so a second open conflicts as another
// process's would), and released when the test ends.
func TestPortsAreClaimedUntilTheTestEnds(t *testing.T) {
	var p int
	t.Run("holder", func(t *testing.T) {
		p = Ports(t, 1)[0]
		_, ok := claim(p)
		assert.False(t, ok, "port %d is claimed while the test that took it runs", p)
	})
	release, ok := claim(p)
	require.True(t, ok, "port %d is released when that test ends", p)
	_, again := claim(p)
	assert.False(t, again, "a claim excludes the next")
	release()
	release2, ok := claim(p)
	require.True(t, ok)
	release2()
	_, err := os.Stat(filepath.Join(os.TempDir(), "kvmesh-freeport", strconv.Itoa(p)))
	require.ErrorIs(t, err, os.ErrNotExist, "a released claim leaves no file behind")
}

// Many claims of one port at once, from goroutines (each claim opens the
// file on its own, so they exclude each other as processes do), taken and
// released over and over: at no time do two hold it, although releases
// remove the file that the others open.
func TestClaimExcludesAcrossRemovals(t *testing.T) {
	p := 1<<20 + os.Getpid() // a name no port and no other process uses
	var holders, taken atomic.Int32
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 300 {
				release, ok := claim(p)
				if !ok {
					continue
				}
				taken.Add(1)
				if n := holders.Add(1); n != 1 {
					t.Errorf("%d holders of one claim", n)
				}
				runtime.Gosched() // a holder does something with its port
				holders.Add(-1)
				release()
			}
		}()
	}
	wg.Wait()
	require.Positive(t, taken.Load())
}
