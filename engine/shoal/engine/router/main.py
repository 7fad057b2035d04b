"""`run_router(args)`: `shoal serve MODEL --frontend-only` after `serve.py` parsed the flags.

One process: uvicorn serving the router app. No model, tokenizer or EngineCore is loaded; MODEL
is only the default served model name. Exit code 0 after SIGTERM/SIGINT (in-flight requests get
GRACE_S to finish), 1 when it cannot bind, 2 for a bad routing setting. `serve_app` is shared
with the gateway (gateway.py).
"""

from __future__ import annotations

import logging
import os
import signal

from shoal.engine.router.affinity import IMBALANCE, IMBALANCE_ENV, ROUTING_ENV, make_affinity

logger = logging.getLogger("shoal.router")

COOLDOWN_ENV = "SHOAL_ROUTER_COOLDOWN_S"
POLL_ENV = "SHOAL_ROUTER_POLL_S"
PROBE_ENV = "SHOAL_ROUTER_PROBE_S"
# On SIGTERM, streams in flight get this long to finish before they are cut.
GRACE_S = 30


def routing_from_env() -> tuple[str, int]:
    """(routing, imbalance) from SHOAL_ROUTER_ROUTING / SHOAL_ROUTER_PREFIX_IMBALANCE;
    ValueError says what is wrong."""
    routing = os.environ.get(ROUTING_ENV) or "least-outstanding"
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


def serve_app(app, host: str, port: int) -> int:
    """Run `app` under uvicorn until SIGTERM/SIGINT; the exit code."""
    import uvicorn
    from shoal.engine.entrypoints import event_loop

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
        event_loop.run(server.serve())
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind
        return int(exc.code or 1)
    if not server.started:
        return 1
    logger.info("stopped")
    return 0


def run_router(args) -> int:
    from shoal.engine.router.app import Router, build_app
    from shoal.engine.router.discovery import POLL_INTERVAL_S
    from shoal.engine.router.health import PROBE_INTERVAL_S
    from shoal.engine.router.picker import COOLDOWN_S

    try:
        routing, imbalance = routing_from_env()
    except ValueError as exc:
        logger.error("configuration error: %s", exc)
        return 2
    router = Router(
        args.engine_discovery_file, served_model_names=args.served_model_name,
        default_model=args.model, api_key=args.api_key,
        cooldown=float(os.environ.get(COOLDOWN_ENV, COOLDOWN_S)),
        poll_interval=float(os.environ.get(POLL_ENV, POLL_INTERVAL_S)),
        probe_interval=float(os.environ.get(PROBE_ENV, PROBE_INTERVAL_S)),
        routing=routing, imbalance=imbalance)
    app = build_app(router)
    logger.info("frontend only: routing %s to the engine groups in %s on %s:%d (%s)",
                ", ".join(router.model_names()), args.engine_discovery_file, args.host,
                args.port, routing)
    return serve_app(app, args.host, args.port)
