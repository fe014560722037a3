//go:build unix

package freeport

import (
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
}
