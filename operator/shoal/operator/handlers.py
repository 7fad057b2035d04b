"""kopf handlers: small and declarative; all decisions live in reconcile.py.

Triggers, all funnelled into one `Reconciler.reconcile(body)` guarded by a per-resource lock:
- the InferenceEngine is created, resumed (operator start) or its spec/metadata changes;
- any engine or frontend pod of ours changes (a rank got ready, terminated, was deleted);
- the time a pass planned (a backoff deadline, a drain's deadline): `Wakeups` runs that pass
  when it is due, so a restart due in 37 s happens at 37 s;
- a new in-flight count of a draining rank 0 (drain_probe.py);
- a timer: a full pass every $SHOAL_FULL_RESYNC_SECONDS as a safety net for missed events;
- deletion: a finalizer holds the resource until every group has stopped in order.

Pods are read from kopf's index (`pods_by_engine`, see pod_index.py), not listed per pass.

Handler progress and the diff base are kept in annotations under `shoal.dev/`: the structural
schema prunes unknown status fields, so kopf's default `status.kopf` would not persist.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time

import kopf
from shoal.operator import labels as L
from shoal.operator import pod_index
from shoal.operator.drain_probe import DrainProbes
from shoal.operator.kube import Kube
from shoal.operator.reconcile import Reconciler, listed_pods
from shoal.operator.wakeups import Wakeups

log = logging.getLogger("shoal.operator")

RESYNC_SECONDS = float(os.environ.get("SHOAL_RESYNC_SECONDS", "10"))
FULL_RESYNC_SECONDS = float(os.environ.get("SHOAL_FULL_RESYNC_SECONDS", str(max(60.0, RESYNC_SECONDS))))
# How long one run of the delete handler follows the ordered stop before it hands back to kopf
# (each hand-back is one annotation write); longer than any usual drain (timeout + margin).
DELETE_FOLLOW_SECONDS = 300.0
_state: dict = {}
_stats_lock = threading.Lock()


def reconciler() -> Reconciler:
    if "r" not in _state:
        kube = Kube()
        _state["pods"] = pod_index.PodIndex(listed_pods(kube))
        _state["r"] = Reconciler(kube, pods=_state["pods"], in_flight=drain_probes().counts)
    return _state["r"]


def drain_probes() -> DrainProbes:
    """Rank 0's in-flight count while it drains; a new count asks for a pass at once."""
    if "d" not in _state:
        _state["d"] = DrainProbes(on_change=lambda key: wakeups().schedule(key, 0))
    return _state["d"]


def _attach(kwargs: dict) -> None:
    """Hand kopf's pod index to the reconciler (kopf passes indices to handlers only)."""
    if kwargs.get(pod_index.INDEX) is not None:
        reconciler()
        _state["pods"].attach(kwargs[pod_index.INDEX])


@kopf.index("", "v1", "pods", labels={L.LABEL_MANAGED_BY: L.MANAGED_BY})
def pods_by_engine(namespace, labels, body, **_):
    """Engine and frontend pods by (namespace, engine, component): a pass reads them here."""
    key = pod_index.key_of(namespace, labels)
    return {key: pod_index.snapshot(body)} if key else None


def wakeups() -> Wakeups:
    if "w" not in _state:
        _state["w"] = Wakeups(lambda key: _reconcile({"metadata": {"namespace": key[0], "name": key[1]}}))
    return _state["w"]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    settings.persistence.finalizer = "shoal.dev/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="shoal.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="shoal.dev", key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # our own Events say what happened; no echo of logs
    settings.execution.max_workers = int(os.environ.get("SHOAL_WORKERS", "8"))
    settings.watching.server_timeout = 300
    settings.networking.error_backoffs = [1, 2, 5, 10]
    reconciler()
    log.info("shoal-operator started: resync every %.1fs, PDB API %s", RESYNC_SECONDS,
             reconciler().pdb_api_version())


@kopf.on.startup()
async def bind_drain_probes(**_):
    """Drain probes run on kopf's event loop (async, each read bounded by a 1 s timeout)."""
    drain_probes().bind(asyncio.get_running_loop())


@kopf.on.cleanup()
def write_stats(**_):
    """Where asked ($SHOAL_OPERATOR_STATS_FILE), leave the read and write counts for the benchmark:
    after passes (at most once a second) and at exit."""
    path = os.environ.get("SHOAL_OPERATOR_STATS_FILE")
    if not path or "r" not in _state:
        return
    with _stats_lock:  # handlers run in a thread pool
        kube = _state["r"].kube
        writes = {f"{verb} {plural}": n for (verb, plural), n in sorted(kube.writes.items())}
        reads = {f"{verb} {plural}": n for (verb, plural), n in sorted(kube.reads.items())}
        try:
            with open(path + ".tmp", "w") as f:
                json.dump({"writes": writes, "reads": reads}, f)
            os.replace(path + ".tmp", path)
        except OSError as e:  # a report, never a reason to fail a handler
            log.warning("could not write %s: %s", path, e)
        _state["stats_at"] = time.monotonic()


def _after_pass() -> None:
    if os.environ.get("SHOAL_OPERATOR_STATS_FILE") and time.monotonic() - _state.get("stats_at", 0) > 1:
        write_stats()


def _reconcile(body):
    outcome = reconciler().reconcile(_plain(body))
    meta = body["metadata"]
    if outcome.requeue_after is not None:
        wakeups().schedule((meta["namespace"], meta["name"]), outcome.requeue_after)
    drain_probes().follow(meta["namespace"], meta["name"], outcome.drain_probes)
    _after_pass()
    return outcome


def _plain(body) -> dict:
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
            "metadata": dict(body["metadata"]), "spec": dict(body.get("spec") or {}),
            "status": dict(body.get("status") or {})}


@kopf.on.resume(L.GROUP, L.VERSION, L.PLURAL)
@kopf.on.create(L.GROUP, L.VERSION, L.PLURAL)
@kopf.on.update(L.GROUP, L.VERSION, L.PLURAL, field="spec")
def on_change(body, **kw):
    _attach(kw)
    _reconcile(body)


@kopf.timer(L.GROUP, L.VERSION, L.PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def resync(body, **kw):
    """A safety net for missed events: a full pass when none ran for FULL_RESYNC_SECONDS. Time-
    driven work (backoff deadlines, drains) runs at its planned time through `wakeups()`."""
    _attach(kw)
    if body["metadata"].get("deletionTimestamp"):
        return
    if reconciler().seconds_since_pass(body["metadata"]["namespace"],
                                       body["metadata"]["name"]) >= FULL_RESYNC_SECONDS:
        _reconcile(body)


@kopf.on.event("", "v1", "pods", labels={L.LABEL_MANAGED_BY: L.MANAGED_BY, L.LABEL_COMPONENT: L.COMPONENT_ENGINE})
def on_pod(body, **kw):
    _attach(kw)
    owner = next((o for o in body["metadata"].get("ownerReferences") or [] if o.get("kind") == L.KIND), None)
    if owner:  # reconcile() reads the owner afresh; the uid guards against a same-name successor
        _reconcile({"metadata": {"namespace": body["metadata"]["namespace"],
                                 "name": owner["name"], "uid": owner.get("uid")}})


@kopf.on.event("", "v1", "pods", labels={L.LABEL_MANAGED_BY: L.MANAGED_BY, L.LABEL_COMPONENT: L.COMPONENT_FRONTEND})
def on_frontend_pod(body, type, **kw):
    """A frontend got (or lost) readiness: the resource's Ready and Serving follow it. Frontend
    pods belong to a ReplicaSet; the engine label names their InferenceEngine."""
    _attach(kw)
    labels = body["metadata"].get("labels") or {}
    if type in ("ADDED", "MODIFIED", "DELETED") and labels.get(L.LABEL_ENGINE):
        _reconcile({"metadata": {"namespace": body["metadata"]["namespace"],
                                 "name": labels[L.LABEL_ENGINE]}})


@kopf.on.delete(L.GROUP, L.VERSION, L.PLURAL)
async def on_delete(body, **kw):
    """Ordered stop of every group (rank 0 drains first); the finalizer goes when no pod is
    left, and the garbage collector removes the rest through owner references.

    The handler follows the whole stop (up to DELETE_FOLLOW_SECONDS) without holding a worker
    thread: it runs a pass, then waits in the event loop until another pass ran (pod events,
    planned wake-ups) or its planned time came. So a delete ends with one handler run instead of
    a kopf retry, and a progress-annotation write, every second (found on a real cluster: a 14 s
    delete made 29 annotation patches)."""
    _attach(kw)
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    loop = asyncio.get_running_loop()
    until = loop.time() + DELETE_FOLLOW_SECONDS
    while True:
        outcome = await asyncio.to_thread(_reconcile, body)
        if not outcome.pods_left:
            return
        if loop.time() >= until:
            raise kopf.TemporaryError(f"waiting for {outcome.pods_left} engine pods to stop", delay=1)
        seen = reconciler().passes(ns, name)
        wake = min(until, loop.time() + (outcome.requeue_after or 2.0))
        while reconciler().passes(ns, name) <= seen and loop.time() < wake:
            await asyncio.sleep(0.2)
