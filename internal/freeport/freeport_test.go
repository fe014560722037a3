package freeport

import (
	"net"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestPortsAreFreeDistinctAndBelowTheEphemeralRange binds every port handed
// out for TCP and UDP on both loopback IPs asked for.
func TestPortsAreFreeDistinctAndBelowTheEphemeralRange(t *testing.T) {
	ips := []string{"127.0.0.1", "127.0.0.2"}
	ps := Ports(t, 20, ips...)
	ps = append(ps, Ports(t, 20, ips...)...)
	seen := map[int]bool{}
	high := ephemeralLow()
	for _, p := range ps {
		require.False(t, seen[p], "port %d handed out twice", p)
		seen[p] = true
		require.GreaterOrEqual(t, p, low)
		require.Less(t, p, high, "below the ephemeral range")
		for _, ip := range ips {
			addr := net.JoinHostPort(ip, strconv.Itoa(p))
			l, err := net.Listen("tcp", addr)
			require.NoError(t, err)
			u, err := net.ListenPacket("udp", addr)
			require.NoError(t, err)
			_, _ = l.Close(), u.Close()
		}
	}
}

// TestTakenPortIsSkipped: a port in use is never handed out.
func TestTakenPortIsSkipped(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	taken := l.Addr().(*net.TCPAddr).Port
	require.False(t, free(taken, []string{"127.0.0.1"}))
}

// TestRefusingRefusesAndStaysTaken: connecting is refused, and no listener
// can bind the port while the test runs (a listener closed at once, as
// before, fails the second check).
func TestRefusingRefusesAndStaysTaken(t *testing.T) {
	addr := Refusing(t)
	_, err := net.Dial("tcp", addr)
	require.Error(t, err, "nothing listens on %s", addr)
	l, err := net.Listen("tcp", addr)
	if err == nil {
		l.Close()
	}
	require.Error(t, err, "%s stays taken", addr)
}
