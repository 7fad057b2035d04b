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
from shoal.router.engine_load import GAUGES, parse
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
        self._reread: asyncio.Future | None = None  # the read of every list now in flight
        self._reread_at = float("-inf")  # when it started (time.monotonic)

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
        """The group's adapters and, from one /metrics read, the adapters it runs and
        (kv-aware) its load gauges. A failed list read keeps the last list of this address (an
        engine drops an adapter only when told to, and a group's 404 says so: a busy engine
        missing a 2 s read made its adapters the router's 404); a failed /metrics read leaves
        no gauges (a kv-aware group is then scored by the router's own count). The read asks
        for those series alone (`name[]`, prometheus_client's filter, which vLLM's /metrics
        takes too): the whole text cost a Shoal engine 4.9 ms of CPU per read, the gauges
        0.6, on cores that serve requests (benchmarks/README.md, kv-routing)."""
        state = self.picker.states.get(group.key)
        if state is None:
            return
        models = await self._get(group, "/v1/models", self.headers)
        if models is not None:
            state.adapters = adapters.listed(models)
        if self.picker.kv is None and not state.adapters:
            return
        state.peak = state.outstanding  # the read's window starts (EngineLoad.ours)
        names = [*(GAUGES if self.picker.kv is not None else ()),
                 *((adapters.INFO_METRIC,) if state.adapters else ())]
        text = await self._get(group, "/metrics", params={"name[]": names})
        if self.picker.kv is not None:
            state.engine = (parse(text, time.monotonic(), ours=state.peak)
                            if text is not None else None)
        state.resident = adapters.running(text) if text and state.adapters else frozenset()

    async def reread(self) -> None:
        """Read every usable group's lists by a read that started after this call (one read in
        flight, shared by every caller that asked before it started). Before the router answers
        a name no list has with its own 404: a group that just came, or an adapter loaded since
        the last round, is found (benchmarks/lora_churn.py: an adapter reported Ready, proven
        through one frontend, was the other frontend's 404 until its next round)."""
        asked = time.monotonic()
        while True:
            task = self._reread
            if task is not None and self._reread_at >= asked:
                await asyncio.shield(task)
                return
            if task is not None and not task.done():
                await asyncio.shield(task)  # began before this call: it may miss the change
                continue
            self._reread_at = time.monotonic()
            self._reread = asyncio.ensure_future(asyncio.gather(
                *(self.read_engine(s.group) for s in self.picker.usable())))

    async def _get(self, group: Group, path: str, headers: dict | None = None,
                   params: dict | None = None) -> str | None:
        try:
            resp = await self.client.get(f"{group.url}{path}", headers=headers, params=params,
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
