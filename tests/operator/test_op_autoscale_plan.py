"""The autoscaler inside plan(): its count replaces spec.replicas, a scale-down is the ordered
drain (withdrawn from discovery first), Events carry the numbers, status.autoscaling and the
Autoscaling condition report it, and an invalid spec.autoscaling is refused by name."""

from __future__ import annotations

import datetime as dt

from shoal.operator import labels as L
from shoal.operator.actions import CreatePods, DeletePod, EmitEvent, WriteDiscovery
from shoal.operator.autoscale import PERIOD_SECONDS, WAKE_POLL_SECONDS
from shoal.operator.autoscale_hpa import HPAs
from shoal.operator.autoscale_metrics import Sample
from shoal.operator.plan import Memory, Observed, plan
from shoal.operator.spec import EngineRef, EngineSpec
from shoal.operator.status import engine_status
from support.builders import engine

T0 = dt.datetime(2026, 12, 2, 8, 0, 0, tzinfo=dt.timezone.utc)


def iso(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def body(**autoscaling) -> dict:
    a = {"minReplicas": 1, "maxReplicas": 3, "requestsPerGroup": 8,
         "scaleUpStabilizationSeconds": 0, "scaleDownDelaySeconds": 60, **autoscaling}
    return engine("llm", "ns").groups(1).set(autoscaling=a).obj()


def pod(g: int, rev: str) -> dict:
    labels = {L.LABEL_GROUP: str(g), L.LABEL_RANK: "0", L.LABEL_REVISION: rev}
    return {"metadata": {"name": f"llm-g{g}-r0", "uid": f"uid-g{g}", "labels": labels,
                         "creationTimestamp": iso(T0 - dt.timedelta(seconds=600))},
            "spec": {"nodeName": "n"},
            "status": {"phase": "Running", "podIP": f"10.0.0.{g}",
                       "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": L.ENGINE_CONTAINER,
                                              "state": {"running": {}}}]}}


def run(b: dict, *, groups: int, autoscaling: dict | None, samples=None, wake=None, hpas=None,
        now=T0):
    spec = EngineSpec.of(b)
    pods = {g: {0: pod(g, spec.revision)} for g in range(groups)}
    memory = Memory(groups={g: {"index": g, "phase": "Ready", "restarts": 0,
                                "revision": spec.revision} for g in range(groups)},
                    autoscaling=autoscaling)
    observed = Observed(ref=EngineRef.of(b), pods=pods, samples=samples, wake=wake, hpas=hpas)
    return spec, plan(spec, observed, memory, now)


def events(p) -> list[tuple[str, str]]:
    return [(a.reason, a.message) for a in p.actions if isinstance(a, EmitEvent)]


def test_load_over_the_target_adds_groups_with_an_event_and_a_status():
    spec, p = run(body(), groups=1, autoscaling={"desiredGroups": 1},
                  samples={0: Sample(running=12, waiting=8, kv_usage=0.5)})
    assert p.replicas == 3
    assert CreatePods(1, (0,)) in p.actions and CreatePods(2, (0,)) in p.actions
    assert events(p)[0] == ("ScaledUp", "1 -> 3 groups: requestsPerGroup 20 (target 8) over 1 "
                                        "ready groups, 20 requests; wanted since "
                                        "2026-12-02T08:00:00Z")
    assert p.requeue_after == PERIOD_SECONDS
    status = engine_status(ref=EngineRef.of(body()), generation=1, deleting=False, plan=p,
                           frontends_ready=1, frontends_desired=1, pods_left=1, previous=[],
                           now=iso(T0))
    a = status["autoscaling"]
    assert (a["currentGroups"], a["desiredGroups"], a["metric"], a["value"], a["target"],
            a["lastScaleTime"]) == (1, 3, "requestsPerGroup", 20.0, 8.0, iso(T0))
    cond = next(c for c in status["conditions"] if c["type"] == "Autoscaling")
    assert (cond["status"], cond["reason"]) == ("True", "SpecReplicasIgnored")
    assert "spec.replicas (1) is ignored" in cond["message"]


def test_idle_past_the_delay_drains_to_zero_withdrawn_from_discovery_first():
    mem = {"desiredGroups": 1, "downSince": iso(T0 - dt.timedelta(seconds=60)), "downTo": 0}
    spec, p = run(body(minReplicas=0), groups=1, autoscaling=mem,
                  samples={0: Sample(running=0, waiting=0, kv_usage=0)})
    assert p.replicas == 0
    kinds = [type(a).__name__ for a in p.actions]
    assert kinds.index("WriteDiscovery") < kinds.index("DeletePod"), "withdrawn, then drained"
    assert WriteDiscovery(()) in p.actions
    assert DeletePod("llm-g0-r0", "uid-g0", None) in p.actions
    assert [r for r, _ in events(p)] == ["ScaledDown", "DrainStarted"]
    assert p.autoscaling["lastScaleDirection"] == "Down"


def test_at_zero_a_pass_looks_for_a_wake_often_and_a_wake_creates_a_group():
    mem = {"desiredGroups": 0, "lastScaleTime": iso(T0 - dt.timedelta(seconds=600)),
           "lastScaleDirection": "Down"}
    _, idle = run(body(minReplicas=0), groups=0, autoscaling=mem, samples={})
    assert idle.replicas == 0 and not [a for a in idle.actions if isinstance(a, CreatePods)]
    assert idle.requeue_after == WAKE_POLL_SECONDS
    _, woken = run(body(minReplicas=0), groups=0, autoscaling=mem, samples={},
                   wake=iso(T0 - dt.timedelta(seconds=1)))
    assert woken.replicas == 1 and CreatePods(0, (0,)) in woken.actions
    assert events(woken)[0][0] == "ScaledUp" and "wake Lease" in events(woken)[0][1]


def test_without_a_scrape_the_count_holds_and_the_next_look_is_a_period_away():
    _, p = run(body(), groups=2, autoscaling={"desiredGroups": 2, "reason": "as before"})
    assert p.replicas == 2 and not events(p) and p.requeue_after == PERIOD_SECONDS
    assert p.autoscaling["reason"] == "as before"


def test_an_hpa_on_the_same_engine_is_a_condition():
    _, p = run(body(), groups=1, autoscaling={"desiredGroups": 1},
               hpas=HPAs(names=("llm",)))
    assert p.autoscaling_condition[:2] == (False, "HPAConflict")


def test_max_below_min_is_refused_naming_both_and_nothing_is_created():
    _, p = run(body(minReplicas=3, maxReplicas=2), groups=0, autoscaling=None)
    assert any("maxReplicas (2) must be >= spec.autoscaling.minReplicas (3)" in x
               for x in p.problems)
    assert not [a for a in p.actions if isinstance(a, CreatePods)]


def test_two_targets_are_refused():
    _, p = run(body(kvCacheUsage=0.5), groups=0, autoscaling=None)
    assert any("exactly one target" in x and "kvCacheUsage" in x for x in p.problems)


def test_without_autoscaling_nothing_changes():
    b = engine("llm", "ns").groups(2).obj()
    spec = EngineSpec.of(b)
    p = plan(spec, Observed(ref=EngineRef.of(b)), Memory(), T0)
    assert spec.autoscaling is None and p.autoscaling is None and p.replicas == 2
    assert p.autoscaling_condition is None
