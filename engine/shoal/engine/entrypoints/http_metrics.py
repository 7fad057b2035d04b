"""vLLM's HTTP request metrics: prometheus-fastapi-instrumentator attached as vLLM's api_server
attaches it (vllm/entrypoints/serve/instrumentator/metrics.py: its default metrics and vLLM's
excluded handlers), so dashboards built on vLLM's `http_requests_total`,
`http_request_size_bytes`, `http_response_size_bytes`, `http_request_duration_highr_seconds`
and `http_request_duration_seconds` (labels handler, method, status grouped as "2xx") read the
same series here.

The series live in a registry of the app's own (an app per AsyncLLM, several in tests); /metrics
renders it after the engine's metrics.
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

# vLLM's list: probes and the scrape itself are not counted.
EXCLUDED_HANDLERS = ["/metrics", "/health", "/load", "/ping", "/version", "/server_info"]


def instrument(app: FastAPI) -> CollectorRegistry:
    """Add the instrumentator's middleware to `app`; the registry its series go to."""
    from prometheus_fastapi_instrumentator import Instrumentator

    registry = CollectorRegistry()
    Instrumentator(excluded_handlers=EXCLUDED_HANDLERS, registry=registry).add().instrument(app)
    return registry
