"""Per-group restart backoff: pure arithmetic, table-tested."""

from __future__ import annotations


def restart_delay(restarts: int, base: int, cap: int) -> int:
    """Seconds to wait before restart number `restarts` (1-based): base, 2*base, 4*base, ...,
    never more than `cap`."""
    if restarts <= 0 or base <= 0:
        return 0
    return int(min(cap, base * 2 ** min(restarts - 1, 30)))


def restarts_exhausted(restarts: int, max_restarts: int) -> bool:
    """True when one more restart would exceed the limit; max_restarts 0 means no limit."""
    return max_restarts > 0 and restarts >= max_restarts
