package scenarios

import (
	"flag"
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/chaos/cluster"
	"github.com/kvmesh/kvmesh/chaos/suite"
)

var longFlag = flag.Bool("long", false, "run the long, heavier form of every scenario (or KVMESH_CHAOS_LONG=1)")

// long reports whether the long form runs.
func long() bool { return *longFlag || os.Getenv("KVMESH_CHAOS_LONG") == "1" }

var report cluster.Report

var leakOpts = []goleak.Option{
	// Idle keep-alive connections of servers shut down by a scenario close
	// asynchronously.
	goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"),
	// zmq4 v0.17's PUB writer can miss its close signal and wait forever:
	// the library's goroutine, not ours (see chaos/sim).
	goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
	// zmq4 v0.17's SUB/DEALER reader sends each message into a 10-slot
	// channel without watching the socket's context: a socket closed while
	// that channel is full (an owner that stops ingesting a busy engine
	// when KV ownership moves, as after a partition heals) leaves it
	// blocked forever (only that send is ignored: its top frame). The
	// library's goroutine, not ours.
	goleak.IgnoreTopFunction("github.com/go-zeromq/zmq4.(*qreader).listen"),
}

func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	if rows := report.Rows(); len(rows) > 0 {
		mode := "short"
		if long() {
			mode = "long"
		}
		fmt.Printf("\nchaos suite (%s form)\n%s", mode, report.Table())
		for _, r := range rows {
			if r.Load.Lost != 0 {
				fmt.Printf("LOST REQUESTS in %s: %s\n", r.Scenario, r.Load)
				code = 1
			}
		}
	}
	if code == 0 {
		if err := goleak.Find(leakOpts...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// run runs the suite's scenario of that test name on t, in the form the
// flags chose, recording its rows in the package's report.
func run(t *testing.T) {
	sc, ok := suite.Lookup(t.Name())
	if !ok {
		t.Fatalf("no suite scenario for test %s", t.Name())
	}
	sc.Run(suite.NewR(t, suite.Size{Long: long()}, &report))
}
