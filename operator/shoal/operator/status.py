"""Summaries of observed state: conditions in the Kubernetes API conventions and the phase.

Pure functions over the per-group state a planned pass computed.
"""

from __future__ import annotations

from shoal.operator import labels as L
from shoal.operator import render
from shoal.operator.observed import no_empty_strings
from shoal.operator.phases import MOVING, GroupPhase, Phase


def condition(type_: str, ok: bool | None, reason: str, message: str, generation: int, now: str,
              previous: list[dict]) -> dict:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    prev = next((c for c in previous if c.get("type") == type_), None)
    since = prev["lastTransitionTime"] if prev and prev.get("status") == status and prev.get("lastTransitionTime") else now
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def camel(cause: str) -> str:
    return "".join(p.capitalize() for p in cause.split("_")) or "Unknown"


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
    backing = [g for g in desired if g["phase"] == GroupPhase.BACKING_OFF]
    moving = [g for g in groups if g["phase"] in MOVING]
    served = bool(frontends_ready and serving)

    conds = [condition("SpecValid", not problems, "Invalid" if problems else "Valid",
                       "; ".join(problems) or "spec accepted", generation, now, previous)]
    groups_msg = f"{ready}/{replicas} engine groups ready"
    fe_msg = (f"{frontends_ready}/{frontends_desired} frontends ready; discovery lists "
              + (f"groups {', '.join(map(str, serving))}" if serving else "no group"))
    if deleting:
        conds.append(condition("Ready", False, "Terminating",
                               f"deleting: {len(groups)} groups stopping, {pods_left} engine pods left",
                               generation, now, previous))
    elif replicas and ready == replicas and served:
        conds.append(condition("Ready", True, "AllGroupsReady", f"{groups_msg}; {fe_msg}",
                               generation, now, previous))
    elif replicas and ready == replicas:
        conds.append(condition("Ready", False, "FrontendsNotReady", f"{groups_msg}; {fe_msg}",
                               generation, now, previous))
    elif not replicas:
        conds.append(condition("Ready", False, "ScaledToZero", "replicas is 0: no engine group",
                               generation, now, previous))
    else:
        conds.append(condition("Ready", False, "GroupsNotReady", f"{groups_msg}; {fe_msg}",
                               generation, now, previous))
    if deleting:
        conds.append(condition("Serving", False, "Terminating", "the resource is being deleted",
                               generation, now, previous))
    else:
        conds.append(condition("Serving", served, "FrontendsServing" if served else
                               ("NoGroupInDiscovery" if frontends_ready else "NoFrontendReady"),
                               fe_msg, generation, now, previous))
    conds.append(condition("Progressing", bool(moving), "GroupsChanging" if moving else "Stable",
                           ", ".join(f"group {g['index']} {g['phase']}" for g in moving) or "no change in progress",
                           generation, now, previous))
    bad = failed + backing
    conds.append(condition("Degraded", bool(bad), "GroupsFailed" if bad else "AsDesired",
                           "; ".join(f"group {g['index']} {g['phase']}: {g.get('message', '')}" for g in bad)
                           or "no failed group", generation, now, previous))
    if bad and last_failure:
        lf = last_failure
        reason = ("PermanentError" if lf.get("permanent") else camel(lf.get("cause", "unknown")))
        msg = (f"group {lf.get('group')} rank {lf.get('rank')} pod {lf.get('pod')} "
               f"({lf.get('cause')}, exit code {lf.get('exitCode')}): {lf.get('message', '')}")
        if any(g["phase"] == GroupPhase.FAILED for g in bad):
            msg += " -- not restarting: " + "; ".join(g.get("message", "") for g in failed)
        conds.append(condition("EngineDead", True, reason, msg[:2000], generation, now, previous))
    else:
        conds.append(condition("EngineDead", False, "EnginesAlive", "no engine group is dead", generation, now, previous))

    if deleting:
        phase = Phase.TERMINATING
    elif problems or (replicas and len(failed) == replicas):
        phase = Phase.FAILED
    elif bad:
        phase = Phase.DEGRADED
    elif replicas and ready == replicas and served:
        phase = Phase.READY
    elif not groups:
        phase = Phase.PENDING
    else:
        phase = Phase.PROGRESSING
    return phase, conds


def engine_status(*, body: dict, plan, frontends_ready: int, frontends_desired: int, pods_left: int,
                  previous: list[dict], now: str) -> dict:
    """status of the InferenceEngine after a planned pass (`plan.Plan`), "" values dropped."""
    meta = body["metadata"]
    name, groups, replicas = meta["name"], list(plan.groups), plan.replicas
    deleting = bool(meta.get("deletionTimestamp"))
    phase, conditions = summarize(
        replicas=replicas, groups=groups, problems=list(plan.problems), deleting=deleting,
        last_failure=plan.last_failure, generation=meta.get("generation", 0), now=now,
        previous=previous, frontends_ready=frontends_ready, frontends_desired=frontends_desired,
        serving=list(plan.ready_groups), pods_left=pods_left)
    # The `ready` column counts groups a client of the Service reaches: none while no frontend
    # is Ready.
    served = len(plan.ready_groups) if frontends_ready else 0
    status = {
        "observedGeneration": meta.get("generation", 0),
        "phase": phase,
        "replicas": sum(1 for g in groups if g["index"] < replicas),
        "readyReplicas": len(plan.ready_groups),
        "updatedReplicas": sum(1 for g in groups if g.get("revision") == plan.revision and g["index"] < replicas),
        "ready": f"{served}/{replicas}",
        "selector": render.selector_string(name),
        "endpoint": L.endpoint_url(name, meta["namespace"]),
        "restartCount": plan.restart_count,
        "revision": plan.revision,
        "conditions": conditions,
        "groups": groups,
    }
    if plan.last_failure:
        status["lastFailure"] = plan.last_failure
    return no_empty_strings(status)
