"""The discovery file the operator keeps (ConfigMap `NAME-engines`, key `engines.json`; the
format is `shoal.contract.discovery`) and a watcher that re-reads it when it changes.

A file that cannot be read or parsed keeps the last good list (the kubelet swaps ConfigMap
files atomically, but hand-edited files can be half-written), with one log line per distinct
problem.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from shoal.contract import discovery

logger = logging.getLogger("shoal.router.discovery")

POLL_INTERVAL_S = 1.0


@dataclass(frozen=True, order=True)
class Group:
    """One engine group as the file names it: its index and its rank 0's base URL. `engine`
    says which InferenceEngine ("NAMESPACE/NAME") it belongs to when one router serves several
    (the gateway); a per-engine frontend leaves it empty."""

    id: int
    url: str
    engine: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return (self.engine, self.id)

    @property
    def name(self) -> str:
        """How logs and error messages name it: "group 1" or "engine prod/llm group 1"."""
        return f"engine {self.engine} group {self.id}" if self.engine else f"group {self.id}"

    @property
    def label(self) -> str:
        """The `group` label of the router's metrics: "1" or "prod/llm/1"."""
        return f"{self.engine}/{self.id}" if self.engine else str(self.id)

    def with_engine(self, engine: str) -> Group:
        return Group(self.id, self.url, engine)


@dataclass(frozen=True)
class Discovery:
    groups: tuple[Group, ...]
    model: str | None
    wakeable: bool = False  # no group may be on purpose: hold requests and wake it (hold.py)


def parse_discovery(text: str) -> Discovery:
    """Validate the document (shoal.contract.discovery); ValueError says what is wrong."""
    model, groups = discovery.decode(text)
    return Discovery(tuple(Group(gid, url) for gid, url in sorted(groups.items())), model,
                     discovery.decode_wakeable(text))


async def poll(check: Callable[[], object], interval: float, what: str) -> None:
    """Call `check` every `interval` seconds for ever; a failure is logged, never fatal (the
    watchers must outlive any surprise)."""
    while True:
        try:
            check()
        except Exception:  # noqa: BLE001 - logged with its traceback, the loop goes on
            logger.exception("%s failed", what)
        await asyncio.sleep(interval)


def file_signature(path) -> tuple | None:
    """(inode, mtime, size) of a file, None when absent: what a poller compares."""
    # ConfigMap volumes swap a symlink: stat() follows it, so the inode changes with each update.
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class DiscoveryWatcher:
    """Polls the file's (inode, mtime, size) and calls `on_change(Discovery)` on each new good
    version. `problem` holds why the current file is not used (None when it is)."""

    def __init__(self, path: str, on_change: Callable[[Discovery], None],
                 interval: float = POLL_INTERVAL_S) -> None:
        self.path = path
        self.on_change = on_change
        self.interval = interval
        self.current: Discovery | None = None
        self.problem: str | None = None
        self._seen: tuple | None | str = "never"
        self.api_active = False  # set by the API source once it has delivered

    def check(self) -> None:
        """Re-read the file if it changed since the last check. Once the Kubernetes API source
        (k8s_discovery.py) has delivered, the file is only a fallback and is not read: the
        kubelet refreshes it up to a minute late and must not roll a newer list back."""
        if self.api_active:
            return
        sig = file_signature(self.path)
        if sig == self._seen:
            return
        self._seen = sig
        if sig is None:
            self._report(f"discovery file {self.path} does not exist")
            return
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            self._report(f"discovery file {self.path} is invalid: {exc}")
            return
        self.offer(text, f"discovery file {self.path}")

    def offer(self, text: str, source: str) -> bool:
        """Use `text` (the discovery JSON) from `source` if it is valid; False if it is not."""
        try:
            found = parse_discovery(text)
        except ValueError as exc:
            self._report(f"{source} is invalid: {exc}")
            return False
        if self.problem:
            logger.info("%s is valid again", source)
        self.problem = None
        if found != self.current:
            self.current = found
            self.on_change(found)
        return True

    def _report(self, problem: str) -> None:
        if problem != self.problem:
            kept = ("keeping the last good list of "
                    f"{len(self.current.groups)} group(s)" if self.current else "no groups known")
            logger.error("%s; %s", problem, kept)
        self.problem = problem

    async def run(self) -> None:
        await poll(self.check, self.interval, f"discovery check of {self.path}")
