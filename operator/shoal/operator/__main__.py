"""`shoal-operator`: run the kopf operator (namespaced or cluster-wide, liveness, log level).

    shoal-operator --namespace team-a --namespace team-b
    shoal-operator --all-namespaces --liveness http://0.0.0.0:8080/healthz --log-level debug
    shoal-operator --all-namespaces --metrics-port 8081     # Prometheus series (metrics.py)

Flags have environment fallbacks for the chart: SHOAL_NAMESPACES (comma separated; globs such
as `llm-*` work), SHOAL_ALL_NAMESPACES=1, SHOAL_LIVENESS, SHOAL_LOG_LEVEL, SHOAL_METRICS_PORT.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(prog="shoal-operator",
                                description="Reconcile InferenceEngine resources.")
    p.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=None,
        help="watch this namespace (repeatable; globs allowed). Default: $SHOAL_NAMESPACES",
    )
    p.add_argument("--all-namespaces", "-A", action="store_true",
                   default=env.get("SHOAL_ALL_NAMESPACES", "") in ("1", "true", "yes"),
                   help="watch every namespace (needs cluster-wide RBAC)")
    p.add_argument("--liveness", default=env.get("SHOAL_LIVENESS"),
                   help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--metrics-port", type=int, default=int(env.get("SHOAL_METRICS_PORT", "0")),
                   help="serve the operator's Prometheus series on this port (0: none)")
    p.add_argument("--log-level", default=env.get("SHOAL_LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    if args.namespace is None:
        args.namespace = [n for n in env.get("SHOAL_NAMESPACES", "").split(",") if n]
    if not args.all_namespaces and not args.namespace:
        p.error("say which namespaces to watch: --namespace NS (repeatable) or --all-namespaces")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import kopf  # imported late: `--help` and bad flags answer fast

    kopf.configure(debug=args.log_level == "debug", verbose=args.log_level in ("debug", "info"),
                   quiet=args.log_level in ("warning", "error"))
    logging.getLogger().setLevel(args.log_level.upper())
    logging.getLogger("kopf.objects").setLevel(max(logging.WARNING, logging.getLogger().level))
    from shoal.operator import handlers  # noqa: F401  (registers the handlers)
    from shoal.operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    kopf.run(
        clusterwide=args.all_namespaces,
        namespaces=() if args.all_namespaces else args.namespace,
        liveness_endpoint=args.liveness,
        standalone=True,
        memo=kopf.Memo(metrics=metrics),  # the startup handler hands it to every pass
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
