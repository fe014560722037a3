package faultproxy

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"syscall"
	"time"
)

// portHold keeps a refusing proxy's port bound without listening on it.
// With no listener the kernel answers a connection attempt with a reset,
// exactly as for a port nothing is bound to, but no other socket can take
// the port meanwhile: not another process's listener on :0, and not an
// outgoing connection's ephemeral source port, which on a busy machine is
// what made "listen again" fail with "address already in use".
type portHold struct{ fd int }

// holdPort binds a TCP socket to addr (an IP:port) without listening. The
// listener just closed on addr may take a moment to release it (Go closes
// the socket once its Accept returns), so an address in use is retried
// for up to a second.
func holdPort(addr string) (*portHold, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, err
	}
	family, sa := syscall.AF_INET, syscall.Sockaddr(nil)
	if a := ap.Addr().Unmap(); a.Is4() {
		sa = &syscall.SockaddrInet4{Port: int(ap.Port()), Addr: a.As4()}
	} else {
		family = syscall.AF_INET6
		sa = &syscall.SockaddrInet6{Port: int(ap.Port()), Addr: a.As16()}
	}
	fd, err := syscall.Socket(family, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	// As net.Listen does: connections of the old listener may be in
	// TIME_WAIT on this port.
	if err := syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1); err != nil {
		_ = syscall.Close(fd)
		return nil, os.NewSyscallError("setsockopt", err)
	}
	deadline := time.Now().Add(time.Second)
	for {
		err = syscall.Bind(fd, sa)
		if err == nil {
			return &portHold{fd: fd}, nil
		}
		if !errors.Is(err, syscall.EADDRINUSE) || time.Now().After(deadline) {
			_ = syscall.Close(fd)
			return nil, os.NewSyscallError("bind", err)
		}
		time.Sleep(5 * time.Millisecond) // retry with a bound: the old listener is closing
	}
}

// listen turns the held socket into a listener; the hold is spent either
// way.
func (h *portHold) listen() (net.Listener, error) {
	if err := syscall.Listen(h.fd, syscall.SOMAXCONN); err != nil {
		_ = syscall.Close(h.fd)
		return nil, os.NewSyscallError("listen", err)
	}
	f := os.NewFile(uintptr(h.fd), "faultproxy-listener")
	ln, err := net.FileListener(f) // a dup of the fd; f's copy closes below
	if cerr := f.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("listener from held socket: %w", err)
	}
	return ln, nil
}

// release gives the port up without listening.
func (h *portHold) release() error { return syscall.Close(h.fd) }
