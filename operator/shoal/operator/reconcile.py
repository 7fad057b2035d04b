"""One reconcile pass for one InferenceEngine: observe, decide group by group, write, report.

A straight list of steps (LWS style):
1. validate the spec (problems -> SpecValid=False, nothing created);
2. apply the singletons (frontend Deployment and Service, headless Service, PDB) when absent
   or when their rendered hash changed;
3. per group: detect a death (record it, Event, tear the group down, back off or give up),
   finish a stop in progress (rank 0 first), recreate after backoff, create missing groups,
   start at most one rolling update, track readiness;
4. rewrite the discovery ConfigMap with the ready groups;
5. patch status only if it changed.

The operator's memory lives in `status.groups` (restarts, backoff deadline, the death already
handled), so a restarted operator continues where the last one stopped. Every name is
deterministic, so a second pass, or two operators racing, never duplicate an object.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass, field

from shoal.operator import events, render
from shoal.operator import labels as L
from shoal.operator.backoff import restart_delay, restarts_exhausted
from shoal.operator.failures import Failure, failure_of, is_stopping, root_cause, terminated_state
from shoal.operator.kube import PLURALS, Kube
from shoal.operator.observed import (
    PassState,
    iso,
    iso_not_before,
    no_empty_strings,
    owned_by,
    parse_time,
    pod_ready,
    ranks_status,
    ref,
    revision_of,
    stalled,
    status_differs,
    vanished,
    waiting_reason,
)
from shoal.operator.phases import GroupPhase
from shoal.operator.shutdown import OrderedStop
from shoal.operator.spec import EngineSpec
from shoal.operator.status import summarize
from shoal.operator.validation import spec_problems

log = logging.getLogger("shoal.operator.reconcile")

SINGLETON_CACHE_SECONDS = 60.0
# A dead group's live ranks get SIGTERM and this long before SIGKILL (not their drain grace:
# there is nothing left to drain).
DEAD_GROUP_GRACE_SECONDS = 10
# A pod still there this long after its grace ran out is on a node that does not answer: its
# object is removed (grace 0) so that the group can come back elsewhere.
FORCE_AFTER_SECONDS = 30


@dataclass
class Outcome:
    """What a pass leaves behind: used by the delete handler (done?) and by tests."""

    pods_left: int = 0
    requeue_after: float | None = None
    status: dict = field(default_factory=dict)


class Reconciler:
    """Holds the API client, a clock, the PDB API version found by discovery and a short-lived
    cache of singleton hashes (so a quiet pass does no GET per singleton)."""

    def __init__(self, kube: Kube, *, clock=None, pdb_api_version: str | None | bool = True):
        self.kube = kube
        self.stopper = OrderedStop(kube, self._apply, self._teardown)
        self.clock = clock or (lambda: dt.datetime.now(dt.timezone.utc))
        self._pdb = pdb_api_version
        self._applied: dict[tuple, tuple[str, float]] = {}
        self._locks: dict[tuple, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._last_pass: dict[tuple, float] = {}
        self._passes: dict[tuple, int] = {}

    # ---- entry points --------------------------------------------------------------------

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def reconcile(self, body: dict) -> Outcome:
        meta = body["metadata"]
        with self.lock(meta["namespace"], meta["name"]):
            # Work on the freshest copy: handlers may hand us a body that is a few events old.
            fresh = self.kube.get(L.API_VERSION, L.PLURAL, meta["namespace"], meta["name"])
            if fresh is None or (meta.get("uid") and fresh["metadata"].get("uid") != meta["uid"]):
                return Outcome()
            self._last_pass[(meta["namespace"], meta["name"])] = time.monotonic()
            try:
                return self._pass(fresh)
            finally:
                with self._locks_guard:
                    key = (meta["namespace"], meta["name"])
                    self._passes[key] = self._passes.get(key, 0) + 1

    def passes(self, namespace: str, name: str) -> int:
        """How many passes of this resource have finished (in this process)."""
        with self._locks_guard:
            return self._passes.get((namespace, name), 0)

    def seconds_since_pass(self, namespace: str, name: str) -> float:
        last = self._last_pass.get((namespace, name))
        return float("inf") if last is None else time.monotonic() - last

    def pdb_api_version(self) -> str | None:
        """policy/v1 where served (1.21+), else policy/v1beta1 (1.20), else no PDB."""
        if self._pdb is True:
            for gv in ("policy/v1", "policy/v1beta1"):
                if "poddisruptionbudgets" in self.kube.resources(gv):
                    self._pdb = gv
                    break
            else:
                self._pdb = None
        return self._pdb or None

    # ---- the pass ------------------------------------------------------------------------

    def _pass(self, body: dict) -> Outcome:
        meta, spec = body["metadata"], render.spec_of(body)
        name, ns = meta["name"], meta["namespace"]
        now = self.clock()
        old_status = body.get("status") or {}
        deleting = bool(meta.get("deletionTimestamp"))
        problems = spec_problems(name, spec)
        es = EngineSpec.of(body)
        replicas = 0 if deleting else es.replicas
        rev = render.engine_revision(spec)
        st = PassState(body=body, spec=es, now=now, rev=rev, old_status=old_status,
                        last_failure=old_status.get("lastFailure"),
                        restart_count=int(old_status.get("restartCount", 0)), deleting=deleting,
                        serving={int(g["index"]) for g in old_status.get("groups") or []
                                 if g.get("phase") == GroupPhase.READY and int(g["index"]) < replicas})

        pods = self.kube.list("v1", "pods", ns, f"{L.LABEL_ENGINE}={name},{L.LABEL_COMPONENT}={L.COMPONENT_ENGINE}")
        pods = [p for p in pods if owned_by(p, meta.get("uid"))]
        by_group: dict[int, dict[int, dict]] = {}
        for p in pods:
            lbl = p["metadata"]["labels"]
            by_group.setdefault(int(lbl[L.LABEL_GROUP]), {})[int(lbl[L.LABEL_RANK])] = p
        memory = {int(g["index"]): dict(g) for g in old_status.get("groups") or []}

        if not problems and not deleting:
            self._apply_singletons(body, st.serving)

        # A stopped group whose rank 0 drained and is gone has no pods left but still gets its
        # pass: that is when its drain is reported finished (single-rank groups; found on a
        # real cluster, where DrainFinished never came).
        draining = {i for i, m in memory.items() if m.get("drainStartTime")}
        indexes = sorted(set(by_group) | draining | set(range(replicas if not problems else 0)))
        groups: list[dict] = []
        for g in indexes:
            mem = memory.get(g, {"index": g, "restarts": 0})
            gpods = by_group.get(g, {})
            if problems and g not in by_group:
                continue
            if problems:  # invalid spec: keep what runs, create nothing, still watch for deaths
                new = self._watch_only(st, g, mem, gpods)
            elif g >= replicas:
                new = self.stopper.stop(st, g, mem, gpods, "delete" if deleting else "scale-down")
            else:
                new = self._group(st, g, mem, gpods, replicas)
            if new is not None:
                seen = {**by_group.get(g, {}), **st.created.get(g, {})}
                new["ranks"] = ranks_status(seen if new.get("phase") != GroupPhase.BACKING_OFF else {})
                groups.append(new)

        # Rolling update: at most one group stops for an update at a time, and only when every
        # group already at the new revision is ready.
        if not problems and not deleting:
            self._roll_one(st, groups, by_group)

        ready_groups = [g["index"] for g in groups if g["phase"] == GroupPhase.READY and g["index"] < replicas]
        if not problems and not deleting:
            self._apply(body, render.discovery_configmap(body, ready_groups))

        frontends = [] if deleting else self.kube.list(
            "v1", "pods", ns, f"{L.LABEL_ENGINE}={name},{L.LABEL_COMPONENT}={L.COMPONENT_FRONTEND}")
        frontends_ready = sum(1 for p in frontends if pod_ready(p))
        left = sum(len(v) for v in by_group.values())
        phase, conditions = summarize(
            replicas=replicas, groups=groups, problems=problems, deleting=deleting,
            last_failure=st.last_failure, generation=meta.get("generation", 0), now=iso(now),
            previous=old_status.get("conditions") or [], frontends_ready=frontends_ready,
            frontends_desired=es.frontend_replicas, serving=ready_groups, pods_left=left)
        # The `ready` column counts groups a client of the Service reaches: none while no
        # frontend is Ready.
        served = len(ready_groups) if frontends_ready else 0
        status = {
            "observedGeneration": meta.get("generation", 0),
            "phase": phase,
            "replicas": sum(1 for g in groups if g["index"] < replicas),
            "readyReplicas": len(ready_groups),
            "updatedReplicas": sum(1 for g in groups if g.get("revision") == rev and g["index"] < replicas),
            "ready": f"{served}/{replicas}",
            "selector": render.selector_string(name),
            "endpoint": L.endpoint_url(name, ns),
            "restartCount": st.restart_count,
            "revision": rev,
            "conditions": conditions,
            "groups": groups,
        }
        if st.last_failure:
            status["lastFailure"] = st.last_failure
        status = no_empty_strings(status)
        if status_differs(old_status, status):
            patch = dict(status)
            if old_status.get("lastFailure") and st.last_failure:  # merge-patch: clear stale keys
                patch["lastFailure"] = {k: None for k in old_status["lastFailure"]} | st.last_failure
            self.kube.patch(L.API_VERSION, L.PLURAL, ns, name, {"status": patch}, sub="status")
        return Outcome(pods_left=left, requeue_after=st.requeue_after, status=status)

    # ---- singletons ----------------------------------------------------------------------

    def _apply_singletons(self, body: dict, serving: set[int]) -> None:
        """In dependency order: what the frontend pods mount and read (ServiceAccount, Role,
        the discovery ConfigMap) exists before the Deployment that creates them."""
        objs = [render.frontend_service_account(body), render.frontend_role(body),
                render.frontend_role_binding(body), render.discovery_configmap(body, sorted(serving)),
                render.ranks_service(body), render.frontend_deployment(body),
                render.frontend_service(body)]
        pdb = self.pdb_api_version()
        if pdb:
            objs.append(render.pod_disruption_budget(body, pdb))
        for obj in objs:
            self._apply(body, obj)

    def _apply(self, body: dict, obj: dict) -> None:
        """Create when absent; merge-patch when the rendered hash changed; else write nothing."""
        meta = obj["metadata"]
        want = meta["annotations"][L.ANNOTATION_SPEC_HASH]
        key = (obj["kind"], meta["namespace"], meta["name"], body["metadata"]["uid"])
        cached = self._applied.get(key)
        if cached and cached[0] == want and time.monotonic() - cached[1] < SINGLETON_CACHE_SECONDS:
            return
        plural = PLURALS[obj["kind"]]
        have = self.kube.get(obj["apiVersion"], plural, meta["namespace"], meta["name"])
        if have is None:
            self.kube.create(obj)
        elif (have["metadata"].get("annotations") or {}).get(L.ANNOTATION_SPEC_HASH) != want:
            patch = {"metadata": {"labels": meta["labels"], "annotations": meta["annotations"]}}
            patch.update({k: v for k, v in obj.items() if k in ("spec", "data", "rules", "subjects")})
            self.kube.patch(obj["apiVersion"], plural, meta["namespace"], meta["name"], patch)
        self._applied[key] = (want, time.monotonic())

    # ---- groups --------------------------------------------------------------------------

    def _group(self, st: PassState, g: int, mem: dict, pods: dict[int, dict], replicas: int) -> dict:
        nodes = st.spec.nodes_per_group
        mem = {**mem, "index": g}
        mem.setdefault("restarts", 0)

        death = root_cause(list(pods.values()))
        if death is None and pods and mem.get("phase") == GroupPhase.READY and len(pods) < nodes and not any(
                is_stopping(p) for p in pods.values()):
            death = vanished(st, g, mem, pods, nodes)
        if death is None and pods and mem.get("phase") == GroupPhase.STARTING and not any(
                is_stopping(p) for p in pods.values()) and not all(pod_ready(p) for p in pods.values()):
            death = stalled(st, g, pods, st.spec.startup_timeout_seconds)
        if death and death.key != mem.get("failureKey"):
            return self._on_death(st, g, mem, pods, death)

        phase = mem.get("phase")
        if phase == GroupPhase.FAILED:
            if revision_of(pods) not in (None, st.rev) or (not pods and mem.get("revision") != st.rev):
                # The spec changed since the permanent failure: try again from scratch, once
                # the old pods are gone (the BackingOff step below, due at once).
                self._teardown_dead(st, pods)
                mem.update(phase=GroupPhase.BACKING_OFF, restarts=0, nextRestartTime=iso(st.now),
                           message="spec changed; recreating")
                if not pods:
                    return self._create(st, g, mem)
            return mem
        if phase == GroupPhase.BACKING_OFF:
            if pods:  # the old ranks are still stopping: no replacement starts beside them
                self._teardown_dead(st, pods)
                return mem
            due = parse_time(mem.get("nextRestartTime"))
            if due and st.now < due:
                st.requeue((due - st.now).total_seconds())
                return mem
            events.emit(self.kube, st.body, events.NORMAL, "GroupRestarted",
                        f"group {g}: recreating all {nodes} ranks (restart {mem['restarts']})")
            mem.pop("nextRestartTime", None)
            return self._create(st, g, mem)
        if phase in (GroupPhase.UPDATING, GroupPhase.DRAINING) or any(is_stopping(p) for p in pods.values()):
            if pods:
                return self.stopper.stop(st, g, mem, pods, mem.get("stopReason") or "update")
            mem.pop("stopReason", None)
            return self._create(st, g, mem)
        if not pods:
            return self._create(st, g, mem)
        if len(pods) < nodes:  # a create that did not finish: complete the group
            return self._create(st, g, mem, existing=pods)

        mem["revision"] = revision_of(pods) or st.rev
        if all(pod_ready(p) for p in pods.values()):
            if mem.get("phase") != GroupPhase.READY:
                mem["readySince"] = iso(st.now)
                log.info("%s group %d ready (%d ranks)", ref(st.body), g, nodes)
            mem.update(phase=GroupPhase.READY, message=f"all {nodes} ranks ready")
            reset = st.spec.restart.reset_after_seconds
            since = parse_time(mem.get("readySince"))
            if mem.get("restarts") and since and (st.now - since).total_seconds() >= reset:
                mem["restarts"] = 0
        else:
            ready = sum(pod_ready(p) for p in pods.values())
            waiting = [f"rank {r}: {w}" for r, p in sorted(pods.items()) if (w := waiting_reason(p))]
            message = f"{ready}/{nodes} ranks ready" + (f"; {'; '.join(waiting)}" if waiting else "")
            if waiting and message != mem.get("message"):  # Pending reasons, once per change
                events.emit(self.kube, st.body, events.WARNING, "RankWaiting", f"group {g}: {'; '.join(waiting)}")
            mem.update(phase=GroupPhase.STARTING, message=message)
            mem.pop("readySince", None)
        return mem

    def _on_death(self, st: PassState, g: int, mem: dict, pods: dict[int, dict], death: Failure) -> dict:
        rp = st.spec.restart
        st.last_failure = death.to_status()
        mem["failureKey"] = death.key
        mem.pop("readySince", None)
        events.emit(self.kube, st.body, events.WARNING, "EngineDied",
                    f"group {g} rank {death.rank} pod {death.pod} died ({death.cause}, exit code "
                    f"{death.exit_code}, signal {death.signal}, reason {death.reason or '-'}): {death.message}")
        restarts = int(mem.get("restarts", 0))
        if death.permanent or rp.never or restarts_exhausted(restarts, rp.max_restarts):
            why = ("a restart cannot fix it; fix the spec to retry" if death.permanent
                   else "restartPolicy.policy is Never" if rp.never
                   else f"{restarts} consecutive restarts reached restartPolicy.maxRestarts")
            mem.update(phase=GroupPhase.FAILED, revision=revision_of(pods) or st.rev,
                       message=f"rank {death.rank} {death.cause}: not restarting: {why}")
            events.emit(self.kube, st.body, events.WARNING, "RestartSkipped",
                        f"group {g}: not restarting after {death.cause} on rank {death.rank}: {why}")
            # Keep the failed pod for its logs; stop the ranks that are still running.
            self._teardown_dead(st, {r: p for r, p in pods.items() if failure_of(p) is None})
            return mem
        restarts += 1
        delay = restart_delay(restarts, rp.backoff_base_seconds, rp.backoff_max_seconds)
        st.restart_count += 1
        mem.update(phase=GroupPhase.BACKING_OFF, restarts=restarts, nextRestartTime=iso_not_before(st.now + dt.timedelta(seconds=delay)),
                   message=f"rank {death.rank} died ({death.cause}); restart {restarts} in {delay}s")
        events.emit(self.kube, st.body, events.NORMAL, "GroupRestarting",
                    f"group {g}: tearing down all ranks; restart {restarts} in {delay}s")
        # A tensor-parallel group with a dead rank cannot continue: all ranks go at once.
        self._teardown_dead(st, pods)
        st.requeue(delay)
        return mem

    def _watch_only(self, st: PassState, g: int, mem: dict, pods: dict[int, dict]) -> dict:
        """The spec became invalid: what runs keeps running and nothing is created or restarted,
        but a death is still recorded and reported (lastFailure, EngineDied)."""
        mem = {**mem, "index": g}
        death = root_cause(list(pods.values()))
        if death and death.key != mem.get("failureKey"):
            st.last_failure = death.to_status()
            mem["failureKey"] = death.key
            events.emit(self.kube, st.body, events.WARNING, "EngineDied",
                        f"group {g} rank {death.rank} pod {death.pod} died ({death.cause}, exit code "
                        f"{death.exit_code}): {death.message}; not restarting while the spec is invalid")
            mem.update(phase=GroupPhase.FAILED,
                       message=f"rank {death.rank} {death.cause}: not restarting while the spec is invalid")
        mem.setdefault("phase", GroupPhase.PENDING)
        return mem

    def _create(self, st: PassState, g: int, mem: dict, existing: dict | None = None) -> dict:
        existing = existing or {}
        for pod in render.group_pods(st.body, g):
            rank = int(pod["metadata"]["labels"][L.LABEL_RANK])
            if rank not in existing:
                st.created.setdefault(g, {})[rank] = self.kube.create(pod) or pod
        nodes = st.spec.nodes_per_group
        mem.update(phase=GroupPhase.STARTING, revision=st.rev, message=f"0/{nodes} ranks ready")
        for k in ("readySince", "drainStartTime", "stopReason", "nextRestartTime"):
            mem.pop(k, None)
        log.info("%s group %d created %d ranks at revision %s", ref(st.body), g, nodes, st.rev)
        return mem

    def _teardown(self, st: PassState, pods: dict[int, dict], grace: int | None) -> None:
        for p in pods.values():
            # A pod already stopping is left alone, unless it must now go faster.
            current = p["metadata"].get("deletionGracePeriodSeconds")
            if not is_stopping(p) or (grace is not None and (current is None or current > grace)):
                self.kube.delete("v1", "pods", p["metadata"]["namespace"], p["metadata"]["name"],
                                 grace_seconds=grace, uid=p["metadata"].get("uid"))

    def _teardown_dead(self, st: PassState, pods: dict[int, dict]) -> None:
        """Stop a dead group's ranks so that no replacement of the same name can start while an
        old process still runs: SIGTERM with DEAD_GROUP_GRACE_SECONDS, the pod object staying
        until the kubelet saw its container stop (the replacement waits for the object to go).
        Grace 0 only where nothing runs any more (the container terminated) or where the grace
        ran out FORCE_AFTER_SECONDS ago (a node that no longer answers)."""
        for r, p in pods.items():
            gone_at = parse_time(p["metadata"].get("deletionTimestamp"))
            overdue = gone_at is not None and st.now >= gone_at + dt.timedelta(seconds=FORCE_AFTER_SECONDS)
            ended = terminated_state(p) is not None
            self._teardown(st, {r: p}, grace=0 if ended or overdue else DEAD_GROUP_GRACE_SECONDS)
            if gone_at is not None and not (ended or overdue):
                st.requeue((gone_at + dt.timedelta(seconds=FORCE_AFTER_SECONDS) - st.now).total_seconds())

    # ---- ordered stop: rank 0 drains first, headless ranks stay until it is gone -----------

    def _roll_one(self, st: PassState, groups: list[dict], by_group: dict[int, dict[int, dict]]) -> None:
        if any(g["phase"] in (GroupPhase.UPDATING,) for g in groups):
            return
        if any(g.get("revision") == st.rev and g["phase"] == GroupPhase.STARTING for g in groups):
            return
        # Groups that are not serving anyway go first; then ready ones, lowest index first.
        for g in sorted(groups, key=lambda g: (g["phase"] == GroupPhase.READY, g["index"])):
            pods = by_group.get(g["index"], {})
            if pods and g["phase"] in (GroupPhase.READY, GroupPhase.STARTING) and g.get("revision") != st.rev:
                events.emit(self.kube, st.body, events.NORMAL, "GroupUpdating",
                            f"group {g['index']}: rolling to revision {st.rev} (one group at a time)")
                g.update(self.stopper.stop(st, g["index"], g, pods, "update"))
                g["ranks"] = ranks_status(pods)
                return
