"""Planned passes: a pass that says "come back in 37 s" (a backoff deadline, a drain's end) gets
a pass at 37 s, not at the next timer tick.

One daemon thread holds a deadline per resource (the earliest asked for wins) and calls `run`
with the resource's key when it is due. Nothing is written to the API to remember a wake-up:
after an operator restart, the resume handler's pass plans them again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

log = logging.getLogger("shoal.operator.wakeups")


class Wakeups:
    def __init__(self, run: Callable[[Hashable], None],
                 clock: Callable[[], float] = time.monotonic):
        self._run = run
        self._clock = clock
        self._due: dict[Hashable, float] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def schedule(self, key: Hashable, delay: float) -> None:
        """Ask for a pass of `key` in `delay` seconds; an earlier request already held stays."""
        at = self._clock() + max(delay, 0.0)
        with self._cond:
            if key in self._due and self._due[key] <= at:
                return
            self._due[key] = at
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="shoal-wakeups",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> dict[Hashable, float]:
        """Seconds until each planned pass (for logs and tests)."""
        now = self._clock()
        with self._cond:
            return {k: at - now for k, at in self._due.items()}

    def pop_due(self) -> list[Hashable]:
        """Keys whose time has come, removed from the plan (the loop's one step)."""
        now = self._clock()
        with self._cond:
            due = [k for k, at in self._due.items() if at <= now]
            for k in due:
                del self._due[k]
            return due

    def _loop(self) -> None:
        while True:
            for key in self.pop_due():
                try:
                    self._run(key)
                except Exception:  # noqa: BLE001 - a failed pass must not stop later wake-ups
                    log.exception("planned pass of %s failed", key)
            with self._cond:
                wait = min(self._due.values(), default=self._clock() + 60.0) - self._clock()
                if wait > 0:
                    self._cond.wait(timeout=wait)
