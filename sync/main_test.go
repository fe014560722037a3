package sync

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/leaktest"
)

func TestMain(m *testing.M) {
	// zmq4's PUB writer goroutine outlives a closed socket (the engine
	// simulator's publisher); it is not ours and holds nothing of ours.
	leaktest.Main(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}
