"""Drain progress: while a group's rank 0 drains, its in-flight requests are read from its
/metrics (vLLM's names, engine/shoal/engine/frontend/metrics.py) and shown in the group's message.

The reads run as tasks on kopf's event loop, each bounded by PROBE_TIMEOUT_SECONDS, so a pass
never waits for an engine: a pass only reads the last count (`counts`). A changed count asks for
a pass (`on_change`), and that pass writes status only because its message changed: one status
write per change, none while the count stays, none when the engine does not answer.

aiohttp, not httpx: it comes with kopf, so the operator image gains no dependency.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

import aiohttp

log = logging.getLogger("shoal.operator.drain_probe")

# Requests rank 0 still owes an answer: running, and admitted but waiting for the batch.
IN_FLIGHT_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
PROBE_TIMEOUT_SECONDS = 1.0
PROBE_INTERVAL_SECONDS = 2.0

Fetch = Callable[[str], Awaitable[str]]


def in_flight(text: str) -> int | None:
    """The sum of IN_FLIGHT_METRICS in a Prometheus text exposition; None if neither is there."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in IN_FLIGHT_METRICS:
            total += float(line.rsplit(" ", 1)[-1])
            seen = True
    return int(total) if seen else None


async def fetch_metrics(url: str) -> str:
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.get(url) as r:
            r.raise_for_status()
            return await r.text()


class DrainProbes:
    """One probe task per draining group; `follow` (thread-safe) says which groups drain now."""

    def __init__(self, on_change: Callable[[tuple[str, str]], None], fetch: Fetch = fetch_metrics,
                 interval: float = PROBE_INTERVAL_SECONDS):
        self._on_change, self._fetch, self._interval = on_change, fetch, interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[tuple, tuple[str, asyncio.Task]] = {}  # (ns, name, group) -> (url, task)
        self._counts: dict[tuple, int] = {}
        self._engines: set[tuple[str, str]] = set()  # engines with a group followed
        self._lock = threading.Lock()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def counts(self, namespace: str, name: str) -> dict[int, int]:
        """The last in-flight count of each draining group of one engine."""
        with self._lock:
            return {k[2]: n for k, n in self._counts.items() if k[:2] == (namespace, name)}

    def follow(self, namespace: str, name: str, targets: dict[int, str]) -> None:
        """Probe exactly these groups (group -> rank 0's /metrics URL) of one engine from now on."""
        with self._lock:  # called from worker threads: _tasks belongs to the loop
            known = (namespace, name) in self._engines
            (self._engines.add if targets else self._engines.discard)((namespace, name))
        if self._loop is not None and (targets or known):
            self._loop.call_soon_threadsafe(self._sync, namespace, name, dict(targets))

    def _sync(self, namespace: str, name: str, targets: dict[int, str]) -> None:
        for key in [k for k in self._tasks if k[:2] == (namespace, name)]:
            if self._tasks[key][0] != targets.get(key[2]):
                self._tasks.pop(key)[1].cancel()
                with self._lock:
                    self._counts.pop(key, None)
        for g, url in targets.items():
            key = (namespace, name, g)
            if key not in self._tasks:
                self._tasks[key] = (url, asyncio.ensure_future(self._watch(key, url)))

    def _mine(self, key: tuple) -> bool:
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", lambda: 0)()  # 3.11+: a cancel was asked for
        return not cancelling and self._tasks.get(key, (None, None))[1] is task

    async def _watch(self, key: tuple, url: str) -> None:
        # Ends when cancelled, and also when no longer the key's task: Python 3.11's wait_for
        # can swallow a cancel that lands as the read completes.
        while self._mine(key):
            try:
                n = in_flight(await asyncio.wait_for(self._fetch(url), PROBE_TIMEOUT_SECONDS))
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - an engine that does not answer has no count
                n = None
            with self._lock:
                if not self._mine(key):
                    return
                changed = n is not None and self._counts.get(key) != n
                if changed:
                    self._counts[key] = n
            if changed:
                log.info("%s/%s group %d: %d requests in flight", key[0], key[1], key[2], n)
                self._on_change(key[:2])
            await asyncio.sleep(self._interval)
