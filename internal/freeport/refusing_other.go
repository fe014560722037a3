//go:build !unix

package freeport

import (
	"strconv"
	"testing"
)

// Refusing returns a loopback address ("127.0.0.1:port") that refuses
// connections: a replica URL that nobody serves. Without Unix sockets'
// bind-without-listen it is a port from Ports, which no ":0" listener or
// dial is given, left unbound.
func Refusing(t testing.TB) string {
	t.Helper()
	return "127.0.0.1:" + strconv.Itoa(Ports(t, 1)[0])
}
