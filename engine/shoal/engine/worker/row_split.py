"""Split a C kernel's rows across torch's intra-op threads.

ctypes releases the GIL during a call, so one call per contiguous row range, each on a pool
thread, runs the ranges in parallel; the kernels themselves stay single-threaded plain C."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch


class RowSplitter:
    def __init__(self, name: str, min_rows_per_thread: int) -> None:
        self.name, self.min_rows = name, min_rows_per_thread
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0

    def run(self, fn: Callable[[int, int], int], rows: int, min_rows: int | None = None) -> int:
        """fn(start, end) over [0, rows) in up to torch.get_num_threads() ranges of at least
        min_rows (default: the splitter's); the smallest return code (0 = success)."""
        threads = min(torch.get_num_threads(), rows // (min_rows or self.min_rows))
        if threads <= 1:
            return fn(0, rows)
        if self._size < threads - 1:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix=self.name)
            self._size = threads - 1
        bounds = [rows * i // threads for i in range(threads + 1)]
        # The first range runs on the calling thread: one hand-off fewer per call.
        others = [self._pool.submit(fn, a, b) for a, b in zip(bounds[1:-1], bounds[2:], strict=True)]
        first = fn(bounds[0], bounds[1])
        return min([first] + [f.result() for f in others])
