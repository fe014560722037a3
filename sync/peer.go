package sync

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvmesh/kvmesh/index"
	peerv1 "github.com/kvmesh/kvmesh/proto/peer/v1"
)

const (
	defaultChunkBytes = 1 << 20
	maxChunkBytes     = 4 << 20
	// maxSnapshotBytes bounds what a puller accepts (an index at its
	// 4M-entry default is a few hundred MB).
	maxSnapshotBytes = 16 << 30
)

// peerService serves index snapshots to peers.
type peerService struct {
	peerv1.UnimplementedPeerServer
	c *Cluster
}

var _ peerv1.PeerServer = (*peerService)(nil)

// Snapshot implements peerv1.PeerServer.
func (s *peerService) Snapshot(req *peerv1.SnapshotRequest, stream grpc.ServerStreamingServer[peerv1.SnapshotChunk]) error {
	c := s.c
	if req.GetCluster() != c.cfg.ClusterName {
		return status.Errorf(codes.FailedPrecondition, "%v: %q, this is %q", ErrWrongCluster, req.GetCluster(), c.cfg.ClusterName)
	}
	chunk := int(req.GetMaxChunkBytes())
	if chunk <= 0 {
		chunk = defaultChunkBytes
	}
	chunk = min(chunk, maxChunkBytes)
	data := c.snapshot()
	total := uint64(len(data))
	for off := 0; off < len(data) || off == 0; off += chunk {
		end := min(off+chunk, len(data))
		if err := stream.Send(&peerv1.SnapshotChunk{Data: data[off:end], Offset: uint64(off), TotalBytes: total}); err != nil {
			return err
		}
		if end == len(data) {
			break
		}
	}
	c.m.servedBytes.Add(float64(total))
	c.log.Debug("served snapshot", "to", req.GetRequester(), "bytes", total)
	return nil
}

// snapshot encodes the index with watermarks consistent with it: no peer
// delta is applied while it encodes (owner batches wait too).
func (c *Cluster) snapshot() []byte {
	c.ap.mu.Lock()
	defer c.ap.mu.Unlock()
	w := c.ap.watermarksLocked()
	// This gateway's own decisions are in its index without passing the
	// applier: its watermark is the last batch it published.
	w[srcDecisions+c.origin] = c.publishedSeq()
	return c.deps.Index.AppendSnapshot(nil, w, c.deps.Replicas.ReplicaName)
}

// pullSnapshot streams a peer's snapshot.
func (c *Cluster) pullSnapshot(ctx context.Context, addr string) ([]byte, error) {
	conn, err := grpc.NewClient(addr, c.sec.dialOptions()...)
	if err != nil {
		return nil, fmt.Errorf("sync: dial peer %s: %w", addr, err)
	}
	defer conn.Close()
	stream, err := peerv1.NewPeerClient(conn).Snapshot(ctx, &peerv1.SnapshotRequest{
		Cluster: c.cfg.ClusterName, Requester: c.cfg.NodeName, MaxChunkBytes: defaultChunkBytes})
	if err != nil {
		return nil, snapshotErr(addr, err)
	}
	var data []byte
	for {
		ch, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, snapshotErr(addr, err)
		}
		if ch.GetTotalBytes() > maxSnapshotBytes || ch.GetOffset() != uint64(len(data)) ||
			uint64(len(data)+len(ch.GetData())) > ch.GetTotalBytes() {
			return nil, fmt.Errorf("%w: snapshot chunk at %d of %d (have %d)", ErrMalformed, ch.GetOffset(), ch.GetTotalBytes(), len(data))
		}
		if data == nil {
			data = make([]byte, 0, ch.GetTotalBytes())
		}
		data = append(data, ch.GetData()...)
	}
	if len(data) == 0 || uint64(len(data)) != uint64(cap(data)) {
		return nil, fmt.Errorf("%w: snapshot from %s incomplete (%d bytes)", ErrMalformed, addr, len(data))
	}
	return data, nil
}

// snapshotErr wraps a pull's gRPC error; a refused token is
// ErrUnauthenticated.
func snapshotErr(addr string, err error) error {
	if status.Code(err) == codes.Unauthenticated {
		return fmt.Errorf("%w: snapshot from %s: %w", ErrUnauthenticated, addr, err)
	}
	return fmt.Errorf("sync: snapshot from %s: %w", addr, err)
}

// restoreFrom pulls a snapshot from peer and restores, selectively, what
// the peer has a newer view of: the applier buffers meanwhile, and applies
// what it buffered above the restored watermarks afterwards.
//
// An engine's confirmed entries (and engine map) are taken only when the
// peer's watermark for it is newer than this gateway's (applier.kvNewer),
// or when force names it (the peer owns it and checkKV found this
// gateway's view of it different at the same watermark);
// an engine this gateway owns is never taken from a peer except at
// bootstrap, since the owner ingests it directly and a peer's view can only
// be older (peers miss removals while NATS is down: KV batches are not
// gossiped). Every other engine's entries stay as they are here.
//
// History and speculative entries (routing decisions, which carry no
// per-origin ledger in the index) are taken at bootstrap, after a loss
// (decisions) and when the peer is ahead on another gateway's decision
// stream; this gateway's own decisions newer than the peer's watermark
// for it are then re-applied from the own ring.
func (c *Cluster) restoreFrom(ctx context.Context, peer Member, boot, decisions bool, force map[string]bool) error {
	start := time.Now()
	c.ap.beginBuffering()
	defer c.ap.endBuffering()
	data, err := c.pullSnapshot(ctx, peer.Meta.PeerAddr)
	if err != nil {
		return err
	}
	c.m.bootstrapBytes.Add(float64(len(data)))
	w, err := index.SnapshotWatermarks(data)
	if err != nil {
		return err
	}
	// Ownership is read before the applier lock: owners.reconcile holds its
	// lock while a subscriber's handler may wait for the applier's.
	owned := make(map[string]bool)
	if !boot {
		for k := range w {
			if r, ok := strings.CutPrefix(k, srcKV); ok && c.own.owned(r) {
				owned[r] = true
			}
		}
	}
	now := time.Now()
	c.ap.mu.Lock()
	takeKV := make(map[string]bool)
	takeID := make(map[index.ReplicaID]bool)
	for k := range w {
		if !strings.HasPrefix(k, srcKV) {
			continue
		}
		r := k[len(srcKV):]
		id, ok := c.deps.Replicas.ReplicaID(r)
		if !ok || owned[r] || !force[r] && !c.ap.kvNewerLocked(w, r) {
			continue
		}
		if reason := c.ap.kvWatermarkBadLocked(w, r, now); reason != "" {
			// A watermark no engine can have reached: keep our view (and
			// our watermark) of this engine rather than one bad value.
			c.m.kvRejected.WithLabelValues("snapshot", reason).Inc()
			c.log.Warn("peer snapshot watermark refused", "peer", peer.Name, "replica", r, "reason", reason)
			continue
		}
		takeKV[r], takeID[id] = true, true
	}
	if !decisions {
		for k, v := range w {
			if o, ok := strings.CutPrefix(k, srcDecisions); ok && o != c.origin {
				if st := c.ap.origins[o]; st == nil || v > st.base {
					decisions = true
					break
				}
			}
		}
	}
	take := func(r index.ReplicaID, l index.Ledger) bool {
		if l == index.Confirmed {
			return takeID[r]
		}
		return decisions
	}
	if _, err := c.deps.Index.Restore(data, c.deps.Replicas.ReplicaID,
		index.KeepReplicaSettings(), index.RestoreOnly(take)); err != nil {
		c.ap.mu.Unlock()
		return err
	}
	if c.deps.AfterRestore != nil {
		c.deps.AfterRestore()
	}
	c.ap.setWatermarksLocked(w, decisions, takeKV)
	if decisions {
		// Our own batches the peer had not applied when it encoded.
		mine := w[srcDecisions+c.origin]
		delete(c.ap.origins, c.origin)
		c.ring.after(mine, func(msg []byte) {
			if m, err := decodeMessage(msg); err == nil && m.Decisions != nil {
				c.ap.applyDecisionsLocked(m.Decisions, true)
			}
		})
	}
	c.ap.mu.Unlock()
	c.m.bootstrapSeconds.Observe(time.Since(start).Seconds())
	c.log.Info("index restored from peer", "peer", peer.Name, "bytes", len(data),
		"engines", len(takeKV), "decisions", decisions,
		"entries", c.deps.Index.Stats().TotalEntries(), "took", time.Since(start))
	return nil
}

// bootstrap restores from the first live peer that serves a snapshot.
func (c *Cluster) bootstrap(ctx context.Context) error {
	var lastErr error = ErrNoPeer
	for _, m := range c.ms.snapshot() {
		if m.Self || m.Meta.PeerAddr == "" || m.Meta.Leaving {
			continue
		}
		pctx, cancel := context.WithTimeout(ctx, c.cfg.BootstrapTimeout)
		err := c.restoreFrom(pctx, m, true, true, nil)
		cancel()
		if err == nil {
			c.m.bootstraps.WithLabelValues("ok").Inc()
			return nil
		}
		c.log.Warn("snapshot bootstrap from peer failed", "peer", m.Name, "err", err)
		lastErr = err
	}
	if lastErr == ErrNoPeer {
		c.m.bootstraps.WithLabelValues("no_peer").Inc()
	} else {
		c.m.bootstraps.WithLabelValues("error").Inc()
	}
	return lastErr
}
