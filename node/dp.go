package node

import (
	"fmt"
	"net"
	"net/url"
	"strconv"
)

// HeaderDataParallelRank is the request header vLLM reads to choose the
// data-parallel rank (engine core) that serves a request instead of its
// own load balancer: OpenAIServing._get_data_parallel_rank in
// vllm/entrypoints/openai reads "X-data-parallel-rank" as an int (HTTP
// header names are case-insensitive). The gateway sets it for a rank
// replica (ReplicaConfig.DataParallelSize > 1) and never forwards a
// client's own.
const HeaderDataParallelRank = "X-data-parallel-rank"

// MaxDataParallelSize bounds ReplicaConfig.DataParallelSize.
const MaxDataParallelSize = 256

// rankName is the name of rank r of the data-parallel replica name.
func rankName(name string, r int) string { return name + "#" + strconv.Itoa(r) }

// offsetPort returns a tcp:// ZMQ endpoint with its port raised by r, as
// vLLM's ZmqEventPublisher offsets the KV-event and replay endpoints of
// data-parallel rank r. Other transports are refused.
func offsetPort(endpoint string, r int) (string, error) {
	u, err := url.Parse(endpoint)
	if err != nil || u.Scheme != "tcp" {
		return "", fmt.Errorf("%w: data-parallel endpoint %q must be tcp://host:port", ErrInvalidConfig, endpoint)
	}
	host, port, err := net.SplitHostPort(u.Host)
	p, perr := strconv.Atoi(port)
	if err != nil || perr != nil || p+r > 65535 {
		return "", fmt.Errorf("%w: data-parallel endpoint %q needs a port (rank %d adds %d)", ErrInvalidConfig, endpoint, r, r)
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(p+r)), nil
}

// expandRanks returns rcs with each data-parallel replica (DataParallelSize
// N > 1) replaced by its N ranks: "name#0".."name#N-1", the same URL, the
// KV-event and replay endpoints offset by the rank (offsetPort), and
// DataParallelRank set. Each rank is then a replica of its own to the
// index (its own residency from its own event stream), the strategies and
// the proxy, which sends the request to the engine with
// HeaderDataParallelRank. Other replicas are returned as they are.
func expandRanks(rcs []ReplicaConfig) ([]ReplicaConfig, error) {
	n := 0
	for _, rc := range rcs {
		n += max(rc.DataParallelSize, 1)
	}
	if n == len(rcs) {
		return rcs, nil
	}
	out := make([]ReplicaConfig, 0, n)
	for _, rc := range rcs {
		if rc.DataParallelSize <= 1 {
			out = append(out, rc)
			continue
		}
		for r := range rc.DataParallelSize {
			x := rc
			x.Name, x.DataParallelRank = rankName(rc.Name, r), r
			var err error
			if x.KVEndpoint != "" {
				if x.KVEndpoint, err = offsetPort(rc.KVEndpoint, r); err != nil {
					return nil, err
				}
			}
			if x.ReplayEndpoint != "" {
				if x.ReplayEndpoint, err = offsetPort(rc.ReplayEndpoint, r); err != nil {
					return nil, err
				}
			}
			out = append(out, x)
		}
	}
	return out, nil
}
