"""The operator's own series (metrics.py): what the status a pass wrote becomes, the not-Ready
clock across a group's restarts, groups and engines that go away, and the one hook (a pass
reports the status it patched). The rules that read them: tests/packaging/test_alerts_*.py."""

from __future__ import annotations

import datetime as dt

import pytest
from prometheus_client.parser import text_string_to_metric_families
from shoal.operator.metrics import OperatorMetrics
from shoal.operator.observed import STALL_MARGIN_SECONDS
from shoal.operator.plan import Observed, Plan
from shoal.operator.reconcile import Reconciler
from shoal.operator.spec import parse
from support.builders import engine

T0 = dt.datetime(2026, 12, 1, 10, 0, 0, tzinfo=dt.timezone.utc)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def parsed(name: str = "llm", namespace: str = "prod", startup: int = 300):
    return parse(engine(name, namespace).groups(2).engine(startupTimeoutSeconds=startup).obj())


def status(*groups: tuple[str, int], replicas: int | None = None, phase: str = "Progressing",
           restart_count: int = 0) -> dict:
    return {"phase": phase, "replicas": len(groups) if replicas is None else replicas,
            "readyReplicas": sum(p == "Ready" for p, _ in groups), "restartCount": restart_count,
            "groups": [{"index": i, "phase": p, "restarts": r} for i, (p, r) in enumerate(groups)]}


def samples(m: OperatorMetrics) -> dict[tuple, float]:
    """(name, sorted labels) -> value, from the real exposition text."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(m.render()) for s in fam.samples}


def value(m: OperatorMetrics, name: str, **labels) -> float | None:
    return samples(m).get((name, tuple(sorted(labels.items()))))


def G(g: int, ns: str = "prod", name: str = "llm") -> dict:
    return {"namespace": ns, "inference_engine": name, "engine_group": str(g)}


E = {"namespace": "prod", "inference_engine": "llm"}


def test_a_status_becomes_kubernetes_style_series():
    m = OperatorMetrics()
    m.report(*parsed(), status(("Ready", 0), ("BackingOff", 2), restart_count=5), at(0))
    assert value(m, "shoal_engine_groups_desired", **E) == 2
    assert value(m, "shoal_engine_groups_ready", **E) == 1
    assert value(m, "shoal_engine_restarts_total", **E) == 5
    assert value(m, "shoal_engine_startup_bound_seconds", **E) == 300 + STALL_MARGIN_SECONDS
    # One-hot phases, as kube_pod_status_phase: every phase present, 1 for the group's own.
    phases = {dict(k[1])["phase"]: v for k, v in samples(m).items()
              if k[0] == "shoal_engine_group_phase" and dict(k[1])["engine_group"] == "1"}
    assert phases == {"Pending": 0, "Starting": 0, "Ready": 0, "Failed": 0, "BackingOff": 1,
                      "Draining": 0, "Updating": 0}
    assert [value(m, "shoal_engine_group_ready", **G(g)) for g in (0, 1)] == [1, 0]
    assert value(m, "shoal_engine_group_consecutive_restarts", **G(1)) == 2
    since = "shoal_engine_group_not_ready_since_timestamp_seconds"
    assert value(m, since, **G(0)) is None and value(m, since, **G(1)) == at(0).timestamp()
    assert value(m, "shoal_operator_build_info", version=m.version) == 1


def test_the_not_ready_clock_runs_across_restarts_and_stops_at_ready():
    m, ref_spec = OperatorMetrics(), parsed()
    since = "shoal_engine_group_not_ready_since_timestamp_seconds"
    m.report(*ref_spec, status(("Starting", 0), ("Ready", 0)), at(0))
    m.report(*ref_spec, status(("BackingOff", 1), ("Ready", 0)), at(400))  # a stall restart
    m.report(*ref_spec, status(("Starting", 1), ("Ready", 0)), at(420))
    assert value(m, since, **G(0)) == at(0).timestamp()
    m.report(*ref_spec, status(("Ready", 1), ("Ready", 0)), at(500))
    assert value(m, since, **G(0)) is None
    m.report(*ref_spec, status(("BackingOff", 2), ("Ready", 0)), at(600))
    assert value(m, since, **G(0)) == at(600).timestamp()


def test_only_desired_groups_have_series():
    """A group that a scale-down is stopping (index >= replicas) is going away: no alert
    should read it as down."""
    m = OperatorMetrics()
    m.report(*parsed(), status(("Ready", 0), ("Draining", 1), replicas=1), at(0))
    groups = {dict(k[1]).get("engine_group") for k in samples(m)} - {None}
    assert groups == {"0"}


def test_an_engine_being_deleted_leaves_and_the_others_stay():
    m = OperatorMetrics()
    m.report(*parsed("a"), status(("Ready", 0)), at(0))
    m.report(*parsed("b"), status(("Ready", 0)), at(0))
    m.report(*parsed("a"), status(("Draining", 0), replicas=0, phase="Terminating"), at(10))
    engines = {dict(k[1]).get("inference_engine") for k in samples(m)} - {None}
    assert engines == {"b"}
    assert value(m, "shoal_operator_build_info", version=m.version) == 1


class _Kube:
    """What `_report` uses of the API client: the status patch, the frontends' list."""

    def __init__(self):
        self.patches: list[dict] = []

    def patch(self, api_version, plural, namespace, name, body, sub=None):
        self.patches.append(body)

    def list(self, api_version, plural, namespace, selector):
        return []


@pytest.mark.parametrize("first", [True, False], ids=["status changed", "status unchanged"])
def test_a_pass_reports_the_status_it_wrote(first):
    kube, m = _Kube(), OperatorMetrics()
    ref, spec = parsed()
    groups = ({"index": 0, "phase": "Ready", "restarts": 0},
              {"index": 1, "phase": "BackingOff", "restarts": 1})
    p = Plan(actions=(), requeue_after=None, groups=groups, ready_groups=(0,), problems=(),
             replicas=2, revision="r1", last_failure=None, restart_count=1)
    rec = Reconciler(kube, metrics=m)
    old = {} if first else rec._report(Observed(ref=ref), spec, p, {}, at(0))
    written = rec._report(Observed(ref=ref), spec, p, old, at(1))
    assert len(kube.patches) == 1  # the second pass, unchanged, patches nothing: still reported
    assert kube.patches[0]["status"]["groups"] == written["groups"]
    assert value(m, "shoal_engine_groups_ready", **E) == written["readyReplicas"] == 1
    assert value(m, "shoal_engine_group_consecutive_restarts", **G(1)) == 1
