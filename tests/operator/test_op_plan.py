"""plan(spec, observed, memory, now) as a table (LWS style): each case is a sentence, the pods
and status memory it starts from, and the exact actions and next look it must produce.

Events are compared by (type, reason); their wording is checked where it carries a number."""

from __future__ import annotations

import copy
import datetime as dt
import json
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from shoal.contract.termination import Cause, encode, write_termination_message
from shoal.operator import labels as L
from shoal.operator import render
from shoal.operator.actions import ApplyChildren, CreatePods, DeletePod, EmitEvent, WriteDiscovery
from shoal.operator.node_loss import NodeHealth
from shoal.operator.observed import STALL_MARGIN_SECONDS
from shoal.operator.plan import Memory, Observed, plan
from shoal.operator.spec import EngineRef, EngineSpec
from support.builders import engine

T0 = dt.datetime(2026, 12, 1, 10, 0, 0, tzinfo=dt.timezone.utc)


def at(seconds: float = 0) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def iso(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(g: int, r: int, *, ready: bool = True, rev: str | None = None, created: float = -600,
        deleting: float | None = None, exit_code: int | None = None, message: str = "",
        reason: str = "Error", grace: int | None = None, node: str = "node-a") -> dict:
    """An engine pod as the API server returns it: running (and Ready), stopping since
    `deleting` seconds, or its engine container terminated with `exit_code`."""
    labels = {L.LABEL_GROUP: str(g), L.LABEL_RANK: str(r), L.LABEL_REVISION: rev or CURRENT}
    meta = {"name": f"llm-g{g}-r{r}", "uid": f"uid-g{g}-r{r}",
            "creationTimestamp": iso(at(created)), "labels": labels}
    if deleting is not None:
        meta["deletionTimestamp"] = iso(at(deleting))
        meta["deletionGracePeriodSeconds"] = grace if grace is not None else 45
    status = {"phase": "Running",
              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
              "containerStatuses": [{"name": L.ENGINE_CONTAINER, "state": {"running": {}}}]}
    if exit_code is not None:
        ended = {"exitCode": exit_code, "reason": reason, "message": message,
                 "finishedAt": iso(at(0))}
        status = {"phase": "Failed" if exit_code else "Succeeded", "containerStatuses": [
            {"name": L.ENGINE_CONTAINER, "state": {"terminated": ended}}]}
    return {"metadata": meta, "spec": {"nodeName": node}, "status": status}


BASE = engine("llm", "ns").groups(1).ranks(2)
CURRENT = "<the case's revision>"  # replaced by the revision of the case's spec


def group(g: int, phase: str, **kw) -> dict:
    return {"index": g, "phase": phase, "restarts": 0, "revision": CURRENT, **kw}


def dead(r: int) -> DeletePod:
    return DeletePod(f"llm-g0-r{r}", f"uid-g0-r{r}", 10)


def delete(g: int, r: int, grace: int | None = None) -> DeletePod:
    return DeletePod(f"llm-g{g}-r{r}", f"uid-g{g}-r{r}", grace)


def ev(type_: str, reason: str) -> tuple:
    return ("event", type_, reason)


@dataclass
class Case:
    name: str
    pods: list[dict]
    memory: list[dict] = field(default_factory=list)
    now: dt.datetime = T0
    spec: object = BASE
    deleting: bool = False
    actions: tuple = ()
    requeue: float | None = None
    phases: dict = field(default_factory=dict)  # group -> phase after the pass
    in_flight: dict = field(default_factory=dict)  # draining group -> rank 0's requests, as probed
    adapters: dict = field(default_factory=dict)  # group -> InferenceAdapters not answered yet
    nodes: dict = field(default_factory=dict)  # node -> NodeHealth (the others: healthy)


OOM = dict(exit_code=137, reason="OOMKilled")


def down(since: float, ready: str = "Unknown") -> dict:
    """node-b's Ready condition as the node controller sets it when the kubelet goes quiet."""
    return {"node-b": NodeHealth(ready=ready, since=iso(at(since)), reason="NodeStatusUnknown",
                                 message="Kubelet stopped posting node status.")}


ON_B = dict(node="node-b")


def marked(g: int, r: int, at: float, containers_ready: bool = True) -> dict:
    """A running pod whose Ready condition went False at `at`: set by the node controller (its
    containers still ready, as the kubelet last said), or by its kubelet (containers not)."""
    p = pod(g, r)
    p["status"]["conditions"] = [{"type": "Ready", "status": "False",
                                  "lastTransitionTime": iso(at_(at))}]
    p["status"]["containerStatuses"][0]["ready"] = containers_ready
    return p


at_ = at
CASES = [
    Case("a new engine gets its singletons, then every group in index order",
         pods=[], spec=engine("llm", "ns").groups(2).ranks(2),
         actions=(ApplyChildren(()), CreatePods(0, (0, 1)), CreatePods(1, (0, 1)),
                  WriteDiscovery(())),
         phases={0: "Starting", 1: "Starting"}),
    Case("a group that lost a rank before it was ready gets only that rank back; "
         "a look at its stall limit",
         pods=[pod(0, 0, ready=False)], memory=[group(0, "Starting")],
         actions=(ApplyChildren(()), CreatePods(0, (1,)), WriteDiscovery(())),
         requeue=-600 + 1200 + STALL_MARGIN_SECONDS, phases={0: "Starting"}),
    Case("scale up adds the next group and leaves the ready one alone",
         pods=[pod(0, 0), pod(0, 1)], memory=[group(0, "Ready")],
         spec=engine("llm", "ns").groups(2).ranks(2),
         actions=(ApplyChildren((0,)), CreatePods(1, (0, 1)), WriteDiscovery((0,))),
         phases={0: "Ready", 1: "Starting"}),
    Case("scale down withdraws the last group from discovery, then drains its rank 0 only",
         pods=[pod(0, 0), pod(0, 1), pod(1, 0), pod(1, 1)],
         memory=[group(0, "Ready"), group(1, "Ready")],
         actions=(ApplyChildren((0,)), WriteDiscovery((0,)), delete(1, 0),
                  ev("Normal", "DrainStarted"), WriteDiscovery((0,))),
         requeue=30 + render.SHUTDOWN_MARGIN_SECONDS, phases={0: "Ready", 1: "Draining"}),
    Case("scale down: once rank 0's engine ended, the headless ranks go and the drain is reported",
         pods=[pod(0, 0), pod(0, 1), pod(1, 0, deleting=-8, exit_code=0), pod(1, 1)],
         memory=[group(0, "Ready"),
                 group(1, "Draining", stopReason="scale-down", drainStartTime=iso(at(-8)))],
         actions=(ApplyChildren((0,)), ev("Normal", "DrainFinished"), delete(1, 1),
                  WriteDiscovery((0,))),
         phases={0: "Ready", 1: "Draining"}),
    Case("a dead rank tears the whole group down at once and backs off for the base delay",
         pods=[pod(0, 0), pod(0, 1, **OOM)], memory=[group(0, "Ready")],
         actions=(ApplyChildren((0,)), ev("Warning", "EngineDied"), ev("Normal", "GroupRestarting"),
                  dead(0), DeletePod("llm-g0-r1", "uid-g0-r1", 0), WriteDiscovery(())),
         requeue=10, phases={0: "BackingOff"}),
    Case("the third consecutive death backs off four times the base delay",
         pods=[pod(0, 0), pod(0, 1, **OOM)], memory=[group(0, "Starting", restarts=2)],
         actions=(ApplyChildren(()), ev("Warning", "EngineDied"), ev("Normal", "GroupRestarting"),
                  dead(0), DeletePod("llm-g0-r1", "uid-g0-r1", 0), WriteDiscovery(())),
         requeue=40, phases={0: "BackingOff"}),
    Case("backing off, the old ranks gone: nothing happens and the next look is at the deadline",
         pods=[], memory=[group(0, "BackingOff", restarts=1, nextRestartTime=iso(at(7)))],
         actions=(ApplyChildren(()), WriteDiscovery(())), requeue=7, phases={0: "BackingOff"}),
    Case("backing off, at the deadline: all ranks are recreated together",
         pods=[], memory=[group(0, "BackingOff", restarts=1, nextRestartTime=iso(at(7)))],
         now=at(7),
         actions=(ApplyChildren(()), ev("Normal", "GroupRestarted"), CreatePods(0, (0, 1)),
                  WriteDiscovery(())),
         phases={0: "Starting"}),
    Case("backing off while an old rank still stops: no replacement beside it, "
         "a look when the restart is due",
         pods=[pod(0, 0, deleting=-5, grace=10)],
         memory=[group(0, "BackingOff", restarts=1, nextRestartTime=iso(at(5)))],
         actions=(ApplyChildren(()), WriteDiscovery(())), requeue=5, phases={0: "BackingOff"}),
    Case("a due restart waits for an old rank still stopping, a look when that rank is overdue",
         pods=[pod(0, 0, deleting=-5, grace=10)],
         memory=[group(0, "BackingOff", restarts=1, nextRestartTime=iso(at(-1)))],
         actions=(ApplyChildren(()), WriteDiscovery(())), requeue=25, phases={0: "BackingOff"}),
    Case("a permanent failure is not restarted: the failed pod stays for its logs, the rest stop",
         pods=[pod(0, 0, exit_code=1, message=encode(Cause.MODEL_NOT_FOUND, "no /models/tiny")),
               pod(0, 1)],
         memory=[group(0, "Starting")],
         actions=(ApplyChildren(()), ev("Warning", "EngineDied"), ev("Warning", "RestartSkipped"),
                  dead(1), WriteDiscovery(())),
         phases={0: "Failed"}),
    Case("restartPolicy Never leaves a dead group failed",
         pods=[pod(0, 0), pod(0, 1, **OOM)], memory=[group(0, "Ready")],
         spec=engine("llm", "ns").ranks(2).restart(policy="Never"),
         actions=(ApplyChildren((0,)), ev("Warning", "EngineDied"), ev("Warning", "RestartSkipped"),
                  dead(0), WriteDiscovery(())),
         phases={0: "Failed"}),
    Case("a group not Ready before its startup limit is left alone, the next look at the limit",
         pods=[pod(0, 0, ready=False, created=0), pod(0, 1, ready=False, created=0)],
         now=at(100), memory=[group(0, "Starting", message="0/2 ranks ready")],
         spec=engine("llm", "ns").ranks(2).set(engine={"startupTimeoutSeconds": 60}),
         actions=(ApplyChildren(()), WriteDiscovery(())), requeue=80, phases={0: "Starting"}),
    Case("a group still not Ready past its startup limit is stalled and restarted like a death",
         pods=[pod(0, 0, ready=False, created=0), pod(0, 1, ready=False, created=0)],
         now=at(181), memory=[group(0, "Starting", message="0/2 ranks ready")],
         spec=engine("llm", "ns").ranks(2).set(engine={"startupTimeoutSeconds": 60}),
         actions=(ApplyChildren(()), ev("Warning", "EngineDied"), ev("Normal", "GroupRestarting"),
                  dead(0), dead(1), WriteDiscovery(())),
         requeue=10, phases={0: "BackingOff"}),
    Case("delete drains rank 0 first; its headless rank stays up for it",
         pods=[pod(0, 0), pod(0, 1)], memory=[group(0, "Ready")], deleting=True,
         actions=(delete(0, 0), ev("Normal", "DrainStarted")),
         requeue=30 + render.SHUTDOWN_MARGIN_SECONDS, phases={0: "Draining"}),
    Case("delete with shutdown.timeoutSeconds 0 stops every rank at once",
         pods=[pod(0, 0), pod(0, 1)], memory=[group(0, "Ready")], deleting=True,
         spec=engine("llm", "ns").ranks(2).drain(0),
         actions=(ev("Normal", "GroupAborted"), delete(0, 0), delete(0, 1)),
         phases={0: "Draining"}),
    Case("delete of a dead engine stops every rank at once instead of draining",
         pods=[pod(0, 0), pod(0, 1, **OOM)], memory=[group(0, "Ready")], deleting=True,
         actions=(ev("Normal", "GroupAborted"), delete(0, 0), delete(0, 1)),
         phases={0: "Draining"}),
    Case("a drain past its deadline deletes nothing more: the pod's grace period ends it",
         pods=[pod(0, 0, deleting=-50), pod(0, 1)], deleting=True,
         memory=[group(0, "Draining", stopReason="delete", drainStartTime=iso(at(-50)))],
         actions=(), requeue=2, phases={0: "Draining"}),
    Case("a drain that status does not know (the operator died before writing it) is adopted "
         "from rank 0's deletion: its deadline kept, its end reported",
         pods=[pod(1, 0, deleting=35, grace=45), pod(1, 1), pod(0, 0), pod(0, 1)],
         memory=[group(0, "Ready"), group(1, "Ready")],
         actions=(ApplyChildren((0,)), ev("Normal", "DrainStarted"), WriteDiscovery((0,))),
         requeue=30 + render.SHUTDOWN_MARGIN_SECONDS - 10, phases={0: "Ready", 1: "Draining"}),
    Case("a drain that ended past its deadline is reported overdue",
         pods=[pod(0, 0, deleting=-50, exit_code=0), pod(0, 1)], deleting=True,
         memory=[group(0, "Draining", stopReason="delete", drainStartTime=iso(at(-50)))],
         actions=(ev("Warning", "DrainOverdue"), delete(0, 1)), phases={0: "Draining"}),
    Case("a new revision rolls one group: the unready one first, withdrawn, then drained",
         pods=[pod(0, 0, rev="old"), pod(0, 1, rev="old"), pod(1, 0, rev="old"),
               pod(1, 1, rev="old", ready=False)],
         memory=[group(0, "Ready", revision="old"), group(1, "Starting", revision="old")],
         spec=engine("llm", "ns").groups(2).ranks(2),
         actions=(ApplyChildren((0,)), ev("Normal", "GroupUpdating"), WriteDiscovery((0,)),
                  delete(1, 0), ev("Normal", "DrainStarted"), WriteDiscovery((0,))),
         requeue=30 + render.SHUTDOWN_MARGIN_SECONDS, phases={0: "Ready", 1: "Updating"}),
    Case("a new group with every rank ready stays out of discovery until its adapters answered",
         pods=[pod(0, 0), pod(0, 1)], memory=[group(0, "Starting")],
         adapters={0: ("sql", "support")},
         actions=(ApplyChildren(()), WriteDiscovery(())), phases={0: "Starting"}),
    Case("a Ready group is never withdrawn for an adapter added later",
         pods=[pod(0, 0), pod(0, 1)], memory=[group(0, "Ready")], adapters={0: ("sql",)},
         actions=(ApplyChildren((0,)), WriteDiscovery((0,))), phases={0: "Ready"}),
    Case("a group whose ranks are not all ready waits for them, not for its adapters",
         pods=[pod(0, 0), pod(0, 1, ready=False)], memory=[group(0, "Starting")],
         adapters={0: ("sql",)}, actions=(ApplyChildren(()), WriteDiscovery(())),
         requeue=-600 + 1200 + STALL_MARGIN_SECONDS, phases={0: "Starting"}),
    Case("a rank's node NotReady within restartPolicy.nodeLostSeconds: nothing yet, "
         "a look when the bound ends",
         pods=[pod(0, 0), pod(0, 1, **ON_B)], memory=[group(0, "Ready")], nodes=down(-10),
         actions=(ApplyChildren((0,)), WriteDiscovery((0,))), requeue=20, phases={0: "Ready"}),
    Case("a rank's node lost past the bound: the group dies, its pod there goes with grace 0, "
         "the others stop as a dead group's",
         pods=[pod(0, 0), pod(0, 1, **ON_B)], memory=[group(0, "Ready")], nodes=down(-30),
         actions=(ApplyChildren((0,)), ev("Warning", "EngineDied"), ev("Normal", "GroupRestarting"),
                  dead(0), delete(0, 1, grace=0), WriteDiscovery(())),
         requeue=10, phases={0: "BackingOff"}),
    Case("a starting group whose node reports NotReady itself is lost the same way",
         pods=[pod(0, 0, ready=False, **ON_B), pod(0, 1, ready=False)],
         memory=[group(0, "Starting")], nodes=down(-45, ready="False"),
         actions=(ApplyChildren(()), ev("Warning", "EngineDied"), ev("Normal", "GroupRestarting"),
                  delete(0, 0, grace=0), dead(1), WriteDiscovery(())),
         requeue=10, phases={0: "BackingOff"}),
    Case("a pod evicted onto Terminating on a lost node is removed with grace 0; the restart "
         "waits for it no longer",
         pods=[pod(0, 1, deleting=-5, grace=30, **ON_B)], nodes=down(-60),
         memory=[group(0, "BackingOff", restarts=1, nextRestartTime=iso(at(5)))],
         actions=(ApplyChildren(()), delete(0, 1, grace=0), WriteDiscovery(())),
         requeue=5, phases={0: "BackingOff"}),
    Case("a draining rank 0 on a lost node is removed with grace 0 (its drain cannot finish)",
         pods=[pod(0, 0), pod(0, 1), pod(1, 0, deleting=-5, grace=45, **ON_B), pod(1, 1)],
         nodes=down(-40),
         memory=[group(0, "Ready"),
                 group(1, "Draining", stopReason="scale-down", drainStartTime=iso(at(-5)))],
         actions=(ApplyChildren((0,)), delete(1, 0, grace=0), WriteDiscovery((0,))),
         requeue=25 + render.SHUTDOWN_MARGIN_SECONDS, phases={0: "Ready", 1: "Draining"}),
    Case("a node Ready again before the bound changes nothing",
         pods=[pod(0, 0), pod(0, 1, **ON_B)], memory=[group(0, "Ready")],
         nodes=down(-100, ready="True"),
         actions=(ApplyChildren((0,)), WriteDiscovery((0,))), phases={0: "Ready"}),
    Case("a Ready group's rank marked not Ready by the node controller (its containers still "
         "ready) keeps the group in discovery, a look when the bound ends",
         pods=[pod(0, 0), marked(0, 1, at=-5)], memory=[group(0, "Ready")],
         actions=(ApplyChildren((0,)), WriteDiscovery((0,))), requeue=25, phases={0: "Ready"}),
    Case("past the bound a rank the node controller marked not Ready counts as not ready",
         pods=[pod(0, 0), marked(0, 1, at=-31)], memory=[group(0, "Ready")],
         actions=(ApplyChildren((0,)), WriteDiscovery(())), phases={0: "Starting"}),
    Case("a rank its kubelet reports not ready (a failing probe) leaves discovery at once",
         pods=[pod(0, 0), marked(0, 1, at=-5, containers_ready=False)],
         memory=[group(0, "Ready")], actions=(ApplyChildren((0,)), WriteDiscovery(())),
         phases={0: "Starting"}),
    Case("an invalid spec creates nothing",
         pods=[], spec=engine("llm", "ns").ranks(2, tp=3), actions=(), phases={}),
]


def case(prefix: str) -> Case:
    return next(c for c in CASES if c.name.startswith(prefix))


def _shape(actions) -> tuple:
    return tuple(("event", a.type, a.reason) if isinstance(a, EmitEvent) else a for a in actions)


def _run(case: Case):
    body = case.spec.obj()
    spec = EngineSpec.of(body)
    rev = spec.revision
    by_group: dict = {}
    for p in copy.deepcopy(case.pods):
        lbl = p["metadata"]["labels"]
        lbl[L.LABEL_REVISION] = rev if lbl[L.LABEL_REVISION] == CURRENT else lbl[L.LABEL_REVISION]
        by_group.setdefault(int(lbl[L.LABEL_GROUP]), {})[int(lbl[L.LABEL_RANK])] = p
    memory = Memory(groups={
        m["index"]: {**m, "revision": rev if m["revision"] == CURRENT else m["revision"]}
        for m in case.memory})
    observed = Observed(ref=EngineRef.of(body), pods=by_group, in_flight=case.in_flight,
                        deleting=case.deleting, adapters_pending=case.adapters, nodes=case.nodes)
    return plan(spec, observed, memory, case.now)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan(case: Case):
    got = _run(case)
    assert _shape(got.actions) == case.actions
    assert got.requeue_after == case.requeue
    assert {g["index"]: g["phase"] for g in got.groups} == case.phases


def test_backoff_is_stored_as_a_deadline_and_counted():
    got = _run(case("a dead rank tears"))
    g = got.groups[0]
    assert (g["restarts"], g["nextRestartTime"], got.restart_count) == (1, iso(at(10)), 1)
    assert got.last_failure["cause"] == "oom_killed" and got.last_failure["rank"] == 1
    assert g["ranks"] == [], "a backing-off group lists no ranks"


def test_a_death_already_handled_is_not_acted_on_again():
    first = _run(case("a permanent failure"))
    again = Case("again", pods=case("a permanent failure").pods, memory=[first.groups[0]])
    got = _run(again)
    assert _shape(got.actions) == (ApplyChildren(()), WriteDiscovery(())), \
        "no second Event, no second delete"
    assert got.groups[0]["phase"] == "Failed" and got.restart_count == 0


def test_a_lost_node_is_recorded_like_any_death_naming_node_and_rank():
    got = _run(case("a rank's node lost past the bound"))
    lf = got.last_failure
    assert (lf["cause"], lf["reason"], lf["node"], lf["rank"], lf["pod"], lf["permanent"]) == (
        "node_lost", "NodeLost", "node-b", 1, "llm-g0-r1", False)
    assert lf["message"].startswith("node node-b of rank 1 has been Ready=Unknown since "
                                    f"{iso(at(-30))}, past restartPolicy.nodeLostSeconds (30s): "
                                    "NodeStatusUnknown: Kubelet stopped posting node status.")
    assert got.restart_count == 1 and got.groups[0]["restarts"] == 1
    died = next(a for a in got.actions if isinstance(a, EmitEvent) and a.reason == "EngineDied")
    assert "group 0 rank 1 pod llm-g0-r1 died (node_lost" in died.message
    again = Case("again", pods=case("a rank's node lost").pods, memory=[got.groups[0]],
                 nodes=down(-31))
    second = _run(again)
    assert second.restart_count == 0 and not any(
        isinstance(a, EmitEvent) for a in second.actions), "one loss, one restart"


def test_the_node_lost_bound_is_the_spec_field():
    slow = replace(case("a rank's node lost past"),
                   spec=engine("llm", "ns").groups(1).ranks(2).restart(nodeLostSeconds=120))
    assert _run(slow).requeue_after == 90 and _run(slow).groups[0]["phase"] == "Ready"


def test_an_adopted_drain_is_reported_when_rank_0_ends():
    got = _run(case("a drain that status does not know"))
    g1 = got.groups[1]
    assert g1["drainStartTime"] == iso(at(-10)) and g1["stopReason"] == "scale-down"
    done = Case("done", pods=[pod(1, 0, deleting=35, grace=45, exit_code=0), pod(1, 1),
                              pod(0, 0), pod(0, 1)],
                memory=[got.groups[0], g1], now=at(5))
    events = [a.reason for a in _run(done).actions if isinstance(a, EmitEvent)]
    assert events == ["DrainFinished"]


def test_a_group_held_for_its_adapters_says_which():
    (g,) = _run(case("a new group with every rank ready")).groups
    assert (g["stage"], g["message"]) == (
        "LoadingAdapters", "all 2 ranks ready; loading adapters sql, support")
    (g,) = _run(case("a group whose ranks are not all ready")).groups
    assert g["stage"] != "LoadingAdapters" and "adapters" not in g["message"]


def test_plan_does_not_change_what_it_was_given():
    body, pods = BASE.obj(), {0: {0: pod(0, 0), 1: pod(0, 1, **OOM)}}
    memory = Memory(groups={0: {"index": 0, "phase": "Ready", "restarts": 0}})
    before = copy.deepcopy((body, pods, memory))
    plan(EngineSpec.of(body), Observed(ref=EngineRef.of(body), pods=pods), memory, T0)
    assert (body, pods, memory) == before


def _starting(**status) -> dict:
    p = pod(0, 0, ready=False)
    p["status"] = status
    return p


RUNNING = {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}],
           "conditions": [{"type": "PodScheduled", "status": "True"},
                          {"type": "Ready", "status": "False"}]}


def waiting_on(reason: str) -> list[dict]:
    return [{"state": {"waiting": {"reason": reason}}}]


@pytest.mark.parametrize("rank0, stage", [
    ({"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}, "Scheduling"),
    ({"phase": "Pending", "containerStatuses": waiting_on("ContainerCreating")}, "PullingImage"),
    ({"phase": "Pending", "containerStatuses": waiting_on("ImagePullBackOff")}, "PullingImage"),
    ({"phase": "Running", "containerStatuses": waiting_on("CrashLoopBackOff")}, "Restarting"),
    (RUNNING, "Loading"),
], ids=["unbound", "creating", "image-pull-backoff", "crash-loop", "running-not-ready"])
def test_a_starting_group_reports_the_stage_of_its_slowest_rank(rank0, stage):
    p0 = _starting(**rank0)
    if stage == "Scheduling":
        p0["spec"] = {}
    got = _run(Case("stage", pods=[p0, pod(0, 1)], memory=[group(0, "Starting", message="")]))
    assert (got.groups[0]["phase"], got.groups[0]["stage"]) == ("Starting", stage)


@pytest.mark.parametrize("name, g, stage", [
    ("a new engine", 0, "Scheduling"), ("scale up adds", 0, "Ready"),
    ("a dead rank tears", 0, None), ("scale down withdraws", 1, None),
], ids=["created", "ready", "backing-off", "draining"])
def test_stage_is_reported_while_starting_or_ready_only(name, g, stage):
    assert _run(case(name)).groups[g].get("stage") == stage


def _draining(n: int | None, ip: str | None = "10.0.0.7") -> Case:
    p0 = pod(0, 0, deleting=-5)
    if ip:
        p0["status"]["podIP"] = ip
    return Case("draining", pods=[p0, pod(0, 1)], deleting=True,
                in_flight={} if n is None else {0: n},
                memory=[group(0, "Draining", stopReason="delete", drainStartTime=iso(at(-5)))])


DRAINING = "rank 0 draining (delete) for up to 30s since 2026-12-01T09:59:55Z"


@pytest.mark.parametrize("n, message", [
    (None, DRAINING),
    (3, f"draining: 3 requests in flight; {DRAINING}"),
    (1, f"draining: 1 request in flight; {DRAINING}"),
])
def test_a_draining_group_says_how_many_requests_rank_0_still_has(n, message):
    got = _run(_draining(n))
    assert got.groups[0]["message"] == message and _shape(got.actions) == ()
    assert got.drain_probes == {0: "http://10.0.0.7:8000/metrics"}


def test_rank_0_without_an_address_is_not_probed_and_a_finished_drain_is_not():
    assert _run(_draining(None, ip=None)).drain_probes == {}
    assert _run(case("scale down: once rank 0")).drain_probes == {}, \
        "rank 0's engine ended: nothing left to count"


def test_a_due_restart_says_which_old_pods_it_waits_for():
    waiting = case("a due restart waits")
    assert _run(waiting).groups[0]["message"] == \
        "restart 1 due; waiting for the old pods to stop: llm-g0-r0"
    early = case("backing off while an old rank")
    assert "message" not in _run(early).groups[0], "before it is due, the death's message stays"


# ---- a stock vLLM's death as Shoal's supervisor reports it (supervisor_parts.py) ------------
VLLM = engine("llm", "ns").groups(1).ranks(2).set(runtime="VLLM", image="vllm/vllm-openai:v0.32.0")


def _supervised(cause: Cause, message: str, process: str, pid: int) -> str:
    """The supervisor's message as written (its call: write_termination_message with process and
    pid), i.e. real encode() output."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "termination-log"
        assert write_termination_message(cause, message, rank=0, exit_code=1, path=str(path),
                                         process=process, pid=pid)
        return path.read_text()


KILLED = _supervised(Cause.SIGNALED, "EngineCore_DP0 (pid 312, rank 0) killed by SIGKILL (9)\n"
                     "then APIServer (pid 7, rank 0) exited with code 0", "EngineCore_DP0", 312)
BAD_LEN = _supervised(Cause.CONFIG_ERROR, "APIServer (pid 7, rank 0) exited with code 1: "
                      "pydantic_core._pydantic_core.ValidationError: 1 validation error for "
                      "ModelConfig\n  Value error, User-specified max_model_len (100000) is "
                      "greater than the derived max_model_len", "APIServer", 7)


@pytest.mark.parametrize("message, process, cause, phase, after", [
    (KILLED, "EngineCore_DP0", "signaled", "BackingOff", "GroupRestarting"),
    (BAD_LEN, "APIServer", "config_error", "Failed", "RestartSkipped"),
])
def test_a_supervised_death_names_its_process_and_restarts_by_its_cause(message, process, cause,
                                                                       phase, after):
    got = _run(Case("vllm", pods=[pod(0, 0, exit_code=1, message=message), pod(0, 1)],
                    memory=[group(0, "Ready")], spec=VLLM))
    (g,) = got.groups
    assert g["phase"] == phase
    lf = got.last_failure
    assert (lf["process"], lf["cause"], lf["permanent"]) == (process, cause, phase == "Failed")
    assert lf["message"] == json.loads(message)["message"]  # the supervisor's text, whole
    events = {a.reason: a.message for a in got.actions if isinstance(a, EmitEvent)}
    assert set(events) == {"EngineDied", after}
    assert events["EngineDied"].startswith(f"group 0 rank 0 pod llm-g0-r0 process {process} "
                                           f"died ({cause}, exit code 1")
    assert f"rank 0 ({process})" in g["message"]
    deleted = [a.pod for a in got.actions if isinstance(a, DeletePod)]
    if phase == "Failed":  # not restarted: the failed pod stays for its logs, rank 1 stops
        assert "not restarting" in g["message"] and f"on rank 0 ({process})" in events[after]
        assert deleted == ["llm-g0-r1"] and got.restart_count == 0
    else:
        assert deleted == ["llm-g0-r0", "llm-g0-r1"] and got.restart_count == 1
