// Command kvmesh runs a kvmesh gateway and talks to one.
//
//	kvmesh serve --http-addr 127.0.0.1:8080 --model M \
//	    --replica a=http://127.0.0.1:8001 \
//	    --replica b=http://127.0.0.1:8002,kv=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558 \
//	    --index-mode hybrid --strategy cost
//	kvmesh explain --addr 127.0.0.1:8080 --model M --prompt "..."
//	kvmesh doctor --addr 127.0.0.1:8080 [--addr ...]   # exits 1 on any failed check
//	kvmesh config get|set|patch|edit --admin-addr 127.0.0.1:7948
//	kvmesh members --admin-addr 127.0.0.1:7948
//	kvmesh version   # or kvmesh --version
//	kvmesh keygen > cluster.key     # the cluster key (--cluster-key-file)
//
// A three-gateway cluster on one machine (tokens from the environment):
//
//	export KVMESH_ADMIN_TOKEN=secret KVMESH_CLUSTER_KEY=$(kvmesh keygen)
//	kvmesh serve --node-id a --cluster --cluster-profile local --http-addr 127.0.0.1:8080 \
//	    --gossip-addr 127.0.0.1:7946 --nats-client-addr 127.0.0.1:4222 --nats-cluster-addr 127.0.0.1:6222 \
//	    --peer-addr 127.0.0.1:7947 --admin-addr 127.0.0.1:7948 --raft-addr 127.0.0.1:7949 \
//	    --data-dir /tmp/kvmesh-a --bootstrap-expect 3 --model M --replica r1=http://127.0.0.1:8001
//	# b and c: other ports and data dirs, plus --join 127.0.0.1:7946
package main

import (
	"fmt"
	"os"
)

func main() {
	if err := newRootCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "kvmesh:", err)
		os.Exit(1)
	}
}
