"""One fetch per repository at a time in one cache: a whole-repo `flock`.

huggingface_hub locks each blob, so N processes fetching one repository would each still list
the repository and stat every file; with this lock the first downloads and the rest wait, then
find the snapshot complete (often without calling the hub at all: see verify.Record).
The kernel drops a dead holder's lock, so a killed fetch never blocks the next.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shoal.contract.model_fetch import HubRef


def repo_folder(repo_id: str) -> str:
    """huggingface_hub's folder name for a model repository (models--ORG--NAME)."""
    return "models--" + repo_id.replace("/", "--")


def lock_path(cache_dir: str | os.PathLike, ref: HubRef) -> Path:
    """DIR/.locks/models--ORG--NAME/shoal-fetch.lock, beside huggingface_hub's per-blob locks."""
    return Path(cache_dir) / ".locks" / repo_folder(ref.repo_id) / "shoal-fetch.lock"


@dataclass
class Held:
    path: Path
    waited_s: float  # 0.0 when the lock was free
    wait_began: float  # time.time() when this process asked for it

    @property
    def waited(self) -> bool:
        return self.waited_s > 0.0


def _try(f) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


@contextlib.contextmanager
def repo_lock(cache_dir: str | os.PathLike, ref: HubRef, on_wait=None, while_waiting=None,
              interval_s: float = 2.0, poll_s: float = 0.2) -> Iterator[Held]:
    """Hold the repository's lock for the block. If another process holds it, `on_wait(path)`
    is called once, then `while_waiting()` every `interval_s` until the lock is free (a waiting
    pod reports the holder's progress)."""
    path = lock_path(cache_dir, ref)
    path.parent.mkdir(parents=True, exist_ok=True)
    began = time.time()
    with open(path, "a+") as f:
        waited = 0.0
        if not _try(f):
            if on_wait is not None:
                on_wait(path)
            t0 = time.monotonic()
            next_report = t0 + interval_s
            while not _try(f):
                time.sleep(poll_s)
                if while_waiting is not None and time.monotonic() >= next_report:
                    while_waiting()
                    next_report += interval_s
            waited = max(time.monotonic() - t0, 1e-6)
        try:
            yield Held(path, waited, began)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
