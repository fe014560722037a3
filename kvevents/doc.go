// Package kvevents speaks vLLM's KV-cache event protocol: the msgpack payloads
// (all three generations of the format), the ZMQ publisher with its replay
// ROUTER, and the subscriber that tracks sequence numbers, replays gaps and
// resets on rewinds. The engine simulator publishes through the same code that
// the gateway consumes with, so there is one implementation of the wire format.
package kvevents
