"""Active health checks of the listed groups, so the router's /health (the frontend pod's
readiness) says whether a group can serve before a client request finds out. A group whose
/health refuses the connection or answers non-200 is put in cool-down; a 200 after the
cool-down ran out marks it recovered. A kv-aware router also reads each healthy group's load
gauges from its /metrics (engine_load.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from shoal.router.discovery import Group
from shoal.router.engine_load import parse
from shoal.router.picker import GroupPicker

logger = logging.getLogger("shoal.router.health")

PROBE_INTERVAL_S = 2.0
PROBE_TIMEOUT_S = 2.0


class HealthProber:
    def __init__(self, picker: GroupPicker, client: httpx.AsyncClient,
                 interval: float = PROBE_INTERVAL_S) -> None:
        self.picker = picker
        self.client = client
        self.interval = interval

    async def probe(self, group: Group) -> None:
        try:
            resp = await self.client.get(f"{group.url}/health", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            self.picker.mark_failed(group, f"health check failed: {type(exc).__name__}: "
                                           f"{exc or 'no answer'}")
            return
        if resp.status_code == 200:
            self.picker.mark_ok(group)
            if self.picker.kv is not None:
                await self.read_load(group)
        else:
            detail = resp.text[:200].strip() or "(empty body)"
            self.picker.mark_failed(group, f"/health answered {resp.status_code}: {detail}")

    async def read_load(self, group: Group) -> None:
        """kv-aware: the engine's own load gauges (engine_load.py) into its group's state; a
        failed read leaves none (scored by the router's own count)."""
        state = self.picker.states.get(group.key)
        if state is None:
            return
        try:
            resp = await self.client.get(f"{group.url}/metrics", timeout=PROBE_TIMEOUT_S)
            load = parse(resp.text, time.monotonic()) if resp.status_code == 200 else None
        except httpx.HTTPError:
            load = None
        state.engine = load

    async def probe_all(self) -> None:
        groups = [s.group for s in self.picker.states.values()]
        await asyncio.gather(*(self.probe(g) for g in groups))

    async def run(self) -> None:
        while True:
            try:
                await self.probe_all()
            except Exception:  # noqa: BLE001 - the prober must outlive any surprise
                logger.exception("health probe round failed")
            await asyncio.sleep(self.interval)
