"""glibc's allocator, bounded for a router process (both routers call `bound()` at start).

Why: a router handles bodies of up to hundreds of KB, tokenized in worker threads. With glibc's
defaults each thread that allocates may get its own arena (up to 8 per core), and the mmap
threshold rises after the first large free, so later large bodies are carved from the arenas,
whose free pages are returned only from the top of each heap. Over 30 minutes of 100-220 KB
prompts (benchmarks/router_overhead.py) the gateway's RSS rose about 0.7 KB per request while
Python's own heap stayed level (tracemalloc: 67-76 MiB): growth below Python. Bounded here:

- M_ARENA_MAX = ARENAS: the worker threads share two arenas instead of one each;
- M_MMAP_THRESHOLD = MMAP_THRESHOLD (fixed, which also stops glibc raising it): a block this
  large or larger is its own mapping, unmapped when freed;
- `malloc_trim(0)` every TRIM_EVERY_S seconds from a daemon thread: free pages inside the
  arenas go back to the kernel (glibc >= 2.8 releases them anywhere in the heap, not only at its
  top).

Not glibc (musl, macOS): nothing is done; `bound()` says so in its answer.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

logger = logging.getLogger("shoal.router")

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
M_ARENA_MAX = -8
ARENAS = 2
MMAP_THRESHOLD = 128 * 1024  # glibc's initial value, kept fixed
TRIM_EVERY_S = 60.0


def _glibc():
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both must exist
    except (OSError, AttributeError):
        return None, None
    return libc, version


def bound(trim_every: float = TRIM_EVERY_S) -> str:
    """Apply the bounds above to this process and start the trimming thread; what was done,
    for the start-up log line."""
    libc, version = _glibc()
    if libc is None:
        return "allocator: not glibc, left as it is"
    ok = libc.mallopt(M_ARENA_MAX, ARENAS) == 1 and \
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    if not ok:
        return f"allocator: glibc {version} refused mallopt, left as it is"

    def trim() -> None:
        while True:
            time.sleep(trim_every)
            libc.malloc_trim(0)

    threading.Thread(target=trim, name="malloc-trim", daemon=True).start()
    return (f"allocator: glibc {version}, {ARENAS} arenas, blocks of {MMAP_THRESHOLD // 1024} KiB "
            f"and more mapped on their own, trimmed every {trim_every:g} s")
