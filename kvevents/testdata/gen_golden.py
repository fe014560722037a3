#!/usr/bin/env python3
"""Writes golden KV-event payloads for kvevents' decoder tests.

Each file is one batch as vLLM's msgspec encoder lays it out (msgpack-python
emits the same bytes for these types: compact ints, float64, str keys, bin for
bytes). Run from this directory with Debian's python3-msgpack:

    /usr/bin/python3 gen_golden.py

The Go test (golden_test.go) states the expected decoded values.
"""
import msgpack

HASH_BIG = (1 << 64) - 2  # needs uint64
HASH_NEG = -(1 << 62)  # old versions sent signed hashes
HASH_BYTES = bytes(range(32))  # sha256-style bytes hash
TOKENS = list(range(1000, 1032))

def stored_map(hashes, parent, tokens, extra=None):
    d = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
         "token_ids": tokens, "block_size": 16, "lora_id": None, "medium": "GPU",
         "lora_name": None}
    if extra:
        d.update(extra)
    return d

def write(name, obj):
    with open(name, "wb") as f:
        f.write(msgpack.packb(obj, use_bin_type=True))

# (a) array batch, tagged-array events, trailing defaults omitted
# (a BlockStored from before medium/lora_name existed, dp rank omitted).
write("golden_array_v0.9.msgpack", [
    1764400000.25,
    [["BlockStored", [HASH_NEG, 7], None, TOKENS, 16],
     ["BlockRemoved", [7], "GPU"],
     ["AllBlocksCleared"]],
])

# (b) v0.26: array batch, map events, dp rank present, extra_keys/group_idx set.
write("golden_map_v0.26.msgpack", [
    1764400001.5,
    [stored_map([HASH_BIG, HASH_BYTES], 42, TOKENS,
                {"extra_keys": [["salt-a"], None], "group_idx": 0}),
     {"type": "BlockRemoved", "block_hashes": [HASH_BIG], "medium": "GPU"},
     {"type": "SomeFutureEvent", "x": 1}],
    0,
])

# (c) newest: map batch with map events, future fields, dp rank omitted.
write("golden_map_envelope.msgpack", {
    "ts": 1764400002.75,
    "events": [stored_map([5, 6], None, TOKENS,
                          {"kv_cache_spec_kind": "full_attention",
                           "kv_cache_spec_sliding_window": None})],
})
