"""Poll a condition until it holds or a deadline passes: the suite's replacement for sleeps.

A timeout names what was awaited and the last value (or exception) seen, so a failing test says
*what* did not happen, not just that time ran out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The condition did not hold in time (an AssertionError so pytest shows it as a failure)."""


def _describe(what: str, timeout: float, last: object, error: BaseException | None,
              detail: Callable[[], str] | None = None) -> str:
    msg = f"timed out after {timeout:.1f}s waiting for {what}; last value: {last!r}"
    if error is not None:
        msg += f"; last error: {type(error).__name__}: {error}"
    if detail is not None:
        msg += f"; {detail()}"
    return msg


def wait_for(
    condition: Callable[[], T],
    timeout: float = 30.0,
    interval: float = 0.1,
    what: str | None = None,
    ignore: tuple[type[BaseException], ...] = (),
    detail: Callable[[], str] | None = None,
) -> T:
    """Call `condition` until it returns a truthy value, and return that value.

    Exceptions listed in `ignore` count as "not yet" (e.g. ApiException for an object that does
    not exist yet); any other exception propagates at once. On timeout the error names `what`,
    the last value and error, and `detail()` (e.g. a server's log tail) when given.
    """
    what = what or getattr(condition, "__name__", "condition")
    deadline = time.monotonic() + timeout
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            last = condition()
            error = None
            if last:
                return last
        except ignore as exc:
            error = exc
        if time.monotonic() >= deadline:
            raise WaitTimeout(_describe(what, timeout, last, error, detail))
        time.sleep(interval)


async def async_wait_for(
    condition: Callable[[], T | Awaitable[T]],
    timeout: float = 30.0,
    interval: float = 0.1,
    what: str | None = None,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """`wait_for` for asyncio tests; `condition` may be a plain or an async callable."""
    what = what or getattr(condition, "__name__", "condition")
    deadline = time.monotonic() + timeout
    last: object = None
    error: BaseException | None = None
    while True:
        try:
            last = condition()
            if asyncio.iscoroutine(last) or isinstance(last, asyncio.Future):
                last = await last
            error = None
            if last:
                return last  # type: ignore[return-value]
        except ignore as exc:
            error = exc
        if time.monotonic() >= deadline:
            raise WaitTimeout(_describe(what, timeout, last, error))
        await asyncio.sleep(interval)


def wait_gone(read: Callable[[], object], timeout: float = 30.0, what: str = "deletion") -> None:
    """Wait until `read()` raises a 404 ApiException (the object no longer exists)."""
    from kubernetes.client.exceptions import ApiException

    def gone() -> bool:
        try:
            read()
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    wait_for(gone, timeout=timeout, interval=0.2, what=what)
