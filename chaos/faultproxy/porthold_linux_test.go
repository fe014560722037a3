package faultproxy

import (
	"fmt"
	"net"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRefusingProxyHoldsItsPort: while refusing, the proxy's port stays
// bound to a socket of its own (so that no outgoing connection's ephemeral
// port or :0 listener takes it and "listen again" cannot fail), and the
// same socket becomes the listener again.
func TestRefusingProxyHoldsItsPort(t *testing.T) {
	echo, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = echo.Close() })
	cfg := DefaultConfig()
	cfg.Target = echo.Addr().String()
	p, err := New(cfg)
	require.NoError(t, err)
	require.NoError(t, p.Start())
	t.Cleanup(func() { _ = p.Close() })
	_, port, err := net.SplitHostPort(p.Addr())
	require.NoError(t, err)

	for range 3 {
		require.NoError(t, p.SetRefuse(true))
		p.mu.Lock()
		h := p.hold
		var sa syscall.Sockaddr
		if h != nil {
			sa, err = syscall.Getsockname(h.fd)
		}
		p.mu.Unlock()
		require.NotNil(t, h, "the port is held while refusing")
		require.NoError(t, err)
		require.Equal(t, port, fmt.Sprint(sa.(*syscall.SockaddrInet4).Port))
		_, err = net.Dial("tcp", p.Addr())
		require.ErrorIs(t, err, syscall.ECONNREFUSED)

		require.NoError(t, p.SetRefuse(false))
		c, err := net.Dial("tcp", p.Addr())
		require.NoError(t, err, "the held socket listens again")
		_ = c.Close()
	}
}
