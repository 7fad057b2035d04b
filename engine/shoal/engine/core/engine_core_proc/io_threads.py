"""The engine process's two socket threads, and the queues they share with the busy loop.

Each socket has one owner thread and nothing else touches it (ZeroMQ sockets are not
thread-safe):
- input thread: the DEALER socket, connected to the frontend's ROUTER. It sends EngineHello,
  takes the HandshakeAck, then decodes ADD / ABORT / UTILITY frames into `Channels.input`. An
  ABORT also goes to `Channels.aborts` and into the EngineCore's own queue, so the busy loop
  applies it right after the forward pass now running, before that step's outputs are sent.
- output thread: the PUSH socket, connected to the frontend's PULL. It msgpack-encodes batches
  into a few reused buffers, tracked by zmq MessageTrackers until ZeroMQ is done with them, and
  sends the two-frame notices ([wire.ENGINE_CORE_READY | DEAD | STOPPED][struct]).
"""

from __future__ import annotations

import os
import queue
import socket as _socket
import threading
from collections import deque
from typing import Any

import msgspec
import zmq
from shoal.engine import __version__ as ENGINE_VERSION
from shoal.engine import wire
from shoal.engine.codec import MsgpackDecoder, MsgpackEncoder
from shoal.engine.wire import PROTOCOL_VERSION, EngineCoreRequest, RequestType, UtilityCall

MAX_REUSE_BUFFERS = 4
# The output queue's kind for a step's OutputBatch; a notice's kind is its wire constant.
BATCH = b""
NOTICES = (wire.ENGINE_CORE_READY, wire.ENGINE_CORE_DEAD, wire.ENGINE_CORE_STOPPED)


class Channels:
    """What the IO threads and the busy loop share: queues, and the handshake's answer."""

    def __init__(self) -> None:
        self.input: queue.Queue = queue.Queue()  # (RequestType, payload) for the busy loop
        self.aborts: queue.Queue = queue.Queue()  # id lists, applied after the forward pass
        self.output: queue.Queue = queue.Queue()  # (BATCH or a notice, struct); None ends it
        self.ack_event = threading.Event()
        self.ack: wire.HandshakeAck | None = None
        self.io_error: BaseException | None = None
        self.engine_core: Any = None  # set once built: ABORTs reach its queue directly

    def send(self, kind: bytes, obj: Any) -> None:
        self.output.put((kind, obj))

    def close_output(self) -> None:
        self.output.put(None)


def input_loop(ctx: zmq.Context, address: str, engine_index: int, rank: int,
               ch: Channels) -> None:
    """The input thread's body; a failure wakes the busy loop, which dies of it."""
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, engine_index.to_bytes(2, "little"))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        hello = wire.EngineHello(PROTOCOL_VERSION, ENGINE_VERSION, os.getpid(),
                                 _socket.gethostname(), engine_index, rank)
        sock.send(msgspec.msgpack.encode(hello))
        decoders = {RequestType.ADD: MsgpackDecoder(EngineCoreRequest),
                    RequestType.ABORT: MsgpackDecoder(list[str]),
                    RequestType.UTILITY: MsgpackDecoder(UtilityCall),
                    RequestType.HANDSHAKE: MsgpackDecoder(wire.HandshakeAck)}
        while True:
            frames = sock.recv_multipart(copy=False)
            tag = RequestType(bytes(frames[0].buffer))
            decoder = decoders.get(tag)
            if decoder is None:  # an engine-internal tag: never sent by a client
                continue
            body = decoder.decode(frames[1:])
            if tag == RequestType.HANDSHAKE:
                ch.ack = body
                ch.ack_event.set()
                continue
            if tag == RequestType.ABORT:
                core = ch.engine_core
                if core is not None:  # applied right after the forward pass now running
                    core.enqueue_aborts(body)
                ch.aborts.put(body)
            ch.input.put((tag, body))
    except Exception as exc:  # noqa: BLE001 - a broken input thread must kill the engine
        ch.io_error = exc
        ch.ack_event.set()
        ch.input.put((RequestType.EXECUTOR_FAILED,
                      f"input thread failed: {type(exc).__name__}: {exc}"))


def output_loop(ctx: zmq.Context, address: str, ch: Channels) -> None:
    """The output thread's body: until the None that ends the queue."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(address)
    encoder = MsgpackEncoder()
    reuse: list[bytearray] = []
    pending: deque = deque()  # (tracker, buffer) still owned by ZeroMQ, oldest at the right
    while True:
        item = ch.output.get()
        if item is None:
            sock.close(linger=5000)
            return
        kind, obj = item
        while pending and pending[-1][0].done:
            buf = pending.pop()[1]
            if len(reuse) < MAX_REUSE_BUFFERS:
                reuse.append(buf)
        if kind != BATCH:
            sock.send_multipart([kind, msgspec.msgpack.encode(obj)])
            continue
        buf = reuse.pop() if reuse else bytearray()
        frames = encoder.encode_into(obj, buf)
        tracker = sock.send_multipart(frames, copy=False, track=True)
        if not tracker.done:
            pending.appendleft((tracker, buf))
        elif len(reuse) < MAX_REUSE_BUFFERS:
            reuse.append(buf)


def start(ctx: zmq.Context, spec: Any, ch: Channels) -> threading.Thread:
    """Start both threads (daemons); returns the output thread, which is joined at exit."""
    output = threading.Thread(target=output_loop, args=(ctx, spec.output_address, ch),
                              name="output", daemon=True)
    output.start()
    threading.Thread(target=input_loop, name="input", daemon=True,
                     args=(ctx, spec.input_address, spec.engine_index, spec.rank, ch)).start()
    return output
