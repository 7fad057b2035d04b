"""Which engine group gets the next request.

Rule: among the usable groups, the one with the fewest outstanding (forwarded, unfinished)
requests; ties go round-robin. A group that refused a connection or answered 503 is skipped for a
cool-down; after it, the group is tried again if the discovery file still lists it (the
operator's stable per-group addresses make a retry safe). Pure bookkeeping, no I/O: the proxy
and the health prober report what they saw.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from shoal.engine.router.discovery import Group

logger = logging.getLogger("shoal.router.picker")

COOLDOWN_S = 5.0


@dataclass
class GroupState:
    group: Group
    outstanding: int = 0
    cooldown_until: float = 0.0
    last_error: str | None = None


class GroupPicker:
    def __init__(self, cooldown: float = COOLDOWN_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown = cooldown
        self.clock = clock
        self.states: dict[int, GroupState] = {}
        self._turn = 0

    # ----- the discovery file -------------------------------------------------------------

    def set_groups(self, groups: tuple[Group, ...] | list[Group]) -> None:
        """Adopt the file's list: new groups start usable, dropped ones get no new requests
        (those in flight finish on their own)."""
        wanted = {g.id: g for g in groups}
        for gid, state in list(self.states.items()):
            if gid not in wanted:
                del self.states[gid]
                logger.info("group %d removed (%s): no longer in the discovery file",
                            gid, state.group.url)
            elif wanted[gid].url != state.group.url:
                logger.info("group %d moved from %s to %s", gid, state.group.url, wanted[gid].url)
                self.states[gid] = GroupState(wanted[gid], state.outstanding)
        for gid, group in sorted(wanted.items()):
            if gid not in self.states:
                self.states[gid] = GroupState(group)
                logger.info("group %d added (%s)", gid, group.url)

    # ----- choosing ------------------------------------------------------------------------

    def usable(self) -> list[GroupState]:
        now = self.clock()
        return [s for _, s in sorted(self.states.items()) if s.cooldown_until <= now]

    def pick(self, exclude: set[int] = frozenset()) -> Group | None:
        """The next group for a request, or None when no group is usable."""
        candidates = [s for s in self.usable() if s.group.id not in exclude]
        if not candidates:
            return None
        fewest = min(s.outstanding for s in candidates)
        tied = [s for s in candidates if s.outstanding == fewest]
        chosen = tied[self._turn % len(tied)]
        self._turn += 1
        return chosen.group

    def acquire(self, group: Group) -> None:
        state = self.states.get(group.id)
        if state is not None:
            state.outstanding += 1

    def release(self, group: Group) -> None:
        state = self.states.get(group.id)
        if state is not None and state.group == group:
            state.outstanding = max(0, state.outstanding - 1)

    # ----- failures ------------------------------------------------------------------------

    def mark_failed(self, group: Group, cause: str) -> None:
        """Skip `group` for the cool-down; one log line when it goes from usable to failed."""
        state = self.states.get(group.id)
        if state is None or state.group != group:
            return
        now = self.clock()
        if state.last_error is None:  # one line per failure, not one per cool-down
            logger.warning("group %d failed (%s): %s; skipping it for %g s at a time until "
                           "it answers again", group.id, group.url, cause, self.cooldown)
        state.cooldown_until = now + self.cooldown
        state.last_error = cause

    def mark_ok(self, group: Group) -> None:
        """The group answered; a running cool-down still runs out (a 503 from a draining group
        can come with a healthy /health)."""
        state = self.states.get(group.id)
        if state is None or state.group != group or state.cooldown_until > self.clock():
            return
        if state.last_error is not None:
            logger.info("group %d recovered (%s)", group.id, group.url)
        state.cooldown_until = 0.0
        state.last_error = None

    def why_none(self, exclude: set[int] = frozenset()) -> str:
        """Why no group (other than `exclude`) is usable, for /health and 503s."""
        if not self.states:
            return "the discovery file lists no engine groups"
        now = self.clock()
        return "; ".join(
            f"group {gid} ({s.group.url}) failed: {s.last_error} (skipped for another "
            f"{max(0.0, s.cooldown_until - now):.1f} s)"
            for gid, s in sorted(self.states.items()) if gid not in exclude)
