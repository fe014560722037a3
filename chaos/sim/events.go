package sim

import "github.com/kvmesh/kvmesh/kvevents"

// EventPublisher sends KV-event batches to consumers. *kvevents.Publisher
// implements it. The Server calls Publish from one goroutine at a time, in
// engine order, while holding its engine lock, so Publish must not block for
// long (queue and return). Close is called once, on Shutdown.
type EventPublisher interface {
	Publish(kvevents.Batch) (kvevents.Seq, error)
	Close() error
}
