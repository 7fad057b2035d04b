"""Discovery straight from the Kubernetes API: watch the operator's ConfigMap `NAME-engines`.

Why: the operator writes the ConfigMap the moment a group becomes Ready (or starts draining),
but the kubelet refreshes a ConfigMap *volume* only on its pod sync, up to a minute later; a
frontend reading only the mounted file stayed unready for ~73 s after its group was Ready. A
watch delivers the change within a second. The mounted file remains the fallback (and the only
source outside Kubernetes).

Enabled when the frontend pod has `SHOAL_DISCOVERY_CONFIGMAP` (the ConfigMap's name) and
`POD_NAMESPACE`, which the operator sets, and a ServiceAccount token; the operator gives the
frontend a ServiceAccount whose Role may get/list/watch only that ConfigMap.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from pathlib import Path

import httpx
from shoal.contract import discovery
from shoal.router.discovery import DiscoveryWatcher

logger = logging.getLogger("shoal.router.discovery")

CONFIGMAP_ENV = discovery.CONFIGMAP_ENV
NAMESPACE_ENV = discovery.NAMESPACE_ENV
KEY = discovery.KEY
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
RETRY_S = 1.0
WATCH_TIMEOUT_S = 300


def in_cluster_server() -> str | None:
    """The API server's URL inside a pod with a ServiceAccount token; else None."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get(
        "KUBERNETES_SERVICE_PORT", "443")
    if not (host and (SA_DIR / "token").is_file()):
        return None
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{port}"


def api_client(server: str, token_file: Path, ca_file: Path) -> httpx.AsyncClient:
    """A client of the API server; the token is read now (projected tokens rotate)."""
    ctx = ssl.create_default_context(cafile=str(ca_file))
    token = token_file.read_text().strip()
    return httpx.AsyncClient(base_url=server, verify=ctx,
                             headers={"Authorization": f"Bearer {token}"},
                             timeout=httpx.Timeout(10.0, read=WATCH_TIMEOUT_S + 30))


def from_environment(watcher: DiscoveryWatcher) -> ConfigMapSource | None:
    """The API source when running in a pod that the operator set up for it; else None."""
    name, ns = os.environ.get(CONFIGMAP_ENV), os.environ.get(NAMESPACE_ENV)
    server = in_cluster_server()
    if not (name and ns and server):
        return None
    return ConfigMapSource(server, ns, name, watcher,
                           token_file=SA_DIR / "token", ca_file=SA_DIR / "ca.crt")


class ConfigMapSource:
    """GET the ConfigMap, then watch it from that resourceVersion; feed every version to the
    watcher (`offer`). On any error: one log line per distinct problem, retry after RETRY_S."""

    def __init__(self, server: str, namespace: str, name: str, watcher: DiscoveryWatcher, *,
                 token_file: Path, ca_file: Path) -> None:
        self.server, self.namespace, self.name = server, namespace, name
        self.watcher = watcher
        self.token_file, self.ca_file = token_file, ca_file
        self.source = f"ConfigMap {namespace}/{name}"
        self.problem: str | None = None

    def _client(self) -> httpx.AsyncClient:
        return api_client(self.server, self.token_file, self.ca_file)

    def _feed(self, obj: dict) -> None:
        text = (obj.get("data") or {}).get(KEY)
        if text is None:
            self._report(f"{self.source} has no key {KEY}")
            return
        if self.watcher.offer(text, self.source):
            if not self.watcher.api_active:
                logger.info("discovery: following %s through the API", self.source)
            self.watcher.api_active = True
            self.problem = None

    def _report(self, problem: str) -> None:
        if problem != self.problem:
            logger.warning("discovery: %s; retrying every %.0fs (the mounted file is the "
                           "fallback meanwhile)", problem, RETRY_S)
        self.problem = problem

    async def once(self) -> None:
        """One GET + one watch until the server closes it."""
        base = f"/api/v1/namespaces/{self.namespace}/configmaps"
        async with self._client() as client:
            r = await client.get(f"{base}/{self.name}")
            if r.status_code != 200:
                raise RuntimeError(f"GET {self.source}: HTTP {r.status_code} {r.text[:200]}")
            obj = r.json()
            self._feed(obj)
            params = {"watch": "true", "fieldSelector": f"metadata.name={self.name}",
                      "resourceVersion": obj["metadata"]["resourceVersion"],
                      "timeoutSeconds": str(WATCH_TIMEOUT_S)}
            async with client.stream("GET", base, params=params) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")[:200]
                    raise RuntimeError(f"watch {self.source}: HTTP {resp.status_code} {body}")
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        self._feed(event["object"])
                    elif event.get("type") == "ERROR":  # e.g. 410 Gone: relist
                        raise RuntimeError(f"watch {self.source}: {event.get('object')}")

    async def run(self) -> None:
        while True:
            try:
                await self.once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep the last list, retry
                self._report(str(exc) or type(exc).__name__)
                await asyncio.sleep(RETRY_S)
