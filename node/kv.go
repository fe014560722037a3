package node

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/kvevents"
)

// kvHandler applies one replica's KV-event stream to the Node's index. The
// replica's subscriber calls it from one goroutine, so the replica's
// scratch buffer is never shared.
type kvHandler struct {
	n *Node
	r *replica
}

var _ kvevents.Handler = kvHandler{}

// newSubscriber builds (but does not start) r's KV-event subscriber when r
// has a source this Node ingests itself: every source in standalone mode;
// in cluster mode only those the cluster cannot move between gateways
// (kv_bind), since the owning gateway ingests the others for everyone
// (pushKVSources hands it every table's list).
func (n *Node) newSubscriber(r *replica) error {
	if !r.cfg.PublishesKVEvents() || n.clusterIngests(r) {
		return nil
	}
	sc := kvevents.DefaultSubscriberConfig()
	sc.Replica = r.name
	sc.Endpoint = r.cfg.KVEndpoint
	if r.cfg.KVBind != "" {
		sc.Endpoint, sc.Bind = r.cfg.KVBind, true
	}
	sc.ReplayEndpoint = r.cfg.ReplayEndpoint
	sub, err := kvevents.NewSubscriber(sc, kvHandler{n: n, r: r}, n.kvMetrics, n.log)
	if err != nil {
		return fmt.Errorf("%w: replica %s: %w", ErrInvalidConfig, r.name, err)
	}
	r.sub = sub
	return nil
}

// startKVEvents starts the subscribers of the current table; they run
// until stopKVEvents (or their replica leaves the table). Only a bind
// failure (kv_bind address in use) is an error: connecting happens in the
// background.
func (n *Node) startKVEvents(ctx context.Context) error {
	for _, r := range n.tbl.Load().replicas {
		if r.sub == nil {
			continue
		}
		if err := ctx.Err(); err != nil {
			n.stopKVEvents()
			return err
		}
		if err := r.sub.Start(n.bgCtx); err != nil {
			n.stopKVEvents()
			return fmt.Errorf("node: replica %s: KV events: %w", r.name, err)
		}
	}
	return nil
}

// stopKVEvents closes every subscriber of the current table and waits for
// it. Idempotent.
func (n *Node) stopKVEvents() {
	for _, r := range n.tbl.Load().replicas {
		if r.sub != nil {
			if err := r.sub.Close(); err != nil && !errors.Is(err, kvevents.ErrClosed) {
				n.log.Warn("closing KV-event subscriber", "replica", r.name, "err", err)
			}
		}
	}
}

// KVBindAddr is the resolved address of the replica's kv_bind socket after
// Start (so that kv_bind tcp://127.0.0.1:0 is usable), else its configured
// KV endpoint, else "" (also when the cluster ingests the replica).
func (n *Node) KVBindAddr(replica string) string {
	r, ok := n.tbl.Load().byName[replica]
	if !ok || r.sub == nil {
		return ""
	}
	return r.sub.Addr()
}

// HandleBatch implements kvevents.Handler. kvevents.Normalize filters
// the GPU tier, roots salted and LoRA chains under the request-side root
// and drops opaque (multimodal) blocks, and index.ApplyKV applies the
// result, exactly as a synced cluster's owner and its peers do.
func (h kvHandler) HandleBatch(_ string, _ kvevents.Seq, b *kvevents.Batch) {
	n, r := h.n, h.r
	r.kvBatch = kvevents.Normalize(n.hasher, r.model, b, r.kvBatch)
	rep := &r.kvReport
	n.index.ApplyKV(r.id, r.kvBatch, rep)
	for _, err := range rep.Errors {
		n.m.kvApplyErrors.WithLabelValues(r.name, applyErrorReason(err)).Inc()
		n.log.Debug("KV event not applied", "replica", r.name, "err", err)
	}
	if rep.ParentZero > 0 {
		n.kvMetrics.Tolerated.WithLabelValues(r.name, index.TolParentZero.String()).Add(float64(rep.ParentZero))
	}
}

// HandleReset implements kvevents.Handler: the replica's confirmed entries
// are no longer known, so they go, and so do its speculative ones (routing
// decisions the reset made false); history entries stay, since history mode
// deliberately knows nothing of engine state.
func (h kvHandler) HandleReset(name string, reason kvevents.ResetReason) {
	r := h.r
	removed := h.n.index.ClearReplica(r.id)
	h.n.log.Info("KV-event stream reset, confirmed and speculative entries dropped", "replica", name,
		"reason", reason.String(), "entries", removed)
}

func applyErrorReason(err error) string {
	switch {
	case errors.Is(err, index.ErrUnknownParent):
		return "unknown_parent"
	case errors.Is(err, index.ErrBlockSize):
		return "block_size"
	case errors.Is(err, index.ErrMalformedStored):
		return "malformed"
	case errors.Is(err, index.ErrNoRoot):
		return "no_root"
	case errors.Is(err, index.ErrGroup):
		return "group"
	}
	return "other"
}
