// Package truth compares what a KV-event consumer believes an engine holds
// with what the engine really holds.
//
// The ground truth is the simulator's own block table (sim.Server.CachedBlocks):
// for every block the engine can reuse, its engine hash and the whole token
// chain that leads to it. FromBlocks turns that table into the kvmesh block
// keys a perfect consumer would hold in its confirmed ledger for the replica,
// computed from tokens with the consumer's own index.Hasher and root, so the
// comparison never relies on the engine's hash algorithm. When the engine
// block size is a multiple of the index block size, each engine block stands
// for its last BlockSize/IndexBlockTokens index blocks.
//
// Compare reads an index.Index's confirmed keys and engine hashes for one
// replica and reports set sizes, the intersection, precision (how much of what
// the index believes is true) and recall (how much of the truth the index
// knows), with a few example differences for diagnostics. Await polls a
// comparison until it satisfies a predicate or a deadline passes (no sleeps:
// a ticker paces the polls and the context bounds them).
//
// Applier is a reference kvevents.Handler that applies a replica's event
// stream to an index the way a gateway does (GPU tier only, stream resets
// clear the replica), for tests that run a bare Subscriber + Index.
//
// Everything here is for tests and the chaos suite: reading the truth and the
// index costs time proportional to their sizes and takes the index's read
// lock once per call.
package truth
