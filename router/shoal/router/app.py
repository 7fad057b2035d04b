"""The router's HTTP surface (FastAPI): the OpenAI routes are forwarded to a group by `Proxy`;
/v1/models, /health, /version and /metrics are answered here.

Objects: one `Router` per process holds the picker, the discovery watcher, the health prober,
the metrics and the shared httpx client; the background tasks live in the app's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from shoal.contract import __version__, discovery
from shoal.contract.auth import KeyCheck
from shoal.contract.routing import DEFAULT_IMBALANCE, DEFAULT_ROUTING, KV_AWARE
from shoal.router import adapters, k8s_discovery, k8s_wake
from shoal.router.affinity import make_affinity, request_keys
from shoal.router.discovery import Discovery, DiscoveryWatcher
from shoal.router.errors import error_response, no_group_message, unknown_model
from shoal.router.health import HealthProber
from shoal.router.hold import READY, Holder, not_woken
from shoal.router.metrics import RouterMetrics
from shoal.router.picker import GroupPicker
from shoal.router.proxy import UPSTREAM_TIMEOUT, Proxy
from starlette.exceptions import HTTPException as StarletteHTTPException

if TYPE_CHECKING:  # zmq only where kv-aware routing runs (main.py builds it)
    from shoal.router.kv_subscriber import KvRouting

PROXIED = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


def model_list(models: list[tuple], created: int) -> dict:
    """OpenAI's /v1/models body for (served name, root model[, parent]) rows: a LoRA adapter's
    parent is its base model, as vLLM lists it."""
    return {"object": "list", "data": [
        {"id": row[0], "object": "model", "created": created, "owned_by": "shoal",
         "root": row[1], "parent": row[2] if len(row) > 2 else None} for row in models]}


class Router:
    def __init__(self, discovery_file: str, *, served_model_names: list[str] | None,
                 default_model: str | None, api_keys: list[str], cooldown: float,
                 poll_interval: float, probe_interval: float,
                 routing: str = DEFAULT_ROUTING, imbalance: int = DEFAULT_IMBALANCE,
                 kv: KvRouting | None = None) -> None:
        self.served_model_names = served_model_names
        self.default_model = default_model
        self.api_keys = api_keys
        self.metrics = RouterMetrics()
        if (routing == KV_AWARE) != (kv is not None):
            raise ValueError("routing kv-aware needs its KvRouting (and only it takes one)")
        self.kv = kv
        self.affinity = None if kv else make_affinity(routing, imbalance)
        self.picker = GroupPicker(cooldown=cooldown, affinity=self.affinity,
                                  kv=kv.aware if kv else None)
        self.watcher = DiscoveryWatcher(discovery_file, self._on_discovery, poll_interval)
        self.client = httpx.AsyncClient(
            timeout=UPSTREAM_TIMEOUT,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=200))
        # Scale from zero (hold.py): while discovery says `wakeable`, a request that finds no
        # group waits for one, and the engine's wake Lease is renewed (in a pod the operator
        # set up; elsewhere nobody is asked).
        self.engine = discovery.engine_of_configmap(os.environ.get(discovery.CONFIGMAP_ENV, ""))
        self.wakeable = False
        self.holder = Holder.from_environment(k8s_wake.from_environment())
        self.proxy = Proxy(self.picker, self.metrics, self.client)
        self.prober = HealthProber(self.picker, self.client, probe_interval,
                                   api_key=api_keys[0] if api_keys else None)
        # In a pod the operator set up: the ConfigMap from the API (seconds, not a kubelet sync).
        self.api_source = k8s_discovery.from_environment(self.watcher)

    def _on_discovery(self, found: Discovery) -> None:
        self.wakeable = found.wakeable
        self.picker.set_groups(found.groups)
        if self.kv is not None:
            self.kv.set_groups(found.groups)

    def model_names(self) -> list[str]:
        if self.served_model_names:
            return self.served_model_names
        found = self.watcher.current
        model = found.model if found and found.model else self.default_model
        return [model] if model else []

    def refresh_gauges(self) -> None:
        self.metrics.listed.set(len(self.picker.states))
        self.metrics.usable.set(len(self.picker.usable()))
        self.metrics.discovery_valid.set(0 if self.watcher.problem else 1)
        self.metrics.holding.set(sum(self.holder.held.values()))
        if self.kv is not None:
            self.metrics.observe_kv(self.kv.index, time.monotonic())

    def unready_reason(self) -> str:
        why = self.picker.why_none()
        if self.watcher.problem:
            why += f" ({self.watcher.problem})"
        return no_group_message(why)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        self.watcher.check()
        sources = [self.api_source.run] if self.api_source is not None else []
        if self.kv is not None:
            sources.append(self.kv.subscriber.run)
        async with background(self.client, self.watcher.run, self.prober.run, *sources):
            yield


@contextlib.asynccontextmanager
async def background(client: httpx.AsyncClient, *runners: Callable[[], Awaitable[None]]):
    """A router's lifespan: each runner (watchers, prober) as a task while the app serves; then
    the tasks cancelled and the shared HTTP client closed."""
    tasks = [asyncio.ensure_future(run()) for run in runners]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()


class Unauthorized(Exception):
    pass


Forward = Callable[[Request, str, bytes], Awaitable[Response]]


@dataclass(frozen=True)
class Surface:
    """What one router answers itself; the routes around it are the same for both routers.

    forward(request, path, body): a PROXIED request, after the API key check; models(): the
    (served name, root) pairs of /v1/models; unready(): why /health is 503, None when ready;
    metrics(): the /metrics body."""

    forward: Forward
    models: Callable[[], list[tuple[str, str]]]
    unready: Callable[[], str | None]
    metrics: Callable[[], Awaitable[bytes]]


def common_app(title: str, lifespan, api_keys: list[str], surface: Surface) -> FastAPI:
    """The routers' FastAPI app: their error handlers, the API key check, the PROXIED routes,
    /v1/models, /health, /metrics and /version."""
    keys = KeyCheck(api_keys)
    app = FastAPI(title=title, version=__version__, docs_url=None, redoc_url=None,
                  lifespan=lifespan)

    @app.exception_handler(Unauthorized)
    async def _on_unauthorized(request: Request, exc: Unauthorized):
        return error_response(401, "invalid or missing API key: send 'Authorization: Bearer "
                                   "<key>' with the key given to --api-key",
                              "AuthenticationError")

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "Error")
        return error_response(exc.status_code, str(exc.detail), kind)

    def check_key(request: Request) -> None:
        if not keys.accepts(request.headers.get("authorization")):
            raise Unauthorized()

    def proxied(path: str, protected: bool):
        async def handler(request: Request) -> Response:
            if protected:
                check_key(request)
            return await surface.forward(request, path, await request.body())

        handler.__name__ = "proxy_" + path.strip("/").replace("/", "_")
        return handler

    for path in PROXIED:
        app.add_api_route(path, proxied(path, path.startswith("/v1")), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return model_list(surface.models(), int(time.time()))

    @app.get("/health")
    async def health():
        why = surface.unready()
        if why:
            return error_response(503, why, "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(await surface.metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    return app


def build_app(router: Router) -> FastAPI:
    async def forward(request: Request, path: str, body: bytes) -> Response:
        if router.wakeable and not router.picker.any_usable():  # scaled to zero: wait
            outcome = await router.holder.wait(router.engine, router.picker.any_usable)
            router.metrics.held.labels(outcome).inc()
            if outcome != READY:
                return not_woken(router.holder, router.engine, outcome)
        only, adapter = None, None
        states = router.picker.states.values()
        model = adapters.model_of(body)
        kind = await adapters.lookup(model, router.model_names(), states, router.prober.reread)
        if kind == adapters.ADAPTER:  # an adapter goes only where it is loaded
            only, adapter = adapters.groups_for(model, states), model
        elif kind == adapters.UNKNOWN:
            return unknown_model(model, [*router.model_names(), *adapters.known(states)])
        keys = (await router.kv.aware.keys_of(body) if router.kv is not None
                else request_keys(router.affinity, body))
        return await router.proxy.forward(request, path, body, only=only, prefix=keys,
                                          adapter=adapter)

    async def metrics() -> bytes:
        router.refresh_gauges()
        return router.metrics.render()

    surface = Surface(
        forward=forward,
        models=lambda: adapters.model_cards(
            {name: router.default_model or name for name in router.model_names()},
            adapters.known(router.picker.states.values())),
        # Ready while it can hold requests for an engine scaled to zero: the Service must keep
        # sending them here, or nobody would ask for a group.
        unready=lambda: (None if router.picker.usable() or router.wakeable
                         else router.unready_reason()),
        metrics=metrics)
    app = common_app("shoal router", router.lifespan, router.api_keys, surface)
    app.state.router = router
    return app
