// Package kvevents speaks vLLM's KV-cache event protocol: the msgpack payloads
// (all three generations of the format), the ZMQ publisher with its replay
// ROUTER, and the subscriber that tracks sequence numbers, replays gaps and
// resets on rewinds. The engine simulator publishes through the same code that
// the gateway consumes with, so there is one implementation of the wire format.
//
// # Payloads
//
// Decoder reads, without being told which: (a) an array batch
// [ts, [events], dp_rank?] with tagged-array events ["BlockStored", f1, ...]
// whose trailing default fields may be omitted; (b) vLLM v0.26's array batch
// with map events {"type": "BlockStored", ...}; (c) the newest map batch
// {"ts", "events", "data_parallel_rank"}. Fields are vLLM's, in its struct
// order (BlockStored: block_hashes, parent_block_hash, token_ids, block_size,
// lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
// kv_cache_spec_sliding_window; later ones are skipped; BlockRemoved:
// block_hashes, medium, group_idx). Block hashes are opaque EngineHash values: integers bit-for-bit
// (negative int64 as two's complement), byte strings folded with
// xxh3.Hash. Unknown fields and event types are skipped without error (the
// ignored count says how many events); a payload that is not a batch wraps
// ErrMalformed, and a well-formed batch with no known event wraps
// ErrNoEvents: never a silent empty batch, never a panic (FuzzDecode). Token
// ids are delivered as they are: converting them to kvmesh block keys is the
// index's job.
//
// # Extra keys, cache salt, LoRA
//
// vLLM mixes per-block "extra keys" into its block hashes: the LoRA name
// (every block of a LoRA request), multimodal item keys, the request's
// cache_salt (only the block at token 0) and prompt-embedding hashes.
// Newer engines send them in BlockStored.extra_keys, one entry per block;
// the decoder summarizes them as CacheSalt (a parentless event's first
// block: the string besides the LoRA name) and OpaqueFrom (the first block
// with anything kvmesh cannot derive from a prompt's text). StoredForIndex
// and RemovedForIndex turn events into index input the way the gateway keys
// requests: GPU medium only, Root = Hasher.Root(model, lora_name,
// cache_salt) for a parentless salted or LoRA event, opaque blocks and
// everything after them dropped. Limits: an engine that does not send
// extra_keys (older vLLM) gives no salt, so its salted sequences are
// confirmed under the unsalted root and a salted request matches them only
// through speculative/history entries (LoRA still works through
// lora_name); multimodal and prompt-embedding blocks are never confirmed.
//
// Encoder writes any of the three forms (Encoding) the way msgspec does,
// including extra_keys (LoRA name, cache salt) when CacheSalt or
// HasExtraKeys is set.
//
// # Wire
//
// A message is [topic, seq (8-byte big-endian), payload], seq counting from 0
// per engine start. Replay: a DEALER sends ["", start_seq(8)]; the ROUTER sees
// [identity, "", start_seq] and answers every buffered batch with seq >=
// start_seq as [identity, "", (topic,) seq, payload] — with the topic frame
// in v0.26 (ReplayWithTopic), without in <= v0.25 (ReplayNoTopic) — then the
// end marker ReplayEnd with an empty payload. The Subscriber reads both.
//
// # Publisher
//
// Publisher is vLLM's ZmqEventPublisher: the PUB binds when its endpoint
// has "*" or "::" (or is ipc/inproc) and otherwise connects, redialling a
// consumer that restarts; Publish assigns seq 0, 1, 2, ... (from FirstSeq,
// 1 to act as llm-d-inference-sim), keeps the last
// BufferSteps payloads for replay and never blocks on subscribers.
//
// # Subscriber
//
// One Subscriber per engine replica. Its reader goroutine receives,
// decodes into pooled Batches and enqueues into a bounded queue; it never
// waits for the Handler. Its writer goroutine applies the sequence rules and
// calls the Handler in order:
//
//   - Catch-up on (re)connect: with a replay endpoint, as soon as the SUB
//     connects (a bound SUB: at Start and after its publisher went away,
//     since it cannot see the publisher connect) the writer replays from
//     0 (first connection, JoinReplay) or from the last delivered seq
//     (reconnect), and repeats that with the reconnect backoff until the
//     first live batch arrives. This covers an engine that published
//     before the subscriber connected, or while the subscription was still
//     on its way (ZMQ's slow joiner), and then went idle: no later seq
//     would ever reveal that gap. The replayed batch at the last delivered
//     seq is not delivered again but checked: if the engine holds another
//     batch there (another clock), it restarted and has already published
//     past the old seq, which no seq rule can tell from a gap:
//     HandleReset(ResetRewind), then a replay from 0 as on a join. Live
//     batches that repeat replayed ones are duplicates. Polls that find
//     nothing new are not counted in replays_total. Batches delivered
//     from any replay count in replayed_batches_total as well as
//     batches_total: the difference arrived live.
//   - Resume (SubscriberConfig.Resume, a gateway taking over an engine's
//     stream with a view that already holds it up to seq R): the
//     subscriber starts as if it had delivered R (with its clock) and then
//     reconnected, so its first catch-up replays from R with the check
//     above instead of the engine's whole buffer from 0.
//   - First batch of a stream (or after a reset): accepted at any seq. If
//     seq > 0, JoinReplay is on and a replay endpoint is configured, it first
//     replays from 0 to learn what the engine already cached (as far as its
//     buffer reaches; a partial join is not a reset: there was no state).
//   - Numbering from 1 (llm-d-inference-sim): a replay from 0 before
//     anything was delivered whose first answer is seq 1 lost nothing. It
//     counts as complete and in kvmesh_kvevents_tolerated_total{kind=
//     "replay_from_one"}, not as failed or partial. A first answer above 1
//     is still a partial replay. (A vLLM ring that dropped exactly seq 0
//     reads the same: at most one batch is missed unnoticed.)
//   - seq == last+1: delivered.
//   - Gap (seq > last+1): replay from last+1 through a DEALER; replayed
//     batches are delivered in order, live ones that queued meanwhile and
//     were already replayed are dropped as duplicates. If replay cannot
//     cover the gap (no endpoint, buffer rolled over, timeout):
//     HandleReset(ResetGapUnrecoverable), then delivery continues with what
//     replay did return and the live stream.
//   - Rewind (a live seq below the last live seq, e.g. 0 after an engine
//     restart, or equal to it on a new connection; or, when only a catch-up
//     delivered before, a first live seq on a new connection at or below
//     the last delivered one, unless the catch-up on that same connection
//     delivered batches, which it may repeat): HandleReset(ResetRewind),
//     then as a first batch.
//   - Same seq again: dropped and counted as a duplicate.
//   - Full queue: the reader drops batches and the writer, on reaching the
//     next batch that got through, calls HandleReset(ResetOverflow).
//   - A batch that fails to decode (ErrMalformed) is counted in
//     kvmesh_kvevents_malformed_total. Its events are not known, so it is
//     never skipped silently: with a replay endpoint the subscriber asks
//     once for that seq again (a copy damaged in transit decodes from the
//     engine's buffer) and delivers the replayed copy in order; if there is
//     no endpoint, the replay does not return the seq or the copy does not
//     decode either, HandleReset(ResetMalformed) (counted in
//     kvmesh_kvevents_resets_total{reason="malformed"}). Either way the
//     seq is consumed and the stream continues with the next batch.
//   - A well-formed batch without a known event (ErrNoEvents: an empty
//     list, or only event types this version does not know) consumes its
//     seq, is not passed on and is counted in
//     kvmesh_kvevents_no_event_batches_total (unknown events also in
//     ignored_events_total). That is no loss: the index tracks only the
//     three known kinds, so no reset.
//
// When the publisher goes away the reader redials with exponential backoff
// (a bound SUB just waits for the publisher to reconnect). Handler must not
// keep a *Batch after HandleBatch returns: batches are recycled.
//
// Parent 0: llm-d-inference-sim's legacy array format sends a chain's
// first block with parent_block_hash 0 instead of nil. index.ApplyStored
// (the one place every apply path reaches) takes it as a chain start when
// 0 names no block the replica's stream stored, and keeps the parent
// meaning when it does (an engine hash can be 0); the node counts it in
// kvmesh_kvevents_tolerated_total{kind="parent_zero"}.
//
// Known limits: without a replay endpoint, batches an engine published
// before the subscription reached it are lost to the subscriber, and if the
// engine then stays idle nothing reveals them (those blocks are never
// confirmed; the first later batch is accepted as a stream start, with no
// reset since there was no state). A restarted engine whose new seq has
// already passed the last seq seen before the restart is indistinguishable
// from a gap by seq alone (the replay then serves the new engine's batches
// without a reset);
// a publisher that vanishes without closing its TCP connection is not
// detected (zmq4 has no heartbeats).
package kvevents
