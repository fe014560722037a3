#!/usr/bin/env python3
"""A stand-in for vLLM's ZMQ KV-event publisher on libzmq (pyzmq), used by
kvevents' interop test to check the Go Subscriber against a real libzmq
PUB and ROUTER.

    vllm_like_publisher.py FORM REPLY COUNT

FORM is array | map | map-envelope (payload generation), REPLY is
with-topic | no-topic (replay reply frames). It binds PUB and ROUTER on
127.0.0.1 ephemeral ports, prints "PUB <addr>" and "ROUTER <addr>", then
publishes COUNT batches, seq 0..COUNT-1, one every 10 ms, with topic "kv".
Batch seq i stores one block with hash (1 << 63) + i and tokens
[i, i+1, i+2, i+3]. After seq 4 is sent it prints "SENT 5", so a consumer
started then must replay to see seq 0..4. It keeps answering replay requests until stdin closes.
"""
import select
import sys
import time

import msgpack
import zmq

form, reply, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
topic = b"kv"
END = (1 << 64) - 1


def batch(i):
    h, toks = (1 << 63) + i, [i, i + 1, i + 2, i + 3]
    if form == "array":
        ev = ["BlockStored", [h], None, toks, 4, None, "GPU", None]
        return [float(i), [ev]]
    ev = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
          "token_ids": toks, "block_size": 4, "lora_id": None, "medium": "GPU",
          "lora_name": None}
    if form == "map":
        return [float(i), [ev]]
    return {"ts": float(i), "events": [ev]}


ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub.bind("tcp://127.0.0.1:*")
router = ctx.socket(zmq.ROUTER)
router.bind("tcp://127.0.0.1:*")
print("PUB", pub.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
print("ROUTER", router.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)

buf = []
seq = 0
next_at = time.monotonic()
poller = zmq.Poller()
poller.register(router, zmq.POLLIN)
poller.register(sys.stdin.fileno(), zmq.POLLIN)
while True:
    for sock, _ in poller.poll(5):
        if sock == router:
            frames = router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            start = int.from_bytes(start, "big")
            for s, payload in buf:
                if s >= start:
                    head = [ident, b"", topic] if reply == "with-topic" else [ident, b""]
                    router.send_multipart(head + [s.to_bytes(8, "big"), payload])
            head = [ident, b"", topic] if reply == "with-topic" else [ident, b""]
            router.send_multipart(head + [END.to_bytes(8, "big"), b""])
        else:
            if not sys.stdin.buffer.read1(1):
                sys.exit(0)
    if seq < count and time.monotonic() >= next_at:
        payload = msgpack.packb(batch(seq), use_bin_type=True)
        pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        buf.append((seq, payload))
        seq += 1
        next_at += 0.01
        if seq == 5:
            print("SENT 5", flush=True)
