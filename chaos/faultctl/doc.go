// Package faultctl runs chaos/faultproxy's links as a standalone service: a
// Manager holds named proxies (TCP relays and ZMQ PUB/SUB message relays)
// and the faults on each, and Handler serves a token-protected HTTP/JSON
// control API to create proxies and to add and remove faults at run time.
// kvmesh faultproxy is the command around it; Client is its Go client.
//
// The API (every route but /healthz needs "Authorization: Bearer TOKEN"):
//
//	GET    /healthz                            200 "ok"
//	GET    /v1/proxies                         every proxy with its faults and counters
//	POST   /v1/proxies                         {"name","kind":"tcp"|"zmq","listen","upstream"}
//	GET    /v1/proxies/{name}
//	DELETE /v1/proxies/{name}                  close it (its connections end)
//	POST   /v1/proxies/{name}/faults           add a fault (FaultSpec), 201 with its name
//	DELETE /v1/proxies/{name}/faults/{fault}   remove one fault
//	DELETE /v1/proxies/{name}/faults           remove every fault (heal)
//	POST   /v1/proxies/{name}/cut              close every open connection now (tcp)
//	POST   /v1/proxies/{name}/half-open        close the upstream side of every open
//	                                           connection, keep the client's (tcp)
//
// Faults on a TCP proxy, each on a direction (up: client to upstream, down:
// upstream to client, both: the default): latency (latency_ms, jitter_ms),
// bandwidth (rate_bytes_per_s), drop (a blackhole: bytes read are
// discarded); and link-wide: refuse (the listener closes; new connections
// are refused) and hold (new connections wait, neither forwarded nor
// closed). Cut and half-open are one-shot actions, not faults.
//
// Faults on a ZMQ proxy act on whole messages, ZMTP framing intact (see
// faultproxy.Relay): drop, duplicate, reorder (a message held and sent
// after the next), garble (payload replaced by random bytes). Each applies
// to a share of the messages (probability, default 1) and ends after count
// messages it acted on (0: never); several are tried in the order added and
// the first that fires decides a message's fate. Draws come from a PCG
// seeded by the fault's seed, so a run is reproducible for the same message
// sequence.
//
// Differences from Toxiproxy's proxies and toxics: faults are switched per
// direction with one fault of a type per direction (a second is refused,
// 409, rather than stacked); there is a message-level ZMQ relay, so a
// KV-event stream can lose, repeat or reorder whole batches instead of
// being corrupted mid-frame by byte-level toxics; count makes a fault
// end by itself (drop exactly three batches); half-open, refuse and hold
// model a vanished peer, a down host and a blackholed handshake, which
// Toxiproxy approximates with timeout and reset_peer toxics and by
// disabling a proxy; toxicity (Toxiproxy's per-connection probability) is
// not offered for TCP faults: they apply to every connection; the control
// API needs a bearer token (Toxiproxy's has none), and proxies can be
// given at start on the command line as well as created through the API.
package faultctl
