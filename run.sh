export KVMESH_ADMIN_TOKEN=devtoken              # operators' token (admin API)
export KVMESH_CLUSTER_KEY=$(kvmesh keygen)      # the gateways' shared secret
REPS="--model M --index-mode hybrid \
  --replica r1=http://127.0.0.1:18001,kv=tcp://127.0.0.1:15551,replay=tcp://127.0.0.1:15561 \
  --replica r2=http://127.0.0.1:18002,kv=tcp://127.0.0.1:15552,replay=tcp://127.0.0.1:15562"
gw() { n=$1 i=$2; shift 2; kvmesh serve --node-id gw-$n --cluster-profile local --bootstrap-expect 3 \
  --data-dir ./data-$n --http-addr 127.0.0.1:1808$i --gossip-addr 127.0.0.1:179${i}6 \
  --peer-addr 127.0.0.1:179${i}7 --admin-addr 127.0.0.1:179${i}8 --raft-addr 127.0.0.1:179${i}9 \
  --nats-client-addr 127.0.0.1:1422$i --nats-cluster-addr 127.0.0.1:1622$i $REPS "$@" > gw-$n.log 2>&1 & echo $! >> pids; }
gw a 1; gw b 2 --join 127.0.0.1:17916; gw c 3 --join 127.0.0.1:17916
for i in $(seq 1 100); do
  ok=0; for p in 18081 18082 18083; do curl -sf localhost:$p/ready >/dev/null && ok=$((ok+1)); done
  [ $ok = 3 ] && break; sleep 0.2
done
echo ready=$ok
kvmesh members --admin-addr 127.0.0.1:17918
kvmesh config patch '{"strategy":"cost"}' --admin-addr 127.0.0.1:17938   # any node; forwarded to the leader
