// Package scenarios is kvmesh's chaos suite: each scenario is a test that
// starts an in-process cluster (chaos/cluster), drives client load, injects
// one kind of fault, and checks the invariants after every step: no client
// request lost (a complete stream or an error the client sees), every
// gateway's confirmed index within bounds of the engines' true block sets
// and converged within a deadline.
//
// Each scenario logs one line of figures and the run ends with a table
// (printed by TestMain). Scenarios:
//
//	1 eviction      KV eviction pressure: precision >= 0.99 within 1 s
//	2 restart/reset engine restart (sequence rewind) and cache reset:
//	                entries dropped within 1 s, no stale affinity after
//	3 zmq           lost, duplicated and reordered KV-event batches, and
//	                a gap larger than the replay buffer: replayed or reset,
//	                the index converges
//	8 bad-input     malformed HTTP bodies and raw bytes to the gateway,
//	                garbled KV-event payloads, garbage on the engine's
//	                replay port: rejected, counted, nothing crashes
//
// The short form (go test -short ./chaos/scenarios) runs in CI in well under
// a minute. The long form runs more requests and rounds:
//
//	KVMESH_CHAOS_LONG=1 go test ./chaos/scenarios -run . -v
//	go test ./chaos/scenarios -v -args -long
//
// Every scenario waits by polling conditions with deadlines; nothing sleeps.
package scenarios
