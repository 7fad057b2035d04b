"""The operator's own Prometheus series (`shoal-operator --metrics-port`), for the chart's
alerts (charts/shoal/templates/_alerts.tpl): what each pass wrote to an InferenceEngine's status,
Kubernetes style (kube-state-metrics' `kube_pod_status_phase{phase}` one-hot gauges, counters
named `_total`, timestamps rather than durations).

Labels: `namespace`, `inference_engine` (the scrape configurations give the engines' own series
the same two), and `engine_group` on the per-group series. Scrape with `honor_labels: true`
(the chart's PodMonitor sets `honorLabels`): `namespace` here is the engine's, not the
operator pod's.

Series (docs/packaging.md, "Alerts", has the table):
- `shoal_operator_build_info{version}`: 1 while the operator runs; its absence is "operator down";
- per engine: `shoal_engine_groups_desired` (status.replicas), `shoal_engine_groups_ready`
  (status.readyReplicas), `shoal_engine_restarts_total` (status.restartCount),
  `shoal_engine_startup_bound_seconds` (engine.startupTimeoutSeconds + the stall margin: how
  long a group may take to become Ready before the operator restarts it as stalled);
- per group: `shoal_engine_group_phase{phase}` (1 for its phase, 0 for the others),
  `shoal_engine_group_ready`, `shoal_engine_group_consecutive_restarts` (status.groups[].restarts:
  restarts since it last stayed Ready for restartPolicy.resetAfterSeconds), and, only while it
  is not Ready, `shoal_engine_group_not_ready_since_timestamp_seconds`.

Only desired groups have series (a group being removed by a scale-down leaves them when its stop
begins), and an engine being deleted has none. The not-Ready clock lives in this process: an
operator restart starts it anew (status keeps no such time), so the start-up alert can come
up to one bound late after one; a group's own restarts (the operator's stall restarts
included) do not reset it.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from shoal.operator.observed import STALL_MARGIN_SECONDS
from shoal.operator.phases import GroupPhase, Phase
from shoal.operator.spec import EngineRef, EngineSpec

ENGINE_LABELS = ("namespace", "inference_engine")
GROUP_LABELS = (*ENGINE_LABELS, "engine_group")


@dataclass(frozen=True)
class EngineView:
    """What the series of one InferenceEngine are made from: its status as the last pass wrote
    it, its start-up bound, and since when each desired group that is not Ready is not."""

    namespace: str
    name: str
    status: Mapping
    startup_bound_seconds: int
    not_ready_since: Mapping[int, float] = field(default_factory=dict)

    @property
    def desired(self) -> int:
        return int(self.status.get("replicas") or 0)

    def groups(self) -> list[Mapping]:
        return desired_groups(self.status)


def desired_groups(status: Mapping) -> list[Mapping]:
    """status.groups of the desired groups (index below status.replicas), by index."""
    desired = int(status.get("replicas") or 0)
    return sorted((g for g in status.get("groups") or [] if int(g["index"]) < desired),
                  key=lambda g: int(g["index"]))


def view_of(ref: EngineRef, spec: EngineSpec, status: Mapping, now: dt.datetime,
            previous: EngineView | None) -> EngineView | None:
    """The view after a pass (None: the engine is being deleted and has no series). A group
    keeps the not-Ready time a previous view gave it; one that just stopped being Ready gets
    `now`."""
    if status.get("phase") == Phase.TERMINATING:
        return None
    before = previous.not_ready_since if previous else {}
    since = {int(g["index"]): before.get(int(g["index"]), now.timestamp())
             for g in desired_groups(status) if g.get("phase") != GroupPhase.READY}
    return EngineView(ref.namespace, ref.name, dict(status),
                      spec.startup_timeout_seconds + STALL_MARGIN_SECONDS, since)


def _gauge(name: str, doc: str, labels=ENGINE_LABELS) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def families(views: list[EngineView], version: str) -> list[Metric]:
    """Every series of the operator, from the views (pure: the same views give the same text)."""
    info = _gauge("shoal_operator_build_info", "1 while the Shoal operator runs.", ["version"])
    info.add_metric([version], 1)
    desired = _gauge("shoal_engine_groups_desired", "Engine groups the InferenceEngine should "
                     "have (status.replicas).")
    ready = _gauge("shoal_engine_groups_ready", "Engine groups Ready (status.readyReplicas).")
    restarts = CounterMetricFamily("shoal_engine_restarts", "Group restarts since the "
                                   "InferenceEngine was created (status.restartCount).",
                                   labels=list(ENGINE_LABELS))
    bound = _gauge("shoal_engine_startup_bound_seconds", "How long a group may take to become "
                   "Ready before the operator restarts it as stalled "
                   f"(engine.startupTimeoutSeconds + {STALL_MARGIN_SECONDS}).")
    phase = _gauge("shoal_engine_group_phase", "1 for the group's phase (status.groups[].phase), "
                   "0 for the others.", [*GROUP_LABELS, "phase"])
    group_ready = _gauge("shoal_engine_group_ready", "1 when the group is Ready (every rank "
                         "Ready, its adapters loaded).",
                         GROUP_LABELS)
    consecutive = _gauge("shoal_engine_group_consecutive_restarts", "Restarts since the group "
                         "last stayed Ready for restartPolicy.resetAfterSeconds "
                         "(status.groups[].restarts).", GROUP_LABELS)
    since = _gauge("shoal_engine_group_not_ready_since_timestamp_seconds", "Since when the group "
                   "is not Ready (as this operator process saw it; absent while Ready).",
                   GROUP_LABELS)
    for v in views:
        engine = [v.namespace, v.name]
        desired.add_metric(engine, v.desired)
        ready.add_metric(engine, int(v.status.get("readyReplicas") or 0))
        restarts.add_metric(engine, int(v.status.get("restartCount") or 0))
        bound.add_metric(engine, v.startup_bound_seconds)
        for g in v.groups():
            index = int(g["index"])
            labels = [*engine, str(index)]
            for p in GroupPhase:
                phase.add_metric([*labels, p.value], 1 if g.get("phase") == p else 0)
            group_ready.add_metric(labels, 1 if g.get("phase") == GroupPhase.READY else 0)
            consecutive.add_metric(labels, int(g.get("restarts") or 0))
            if index in v.not_ready_since:
                since.add_metric(labels, v.not_ready_since[index])
    return [info, desired, ready, restarts, bound, phase, group_ready, consecutive, since]


class OperatorMetrics:
    """The views of every engine the passes reported (passes run in kopf's thread pool: one
    lock), collected into a registry of their own at each scrape."""

    def __init__(self) -> None:
        self.version = importlib.metadata.version("shoal")
        self._views: dict[tuple[str, str], EngineView] = {}
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def report(self, ref: EngineRef, spec: EngineSpec, status: Mapping,
               now: dt.datetime) -> None:
        """After a pass: the status it computed becomes the engine's series."""
        key = (ref.namespace, ref.name)
        with self._lock:
            view = view_of(ref, spec, status, now, self._views.get(key))
            if view is None:
                self._views.pop(key, None)
            else:
                self._views[key] = view

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            views = [self._views[k] for k in sorted(self._views)]
        yield from families(views, self.version)

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """GET /metrics (any path) on `port`, from a daemon thread."""
        start_http_server(port, addr, registry=self.registry)
