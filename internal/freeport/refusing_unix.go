//go:build unix

package freeport

import (
	"fmt"
	"syscall"
	"testing"
)

// Refusing returns a loopback address ("127.0.0.1:port") that refuses
// connections for the rest of the test: a replica URL that nobody serves.
// Its port is held by a socket bound to it but not listening, which makes
// connecting fail at once as at a closed port, while no listener of this
// process or another (":0" or named) can take the port before the test
// ends. A port from a listener closed at once is free again at once: under
// several concurrent CI runs a fake engine of another test bound one
// (ci360), and a gateway's own ":0" listener another (ci613, where the
// "dead" replica answered as a gateway's peer gRPC server).
func Refusing(t testing.TB) string {
	t.Helper()
	// Under ForkLock, as the net package does where SOCK_CLOEXEC is not
	// portable: a process started between the two calls (deploy's tests
	// start gateways concurrently) must not inherit the port.
	syscall.ForkLock.RLock()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err == nil {
		syscall.CloseOnExec(fd)
	}
	syscall.ForkLock.RUnlock()
	if err != nil {
		t.Fatalf("freeport: socket: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatalf("freeport: bind: %v", err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatalf("freeport: getsockname: %v", err)
	}
	return fmt.Sprintf("127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port)
}
