"""`shoal router`: the per-engine frontend. It routes OpenAI requests to the engine groups listed
in a discovery file (the operator's `engines.json`, `shoal.contract.discovery`).

One process: uvicorn serving the router app. No model, tokenizer or EngineCore is loaded.
`shoal serve MODEL --frontend-only --engine-discovery-file PATH` is kept as an alias (the CLI
rewrites it to this command; manifests of earlier releases use it). Exit code 0 after
SIGTERM/SIGINT (in-flight requests get GRACE_S to finish), 1 when it cannot bind, 2 for a bad
setting. `serve_app` is shared with the gateway (gateway.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from shoal.contract import auth, discovery
from shoal.contract.routing import (
    DEFAULT_KV_EVENTS_PORT,
    DEFAULT_KV_REPLAY_PORT,
    DEFAULT_ROUTING,
    IMBALANCE_ENV,
    KV_AWARE,
    KV_EVENTS_PORT_ENV,
    KV_REPLAY_PORT_ENV,
    KV_TOKENIZER_ENV,
    ROUTING_ENV,
)
from shoal.router.affinity import IMBALANCE, make_affinity

logger = logging.getLogger("shoal.router")

COOLDOWN_ENV = "SHOAL_ROUTER_COOLDOWN_S"
POLL_ENV = "SHOAL_ROUTER_POLL_S"
PROBE_ENV = "SHOAL_ROUTER_PROBE_S"
# On SIGTERM, streams in flight get this long to finish before they are cut.
GRACE_S = 30


def routing_from_env() -> tuple[str, int]:
    """(routing, imbalance) from SHOAL_ROUTER_ROUTING / SHOAL_ROUTER_PREFIX_IMBALANCE;
    ValueError says what is wrong."""
    routing = os.environ.get(ROUTING_ENV) or DEFAULT_ROUTING
    raw = os.environ.get(IMBALANCE_ENV) or str(IMBALANCE)
    try:
        imbalance = int(raw)
    except ValueError:
        raise ValueError(f"{IMBALANCE_ENV}={raw!r} is not a whole number") from None
    try:
        make_affinity(routing, imbalance)
    except ValueError as exc:
        raise ValueError(f"{ROUTING_ENV}: {exc}") from None
    return routing, imbalance


def add_kv_arguments(p: argparse.ArgumentParser) -> None:
    """kv-aware routing's settings (both routers); defaults from the operator's environment."""
    p.add_argument("--kv-tokenizer", metavar="PATH", default=os.environ.get(KV_TOKENIZER_ENV),
                   help="kv-aware: the model's tokenizer.json (or its folder)")
    p.add_argument("--kv-events-port", type=int,
                   default=int(os.environ.get(KV_EVENTS_PORT_ENV) or DEFAULT_KV_EVENTS_PORT),
                   help="kv-aware: the port of each group's KV events (vLLM's "
                        "--kv-events-config endpoint) on its rank 0's host")
    p.add_argument("--kv-replay-port", type=int,
                   default=int(os.environ.get(KV_REPLAY_PORT_ENV) or DEFAULT_KV_REPLAY_PORT),
                   help="kv-aware: the port of each group's KV event replay (vLLM's "
                        "replay_endpoint); 0 for none")
    p.add_argument("--kv-endpoint", metavar="LABEL=EVENTS[,REPLAY]", action="append",
                   default=[], help="kv-aware: one group's KV event endpoints instead of its "
                   "host and the ports above (LABEL as in /metrics: '1', or 'ns/engine/1' in the "
                   "gateway), e.g. 0=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558; repeat per group")


def kv_routing(routing: str, args):
    """The KvRouting for `routing: kv-aware`, else None; ValueError says what is missing."""
    if routing != KV_AWARE:
        return None
    from shoal.router.kv_subscriber import make_kv_routing

    return make_kv_routing(args.kv_tokenizer, args.kv_events_port, args.kv_replay_port or None,
                           args.kv_endpoint)


def serve_app(app, host: str, port: int) -> int:
    """Run `app` under uvicorn until SIGTERM/SIGINT; the exit code."""
    import uvicorn
    from shoal.router import allocator

    logger.info("%s", allocator.bound())
    # One line per event: the HTTP client's per-request INFO lines are not events.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    class Server(uvicorn.Server):
        # Not uvicorn's own handler: that re-raises the signal at exit (exit code 143, which
        # reads as a crash); a requested stop exits 0 like `shoal serve`.
        def handle_exit(self, sig: int, frame) -> None:
            name = signal.Signals(sig).name
            if self.should_exit:
                logger.warning("second %s: exiting now", name)
                self.force_exit = True
            else:
                logger.info("received %s: finishing in-flight requests (up to %d s), then "
                            "exiting", name, GRACE_S)
            self.should_exit = True

    server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                   access_log=False, timeout_graceful_shutdown=GRACE_S,
                                   timeout_keep_alive=5))
    try:
        server.run()  # uvloop where installed (loop="auto"), as vLLM's uvicorn[standard]
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind
        return int(exc.code or 1)
    if not server.started:
        return 1
    logger.info("stopped")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shoal router",
        description="The per-engine OpenAI frontend: routes to the engine groups listed in a "
                    "discovery file (docs/router.md). Loads no model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine-discovery-file", metavar="PATH", required=True,
                   help="JSON file listing the engine groups' URLs (the operator's "
                        f"{discovery.KEY}); re-read when it changes")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients send as `model` (default: the discovery "
                        "file's `model`)")
    p.add_argument("--model", default=None,
                   help="the model the groups serve, reported as `root` in /v1/models "
                        "(default: the served name)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    add_kv_arguments(p)
    auth.add_api_key_argument(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [frontend] %(message)s")
    return run_router(args)


def run_router(args) -> int:
    from shoal.router.app import Router, build_app
    from shoal.router.discovery import POLL_INTERVAL_S
    from shoal.router.health import PROBE_INTERVAL_S
    from shoal.router.picker import COOLDOWN_S

    try:
        routing, imbalance = routing_from_env()
        kv = kv_routing(routing, args)
    except ValueError as exc:
        logger.error("configuration error: %s", exc)
        return 2
    router = Router(
        args.engine_discovery_file, served_model_names=args.served_model_name,
        default_model=args.model, api_keys=auth.api_keys(args.api_key, os.environ),
        cooldown=float(os.environ.get(COOLDOWN_ENV, COOLDOWN_S)),
        poll_interval=float(os.environ.get(POLL_ENV, POLL_INTERVAL_S)),
        probe_interval=float(os.environ.get(PROBE_ENV, PROBE_INTERVAL_S)),
        routing=routing, imbalance=imbalance, kv=kv)
    app = build_app(router)
    logger.info("frontend only: routing %s to the engine groups in %s on %s:%d (%s)",
                ", ".join(router.model_names()), args.engine_discovery_file, args.host,
                args.port, routing)
    return serve_app(app, args.host, args.port)
