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
        self.adapter_misses = Counter(
            "shoal_router_adapter_misses",
            "Adapter requests a group answered 404 for although its last /v1/models listed the "
            "adapter (unloaded since); each is re-sent to another group that lists it.",
            registry=r)
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

        # kv-aware routing's index (kv_index.py); set from its stats at each scrape.
        self.kv_blocks = Gauge("shoal_router_kv_index_blocks",
                               "(group, block) entries in the KV events index.", registry=r)
        self.kv_group_blocks = Gauge("shoal_router_kv_index_group_blocks",
                                     "KV blocks the index holds, by group.", ["group"],
                                     registry=r)
        self.kv_groups = Gauge("shoal_router_kv_index_groups",
                               "Groups the KV events index follows.", registry=r)
        self.kv_gaps = Gauge("shoal_router_kv_gaps",
                             "Sequence gaps seen in the groups' KV events since start (each "
                             "replayed).", registry=r)
        self.kv_unrepaired = Gauge("shoal_router_kv_unrepaired_gaps",
                                   "Gaps the replay could not cover since start (the group's "
                                   "entries were cleared).", registry=r)
        self.held = Counter("shoal_router_held_requests_total",
                            "Requests that found no group of an engine scaled to zero and "
                            "waited for one, by outcome (ready, timeout: 503, full: 429).",
                            ["outcome"], registry=r)
        self.holding = Gauge("shoal_router_holding_requests",
                             "Requests waiting now for an engine scaled to zero.", registry=r)
        self.kv_snapshots = Gauge("shoal_router_kv_snapshots",
                                  "Gaps the replay answered with the engine's whole cache (a "
                                  "snapshot) since start.", registry=r)
        self.kv_orphans = Gauge("shoal_router_kv_orphan_blocks",
                                "Stored blocks whose parent the index did not know, since "
                                "start (not indexed).", registry=r)
        self.kv_evicted = Gauge("shoal_router_kv_evicted_blocks",
                                "Entries evicted by the index's memory bound since start.",
                                registry=r)
        self.kv_lag = Gauge("shoal_router_kv_lag_seconds",
                            "Seconds since the group's last KV event batch.", ["group"],
                            registry=r)
        self.kv_stale = Gauge("shoal_router_kv_group_stale",
                              "1 while the group's KV events stopped despite traffic (it is "
                              "scored by load only).", ["group"], registry=r)
        self.kv_stale_groups = Gauge("shoal_router_kv_stale_groups",
                                     "Groups whose KV events stopped despite traffic.",
                                     registry=r)

    def observe_kv(self, index, now: float) -> None:
        """Set the kv series from a KvIndex (kv_index.py)."""
        st = index.stats(now)
        self.kv_blocks.set(st.blocks)
        self.kv_groups.set(st.groups)
        self.kv_gaps.set(st.gaps)
        self.kv_unrepaired.set(st.unrepaired_gaps)
        self.kv_snapshots.set(st.snapshots)
        self.kv_orphans.set(st.orphans)
        self.kv_evicted.set(st.evicted)
        self.kv_stale_groups.set(len(st.stale))
        for gauge in (self.kv_lag, self.kv_stale, self.kv_group_blocks):
            gauge.clear()
        for key in index.groups():
            label = _label(key)
            self.kv_group_blocks.labels(label).set(index.blocks_of(key))
            self.kv_stale.labels(label).set(1 if key in st.stale else 0)
            if key in st.lag_s:
                self.kv_lag.labels(label).set(st.lag_s[key])

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _label(key) -> str:
    """A Group.key (engine, id) as the `group` label (Group.label)."""
    engine, gid = key
    return f"{engine}/{gid}" if engine else str(gid)
