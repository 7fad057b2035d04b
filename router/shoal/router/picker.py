"""Which engine group gets the next request.

Rule (`least-outstanding`): among the usable groups, the one with the fewest outstanding
(forwarded, unfinished) requests; ties go round-robin. With `prefix-affinity` (an injected
`PrefixAffinity`, affinity.py) a request whose prompt starts like an earlier one goes to the
group that served that prefix, while that group's load stays within the affinity's bound. With
`kv-aware` (an injected `KvAware`, kv_score.py) every request is scored against the engines' KV
events index: `prefix` is then the prompt's token ids ([] when unknown: scored by load). A
group that refused a connection or answered 503 is skipped for a cool-down; after it, the
group is tried again if the discovery file still lists it (the operator's stable per-group
addresses make a retry safe). Pure bookkeeping, no I/O: the proxy and the health prober
report what they saw.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.router.discovery import Group
from shoal.router.engine_load import EngineLoad

if TYPE_CHECKING:
    from shoal.router.affinity import PrefixAffinity
    from shoal.router.kv_score import KvAware

logger = logging.getLogger("shoal.router.picker")

COOLDOWN_S = 5.0


@dataclass
class GroupState:
    group: Group
    outstanding: int = 0
    cooldown_until: float = 0.0
    last_error: str | None = None
    engine: EngineLoad | None = None  # kv-aware: the engine's own gauges (engine_load.py)
    peak: int = 0  # the most outstanding since the prober began its last /metrics read
    adapters: dict[str, str] | None = None  # LoRA adapter -> parent (None: not read yet)
    resident: frozenset[str] = frozenset()  # the adapters it runs now (adapters.py)


class GroupPicker:
    def __init__(self, cooldown: float = COOLDOWN_S,
                 clock: Callable[[], float] = time.monotonic,
                 affinity: PrefixAffinity | None = None, kv: KvAware | None = None) -> None:
        self.cooldown = cooldown
        self.clock = clock
        self.affinity = affinity
        self.kv = kv
        # Keyed by Group.key: (engine, index); the engine is "" in a per-engine frontend.
        self.states: dict[tuple[str, int], GroupState] = {}
        self._turn = 0

    # ----- the discovery file -------------------------------------------------------------

    def set_groups(self, groups: tuple[Group, ...] | list[Group]) -> None:
        """Adopt the file's list: new groups start usable, dropped ones get no new requests
        (those in flight finish on their own)."""
        wanted = {g.key: g for g in groups}
        for key, state in list(self.states.items()):
            if key not in wanted:
                del self.states[key]
                logger.info("%s removed (%s): no longer in the discovery file",
                            state.group.name, state.group.url)
            elif wanted[key].url != state.group.url:
                logger.info("%s moved from %s to %s", state.group.name, state.group.url,
                            wanted[key].url)
                self.states[key] = GroupState(wanted[key], state.outstanding)
        for key, group in sorted(wanted.items()):
            if key not in self.states:
                self.states[key] = GroupState(group)
                logger.info("%s added (%s)", group.name, group.url)

    # ----- choosing ------------------------------------------------------------------------

    def usable(self) -> list[GroupState]:
        now = self.clock()
        return [s for _, s in sorted(self.states.items()) if s.cooldown_until <= now]

    def pick(self, exclude: set[tuple[str, int]] = frozenset(),
             only: set[tuple[str, int]] | None = None,
             prefix: list[int] | None = None) -> Group | None:
        """The next group for a request, or None when no group is usable. `exclude`: keys
        already tried; `only`: the keys that may serve it (the gateway: its model's groups);
        `prefix`: the prompt's prefix keys (PrefixAffinity.keys) when routing by prefix."""
        candidates = [s for s in self.usable() if s.group.key not in exclude
                      and (only is None or s.group.key in only)]
        if not candidates:
            return None
        if self.kv is not None:
            chosen = self.kv.choose(prefix or [], candidates)
            self.kv.remember(prefix or [], chosen.group.key, {s.group.key for s in candidates})
            return chosen.group
        chosen = None
        if self.affinity is not None and prefix:
            chosen = self.affinity.choose(prefix, candidates)
        if chosen is None:
            fewest = min(s.outstanding for s in candidates)
            tied = [s for s in candidates if s.outstanding == fewest]
            chosen = tied[self._turn % len(tied)]
            self._turn += 1
        if self.affinity is not None and prefix:
            self.affinity.remember(prefix, chosen.group.key, {s.group.key for s in candidates})
        return chosen.group

    def any_usable(self, exclude: set[tuple[str, int]] = frozenset(),
                   only: set[tuple[str, int]] | None = None) -> bool:
        """Whether `pick` would find a group (without picking one)."""
        return any(s.group.key not in exclude and (only is None or s.group.key in only)
                   for s in self.usable())

    def acquire(self, group: Group) -> None:
        state = self.states.get(group.key)
        if state is not None:
            state.outstanding += 1
            state.peak = max(state.peak, state.outstanding)

    def forget_adapter(self, key: tuple[str, int], name: str) -> None:
        """The group answered 404 for an adapter its last list had: it is not there until the
        next list says so (the health prober's next read)."""
        state = self.states.get(key)
        if state is not None and state.adapters and name in state.adapters:
            state.adapters = {k: v for k, v in state.adapters.items() if k != name}

    def release(self, group: Group) -> None:
        state = self.states.get(group.key)
        if state is not None and state.group == group:
            state.outstanding = max(0, state.outstanding - 1)

    # ----- failures ------------------------------------------------------------------------

    def mark_failed(self, group: Group, cause: str) -> None:
        """Skip `group` for the cool-down; one log line when it goes from usable to failed."""
        state = self.states.get(group.key)
        if state is None or state.group != group:
            return
        now = self.clock()
        if state.last_error is None:  # one line per failure, not one per cool-down
            logger.warning("%s failed (%s): %s; skipping it for %g s at a time until "
                           "it answers again", group.name, group.url, cause, self.cooldown)
        state.cooldown_until = now + self.cooldown
        state.last_error = cause

    def mark_ok(self, group: Group) -> None:
        """The group answered; a running cool-down still runs out (a 503 from a draining group
        can come with a healthy /health)."""
        state = self.states.get(group.key)
        if state is None or state.group != group or state.cooldown_until > self.clock():
            return
        if state.last_error is not None:
            logger.info("%s recovered (%s)", group.name, group.url)
        state.cooldown_until = 0.0
        state.last_error = None

    def why_none(self, exclude: set[tuple[str, int]] = frozenset(),
                 only: set[tuple[str, int]] | None = None) -> str:
        """Why no group (other than `exclude`, among `only`) is usable, for /health and 503s."""
        if not self.states or (only is not None and not only):
            return "the discovery file lists no engine groups"
        now = self.clock()
        return "; ".join(
            f"{s.group.name} ({s.group.url}) failed: {s.last_error} (skipped for another "
            f"{max(0.0, s.cooldown_until - now):.1f} s)"
            for key, s in sorted(self.states.items())
            if key not in exclude and (only is None or key in only))
