// Command kvmesh runs a kvmesh gateway and talks to one.
//
//	kvmesh serve --http-addr 127.0.0.1:8080 --model M \
//	    --replica a=http://127.0.0.1:8001 \
//	    --replica b=http://127.0.0.1:8002,kv=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558 \
//	    --index-mode hybrid --strategy cost
//	kvmesh explain --addr 127.0.0.1:8080 --model M --prompt "..."
//	kvmesh version
package main

import (
	"fmt"
	"os"
)

// version is set at build time with -ldflags "-X main.version=v1.2.3".
var version = "dev"

func main() {
	if err := newRootCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "kvmesh:", err)
		os.Exit(1)
	}
}
