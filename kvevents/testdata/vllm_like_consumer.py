#!/usr/bin/env python3
"""A libzmq (pyzmq) consumer of a kvevents Publisher, used by kvevents'
interop test: it connects a SUB to PUB_ADDR, waits for one live message,
then asks the ROUTER at REPLAY_ADDR for everything from seq 0 through a
DEALER, exactly as vLLM's consumers do, and prints one line per frame set:

    live <frames> <seq> <payload as JSON>
    replay <frames> <seq> <payload as JSON or "">

ending after the replay end marker.

    vllm_like_consumer.py PUB_ADDR REPLAY_ADDR
"""
import json
import sys

import msgpack
import zmq

ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
if not sub.poll(10000):
    sys.exit("no live message")
frames = sub.recv_multipart()
seq = int.from_bytes(frames[1], "big")
print("live", len(frames), seq, json.dumps(msgpack.unpackb(frames[2])), flush=True)

dealer = ctx.socket(zmq.DEALER)
dealer.connect(sys.argv[2])
dealer.send_multipart([b"", (0).to_bytes(8, "big")])
while True:
    if not dealer.poll(10000):
        sys.exit("replay timed out")
    frames = dealer.recv_multipart()
    seq = int.from_bytes(frames[-2], "big")
    body = frames[-1]
    print("replay", len(frames), seq, json.dumps(msgpack.unpackb(body)) if body else '""', flush=True)
    if seq == (1 << 64) - 1:
        break
