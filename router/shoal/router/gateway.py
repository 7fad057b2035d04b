"""The fleet gateway: one OpenAI endpoint for every InferenceEngine it may see, routing each
request by its `model` to that model's engine groups (docs/router.md, "Fleet gateway").

    python -m shoal.router.gateway [--namespace NS ...] [--discovery-dir DIR]
        [--routing least-outstanding|prefix-affinity|kv-aware] [--kv-tokenizer PATH]
        [--host H] [--port P] [--api-key KEY]

Discovery: the operator's discovery ConfigMaps through the API (in a pod: its ServiceAccount;
`--namespace` as often as needed, default the pod's own namespace), and/or a directory of
discovery files (`--discovery-dir`, outside Kubernetes). Forwarding, retries, cool-downs,
health probes and streaming are the per-engine frontend's (proxy.py, picker.py, health.py).
`/v1/models` lists every model with a ready group; an unknown model is OpenAI's 404 naming the
available models; `/metrics` has the gateway's own `shoal_router_*` series (the `group` label is
`NAMESPACE/ENGINE/GROUP`) and the groups' `vllm:*` series summed per model (aggregate.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from shoal.contract import auth
from shoal.contract.routing import DEFAULT_ROUTING, KV_AWARE, ROUTING_ENV
from shoal.router import adapters, aggregate, k8s_discovery
from shoal.router.affinity import IMBALANCE, ROUTINGS, make_affinity, request_keys
from shoal.router.app import Surface, background, common_app
from shoal.router.errors import error_response, unknown_model
from shoal.router.fleet import Fleet
from shoal.router.fleet_sources import ConfigMapsSource, DirectorySource
from shoal.router.health import PROBE_INTERVAL_S, HealthProber
from shoal.router.hold import READY, Holder, not_woken
from shoal.router.k8s_wake import POD_ENV, LeaseWaker
from shoal.router.main import (
    COOLDOWN_ENV,
    POLL_ENV,
    PROBE_ENV,
    add_kv_arguments,
    kv_routing,
    serve_app,
)
from shoal.router.metrics import RouterMetrics
from shoal.router.picker import COOLDOWN_S, GroupPicker
from shoal.router.proxy import UPSTREAM_TIMEOUT, Proxy

logger = logging.getLogger("shoal.gateway")


class Gateway:
    def __init__(self, *, namespaces: list[str], discovery_dir: str | None,
                 kube: tuple[str, Path, Path] | None, api_keys: list[str], routing: str,
                 imbalance: int = IMBALANCE, cooldown: float = COOLDOWN_S,
                 poll_interval: float = 1.0, probe_interval: float = PROBE_INTERVAL_S,
                 kv=None) -> None:
        self.api_keys = api_keys
        self.routing = routing
        self.metrics = RouterMetrics()
        if (routing == KV_AWARE) != (kv is not None):
            raise ValueError("routing kv-aware needs its KvRouting (and only it takes one)")
        self.kv = kv  # kv_subscriber.KvRouting under kv-aware
        self.affinity = None if kv else make_affinity(routing, imbalance)
        self.picker = GroupPicker(cooldown=cooldown, affinity=self.affinity,
                                  kv=kv.aware if kv else None)
        self.fleet = Fleet(self._on_groups)
        self.client = httpx.AsyncClient(
            timeout=UPSTREAM_TIMEOUT,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=200))
        self.proxy = Proxy(self.picker, self.metrics, self.client)
        self.prober = HealthProber(self.picker, self.client, probe_interval,
                                   api_key=api_keys[0] if api_keys else None)
        self.directory = (DirectorySource(discovery_dir, self.fleet, poll_interval)
                          if discovery_dir else None)
        self.api = None
        waker = None
        if kube and namespaces:
            server, token_file, ca_file = kube
            self.api = ConfigMapsSource(server, namespaces, self.fleet, token_file=token_file,
                                        ca_file=ca_file)
            waker = LeaseWaker(server, namespaces[0], os.environ.get(POD_ENV) or "shoal-gateway",
                               token_file=token_file, ca_file=ca_file)
        # Scale from zero (hold.py): requests for a wakeable engine with no group wait here.
        self.holder = Holder.from_environment(waker)

    def _on_groups(self, groups) -> None:
        self.picker.set_groups(groups)
        if self.kv is not None:
            self.kv.set_groups(groups)

    def not_ready(self) -> str | None:
        """Why the gateway cannot answer for the fleet yet (its readiness), else None."""
        if self.api is not None:
            missing = [ns for ns in self.api.namespaces if ns not in self.api.synced]
            if missing:
                problems = "; ".join(p for p in self.api.problems.values() if p)
                return (f"discovery has not listed namespace(s) {', '.join(missing)} yet"
                        + (f": {problems}" if problems else ""))
        return None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        if self.directory is not None:
            self.directory.check()
        sources = [s.run for s in (self.directory, self.api) if s is not None]
        if self.kv is not None:
            sources.append(self.kv.subscriber.run)
        async with background(self.client, self.prober.run, *sources):
            yield


def build_gateway_app(gw: Gateway) -> FastAPI:
    async def forward(request: Request, path: str, body: bytes) -> Response:
        """To the groups of the body's `model`."""
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            return error_response(400, "the request body must be a JSON object",
                                  "BadRequestError")
        models = gw.fleet.models()
        model = data.get("model")
        if model is None and len(models) == 1:
            (model,) = models
        elif model is None:
            return error_response(400, "the request names no `model`; available models: "
                                       f"{', '.join(sorted(models)) or 'none'}",
                                  "BadRequestError")
        states = gw.picker.states.values()
        if model not in models:
            if await adapters.lookup(model, models, states, gw.prober.reread) != adapters.ADAPTER:
                return unknown_model(model, [*models, *adapters.known(states)])
            # A LoRA adapter: only the groups that have it loaded (adapters.py).
            only, adapter = adapters.groups_for(model, states), model
        else:
            adapter = None
            if (engine := gw.fleet.to_wake(model)) is not None:  # scaled to zero: wait for it
                outcome = await gw.holder.wait(
                    engine, lambda: gw.picker.any_usable(only=gw.fleet.groups_of(model)))
                gw.metrics.held.labels(outcome).inc()
                if outcome != READY:
                    return not_woken(gw.holder, engine, outcome)
            only = gw.fleet.groups_of(model)  # after the hold: the groups that woke
        keys = (await gw.kv.aware.keys_of(body) if gw.kv is not None
                else request_keys(gw.affinity, body))
        return await gw.proxy.forward(request, path, body, only=only, prefix=keys,
                                      adapter=adapter)

    async def metrics() -> bytes:
        """The gateway's own series, then every group's vllm:* summed per model."""
        gw.metrics.listed.set(len(gw.picker.states))
        gw.metrics.usable.set(len(gw.picker.usable()))
        gw.metrics.discovery_valid.set(0 if gw.not_ready() else 1)
        gw.metrics.holding.set(sum(gw.holder.held.values()))
        if gw.kv is not None:
            gw.metrics.observe_kv(gw.kv.index, time.monotonic())
        urls = sorted({s.group.url for s in gw.picker.states.values()})
        fleet = aggregate.aggregate(await aggregate.scrape(gw.client, urls))
        return gw.metrics.render() + fleet.encode()

    surface = Surface(forward=forward,
                      models=lambda: adapters.model_cards(
                          {name: name for name in sorted(gw.fleet.models())},
                          adapters.known(gw.picker.states.values())),
                      unready=gw.not_ready, metrics=metrics)
    app = common_app("shoal gateway", gw.lifespan, gw.api_keys, surface)
    app.state.gateway = gw
    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shoal gateway",
        description="One OpenAI endpoint for a fleet of InferenceEngines, routed by `model` "
                    "(docs/router.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--namespace", action="append", default=None, dest="namespaces",
                   help="a namespace whose InferenceEngines to serve (repeat for more); "
                        "default: $POD_NAMESPACE")
    p.add_argument("--discovery-dir", default=None,
                   help="a directory of discovery files, one ENGINE.json per engine (the "
                        "operator's engines.json format); for use outside Kubernetes")
    p.add_argument("--kube-server", default=None,
                   help="the API server's URL (default: the pod's, from its ServiceAccount)")
    p.add_argument("--kube-token-file", default=str(k8s_discovery.SA_DIR / "token"))
    p.add_argument("--kube-ca-file", default=str(k8s_discovery.SA_DIR / "ca.crt"))
    p.add_argument("--routing", choices=ROUTINGS,
                   default=os.environ.get(ROUTING_ENV) or DEFAULT_ROUTING)
    p.add_argument("--prefix-imbalance", type=int, default=IMBALANCE,
                   help="prefix-affinity: a prefix's group keeps it while its outstanding "
                        "requests exceed the least-loaded group's by at most this many")
    add_kv_arguments(p)
    auth.add_api_key_argument(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [gateway] %(message)s")
    namespaces = args.namespaces or ([os.environ["POD_NAMESPACE"]]
                                     if os.environ.get("POD_NAMESPACE") else [])
    server = args.kube_server or k8s_discovery.in_cluster_server()
    if not args.discovery_dir and not (server and namespaces):
        parser.error("nothing to discover: give --discovery-dir, or run in a pod (or give "
                     "--kube-server) with --namespace or $POD_NAMESPACE")
    kube = (server, Path(args.kube_token_file), Path(args.kube_ca_file)) if server else None
    try:
        kv = kv_routing(args.routing, args)
    except ValueError as exc:
        parser.error(str(exc))
    gw = Gateway(namespaces=namespaces if kube else [], discovery_dir=args.discovery_dir,
                 kube=kube, api_keys=auth.api_keys(args.api_key, os.environ), routing=args.routing,
                 imbalance=args.prefix_imbalance,
                 cooldown=float(os.environ.get(COOLDOWN_ENV, COOLDOWN_S)),
                 poll_interval=float(os.environ.get(POLL_ENV, 1.0)),
                 probe_interval=float(os.environ.get(PROBE_ENV, PROBE_INTERVAL_S)), kv=kv)
    sources = ([f"namespace(s) {', '.join(namespaces)} via {server}"] if kube and namespaces
               else []) + ([f"directory {args.discovery_dir}"] if args.discovery_dir else [])
    logger.info("gateway: serving the engines in %s on %s:%d (%s)", " and ".join(sources),
                args.host, args.port, args.routing)
    return serve_app(build_gateway_app(gw), args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
