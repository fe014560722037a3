// Package freeport finds ports for tests that must name an address before
// the process that binds it starts (separate processes, engines addressed
// by several gateways, the same port on several loopback IPs).
//
// A port taken from a ":0" listener and closed again comes from the
// kernel's ephemeral range, which the kernel also hands out as the source
// port of outgoing connections: on a busy machine, between the test's
// choice and the bind, another test's dial takes it ("address already in
// use"). These ports come from below that range instead, chosen at random
// and checked free for TCP and UDP (memberlist binds both) on every IP
// asked for; no dial or ":0" listener is ever given one. Two processes
// could still pick the same port and both find it free before either's
// child binds it (ci692: a vllmsim child of one of three concurrent
// .ci/run found its port taken), so on Unix each port is also claimed for
// the test's duration with a lock file that every process using this
// package honours (claim).
package freeport

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// low is the lowest port handed out: above the well-known and commonly
// registered services' ports.
const low = 20000

var (
	mu    sync.Mutex
	given = map[int]bool{} // ports this process handed out already
)

// Ports returns n distinct ports free for TCP and UDP on every one of ips
// (127.0.0.1 when none is given), below the kernel's ephemeral port range.
// It fails the test when it cannot find them.
func Ports(t testing.TB, n int, ips ...string) []int {
	t.Helper()
	ps, releases, err := find(n, ips)
	t.Cleanup(func() {
		for _, r := range releases {
			r()
		}
	})
	if err != nil {
		t.Fatalf("freeport: %v", err)
	}
	return ps
}

// find returns n ports and the releases of their claims.
func find(n int, ips []string) ([]int, []func(), error) {
	if len(ips) == 0 {
		ips = []string{"127.0.0.1"}
	}
	high := ephemeralLow()
	if high-low < 1000 {
		return nil, nil, fmt.Errorf("ephemeral port range starts at %d: too little room below it", high)
	}
	mu.Lock()
	defer mu.Unlock()
	var out []int
	var releases []func()
	for tries := 0; len(out) < n; tries++ {
		if tries > 100*n+1000 {
			return out, releases, fmt.Errorf("found %d of %d free ports in [%d, %d)", len(out), n, low, high)
		}
		p := low + rand.IntN(high-low)
		if given[p] {
			continue
		}
		release, ok := claim(p)
		if !ok {
			continue // another process's
		}
		if !free(p, ips) {
			release()
			continue
		}
		given[p] = true
		out = append(out, p)
		releases = append(releases, release)
	}
	return out, releases, nil
}

// free reports whether p can be bound for TCP and UDP on every ip.
func free(p int, ips []string) bool {
	var closers []func() error
	defer func() {
		for _, c := range closers {
			_ = c()
		}
	}()
	for _, ip := range ips {
		addr := net.JoinHostPort(ip, strconv.Itoa(p))
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return false
		}
		closers = append(closers, l.Close)
		u, err := net.ListenPacket("udp", addr)
		if err != nil {
			return false
		}
		closers = append(closers, u.Close)
	}
	return true
}

// ephemeralLow is the lowest port of the kernel's ephemeral range: Linux's
// ip_local_port_range, or IANA's 49152 elsewhere.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if errors.Is(err, os.ErrNotExist) {
		return 49152
	}
	if f := strings.Fields(string(b)); err == nil && len(f) > 0 {
		if v, err := strconv.Atoi(f[0]); err == nil {
			return v
		}
	}
	return 32768 // Linux's default, when the file cannot be read
}
