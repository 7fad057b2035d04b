"""Active health checks of the listed groups, so the router's /health (the frontend pod's
readiness) says whether a group can serve before a client request finds out. A group whose
/health refuses the connection or answers non-200 is put in cool-down; a 200 after the
cool-down ran out marks it recovered. After a good /health the prober also reads what the
engine serves: its LoRA adapters from /v1/models (adapters.py; with the router's first API key,
as a client would), and from /metrics the adapters it runs (when it lists any) and, for a
kv-aware router, its load gauges (engine_load.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from shoal.router import adapters
from shoal.router.discovery import Group
from shoal.router.engine_load import parse
from shoal.router.picker import GroupPicker

logger = logging.getLogger("shoal.router.health")

PROBE_INTERVAL_S = 2.0
PROBE_TIMEOUT_S = 2.0


class HealthProber:
    def __init__(self, picker: GroupPicker, client: httpx.AsyncClient,
                 interval: float = PROBE_INTERVAL_S, api_key: str | None = None) -> None:
        self.picker = picker
        self.client = client
        self.interval = interval
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def probe(self, group: Group) -> None:
        try:
            resp = await self.client.get(f"{group.url}/health", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            self.picker.mark_failed(group, f"health check failed: {type(exc).__name__}: "
                                           f"{exc or 'no answer'}")
            return
        if resp.status_code == 200:
            self.picker.mark_ok(group)
            await self.read_engine(group)
        else:
            detail = resp.text[:200].strip() or "(empty body)"
            self.picker.mark_failed(group, f"/health answered {resp.status_code}: {detail}")

    async def read_engine(self, group: Group) -> None:
        """The group's adapters (None: not read) and, from one /metrics read, the adapters it
        runs and (kv-aware) its load gauges; a failed read leaves none of them (a kv-aware
        group is then scored by the router's own count)."""
        state = self.picker.states.get(group.key)
        if state is None:
            return
        models = await self._get(group, "/v1/models", self.headers)
        state.adapters = adapters.listed(models) if models is not None else None
        if self.picker.kv is None and not state.adapters:
            return
        text = await self._get(group, "/metrics")
        if self.picker.kv is not None:
            state.engine = parse(text, time.monotonic()) if text is not None else None
        state.resident = adapters.running(text) if text and state.adapters else frozenset()

    async def read_unlisted(self) -> bool:
        """Read now what every usable group whose adapters were never read lists (a group just
        added or moved: a restarted group enters discovery with its adapters loaded, and its
        list would otherwise be read only at the next round); whether there was any. Before the
        router answers an unknown name with its own 404 (found by benchmarks/lora_churn.py:
        the only groups listing an adapter had just restarted)."""
        unread = [s.group for s in self.picker.usable() if s.adapters is None]
        await asyncio.gather(*(self.read_engine(g) for g in unread))
        return bool(unread)

    async def _get(self, group: Group, path: str, headers: dict | None = None) -> str | None:
        try:
            resp = await self.client.get(f"{group.url}{path}", headers=headers,
                                         timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None

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
