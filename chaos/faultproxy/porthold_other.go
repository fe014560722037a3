//go:build !linux

package faultproxy

import (
	"errors"
	"net"
)

// portHold is Linux-only; elsewhere a refusing proxy closes its listener
// and binds the address again when it stops refusing.
type portHold struct{}

var errNoPortHold = errors.New("faultproxy: holding a port is not supported on this platform")

func holdPort(string) (*portHold, error)        { return nil, errNoPortHold }
func (*portHold) listen() (net.Listener, error) { return nil, errNoPortHold }
func (*portHold) release() error                { return nil }
