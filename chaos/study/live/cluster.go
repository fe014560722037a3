package live

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/kvmesh/kvmesh/index"
	"github.com/kvmesh/kvmesh/node"
)

// ErrNotConverged is returned when a cluster does not form, or its
// gateways' indexes do not agree, within Config.ClusterTimeout.
var ErrNotConverged = errors.New("live: gateways did not converge")

// poll calls cond every period until it returns "" (done), ctx ends or
// timeout passes; the last non-empty answer says what was missing.
func poll(ctx context.Context, timeout, period time.Duration, cond func() string) error {
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(period)
	defer tick.Stop()
	for {
		why := cond()
		if why == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w within %v: %s", ErrNotConverged, timeout, why)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: %w (%s)", ErrNotConverged, ctx.Err(), why)
		case <-tick.C:
		}
	}
}

// waitCluster waits until every gateway is ready (joined, index
// bootstrapped, raft config applied), sees every other one, and, when the
// engines publish KV events, each engine's stream has exactly one owner.
func (w *World) waitCluster(ctx context.Context) error {
	n := len(w.nodes)
	return poll(ctx, w.cfg.ClusterTimeout, 5*time.Millisecond, func() string {
		for _, g := range w.nodes {
			if !g.Ready() {
				return g.NodeID() + " not ready"
			}
			if m := len(g.Cluster().Members()); m != n {
				return fmt.Sprintf("%s sees %d of %d members", g.NodeID(), m, n)
			}
		}
		return w.ownersStable()
	})
}

// ownersStable returns "" when every engine's KV stream is ingested by
// exactly one gateway (or KV events are off).
func (w *World) ownersStable() string {
	if w.cfg.Mode == "history" {
		return ""
	}
	for _, r := range w.names {
		owners := 0
		for _, g := range w.nodes {
			if g.Cluster().OwnsKV(r) {
				owners++
			}
		}
		if owners != 1 {
			return fmt.Sprintf("engine %s has %d KV owners", r, owners)
		}
	}
	return ""
}

// eventsIn reports ("" when none) an engine whose KV owner has not yet
// applied every batch the engine published. Without it Settle could
// return while an engine's last events were still on the wire: every
// gateway would agree on a view that misses them (a busy machine delays
// the owner's subscriber, not the engine).
func (w *World) eventsIn() string {
	if w.cfg.Mode == "history" {
		return ""
	}
	for i, r := range w.names {
		published, ok := w.sims[i].KVPublished()
		if !ok {
			continue
		}
		for _, g := range w.nodes {
			if !g.Cluster().OwnsKV(r) {
				continue
			}
			if applied, ok := g.Cluster().KVApplied(r); !ok || applied < uint64(published) {
				return fmt.Sprintf("engine %s published batch %d, its owner %s has applied %d", r, published, g.NodeID(), applied)
			}
		}
	}
	return ""
}

// settledLedgers are the ledgers Settle compares. Speculative entries are
// left out: they expire after seconds on each gateway's own expiry tick,
// so peers legitimately disagree about them for a moment; the state a
// scenario establishes lives in history entries (history mode) and in the
// engines' confirmed blocks (KV events).
var settledLedgers = []index.Ledger{index.History, index.Confirmed}

// fingerprint summarises the set of keys replica holds in ledger l of g's
// index: count, sum and xor of the keys mixed. Equal sets give equal
// fingerprints; unequal sets collide with negligible probability.
type fingerprint struct {
	n        int
	sum, xor uint64
}

func mix(k uint64) uint64 { // splitmix64's finaliser
	k ^= k >> 30
	k *= 0xbf58476d1ce4e5b9
	k ^= k >> 27
	k *= 0x94d049bb133111eb
	return k ^ k>>31
}

func (w *World) fingerprint(g *node.Node, replica string, l index.Ledger, buf []index.BlockKey) (fingerprint, []index.BlockKey) {
	id, ok := g.ReplicaID(replica)
	if !ok {
		return fingerprint{n: -1}, buf
	}
	buf = g.Index().AppendReplicaKeys(buf[:0], id, l)
	f := fingerprint{n: len(buf)}
	for _, k := range buf {
		m := mix(uint64(k))
		f.sum += m
		f.xor ^= m
	}
	return f, buf
}

// Settle implements study.Settler. For a cluster it polls until every
// gateway's index holds exactly gateway 0's history and confirmed entries
// for every engine, and each engine's KV stream has one owner; isolated
// or single gateways need nothing. The study calls it on idle engines
// after the initialisation, which went through gateway 0 (whose index
// took its decisions synchronously) and straight to the engines.
func (w *World) Settle(ctx context.Context) error {
	if !w.cfg.Clustered() {
		return nil
	}
	var buf []index.BlockKey
	return poll(ctx, w.cfg.ClusterTimeout, w.cfg.SettlePoll, func() string {
		if why := w.ownersStable(); why != "" {
			return why
		}
		if why := w.eventsIn(); why != "" {
			return why
		}
		var diffs []string
		for _, r := range w.names {
			for _, l := range settledLedgers {
				var want fingerprint
				want, buf = w.fingerprint(w.nodes[0], r, l, buf)
				for _, g := range w.nodes[1:] {
					var got fingerprint
					got, buf = w.fingerprint(g, r, l, buf)
					if got != want {
						diffs = append(diffs, fmt.Sprintf("%s %s/%s: %d entries, gateway 0 has %d", g.NodeID(), r, l, got.n, want.n))
					}
				}
			}
		}
		if len(diffs) == 0 {
			return ""
		}
		// What a stall needs to be told apart: replication only flows, and
		// anti-entropy only repairs, while a gateway's NATS is up.
		return strings.Join(diffs, "; ") + " (" + w.busState() + ")"
	})
}

// busState says, per gateway, whether its NATS connection is up and which
// engines' KV streams it owns.
func (w *World) busState() string {
	parts := make([]string, 0, len(w.nodes))
	for _, g := range w.nodes {
		cl := g.Cluster()
		if cl == nil {
			continue
		}
		state := "NATS down"
		if cl.NATSConnected() {
			state = "NATS up"
		}
		var owns []string
		for _, r := range w.names {
			if cl.OwnsKV(r) {
				owns = append(owns, r)
			}
		}
		parts = append(parts, fmt.Sprintf("%s: %s, owns KV of [%s]", g.NodeID(), state, strings.Join(owns, " ")))
	}
	return strings.Join(parts, "; ")
}
