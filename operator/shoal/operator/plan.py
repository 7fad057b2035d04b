"""The decisions of one reconcile pass, as a pure function:

    plan(spec, observed, memory, now) -> Plan(actions, requeue_after, groups, ...)

No API call, no clock read, no kopf: what the pass saw and remembers goes in, the writes it
wants (`actions.py`, in order) and the time of its next look come out, so every decision is
table-tested (tests/operator/test_op_plan.py) and `reconcile.py` only observes, applies and
reports. The steps, LWS style:
1. validate the spec (problems -> nothing created; deaths are still recorded);
2. the singletons (ApplyChildren);
3. per group: detect a death (a rank that ended, or whose node was lost: node_loss.py; record
   it, Event, tear the group down, back off or give up),
   finish a stop in progress (rank 0 first), recreate after backoff, create missing groups,
   track readiness;
4. start at most one rolling update;
5. the discovery file lists the ready groups.
With spec.autoscaling, step 0 is the autoscaler's decision (autoscale.decide(), pure too): its
count replaces spec.replicas, so a scale-down is the same ordered drain as any other.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from shoal.contract.model_fetch import FETCH_CONTAINER
from shoal.operator import autoscale, fetch_progress, render
from shoal.operator import labels as L
from shoal.operator.actions import Action, ApplyChildren, CreatePods, WriteDiscovery
from shoal.operator.backoff import restart_delay, restarts_exhausted
from shoal.operator.events import NORMAL, WARNING
from shoal.operator.failures import Failure, failure_of, is_stopping, root_cause
from shoal.operator.node_loss import node_lost
from shoal.operator.observed import (
    Memory,
    Observed,
    PassState,
    iso,
    iso_not_before,
    marked_not_ready_at,
    parse_time,
    pod_ready,
    ranks_status,
    revision_of,
    stalled,
    startup_stage,
    vanished,
    waiting_reason,
)
from shoal.operator.phases import GroupPhase, GroupStage
from shoal.operator.shutdown import force_lost, stop, teardown_dead
from shoal.operator.spec import EngineSpec
from shoal.operator.validation import spec_problems


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    requeue_after: float | None  # seconds until the next pass this one needs; None: none planned
    groups: tuple[dict, ...]  # status.groups as they are after the actions
    ready_groups: tuple[int, ...]  # desired groups that are Ready (the discovery list)
    problems: tuple[str, ...]  # spec problems (SpecValid=False)
    replicas: int  # desired groups (0 while deleting)
    revision: str
    last_failure: dict | None
    restart_count: int
    # draining group -> rank 0's /metrics
    drain_probes: Mapping[int, str] = field(default_factory=dict)
    # spec.autoscaling: status.autoscaling and the Autoscaling condition's (ok, reason, message)
    autoscaling: dict | None = None
    autoscaling_condition: tuple[bool, str, str] | None = None


def _autoscale(spec: EngineSpec, observed: Observed, memory: Memory, now: dt.datetime,
               problems: list[str]) -> autoscale.Decision | None:
    if spec.autoscaling is None or observed.deleting or problems:
        return None
    ready = {g for g, m in memory.groups.items() if m.get("phase") == GroupPhase.READY}
    return autoscale.decide(spec.autoscaling, replicas=spec.replicas, ready=ready,
                            samples=observed.samples, memory=memory.autoscaling,
                            wake=observed.wake, now=now)


def plan(spec: EngineSpec, observed: Observed, memory: Memory, now: dt.datetime) -> Plan:
    deleting = observed.deleting
    problems = spec_problems(observed.ref.name, spec)
    decision = _autoscale(spec, observed, memory, now, problems)
    replicas = 0 if deleting else spec.replicas
    if decision is not None:
        replicas = decision.desired
    elif spec.autoscaling is not None and not deleting:  # invalid spec: the last count stays
        replicas = int((memory.autoscaling or {}).get("desiredGroups", spec.replicas))
    serving = {g for g, m in memory.groups.items()
               if m.get("phase") == GroupPhase.READY and g < replicas}
    st = PassState(ref=observed.ref, spec=spec, now=now, last_failure=memory.last_failure,
                   restart_count=memory.restart_count, deleting=deleting,
                   in_flight=dict(observed.in_flight), serving=serving,
                   fetch_logs=observed.fetch_logs, adapters_pending=observed.adapters_pending,
                   nodes=observed.nodes)
    by_group = {g: dict(p) for g, p in observed.pods.items() if p}
    if decision is not None:
        if decision.event:
            st.event(NORMAL, *decision.event)
        st.requeue(autoscale.PERIOD_SECONDS if replicas else autoscale.WAKE_POLL_SECONDS)
    if not problems and not deleting:
        st.act(ApplyChildren(tuple(sorted(st.serving))))

    # A stopped group whose rank 0 drained and is gone has no pods left but still gets its
    # pass: that is when its drain is reported finished (single-rank groups; found on a
    # real cluster, where DrainFinished never came).
    draining = {i for i, m in memory.groups.items() if m.get("drainStartTime")}
    groups: list[dict] = []
    for g in sorted(set(by_group) | draining | set(range(replicas if not problems else 0))):
        mem = memory.groups.get(g, {"index": g, "restarts": 0})
        gpods = by_group.get(g, {})
        if problems and g not in by_group:
            continue
        force_lost(st, gpods)
        if problems:  # invalid spec: keep what runs, create nothing, still watch for deaths
            new = _watch_only(st, g, mem, gpods)
        elif g >= replicas:
            new = stop(st, g, mem, gpods, "delete" if deleting else "scale-down")
        else:
            new = _group(st, g, mem, gpods)
        if new is not None:
            if new.get("phase") not in (GroupPhase.STARTING, GroupPhase.READY):
                new.pop("stage", None)
            if new.get("phase") != GroupPhase.STARTING:
                new.pop("download", None)
            seen = {**gpods, **st.created.get(g, {})}
            new["ranks"] = ranks_status(seen if new.get("phase") != GroupPhase.BACKING_OFF else {})
            groups.append(new)

    if not problems and not deleting:
        _roll_one(st, groups, by_group)
    ready = tuple(g["index"] for g in groups
                  if g["phase"] == GroupPhase.READY and g["index"] < replicas)
    if not problems and not deleting:
        st.act(WriteDiscovery(ready))
    return Plan(
        actions=tuple(st.actions),
        requeue_after=st.requeue_after,
        groups=tuple(groups),
        ready_groups=ready,
        problems=tuple(problems),
        replicas=replicas,
        revision=st.spec.revision,
        last_failure=st.last_failure,
        restart_count=st.restart_count,
        drain_probes=dict(st.drain_probes),
        autoscaling=decision.memory if decision else memory.autoscaling,
        autoscaling_condition=(autoscale.verdict(spec.replicas, decision, observed.hpas)
                               if decision else None),
    )


def _group(st: PassState, g: int, mem: dict, pods: dict[int, dict]) -> dict:
    """One desired group's next state."""
    nodes = st.spec.nodes_per_group
    mem = {**mem, "index": g}
    mem.setdefault("restarts", 0)
    quiet = not any(is_stopping(p) for p in pods.values())

    death = root_cause(list(pods.values()))
    phase = mem.get("phase")
    if death is None and pods and phase in (GroupPhase.READY, GroupPhase.STARTING):
        death, due = node_lost(st.nodes, st.spec.restart.node_lost_seconds, g, pods, st.now)
        if due is not None:
            st.requeue(due)
    if death is None and pods and quiet and phase == GroupPhase.READY and len(pods) < nodes:
        death = vanished(st, g, mem, pods, nodes)
    if death is None and pods and quiet and phase == GroupPhase.STARTING and not all(
            pod_ready(p) for p in pods.values()):
        death = stalled(st, g, pods, st.spec.startup_timeout_seconds)
    if death and death.key != mem.get("failureKey"):
        return _on_death(st, g, mem, pods, death)

    if phase == GroupPhase.FAILED:
        rev = st.spec.revision
        if revision_of(pods) not in (None, rev) or (not pods and mem.get("revision") != rev):
            # The spec changed since the permanent failure: try again from scratch, once the
            # old pods are gone (the BackingOff step below, due at once).
            teardown_dead(st, pods)
            mem.update(phase=GroupPhase.BACKING_OFF, restarts=0, nextRestartTime=iso(st.now),
                       message="spec changed; recreating")
            if not pods:
                return _create(st, g, mem)
        return mem
    if phase == GroupPhase.BACKING_OFF:
        due = parse_time(mem.get("nextRestartTime"))
        if due and st.now < due:
            st.requeue((due - st.now).total_seconds())
        if pods:  # the old ranks are still stopping: no replacement starts beside them
            teardown_dead(st, pods)
            if not due or st.now >= due:  # say why a due restart waits (once: no clock in it)
                mem["message"] = (
                    f"restart {mem['restarts']} due; waiting for the old pods to stop: "
                    + ", ".join(p["metadata"]["name"] for _, p in sorted(pods.items()))
                )
            return mem
        if due and st.now < due:
            return mem
        st.event(NORMAL, "GroupRestarted",
                 f"group {g}: recreating all {nodes} ranks (restart {mem['restarts']})")
        mem.pop("nextRestartTime", None)
        return _create(st, g, mem)
    if phase in (GroupPhase.UPDATING, GroupPhase.DRAINING) or not quiet:
        if pods:
            return stop(st, g, mem, pods, mem.get("stopReason") or "update")
        mem.pop("stopReason", None)
        return _create(st, g, mem)
    if len(pods) < nodes:  # none, or a create that did not finish: complete the group
        return _create(st, g, mem, existing=pods)
    return _track(st, g, mem, pods)


def _track(st: PassState, g: int, mem: dict, pods: dict[int, dict]) -> dict:
    """A complete, live group: Ready, or Starting with what each rank waits for."""
    nodes = st.spec.nodes_per_group
    mem["revision"] = revision_of(pods) or st.spec.revision
    pending = st.adapters_pending.get(g)
    if pending and mem.get("phase") != GroupPhase.READY and all(
            pod_ready(p) for p in pods.values()):
        # a new or restarted group serves its adapters from its first request (a Ready group
        # is never taken out of the discovery list for an adapter added later)
        mem.update(phase=GroupPhase.STARTING, stage=GroupStage.LOADING_ADAPTERS,
                   message=f"all {nodes} ranks ready; loading adapters {', '.join(pending)}")
        mem.pop("readySince", None)
        return mem
    unconfirmed = _unconfirmed(st, mem, pods)
    if all(pod_ready(p) or r in unconfirmed for r, p in pods.items()):
        if mem.get("phase") != GroupPhase.READY:
            mem["readySince"] = iso(st.now)
        mem.update(phase=GroupPhase.READY, stage=GroupStage.READY,
                   message=f"all {nodes} ranks ready" + "".join(
                       f"; rank {r} marked not Ready by the node controller (its node missed "
                       f"heartbeats) at {iso(at)}: kept serving until its kubelet reports, "
                       f"or {st.spec.restart.node_lost_seconds}s"
                       for r, at in sorted(unconfirmed.items())))
        since = parse_time(mem.get("readySince"))
        reset_after = st.spec.restart.reset_after_seconds
        if mem.get("restarts") and since and (st.now - since).total_seconds() >= reset_after:
            mem["restarts"] = 0
        return mem
    ready = sum(pod_ready(p) for p in pods.values())
    waiting = [f"rank {r}: {w}" for r, p in sorted(pods.items()) if (w := waiting_reason(p))]
    message = f"{ready}/{nodes} ranks ready" + (f"; {'; '.join(waiting)}" if waiting else "")
    if waiting and not (mem.get("message") or "").startswith(message):  # once per change
        st.event(WARNING, "RankWaiting", f"group {g}: {'; '.join(waiting)}")
    message += _download(st, g, mem, pods)
    mem.update(phase=GroupPhase.STARTING, stage=startup_stage(pods), message=message)
    mem.pop("readySince", None)
    return mem


def _unconfirmed(st: PassState, mem: dict, pods: dict[int, dict]) -> dict[int, dt.datetime]:
    """The ranks of a Ready group whose pod only the node controller marked not Ready, within
    restartPolicy.nodeLostSeconds of the mark (rank -> when): the group stays in discovery
    meanwhile, so that an API server outage or a missed heartbeat does not empty the frontends'
    list (found on real pods: a 30 s outage marked every pod not Ready for ~6 s). A node that is
    really lost is a death at the same bound (node_loss.py); until then the routers' own
    health checks keep requests off a group that does not answer."""
    if mem.get("phase") != GroupPhase.READY:
        return {}
    bound = dt.timedelta(seconds=st.spec.restart.node_lost_seconds)
    out = {}
    for r, p in pods.items():
        at = marked_not_ready_at(p)
        if at is not None and st.now < at + bound:
            out[r] = at
            st.requeue((at + bound - st.now).total_seconds())
    return out


def _download(st: PassState, g: int, mem: dict, pods: dict[int, dict]) -> str:
    """While a rank's model-fetch runs: its progress in `download` and the message (an Event
    per EVENT_STEP_PERCENT or minute), and a pass again in POLL_SECONDS to read it anew."""
    if not any(fetch_progress.fetching(p) for p in pods.values()):
        mem.pop("download", None)
        return ""
    st.requeue(fetch_progress.POLL_SECONDS)
    progress = fetch_progress.group_progress(st.fetch_logs.get(g) or {})
    if progress is None:
        return "; fetching the model"
    mem["download"], due = fetch_progress.next_download(mem.get("download"), progress, st.now,
                                                        iso)
    if due:
        st.event(NORMAL, "ModelDownloading", f"group {g}: {progress.text}")
    return f"; {progress.text}"


def _named(st: PassState, death: Failure) -> Failure:
    """A model-fetch failure names the repository it fetched (the fetcher's message does;
    this holds for any fetcher image)."""
    hub = st.spec.source.hub
    if hub and death.reason.startswith(FETCH_CONTAINER) and hub.repo_id not in death.message:
        return replace(death, message=f"{hub.uri}: {death.message}")
    return death


def _on_death(st: PassState, g: int, mem: dict, pods: dict[int, dict], death: Failure) -> dict:
    rp = st.spec.restart
    death = _named(st, death)
    st.last_failure = death.to_status()
    mem["failureKey"] = death.key
    mem.pop("readySince", None)
    st.event(
        WARNING,
        "EngineDied",
        f"group {g} {death.who} died ({death.cause}, exit code {death.exit_code}, signal "
        f"{death.signal}, reason {death.reason or '-'}): {death.message}",
    )
    restarts = int(mem.get("restarts", 0))
    if death.permanent or rp.never or restarts_exhausted(restarts, rp.max_restarts):
        why = ("a restart cannot fix it; fix the spec to retry" if death.permanent
               else "restartPolicy.policy is Never" if rp.never
               else f"{restarts} consecutive restarts reached restartPolicy.maxRestarts")
        mem.update(phase=GroupPhase.FAILED, revision=revision_of(pods) or st.spec.revision,
                   message=f"{death.rank_process} {death.cause}: not restarting: {why}")
        st.event(WARNING, "RestartSkipped",
                 f"group {g}: not restarting after {death.cause} on {death.rank_process}: {why}")
        # Keep the failed pod for its logs; stop the ranks that are still running.
        teardown_dead(st, {r: p for r, p in pods.items() if failure_of(p) is None})
        return mem
    restarts += 1
    delay = restart_delay(restarts, rp.backoff_base_seconds, rp.backoff_max_seconds)
    st.restart_count += 1
    mem.update(phase=GroupPhase.BACKING_OFF, restarts=restarts,
               nextRestartTime=iso_not_before(st.now + dt.timedelta(seconds=delay)),
               message=f"{death.rank_process} died ({death.cause}); restart {restarts} in {delay}s")
    st.event(NORMAL, "GroupRestarting",
             f"group {g}: tearing down all ranks; restart {restarts} in {delay}s")
    # A tensor-parallel group with a dead rank cannot continue: all ranks go at once.
    teardown_dead(st, pods)
    st.requeue(delay)
    return mem


def _watch_only(st: PassState, g: int, mem: dict, pods: dict[int, dict]) -> dict:
    """The spec became invalid: what runs keeps running and nothing is created or restarted,
    but a death is still recorded and reported (lastFailure, EngineDied)."""
    mem = {**mem, "index": g}
    death = root_cause(list(pods.values()))
    if death and death.key != mem.get("failureKey"):
        st.last_failure = death.to_status()
        mem["failureKey"] = death.key
        st.event(WARNING, "EngineDied",
                 f"group {g} {death.who} died ({death.cause}, exit code {death.exit_code}): "
                 f"{death.message}; not restarting while the spec is invalid")
        mem.update(
            phase=GroupPhase.FAILED,
            message=f"{death.rank_process} {death.cause}: not restarting while the spec is invalid",
        )
    mem.setdefault("phase", GroupPhase.PENDING)
    return mem


def _create(st: PassState, g: int, mem: dict, existing: dict | None = None) -> dict:
    existing = existing or {}
    missing = {int(p["metadata"]["labels"][L.LABEL_RANK]): p
               for p in render.group_pods(st.ref, st.spec, g)}
    missing = {r: p for r, p in missing.items() if r not in existing}
    st.act(CreatePods(g, tuple(sorted(missing))))
    st.created.setdefault(g, {}).update(missing)
    mem.update(phase=GroupPhase.STARTING, stage=GroupStage.SCHEDULING, revision=st.spec.revision,
               message=f"0/{st.spec.nodes_per_group} ranks ready")
    for k in ("readySince", "drainStartTime", "stopReason", "nextRestartTime"):
        mem.pop(k, None)
    return mem


def _roll_one(st: PassState, groups: list[dict], by_group: dict[int, dict[int, dict]]) -> None:
    """Rolling update: at most one group stops for an update at a time, and only when every
    group already at the new revision is ready. Groups that are not serving go first; then
    ready ones, lowest index first."""
    if any(g["phase"] == GroupPhase.UPDATING for g in groups):
        return
    rev = st.spec.revision
    if any(g.get("revision") == rev and g["phase"] == GroupPhase.STARTING for g in groups):
        return
    for g in sorted(groups, key=lambda g: (g["phase"] == GroupPhase.READY, g["index"])):
        pods = by_group.get(g["index"], {})
        live = g["phase"] in (GroupPhase.READY, GroupPhase.STARTING)
        if pods and live and g.get("revision") != rev:
            st.event(
                NORMAL,
                "GroupUpdating",
                f"group {g['index']}: rolling to revision {st.spec.revision} (one group at a time)",
            )
            g.update(stop(st, g["index"], g, pods, "update"))
            g["ranks"] = ranks_status(pods)
            return
