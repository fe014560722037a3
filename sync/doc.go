// Package sync makes N kvmesh gateways behave like one: any gateway routes
// as well as a single gateway that saw every request and every KV event.
// It shares membership (hashicorp/memberlist), the prefix index (routing
// decision deltas and owner-normalized KV events over NATS, snapshots over
// gRPC) and a cluster-wide load view. Callers import it as kvsync (the
// name clashes with the standard library's sync).
//
// # Wiring (what node does)
//
// A gateway builds one Cluster next to its index:
//
//	cfg := kvsync.DefaultConfig() // or LocalConfig(name) on loopback
//	cfg.NodeName, cfg.Join = "gw-a", []string{"10.0.0.2:7946"}
//	cfg.KVSources = ...           // engines with a kv (connect) endpoint
//	c, err := kvsync.New(cfg, kvsync.Deps{
//		Index:        n.Index(),        // required
//		Replicas:     ids,              // required: name <-> ReplicaID, in node's order
//		Load:         loadSource{n},    // exact in-flight counts and queued prefill
//		AfterRestore: reapply,          // optional (restores keep local replica settings)
//		Registerer:   n.Registry(),     // kvmesh_sync_* metrics
//		KVMetrics:    kvMetrics,        // shared kvevents counters (optional)
//		Logger:       log,
//	})
//	err = c.Start(ctx)   // joins, bootstraps the index, returns
//	n.SetPeerLoad(c)     // c.InFlight satisfies node.PeerLoad, c.QueuedPrefill node.PeerQueuedPrefill
//	// on every routing decision, right after index.Record:
//	c.PublishDecision(replicaName, ledger, keys, now)
//	...
//	err = c.Shutdown(ctx) // graceful leave, then stop
//
// node/cluster.go is that wiring: its replica table implements Replicas
// and a LoadSource reads its replicas' in-flight atomics; it calls
// PublishDecision when it records a decision, and does not start its own
// kvevents subscribers for replicas listed in Config.KVSources (the
// cluster's owner ingests those for everyone; KVOwner and OwnsKV say who
// does), and hands the cluster the new list with SetKVSources whenever its
// table changes (a reload, engine discovery). Members and Changed satisfy the sync/config store's Membership
// contract after converting Member. Replicas with kv_bind (the engine's
// publisher connects to the gateway) cannot move between gateways: node
// keeps ingesting those itself, and they are not shared. Every gateway must
// configure the same replica names, model roots (index.SetReplicaRoot),
// hash seed and block size; they come from the raft config (sync/config).
//
// # Membership
//
// memberlist with DefaultLANConfig (Config.GossipProfile "lan") or
// DefaultLocalConfig ("local"), AES-GCM gossip encryption with the cluster
// key's derived gossip keys (Config.Trust; a keyring, so rotation works) or
// Config.SecretKey, seeds retried in the background while alone. Node
// metadata (NodeMeta; versioned, at most 512 bytes) carries the cluster
// name, gateway version, HTTP, peer gRPC, raft and admin addresses, the
// embedded NATS server's route URL and the index modes; members of another
// cluster are ignored. Events (join, update, leave, fail) are recorded
// under memberlist's lock without blocking and delivered to
// MemberListeners from the Cluster's own goroutine. A graceful Leave first
// gossips metadata with Leaving set and announces the leave to every member
// over memberlist's reliable channel, which is how peers tell a leave from
// a failure (memberlist's events do not say). Members declared failed are
// retried every ReconnectInterval for ReconnectTimeout, so both sides of a
// healed partition merge again (memberlist alone leaves each side holding
// the other dead). MemNetwork is an in-memory
// transport that can partition, for tests and the chaos suite.
//
// # NATS subjects
//
// Every subject is namespaced by the cluster name:
//
//	kvmesh.<cluster>.delta.decisions  routing-decision batches (every gateway)
//	kvmesh.<cluster>.kv.<replica>     one engine's normalized KV batches (its owner)
//	kvmesh.<cluster>.load.<node>      a gateway's in-flight counts (every LoadInterval)
//	kvmesh.<cluster>.queued.<node>    its queued prefill tokens (every LoadInterval
//	                                  while any, then once with none)
//	kvmesh.<cluster>.digest           anti-entropy digests (every DigestInterval)
//
// <replica> and <node> are the names with bytes other than [A-Za-z0-9_-]
// replaced by '_'; the real names travel in the payloads. By default each
// gateway embeds a nats-server (client port on loopback, route port for
// peers) and the embedded servers form a NATS cluster through routes to the
// route URLs the peers advertise in memberlist metadata (a live config
// reload adds and removes routes as members come and go; a member the
// failure detector declares dead keeps its route for 30 s, so a false
// verdict on a loaded host does not close a working connection and lose
// what is in flight on it). Config.NATSURL
// selects an external NATS cluster instead. Payloads are at most
// MaxMessageBytes (8 MiB; an external server's max_payload must allow it,
// or KV batches of very long prompts are dropped and counted).
//
// # Wire format
//
// All peer messages (NATS payloads and gossip user messages) share one
// binary, versioned format, documented field by field in wire.go:
// header 'K' 'M' version kind, then varints, fixed 8-byte keys and
// length-prefixed strings. decodeMessage checks every count against the
// bytes left before allocating, rejects trailing bytes, and never panics
// (FuzzDecodeDelta). Malformed messages are dropped and counted
// (kvmesh_sync_messages_malformed_total{source}). Because of that
// strictness a message's layout never grows: new information is a new
// kind on a subject that older gateways do not subscribe to (kind 5,
// queued prefill; TestLoadWireCompatible pins kind 3 to golden bytes of
// the previous release and decodes this release's reports with a frozen
// copy of its decoder).
//
// # Decision deltas
//
// PublishDecision copies the decision into a pending buffer (no allocation
// in steady state, never blocking); a flush goroutine publishes batches at
// most FlushInterval after the first decision or at once at FlushEntries.
// Each batch carries its origin "<node>#<incarnation>" and a per-origin
// sequence number from 1. Receivers ignore their own origin, apply each
// batch once (a 1024-batch window tolerates reordering between NATS and
// gossip, duplicates are dropped), record every decision with the origin's
// timestamp, and count seqs that fall out of the window unseen as a loss
// that triggers a repair. While the NATS connection is down, batches are
// split to fit one gossip packet, sent at once to every live member as a
// memberlist user message (UDP, encrypted with the gossip key) and queued
// in a memberlist TransmitLimitedQueue whose retransmits to random members
// cover lost packets (best effort: bounded retransmits, the queue pruned
// at 4096 messages); routing never waits for either. Load reports and
// digests are not gossiped (they are periodic and expire).
//
// # KV events
//
// Each engine in Config.KVSources (or the last SetKVSources) has exactly
// one owner: the live member with the highest rendezvous score
// xxh3(replica, seed=xxh3(member)), so only the engines of a departed
// member move, within memberlist's failure detection time (about a second
// with LocalConfig, a few seconds on the LAN profile; at once on a
// graceful leave). The owner runs the engine's
// kvevents.Subscriber (sequence tracking, replay, resets), normalizes each
// batch with kvevents.Normalize (GPU, offload tiers and KV-cache groups
// apart, see index.KVEvent; roots of LoRA and cache-salted sequences
// resolved from KVSource.Model;
// multimodal and other opaque blocks dropped; engine hashes and token ids
// kept), applies it to its own index and publishes it with the engine's
// sequence number and clock. A new owner resumes from its own view of the
// engine (kvevents.SubscriberConfig.Resume, the last batch it applied, when
// that view has no seq gap): the engine replays only what follows, and the
// subscriber resets the replica if the engine restarted since. Every
// gateway applies a replica's batches in seq order, idempotently: a seq at
// or below the last applied one is a duplicate (a replay that overlaps)
// unless the engine clock moved forward (the engine restarted while
// ownership moved), which clears the replica first.
// Resets clear the replica's confirmed entries everywhere.
//
// # Bootstrap, repair and load
//
// Start subscribes first (the applier buffers), joins, waits for the
// embedded server to route to every peer, pulls a snapshot from a live peer
// over the gRPC Peer service (proto/peer/v1; index.AppendSnapshot with the
// per-source watermarks "d/<origin>" and "kv/<replica>", encoded while no
// delta is applied, streamed in 1 MiB chunks), restores it, then applies the
// buffered deltas above the watermarks. Every DigestInterval each gateway
// publishes its watermarks; a gateway that stays behind a peer on a source
// for one interval, or that saw a loss, pulls a snapshot from the most
// advanced peer (at most once per RepairMinInterval, only while NATS is up)
// and re-applies its own recent batches the peer lacked. A repair is
// selective (index.RestoreOnly): an engine's confirmed entries are taken
// only when the peer's watermark for it is newer (later engine clock, or the
// same clock and a later seq), never for an engine this gateway owns
// (except at bootstrap), and every other engine's entries stay as they are
// here; history and speculative entries are taken at bootstrap, after a
// loss or when the peer is ahead on a decision stream. A gateway that
// applied an engine's batches across a seq gap (batches lost, e.g. while
// NATS was down) keeps applying them but advertises and snapshots the
// watermark from before the gap until a repair replaces its view, so its
// possibly stale view (lost removals) never passes for a newer one. One
// loss shows no gap: a gateway that knew nothing of an engine and missed
// the owner's first batches takes the next one as the stream's start, and
// its watermark then equals the owner's. So an owner's digest also
// carries, for one of its engines per interval, the fingerprint of its
// confirmed view (index.EngineFingerprint: the number of engine blocks and
// a hash of their set) with the watermark it was taken at; a peer whose
// view differed at that watermark counts it
// (kvmesh_sync_kv_diverged_total) and repairs from the owner, taking that
// engine's view whatever the watermarks say. The index keeps the
// fingerprint as blocks come and go, so each gateway records it after
// every batch it applies in sequence (the last 256 per engine): under a
// steady stream a peer is past the owner's watermark by the time the
// digest lands, and is compared with the view it had there. A peer whose view a reset
// emptied compares at the seq it last applied before the reset: an owner
// still at that seq never applied the reset, which came from a gateway
// that owned the engine for a moment only (memberlist took the owner for
// dead), and with the engine idle nothing else would restore the view.
// A digest also carries each engine's clock beside its watermark ("kvts/"
// + replica, as in snapshots), and a peer's lead on an engine counts only
// where a restore would take the peer's view: a peer that missed a reset
// this gateway applied advertises a higher seq at the same clock, and
// pulling its snapshot would take nothing, every repair interval for as
// long as the engine stays idle. (The stale view itself stays until the
// engine's next batch, which the stale gateway sees as a rewind or a gap.)
// These are extra digest sources ("kvts/",
// "kvat/", "kvn/", "kvsum/" + replica), which a previous release ignores.
// Load reports are
// kept per origin with the local receive time and summed into an immutable
// map; InFlight reads it without locks or allocation, and reports older
// than LoadTTL stop counting. A peer's reports stop counting at once when
// it leaves or is declared dead, and one that arrives after that (sent
// before it left) is dropped for a LoadTTL, or until the peer joins again.
// Queued prefill (uncached prompt tokens a peer
// sent a replica whose first byte has not come back; the DES's shared
// queued prefill) follows the same rules in its own map, read by
// QueuedPrefill (node.PeerQueuedPrefill, route.Candidate.
// PeerQueuedPrefillTokens). It travels as a separate message (kind 5 on
// the queued subject) rather than a field of the kind-3 load report,
// because the previous release's decoder rejects a longer report or a new
// wire version: kind 3 is unchanged, previous releases never subscribe to
// the queued subject, and a peer of the previous release counts as having
// no queued prefill. A report of all zeros is sent once when a gateway's
// queued prefill drains, so peers clear it within a LoadInterval; if that
// report is lost, LoadTTL expires the last one. A restore keeps this gateway's replica roots
// and publisher flags (index.KeepReplicaSettings).
//
// # Peer service security
//
// A snapshot is the whole index, so the peer port requires the cluster key:
// with Config.Trust it serves and dials mutual TLS under the cluster CA
// (package sync/trust), so a caller without the key fails the handshake
// (counted in kvmesh_sync_peer_unauthenticated_total and
// kvmesh_sync_peer_rejected_total{reason="handshake"}) before any call.
// Config.PeerToken, when set, is also required on every call as
// "authorization: Bearer <token>" (compared in constant time; refusals
// are codes.Unauthenticated, ErrUnauthenticated to the puller, counted in
// kvmesh_sync_peer_unauthenticated_total) and sent on every pull. All
// input the peer port refuses is counted in
// kvmesh_sync_peer_rejected_total{reason}: bad_preface (not an HTTP/2
// connection), handshake (a failed TLS handshake), malformed (a request
// that does not decode) and unauthenticated (sync/config's
// GuardedServerOptions and the token check);
// Config.PeerTLS (sync/config.TLSFiles) serves and dials over TLS, mutual
// when it names a CA, instead of the key's. Every gateway of a cluster uses
// the same token and TLS setting. With Config.Trust the embedded NATS
// server's route port requires the key's mutual TLS and a derived route
// password, its client port a derived token (kvmesh_sync_nats_rejected_total
// counts refusals), and gossip refuses packets not encrypted with a ring key
// (kvmesh_sync_gossip_rejected_total).
//
// # Trusting members less
//
// KV batches, resets and clears for an engine are applied only from the
// member that owns it in this gateway's view (or its previous owner for
// ownerGrace after a move), and only within bounds: a seq beyond
// kvSeqSlack plus kvMaxBatchRate per second since the last batch, or an
// engine clock more than kvMaxClockSkew ahead, is refused
// (kvmesh_sync_kv_rejected_total{source,reason}), and the owner's batch far
// below the watermark resets the view rather than being dropped as a
// duplicate. Snapshot and digest watermarks are checked with the same
// bounds.
//
// # Lifecycle and concurrency
//
// New validates and registers metrics; Start opens everything and returns
// once bootstrapped (ErrAlreadyStarted, ErrShutdown); Shutdown gossips the
// leave, stops owners, the peer service, NATS and every goroutine it
// started, then memberlist, and is idempotent. All exported methods are
// safe for concurrent use. Listeners are called from one goroutine.
package sync
