"""The step broadcast: one message from the EngineCore to every worker of the group.

Local workers read it from a shared-memory ring (shm_ring.py); workers on other nodes from a
ZeroMQ XPUB socket over TCP. The publisher writes each message once to each medium. Before the
first message it waits until every remote worker has subscribed (XPUB reports subscriptions), so
no worker misses the start ("slow joiner").

Who holds what: the EngineCore process (node 0) holds a StepBroadcaster; each worker process
holds one StepReceiver. Only the EngineCore's busy-loop thread publishes.
"""

from __future__ import annotations

import time

import msgspec
import zmq
from shoal.engine.executor.shm_ring import RingHandle, ShmRingReader, ShmRingWriter


class BroadcastHandle(msgspec.Struct, array_like=True, gc=False):
    """Where a worker reads the broadcast: the ring (local) or the TCP address (remote)."""

    ring: RingHandle | None = None
    tcp_address: str | None = None


class StepBroadcaster:
    def __init__(self, num_local: int, num_remote: int, advertise_host: str) -> None:
        self.ring = ShmRingWriter(num_local) if num_local else None
        self.num_remote = num_remote
        self.ctx = zmq.Context.instance()
        self.pub = None
        self.tcp_address = None
        if num_remote:
            self.pub = self.ctx.socket(zmq.XPUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.setsockopt(zmq.SNDHWM, 0)  # never drop a step: a missed step is a hang
            self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber counts, not every topic
            port = self.pub.bind_to_random_port("tcp://*")
            self.tcp_address = f"tcp://{advertise_host}:{port}"
        self.subscribed = 0

    def local_handle(self) -> BroadcastHandle:
        return BroadcastHandle(ring=self.ring.handle if self.ring else None)

    def remote_handle(self) -> BroadcastHandle:
        return BroadcastHandle(tcp_address=self.tcp_address)

    def wait_for_subscribers(self, timeout: float, alive=lambda: None) -> None:
        """Block until every remote worker has subscribed; `alive()` raises to give up early."""
        deadline = time.monotonic() + timeout
        while self.subscribed < self.num_remote:
            alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.num_remote - self.subscribed} of {self.num_remote} "
                                   f"remote workers did not subscribe to the step broadcast at "
                                   f"{self.tcp_address} within {timeout:.0f} s")
            if self.pub.poll(100):
                if self.pub.recv()[:1] == b"\x01":
                    self.subscribed += 1

    def publish(self, data: bytes) -> None:
        if self.ring is not None:
            self.ring.write(data)
        if self.pub is not None:
            self.pub.send(data, copy=len(data) < 65536)

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self.pub is not None:
            self.pub.close(linger=0)
            self.pub = None


class StepReceiver:
    """A worker's end: `recv(timeout)` returns the next message or None."""

    def __init__(self, handle: BroadcastHandle, local_reader: int) -> None:
        self.ring = ShmRingReader(handle.ring, local_reader) if handle.ring else None
        self.sub = None
        if self.ring is None:
            if not handle.tcp_address:
                raise ValueError("a broadcast handle names neither a ring nor a TCP address")
            self.sub = zmq.Context.instance().socket(zmq.SUB)
            self.sub.setsockopt(zmq.LINGER, 0)
            self.sub.setsockopt(zmq.RCVHWM, 0)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.sub.connect(handle.tcp_address)

    def recv(self, timeout: float | None = None) -> bytes | None:
        if self.ring is not None:
            return self.ring.read(timeout)
        if self.sub.poll(None if timeout is None else int(timeout * 1000)):
            return self.sub.recv()
        return None

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
        if self.sub is not None:
            self.sub.close(linger=0)
