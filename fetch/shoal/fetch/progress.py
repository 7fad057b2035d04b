"""Progress lines while huggingface_hub downloads: the bytes in the cache, polled.

huggingface_hub writes each blob to `blobs/ETAG.<random>.incomplete` and renames it to
`blobs/ETAG` when complete, so the bytes fetched so far are, per expected file, the complete
blob's size or the sizes of its incomplete files. Polling the directory sees every worker thread
(and a concurrent process, if the lock were bypassed) without hooking the client's internals.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from shoal.contract.model_fetch import HubRef, progress_line
from shoal.fetch.verify import Expected

INTERVAL_S = 2.0


def bytes_present(blobs: Path, expected: Iterable[Expected]) -> int:
    """Bytes of the expected files in `blobs/`, complete or partly downloaded."""
    total = 0
    for e in expected:
        if not e.etag:
            continue
        blob = blobs / e.etag
        try:
            total += min(blob.stat().st_size, e.size)
            continue
        except FileNotFoundError:
            pass
        partial = 0
        for p in blobs.glob(f"{e.etag}.*incomplete"):
            try:
                partial = max(partial, p.stat().st_size)
            except FileNotFoundError:
                pass
        total += min(partial, e.size)
    return total


class Reporter:
    """Prints a progress line every INTERVAL_S from a thread, and one at `stop()`."""

    def __init__(self, ref: HubRef, blobs: Path, expected: tuple[Expected, ...],
                 emit: Callable[[str], None], interval_s: float = INTERVAL_S) -> None:
        self.ref, self.blobs, self.expected, self.emit = ref, blobs, expected, emit
        self.total = sum(e.size for e in expected)
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fetch-progress", daemon=True)

    def line(self) -> str:
        return progress_line(self.ref, bytes_present(self.blobs, self.expected), self.total)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.emit(self.line())

    def __enter__(self) -> Reporter:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.emit(self.line())
