"""CPU memory for the KV cache: zero pages from the OS, on huge pages, committed off the
start-up path.

Why not `torch.zeros`: a decode step reads each request's K/V blocks from all over a cache of
gigabytes, so the cache is advised onto transparent huge pages (with 4 KiB pages nearly every
block was a TLB miss). Faulting those in by zeroing them cost about a second per GiB at start-up
on the 2-core EPYC measured (the kernel compacts memory for each 2 MiB page), on the engine's
critical path. Instead the cache is one anonymous mapping, which the OS hands out zeroed, and a
background thread commits it with `MADV_POPULATE_WRITE` (Linux 5.14+), which faults pages in
without writing to them, so it can run while the first steps write K/V; it runs at nice 19 and
paced, so those steps keep their speed. A kernel without it (or
a libc without madvise) gets the old way: the whole cache written with zeros before the engine
reports ready. Each event is logged with its rank.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time

import torch

log = logging.getLogger(__name__)

_HUGE = 2 << 20
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23
# Commit in pieces of one huge page with a pause after each (about 150 MiB/s here, 1 GiB in about
# 7 s): an exiting process is never held by one long call, each call holds the process's
# memory-map lock only briefly, and the first steps, which run meanwhile, keep their speed. Tiny,
# 1 GiB, 2 cores, 2026-12-01, output tok/s of the first 200 requests after a start: 5,034-5,615
# with the commit at full pace (it took 2.0-2.3 s that hour), 7,433-7,797 paced, 7,128-8,531
# with no commit at all.
_CHUNK = 2 << 20
_PAUSE = 0.01


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise  # noqa: B018 - AttributeError where there is none
        return libc
    except (OSError, AttributeError):
        return None


def _madvise(libc, addr: int, length: int, advice: int) -> int:
    """0, or the errno of a refused call."""
    if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) == 0:
        return 0
    return ctypes.get_errno()


class KvArena:
    """One mapping of `nbytes` that the rank's K/V tensors are views of.

    `committed` is set once every page is resident (at once, on the fallback path)."""

    def __init__(self, nbytes: int, rank: int = 0) -> None:
        self.nbytes, self.rank = nbytes, rank
        self._map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._used = 0
        self.committed = threading.Event()
        self.how = ""

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next `shape` of `dtype` in the arena, zero until written."""
        n = dtype.itemsize
        for d in shape:
            n *= d
        if self._used + n > self.nbytes:
            raise ValueError(f"KV arena of {self.nbytes} bytes cannot hold {n} more")
        view = self._bytes[self._used:self._used + n].view(dtype).view(shape)
        self._used += n
        return view

    def commit(self) -> None:
        """Advise huge pages, then commit the pages: in the background where the kernel can
        populate without writing, else by writing zeros now (before any step writes K/V)."""
        libc, addr = _libc(), self._bytes.data_ptr()
        if libc is not None:
            _madvise(libc, addr, self.nbytes // _HUGE * _HUGE, _MADV_HUGEPAGE)  # best effort
            first = min(_CHUNK, self.nbytes)
            err = _madvise(libc, addr, first, _MADV_POPULATE_WRITE)
            if err == 0:
                threading.Thread(target=self._populate, args=(libc, addr, first), daemon=True,
                                 name=f"kv-commit-{self.rank}").start()
                return
            why = f"madvise(MADV_POPULATE_WRITE) refused: {errno.errorcode.get(err, err)}"
        else:
            why = "no madvise in this libc"
        start = time.monotonic()
        self._bytes.zero_()
        self._done(f"zeroed before start-up ({why}) in {time.monotonic() - start:.1f} s")

    def _populate(self, libc, addr: int, done: int) -> None:
        # The lowest CPU priority for this thread alone (Linux: nice is per thread), and a pause
        # after each piece (_PAUSE): the first steps, which run while it commits, come first.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):  # not Linux: the commit keeps the default priority
            pass
        start = time.monotonic()
        while done < self.nbytes:
            n = min(_CHUNK, self.nbytes - done)
            err = _madvise(libc, addr + done, n, _MADV_POPULATE_WRITE)
            if err:  # out of memory mid-way: say so; the pages fault in on first use instead
                self._done(f"left to fault in on first use after {done} bytes: madvise "
                           f"failed with {errno.errorcode.get(err, err)}", logging.WARNING)
                return
            done += n
            time.sleep(_PAUSE)
        self._done(f"committed in the background in {time.monotonic() - start:.1f} s")

    def _done(self, how: str, level: int = logging.INFO) -> None:
        self.how = how
        log.log(level, "rank %d: KV cache memory (%.2f GiB) %s", self.rank, self.nbytes / 2**30,
                how)
        self.committed.set()
