"""`run_router(args)`: `shoal serve MODEL --frontend-only` after `serve.py` parsed the flags.

One process: uvicorn serving the router app. No model, tokenizer or EngineCore is loaded; MODEL
is only the default served model name. Exit code 0 after SIGTERM/SIGINT (in-flight requests get
GRACE_S to finish), 1 when it cannot bind.
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger("shoal.router")

COOLDOWN_ENV = "SHOAL_ROUTER_COOLDOWN_S"
POLL_ENV = "SHOAL_ROUTER_POLL_S"
PROBE_ENV = "SHOAL_ROUTER_PROBE_S"
# On SIGTERM, streams in flight get this long to finish before they are cut.
GRACE_S = 30


def run_router(args) -> int:
    import uvicorn
    from shoal.engine.entrypoints import event_loop
    from shoal.engine.router.app import Router, build_app
    from shoal.engine.router.discovery import POLL_INTERVAL_S
    from shoal.engine.router.health import PROBE_INTERVAL_S
    from shoal.engine.router.picker import COOLDOWN_S

    router = Router(
        args.engine_discovery_file, served_model_names=args.served_model_name,
        default_model=args.model, api_key=args.api_key,
        cooldown=float(os.environ.get(COOLDOWN_ENV, COOLDOWN_S)),
        poll_interval=float(os.environ.get(POLL_ENV, POLL_INTERVAL_S)),
        probe_interval=float(os.environ.get(PROBE_ENV, PROBE_INTERVAL_S)))
    # One line per event: the HTTP client's per-request INFO lines are not events.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    app = build_app(router)

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

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                   access_log=False, timeout_graceful_shutdown=GRACE_S,
                                   timeout_keep_alive=5))
    logger.info("frontend only: routing %s to the engine groups in %s on %s:%d",
                ", ".join(router.model_names()), args.engine_discovery_file, args.host,
                args.port)
    try:
        event_loop.run(server.serve())
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind
        return int(exc.code or 1)
    if not server.started:
        return 1
    logger.info("frontend stopped")
    return 0
