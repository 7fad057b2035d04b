"""Requests for an engine that has no group on purpose (scaled to zero: discovery's
`wakeable`) wait here for its first group instead of failing, as KubeAI's proxy and llm-d's
activator do; the first one asks for a group (`wake`, k8s_wake.py: the engine's wake Lease).

Bounded per engine: at most `max_held` requests wait, each at most `hold_s` seconds. Past the
wait: 503 with Retry-After; past the size: 429. A streamed request waits the same way (nothing
is sent to the client before a group answers). Settings: SHOAL_ROUTER_HOLD_SECONDS (default
HOLD_S), SHOAL_ROUTER_HOLD_MAX (default MAX_HELD).

The holder only waits and counts; what "a group is usable" means stays the picker's: a waiter
re-checks `usable()` each POLL_S (a group appears through discovery and the health prober).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from shoal.router.errors import error_response, no_group_message

logger = logging.getLogger("shoal.router.hold")

HOLD_S = 120.0
MAX_HELD = 64
POLL_S = 0.1
WAKE_EVERY_S = 5.0  # while requests wait, the wake is renewed this often
HOLD_ENV = "SHOAL_ROUTER_HOLD_SECONDS"
MAX_ENV = "SHOAL_ROUTER_HOLD_MAX"

RETRY_AFTER_S = 10  # a held request that got no group: when to come back
READY = "ready"
TIMEOUT = "timeout"
FULL = "full"


class Holder:
    def __init__(self, wake: Callable[[str], Awaitable[None]] | None, *,
                 hold_s: float = HOLD_S, max_held: int = MAX_HELD,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.wake = wake  # engine -> None: asks the operator for a group (None: nobody to ask)
        self.hold_s, self.max_held = hold_s, max_held
        self.clock = clock
        self.held: dict[str, int] = {}  # engine -> requests waiting now
        self.outcomes: dict[str, int] = {READY: 0, TIMEOUT: 0, FULL: 0}
        self._woken: dict[str, float] = {}  # engine -> when the wake was last sent

    @classmethod
    def from_environment(cls, wake) -> Holder:
        return cls(wake, hold_s=float(os.environ.get(HOLD_ENV) or HOLD_S),
                   max_held=int(os.environ.get(MAX_ENV) or MAX_HELD))

    async def wait(self, engine: str, usable: Callable[[], bool]) -> str:
        """READY once `usable()`, TIMEOUT after hold_s, FULL at once when max_held wait."""
        if self.held.get(engine, 0) >= self.max_held:
            self.outcomes[FULL] += 1
            return FULL
        self.held[engine] = self.held.get(engine, 0) + 1
        start = self.clock()
        if self.held[engine] == 1:
            logger.info("%s has no group: holding requests up to %.0f s and asking for one",
                        engine or "the engine", self.hold_s)
        try:
            while not usable():
                await self._maybe_wake(engine)
                if self.clock() - start >= self.hold_s:
                    self.outcomes[TIMEOUT] += 1
                    return TIMEOUT
                await asyncio.sleep(POLL_S)
            self.outcomes[READY] += 1
            return READY
        finally:
            self.held[engine] -= 1

    async def _maybe_wake(self, engine: str) -> None:
        now = self.clock()
        if self.wake is None or now - self._woken.get(engine, -WAKE_EVERY_S) < WAKE_EVERY_S:
            return
        self._woken[engine] = now
        try:
            await self.wake(engine)
        except Exception as exc:  # noqa: BLE001 - logged; the request still waits
            logger.warning("could not ask for a group of %s: %s", engine or "the engine", exc)


def not_woken(holder: Holder, engine: str, outcome: str):
    """A held request that got no group: 429 when too many waited, else 503; both say when to
    come back (its first group may still be starting)."""
    name = engine or "the engine"
    if outcome == FULL:
        resp = error_response(429, f"{name} has no engine group yet and {holder.max_held} "
                              "requests are already waiting for one; retry later",
                              "RateLimitError")
    else:
        resp = error_response(503, no_group_message(
            f"{name} was scaled to zero and no group became ready within {holder.hold_s:.0f} s "
            "(one was asked for)"), "ServiceUnavailableError")
    resp.headers["Retry-After"] = str(RETRY_AFTER_S)
    return resp
