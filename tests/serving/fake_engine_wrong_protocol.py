"""A stand-in engine process that speaks a future wire protocol: it connects like the real one,
sends EngineHello with PROTOCOL_VERSION + 1 and waits for the frontend's answer. Used to check
that a version mismatch is a clear error on both sides, not garbage."""

from __future__ import annotations

import sys

import msgspec
import zmq
from shoal.engine import wire

spec = msgspec.json.decode(sys.argv[1])
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.connect(spec["input_address"])
sock.send(msgspec.msgpack.encode(wire.EngineHello(wire.PROTOCOL_VERSION + 1, "9.9.9", 1, "fake")))
if sock.poll(30_000):
    tag, payload = sock.recv_multipart()
    ack = msgspec.msgpack.decode(payload, type=wire.HandshakeAck)
    print(f"fake engine: accepted={ack.accepted} reason={ack.reason}", file=sys.stderr)
sys.exit(3)
