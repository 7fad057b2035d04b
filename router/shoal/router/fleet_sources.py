"""Where the gateway learns of engines: the operator's discovery ConfigMaps through the API
(in a cluster), or a directory of discovery files (outside one).

API: in each namespace the gateway may see, list the ConfigMaps the operator manages for
frontends (labels `app.kubernetes.io/managed-by=shoal-operator`, `shoal.dev/component=frontend`;
the operator's `NAME-engines`, key `engines.json`), then watch them; the engine is
`NAMESPACE/<shoal.dev/engine label>`. A deleted ConfigMap (its InferenceEngine was deleted)
removes the engine. Errors: one log line per distinct problem, retry after RETRY_S.

Directory: every `*.json` file is one engine's `engines.json` (the engine is the file's name
without `.json`), polled like the per-engine frontend's file; an invalid file keeps its last good
version, a removed file removes the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from shoal.contract.labels import FRONTEND_SELECTOR, LABEL_ENGINE
from shoal.router.discovery import (
    POLL_INTERVAL_S,
    Discovery,
    file_signature,
    parse_discovery,
    poll,
)
from shoal.router.fleet import Fleet
from shoal.router.k8s_discovery import KEY, RETRY_S, WATCH_TIMEOUT_S, api_client

logger = logging.getLogger("shoal.router.discovery")

SELECTOR = FRONTEND_SELECTOR


class ConfigMapsSource:
    def __init__(self, server: str, namespaces: list[str], fleet: Fleet, *, token_file: Path,
                 ca_file: Path) -> None:
        self.server, self.namespaces, self.fleet = server, namespaces, fleet
        self.token_file, self.ca_file = token_file, ca_file
        self.problems: dict[str, str | None] = {}
        self.synced: set[str] = set()  # namespaces listed at least once

    def engine_of(self, obj: dict) -> str | None:
        meta = obj.get("metadata") or {}
        name = (meta.get("labels") or {}).get(LABEL_ENGINE)
        return f"{meta.get('namespace')}/{name}" if name else None

    def feed(self, obj: dict) -> str | None:
        """Offer one ConfigMap to the fleet; the engine it names, if any."""
        engine = self.engine_of(obj)
        text = (obj.get("data") or {}).get(KEY)
        if engine is None or text is None:
            return None
        try:
            found = parse_discovery(text)
        except ValueError as exc:
            self._report(f"engine {engine}", f"ConfigMap {obj['metadata'].get('name')} is "
                                             f"invalid: {exc}; keeping its last good list")
            return engine
        self._report(f"engine {engine}", None)
        self.fleet.update(engine, found)
        return engine

    def _report(self, what: str, problem: str | None) -> None:
        if problem and problem != self.problems.get(what):
            logger.warning("discovery: %s: %s", what, problem)
        elif problem is None and self.problems.get(what):
            logger.info("discovery: %s is fine again", what)
        self.problems[what] = problem

    async def once(self, namespace: str) -> None:
        """One list + one watch of `namespace` until the server closes it."""
        base = f"/api/v1/namespaces/{namespace}/configmaps"
        async with api_client(self.server, self.token_file, self.ca_file) as client:
            r = await client.get(base, params={"labelSelector": SELECTOR})
            if r.status_code != 200:
                raise RuntimeError(f"list ConfigMaps in {namespace}: HTTP {r.status_code} "
                                   f"{r.text[:200]}")
            listing = r.json()
            seen = {self.feed(obj) for obj in listing.get("items") or []}
            for engine in [e for e in self.fleet.engines if e.startswith(f"{namespace}/")]:
                if engine not in seen:
                    self.fleet.remove(engine, "its discovery ConfigMap is gone")
            if namespace not in self.synced:
                self.synced.add(namespace)
                logger.info("discovery: following the discovery ConfigMaps in namespace %s "
                            "through the API", namespace)
            self._report(f"namespace {namespace}", None)
            params = {"watch": "true", "labelSelector": SELECTOR,
                      "resourceVersion": listing["metadata"]["resourceVersion"],
                      "timeoutSeconds": str(WATCH_TIMEOUT_S), "allowWatchBookmarks": "true"}
            async with client.stream("GET", base, params=params) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")[:200]
                    raise RuntimeError(f"watch ConfigMaps in {namespace}: HTTP "
                                       f"{resp.status_code} {body}")
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind in ("ADDED", "MODIFIED"):
                        self.feed(obj)
                    elif kind == "DELETED" and (engine := self.engine_of(obj)):
                        self.fleet.remove(engine, "its discovery ConfigMap was deleted")
                    elif kind == "ERROR":  # e.g. 410 Gone: list again
                        raise RuntimeError(f"watch ConfigMaps in {namespace}: {obj}")

    async def follow(self, namespace: str) -> None:
        while True:
            try:
                await self.once(namespace)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep what is known, retry
                self._report(f"namespace {namespace}",
                             f"{exc or type(exc).__name__}; retrying every {RETRY_S:.0f}s")
                await asyncio.sleep(RETRY_S)

    async def run(self) -> None:
        await asyncio.gather(*(self.follow(ns) for ns in self.namespaces))


class DirectorySource:
    def __init__(self, path: str, fleet: Fleet, interval: float = POLL_INTERVAL_S) -> None:
        self.path, self.fleet, self.interval = Path(path), fleet, interval
        self._seen: dict[str, tuple | None] = {}
        self.problems: dict[str, str | None] = {}  # engine ("" = the directory) -> problem

    def check(self) -> None:
        missing = not self.path.is_dir()
        if missing and self.problems.get("") is None:
            logger.error("discovery directory %s does not exist; serving no engines from it",
                         self.path)
        self.problems[""] = "missing" if missing else None
        files = {} if missing else {p.name[:-len(".json")]: p for p in self.path.glob("*.json")}
        for engine in sorted(set(self._seen) - set(files)):
            del self._seen[engine]
            self.problems.pop(engine, None)
            self.fleet.remove(engine, f"{self.path / (engine + '.json')} is gone")
        for engine, path in sorted(files.items()):
            sig = file_signature(path)
            if sig == self._seen.get(engine, "never"):
                continue
            self._seen[engine] = sig
            try:
                found = parse_discovery(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                problem = f"discovery file {path} is invalid: {exc}"
                if self.problems.get(engine) != problem:
                    logger.error("%s; keeping engine %s's last good list", problem, engine)
                self.problems[engine] = problem
                continue
            if self.problems.pop(engine, None):
                logger.info("discovery file %s is valid again", path)
            self.fleet.update(engine, found)

    async def run(self) -> None:
        await poll(self.check, self.interval, f"discovery check of {self.path}")


__all__ = ["ConfigMapsSource", "Discovery", "DirectorySource"]
