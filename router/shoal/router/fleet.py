"""The gateway's view of the fleet: which InferenceEngines serve which model, and their groups.

Each engine ("NAMESPACE/NAME") has one discovery document, the same `engines.json` the operator
writes for that engine's own frontend (render.discovery_data): its served model name and its
ready groups. An engine with no ready group serves nothing yet, so its model is not listed,
unless it was scaled to zero on purpose (`wakeable`): then a request waits for it (hold.py).
Engines that serve the same model name share its traffic: the model's groups are all of theirs.

Pure bookkeeping: sources (fleet_sources.py) call `update` / `remove`; every change hands the
whole list of groups to `on_groups` (the picker's set_groups) and logs one line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from shoal.router.discovery import Discovery, Group

logger = logging.getLogger("shoal.router.fleet")


class Fleet:
    def __init__(self, on_groups: Callable[[list[Group]], None]) -> None:
        self.on_groups = on_groups
        self.engines: dict[str, Discovery] = {}

    def update(self, engine: str, found: Discovery) -> None:
        """`engine`'s discovery document is now `found` (its groups are tagged with it)."""
        tagged = Discovery(tuple(g.with_engine(engine) for g in found.groups), found.model,
                           found.wakeable)
        if self.engines.get(engine) == tagged:
            return
        self.engines[engine] = tagged
        logger.info("engine %s: model %s, %d ready group(s)", engine, tagged.model or "(none)",
                    len(tagged.groups))
        self._changed()

    def remove(self, engine: str, why: str) -> None:
        if self.engines.pop(engine, None) is not None:
            logger.info("engine %s removed: %s", engine, why)
            self._changed()

    def _changed(self) -> None:
        self.on_groups([g for _, d in sorted(self.engines.items()) for g in d.groups])

    # ----- routing ----------------------------------------------------------------------

    def models(self) -> dict[str, list[str]]:
        """Served model name -> the engines serving it: those with a ready group, and those
        scaled to zero that a request wakes (discovery's `wakeable`)."""
        out: dict[str, list[str]] = {}
        for engine, found in sorted(self.engines.items()):
            if found.model and (found.groups or found.wakeable):
                out.setdefault(found.model, []).append(engine)
        return out

    def to_wake(self, model: str) -> str | None:
        """The engine to wake for `model` when none of its engines has a group: the first
        wakeable one ("NAMESPACE/NAME"); None when a group exists or none is wakeable."""
        serving = [(e, d) for e, d in sorted(self.engines.items()) if d.model == model]
        if any(d.groups for _, d in serving):
            return None
        return next((e for e, d in serving if d.wakeable), None)

    def groups_of(self, model: str) -> set[tuple[str, int]]:
        """The picker keys of every group serving `model` (empty if none)."""
        return {g.key for found in self.engines.values() if found.model == model
                for g in found.groups}
