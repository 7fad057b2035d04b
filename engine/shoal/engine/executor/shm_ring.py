"""A shared-memory ring: one writer, N readers on the same machine, every reader sees every message.

Why: each engine step's SchedulerOutput goes to every local worker. Through a socket that is one
copy into the kernel and N out of it, per step; through this ring it is one copy into shared
memory and N reads, with no system call when the readers are already waiting.

Layout (one SharedMemory block): `slots` slots, each a header then `chunk_bytes` of data.
Header: [written: u8][read flag per reader: u8 x N][pad][total_len: u64][chunk_len: u64].
The writer fills a slot only when every reader has read it (or it was never written), writes the
data and lengths first and the `written` flag last; a reader reads a slot once `written` is set
and its own flag is clear, then sets its flag. A message longer than one slot continues in the
following slots (each carries the message's total length). Stores are plain byte stores: x86's
total store order keeps data before flags, as in vLLM's ring.

Waiting is a short burst of sched_yield, then sleeps growing to 2 ms while idle: a worker that
waits between requests costs almost nothing, and one that waits between steps answers in
microseconds.
"""

from __future__ import annotations

import os
import struct
import time
from multiprocessing import resource_tracker, shared_memory

import msgspec

_LENS = struct.Struct("<QQ")


class RingHandle(msgspec.Struct, array_like=True, gc=False):
    """What a reader needs to attach (sent to workers in their start-up spec)."""

    name: str
    num_readers: int
    slots: int
    chunk_bytes: int


def _header_bytes(num_readers: int) -> int:
    return -(-(1 + num_readers) // 8) * 8 + _LENS.size


class _Waiter:
    """Poll a condition: yield the CPU for a short burst, then sleep in growing steps."""

    def __init__(self, timeout: float | None) -> None:
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.tries = 0
        self.started = time.monotonic()

    def wait(self) -> bool:
        """One wait; False once the timeout has passed."""
        self.tries += 1
        if self.tries < 256:
            os.sched_yield()
            return True
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            return False
        idle = now - self.started
        time.sleep(0.0001 if idle < 0.01 else 0.0005 if idle < 1.0 else 0.002)
        return True


class _Ring:
    def __init__(self, shm: shared_memory.SharedMemory, handle: RingHandle) -> None:
        self.shm, self.handle = shm, handle
        self.buf = shm.buf
        self.header = _header_bytes(handle.num_readers)
        self.stride = self.header + handle.chunk_bytes

    def slot(self, index: int) -> int:
        return (index % self.handle.slots) * self.stride


class ShmRingWriter(_Ring):
    def __init__(self, num_readers: int, slots: int = 8, chunk_bytes: int = 1 << 20) -> None:
        handle_size = slots * (_header_bytes(num_readers) + chunk_bytes)
        shm = shared_memory.SharedMemory(create=True, size=handle_size)
        shm.buf[:handle_size] = bytes(handle_size)
        super().__init__(shm, RingHandle(shm.name, num_readers, slots, chunk_bytes))
        self.index = 0
        self.readers = range(1, 1 + num_readers)

    def _free(self, base: int) -> bool:
        buf = self.buf
        return buf[base] == 0 or all(buf[base + r] for r in self.readers)

    def write(self, data: bytes | memoryview, timeout: float | None = None) -> None:
        """Publish one message to every reader. TimeoutError if a reader stops reading."""
        total, chunk, offset = len(data), self.handle.chunk_bytes, 0
        view = memoryview(data)
        while True:
            base = self.slot(self.index)
            waiter = _Waiter(timeout)
            while not self._free(base):
                if not waiter.wait():
                    raise TimeoutError(f"shared-memory ring: a reader has not read slot "
                                       f"{self.index % self.handle.slots} within {timeout} s")
            part = view[offset:offset + chunk]
            buf = self.buf
            buf[base] = 0
            data_at = base + self.header
            buf[data_at:data_at + len(part)] = part
            _LENS.pack_into(buf, base + self.header - _LENS.size, total, len(part))
            for r in self.readers:
                buf[base + r] = 0
            buf[base] = 1  # last: readers may now read the slot
            self.index += 1
            offset += len(part)
            if offset >= total:
                return

    def close(self) -> None:
        self.buf = None
        self.shm.close()
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


class ShmRingReader(_Ring):
    def __init__(self, handle: RingHandle, reader: int) -> None:
        shm = shared_memory.SharedMemory(name=handle.name)
        # The writer owns the segment's lifetime; without this, this process's resource tracker
        # would unlink it (and warn) when the reader exits.
        try:
            resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
        except Exception:  # noqa: BLE001 - best effort, the tracker's API is private
            pass
        super().__init__(shm, handle)
        if not 0 <= reader < handle.num_readers:
            raise ValueError(f"reader {reader} outside [0, {handle.num_readers})")
        self.flag = 1 + reader
        self.index = 0

    def _ready(self, base: int) -> bool:
        return self.buf[base] == 1 and self.buf[base + self.flag] == 0

    def read(self, timeout: float | None = None) -> bytes | None:
        """The next message, or None if none came within `timeout`."""
        parts: list[bytes] = []
        got, total = 0, None
        while total is None or got < total:
            base = self.slot(self.index)
            waiter = _Waiter(timeout if total is None else None)
            while not self._ready(base):
                if not waiter.wait():
                    return None
            total, n = _LENS.unpack_from(self.buf, base + self.header - _LENS.size)
            data_at = base + self.header
            parts.append(bytes(self.buf[data_at:data_at + n]))
            self.buf[base + self.flag] = 1
            self.index += 1
            got += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        self.buf = None
        self.shm.close()
