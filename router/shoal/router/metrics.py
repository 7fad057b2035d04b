"""The router's own Prometheus series (`shoal_router_*`). The engines' `vllm:*` series stay on
each group's own /metrics: scrape the groups for those; the router does not re-export them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

OUTCOMES = ("ok", "client_error", "upstream_error", "disconnect")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "shoal_router_requests", "Requests forwarded, by group, endpoint and outcome "
            "(ok, client_error = 4xx passed through, upstream_error, disconnect).",
            ["group", "endpoint", "outcome"], registry=r)
        self.upstream_errors = Counter(
            "shoal_router_upstream_errors", "Upstream failures, by group and cause "
            "(connect, no_answer = dropped before answering, unavailable = 503, "
            "midway = failed after the response started, "
            "server_error = other 5xx).", ["group", "cause"], registry=r)
        self.retries = Counter("shoal_router_retries",
                               "Requests re-sent to another group after the first one failed "
                               "before answering.", registry=r)
        self.no_group = Counter("shoal_router_no_group",
                                "Requests answered 503 because no engine group was usable.",
                                registry=r)
        self.outstanding = Gauge("shoal_router_outstanding_requests",
                                 "Requests in flight, by group.", ["group"], registry=r)
        self.listed = Gauge("shoal_router_groups_listed",
                            "Groups listed in the discovery file.", registry=r)
        self.usable = Gauge("shoal_router_groups_usable",
                            "Listed groups not in a failure cool-down.", registry=r)
        self.discovery_valid = Gauge("shoal_router_discovery_file_valid",
                                     "1 when the discovery file was read and validated.",
                                     registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
