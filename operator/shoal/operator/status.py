"""Summaries of observed state: conditions in the Kubernetes API conventions and the phase.

Pure functions over the per-group state a planned pass computed. Every condition type is a
`ConditionType` (phases.py), the one list the CRD documents too.
"""

from __future__ import annotations

from shoal.operator import labels as L
from shoal.operator.observed import no_empty_strings
from shoal.operator.phases import MOVING, ConditionType, GroupPhase, Phase
from shoal.operator.render_common import selector_string
from shoal.operator.spec import EngineRef

C = ConditionType
AUTOSCALING = "Autoscaling"  # the condition spec.autoscaling adds (autoscale.verdict)


def condition(type_: str, ok: bool | None, reason: str, message: str, generation: int, now: str,
              previous: list[dict]) -> dict:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    prev = next((c for c in previous if c.get("type") == type_), None)
    kept = prev and prev.get("status") == status and prev.get("lastTransitionTime")
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": prev["lastTransitionTime"] if kept else now,
            "observedGeneration": generation}


def camel(cause: str) -> str:
    return "".join(p.capitalize() for p in cause.split("_")) or "Unknown"


# (ok, reason, message) of one condition
Verdict = tuple[bool, str, str]


def _ready(*, replicas: int, ready: int, served: bool, deleting: bool, groups: list[dict],
           pods_left: int, detail: str) -> Verdict:
    if deleting:
        return False, "Terminating", (f"deleting: {len(groups)} groups stopping, {pods_left} "
                                      "engine pods left")
    if not replicas:
        return False, "ScaledToZero", "replicas is 0: no engine group"
    if ready == replicas:
        return served, "AllGroupsReady" if served else "FrontendsNotReady", detail
    return False, "GroupsNotReady", detail


def _serving(*, served: bool, frontends_ready: int, deleting: bool, fe_msg: str) -> Verdict:
    if deleting:
        return False, "Terminating", "the resource is being deleted"
    reason = ("FrontendsServing" if served
              else "NoGroupInDiscovery" if frontends_ready else "NoFrontendReady")
    return served, reason, fe_msg


def _engine_dead(bad: list[dict], failed: list[dict], last_failure: dict | None) -> Verdict:
    if not (bad and last_failure):
        return False, "EnginesAlive", "no engine group is dead"
    lf = last_failure
    reason = "PermanentError" if lf.get("permanent") else camel(lf.get("cause", "unknown"))
    process = f" process {lf['process']}" if lf.get("process") else ""
    msg = (f"group {lf.get('group')} rank {lf.get('rank')} pod {lf.get('pod')}{process} "
           f"({lf.get('cause')}, exit code {lf.get('exitCode')}): {lf.get('message', '')}")
    if failed:
        msg += " -- not restarting: " + "; ".join(g.get("message", "") for g in failed)
    return True, reason, msg[:2000]


def _phase(*, deleting: bool, problems: list[str], replicas: int, ready: int, served: bool,
           failed: list[dict], bad: list[dict], groups: list[dict]) -> Phase:
    if deleting:
        return Phase.TERMINATING
    if problems or (replicas and len(failed) == replicas):
        return Phase.FAILED
    if bad:
        return Phase.DEGRADED
    if replicas and ready == replicas and served:
        return Phase.READY
    return Phase.PENDING if not groups else Phase.PROGRESSING


def summarize(*, replicas: int, groups: list[dict], problems: list[str], deleting: bool,
              last_failure: dict | None, generation: int, now: str, previous: list[dict],
              frontends_ready: int = 0, frontends_desired: int = 0, serving: list[int] = (),
              pods_left: int = 0) -> tuple[str, list[dict]]:
    """(phase, conditions) from the desired group count, each group's phase and the frontends.

    Ready means served: every desired group is Ready *and* at least one frontend pod is Ready
    (a frontend is Ready only while it reaches a group of its discovery list), so a client of
    the Service gets answers. `Serving` says how many frontends are Ready and which groups
    the discovery list gives them."""
    desired = [g for g in groups if g["index"] < replicas]
    ready = sum(1 for g in desired if g["phase"] == GroupPhase.READY)
    failed = [g for g in desired if g["phase"] == GroupPhase.FAILED]
    bad = failed + [g for g in desired if g["phase"] == GroupPhase.BACKING_OFF]
    moving = [g for g in groups if g["phase"] in MOVING]
    served = bool(frontends_ready and serving)
    fe_msg = (f"{frontends_ready}/{frontends_desired} frontends ready; discovery lists "
              + (f"groups {', '.join(map(str, serving))}" if serving else "no group"))
    detail = f"{ready}/{replicas} engine groups ready; {fe_msg}"

    verdicts: dict[ConditionType, Verdict] = {
        C.SPEC_VALID: (not problems, "Invalid" if problems else "Valid",
                       "; ".join(problems) or "spec accepted"),
        C.READY: _ready(replicas=replicas, ready=ready, served=served, deleting=deleting,
                        groups=groups, pods_left=pods_left, detail=detail),
        C.SERVING: _serving(served=served, frontends_ready=frontends_ready, deleting=deleting,
                            fe_msg=fe_msg),
        C.PROGRESSING: (bool(moving), "GroupsChanging" if moving else "Stable",
                        ", ".join(f"group {g['index']} {g['phase']}" for g in moving)
                        or "no change in progress"),
        C.DEGRADED: (bool(bad), "GroupsFailed" if bad else "AsDesired",
                     "; ".join(f"group {g['index']} {g['phase']}: {g.get('message', '')}"
                               for g in bad) or "no failed group"),
        C.ENGINE_DEAD: _engine_dead(bad, failed, last_failure),
    }
    conds = [condition(t.value, *verdicts[t], generation, now, previous) for t in ConditionType]
    phase = _phase(deleting=deleting, problems=problems, replicas=replicas, ready=ready,
                   served=served, failed=failed, bad=bad, groups=groups)
    return phase, conds


def engine_status(*, ref: EngineRef, generation: int, deleting: bool, plan,
                  frontends_ready: int, frontends_desired: int, pods_left: int,
                  previous: list[dict], now: str) -> dict:
    """status of the InferenceEngine after a planned pass (`plan.Plan`), "" values dropped."""
    groups, replicas = list(plan.groups), plan.replicas
    phase, conditions = summarize(
        replicas=replicas, groups=groups, problems=list(plan.problems), deleting=deleting,
        last_failure=plan.last_failure, generation=generation, now=now,
        previous=previous, frontends_ready=frontends_ready, frontends_desired=frontends_desired,
        serving=list(plan.ready_groups), pods_left=pods_left)
    # The `ready` column counts groups a client of the Service reaches: none while no frontend
    # is Ready.
    served = len(plan.ready_groups) if frontends_ready else 0
    desired = [g for g in groups if g["index"] < replicas]
    status = {
        "observedGeneration": generation,
        "phase": phase,
        "replicas": len(desired),
        "readyReplicas": len(plan.ready_groups),
        "updatedReplicas": sum(1 for g in desired if g.get("revision") == plan.revision),
        "ready": f"{served}/{replicas}",
        "selector": selector_string(ref.name),
        "endpoint": L.endpoint_url(ref.name, ref.namespace),
        "restartCount": plan.restart_count,
        "revision": plan.revision,
        "conditions": conditions,
        "groups": groups,
    }
    if plan.last_failure:
        status["lastFailure"] = plan.last_failure
    if plan.autoscaling_condition is not None:
        status["conditions"] = [*conditions, condition(
            AUTOSCALING, *plan.autoscaling_condition, generation, now, previous)]
    if plan.autoscaling is not None:
        status["autoscaling"] = dict(plan.autoscaling)
    return no_empty_strings(status)
