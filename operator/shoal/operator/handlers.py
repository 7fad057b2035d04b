"""kopf handlers: small and declarative; all decisions live in reconcile.py.

Triggers, all funnelled into one `OperatorState.run_pass` (a `Reconciler.reconcile` guarded by
a per-resource lock); the state is made at startup and kept in kopf's `memo` (operator_state.py):
- the InferenceEngine is created, resumed (operator start) or its spec/metadata changes;
- any engine or frontend pod of ours changes (a rank got ready, terminated, was deleted);
- a node whose Ready condition changed, for the engines with pods on it (node_index.py);
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
import copy
import logging
import os

import kopf
from shoal.operator import adapter_pass, events, pod_index
from shoal.operator import labels as L
from shoal.operator.adapter_spec import Adapter
from shoal.operator.kube import Kube
from shoal.operator.node_loss import NodeHealth
from shoal.operator.observed import frontend_urls
from shoal.operator.operator_state import OperatorState

log = logging.getLogger("shoal.operator")

RESYNC_SECONDS = float(os.environ.get("SHOAL_RESYNC_SECONDS", "10"))
FULL_RESYNC_SECONDS = float(os.environ.get("SHOAL_FULL_RESYNC_SECONDS",
                                           str(max(60.0, RESYNC_SECONDS))))
# How long one run of the delete handler follows the ordered stop before it hands back to kopf
# (each hand-back is one annotation write); longer than any usual drain (timeout + margin).
DELETE_FOLLOW_SECONDS = 300.0

# kopf's retries of a failed API call (its watches too): past the last one a watch fails and
# the operator exits. They ride out an API server down for up to ~10 minutes (an upgrade, a
# control-plane restart) without a restart (found on real pods: with 18 s of retries a 40 s
# outage restarted the operator).
ERROR_BACKOFFS = (1, 2, 5, 10) + (10,) * 60

ENGINE_PODS = {L.LABEL_MANAGED_BY: L.MANAGED_BY, L.LABEL_COMPONENT: L.COMPONENT_ENGINE}
FRONTEND_PODS = {L.LABEL_MANAGED_BY: L.MANAGED_BY, L.LABEL_COMPONENT: L.COMPONENT_FRONTEND}


@kopf.index("", "v1", "pods", labels={L.LABEL_MANAGED_BY: L.MANAGED_BY})
def pods_by_engine(namespace, labels, body, **_):
    """Engine and frontend pods by (namespace, engine, component): a pass reads them here."""
    key = pod_index.key_of(namespace, labels)
    return {key: pod_index.snapshot(body)} if key else None


@kopf.index("", "v1", "nodes")
def nodes_health(name, body, **_):
    """Each node's Ready condition (node_loss.py): a pass reads the nodes of its pods here."""
    return {name: NodeHealth.of(body)}


@kopf.on.event("", "v1", "nodes")
def on_node(name, body, type, memo: kopf.Memo, **kw):
    """A node whose Ready condition changed wakes the engines with pods on it."""
    state = _state(memo, kw)
    state.on_node(name, None if type == "DELETED" else NodeHealth.of(body),
                  kw.get(pod_index.INDEX))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_):
    settings.persistence.finalizer = "shoal.dev/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="shoal.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="shoal.dev", key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # our own Events say what happened; no echo of logs
    settings.execution.max_workers = int(os.environ.get("SHOAL_WORKERS", "8"))
    settings.watching.server_timeout = 300
    settings.networking.error_backoffs = ERROR_BACKOFFS
    # The root memo: every resource handler's memo is a shallow copy of it, made after the
    # startup handlers ran, so all of them hold this one state.
    memo.shoal = OperatorState(Kube(), metrics=memo.get("metrics"))  # __main__: /metrics
    log.info("shoal-operator started: resync every %.1fs, PDB API %s, %s", RESYNC_SECONDS,
             memo.shoal.reconciler.pdb_api_version(), memo.shoal.settings)


@kopf.index(L.GROUP, L.VERSION, L.ADAPTER_PLURAL)
def adapters_by_engine(namespace, spec, body, **_):
    """InferenceAdapters by (namespace, engine): an engine's pass reads them here."""
    key = adapter_pass.index_key(namespace, spec)
    return {key: copy.deepcopy({"metadata": dict(body["metadata"]), "spec": dict(spec),
                                "status": dict(body.get("status") or {})})} if key else None


@kopf.on.startup()
async def bind_drain_probes(memo: kopf.Memo, **_):
    """Drain probes and the adapter sync run on kopf's event loop (async, each call bounded)."""
    memo.shoal.drain_probes.bind(asyncio.get_running_loop())
    memo.shoal.adapter_sync.bind(asyncio.get_running_loop())


@kopf.on.cleanup()
def write_stats(memo: kopf.Memo, **_):
    """Leave the final read and write counts for the benchmark (where it asked for them)."""
    if "shoal" in memo:
        memo.shoal.stats.write()


def _state(memo: kopf.Memo, kwargs: dict) -> OperatorState:
    state: OperatorState = memo.shoal
    state.attach(kwargs)
    return state


def _ref_body(namespace: str, name: str, uid: str | None = None) -> dict:
    """What a pass needs to find the resource: it reads the resource afresh by name; the uid
    guards against a same-name successor."""
    return {"metadata": {"namespace": namespace, "name": name, "uid": uid}}


@kopf.on.resume(L.GROUP, L.VERSION, L.PLURAL)
@kopf.on.create(L.GROUP, L.VERSION, L.PLURAL)
@kopf.on.update(L.GROUP, L.VERSION, L.PLURAL, field="spec")
def on_change(body, memo: kopf.Memo, **kw):
    meta = body["metadata"]
    _state(memo, kw).run_pass(_ref_body(meta["namespace"], meta["name"], meta.get("uid")))


@kopf.timer(L.GROUP, L.VERSION, L.PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def resync(body, memo: kopf.Memo, **kw):
    """A safety net for missed events: a full pass when none ran for FULL_RESYNC_SECONDS. Time-
    driven work (backoff deadlines, drains) runs at its planned time through the wake-ups."""
    state = _state(memo, kw)
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return
    if state.reconciler.seconds_since_pass(meta["namespace"], meta["name"]) >= FULL_RESYNC_SECONDS:
        state.run_pass(_ref_body(meta["namespace"], meta["name"], meta.get("uid")))


@kopf.on.event("", "v1", "pods", labels=ENGINE_PODS)
def on_pod(body, memo: kopf.Memo, **kw):
    state = _state(memo, kw)
    meta = body["metadata"]
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("kind") == L.KIND), None)
    if owner:
        state.run_pass(_ref_body(meta["namespace"], owner["name"], owner.get("uid")))


@kopf.on.event("", "v1", "pods", labels=FRONTEND_PODS)
def on_frontend_pod(body, type, memo: kopf.Memo, **kw):
    """A frontend got (or lost) readiness: the resource's Ready and Serving follow it. Frontend
    pods belong to a ReplicaSet; the engine label names their InferenceEngine."""
    state = _state(memo, kw)
    engine = (body["metadata"].get("labels") or {}).get(L.LABEL_ENGINE)
    if type in ("ADDED", "MODIFIED", "DELETED") and engine:
        state.run_pass(_ref_body(body["metadata"]["namespace"], engine))


@kopf.on.delete(L.GROUP, L.VERSION, L.PLURAL)
async def on_delete(body, memo: kopf.Memo, **kw):
    """Ordered stop of every group (rank 0 drains first); the finalizer goes when no pod is
    left, and the garbage collector removes the rest through owner references.

    The handler follows the whole stop (up to DELETE_FOLLOW_SECONDS) without holding a worker
    thread: it runs one pass, then awaits the event that the pass seeing no engine pod left
    sets (passes run on pod events and planned wake-ups meanwhile). So a delete ends with one
    handler run instead of a kopf retry, and a progress-annotation write, every second (found
    on a real cluster: a 14 s delete made 29 annotation patches)."""
    state = _state(memo, kw)
    meta = body["metadata"]
    waiter = state.stop_waiter(meta["uid"])
    try:
        outcome = await asyncio.to_thread(
            state.run_pass, _ref_body(meta["namespace"], meta["name"], meta["uid"]))
        if outcome.stopped or outcome.uid is None:  # no pod left, or the resource is gone
            return
        try:
            await asyncio.wait_for(waiter.event.wait(), DELETE_FOLLOW_SECONDS)
        except asyncio.TimeoutError:
            raise kopf.TemporaryError(f"waiting for the engine pods of {meta['name']} to stop",
                                      delay=1) from None
    finally:
        state.forget_stop_waiter(meta["uid"])


# ---- InferenceAdapter: its engine's pass does the work ---------------------------------------

@kopf.on.resume(L.GROUP, L.VERSION, L.ADAPTER_PLURAL)
@kopf.on.create(L.GROUP, L.VERSION, L.ADAPTER_PLURAL)
@kopf.on.update(L.GROUP, L.VERSION, L.ADAPTER_PLURAL, field="spec")
def on_adapter(body, memo: kopf.Memo, **kw):
    """Its engine's pass loads it and writes its status; with no such engine, say so."""
    state = _state(memo, kw)
    adapter = Adapter.of(body)
    engine = state.reconciler.kube.get(L.API_VERSION, L.PLURAL, adapter.ref.namespace,
                                       adapter.engine) if adapter.engine else None
    if engine is None:
        state.adapter_engine_missing(adapter)
        return
    state.run_pass(_ref_body(adapter.ref.namespace, adapter.engine))


@kopf.on.delete(L.GROUP, L.VERSION, L.ADAPTER_PLURAL)
async def on_adapter_delete(body, memo: kopf.Memo, **kw):
    """Unload it from every group of its engine before the finalizer goes. A group that does
    not answer is reported in an Event and does not hold the delete: a group that restarts
    comes back without it anyway."""
    state = _state(memo, kw)
    adapter = Adapter.of(body)
    pods = await asyncio.to_thread(state.reconciler.pods, adapter.ref.namespace,
                                   adapter.engine, L.COMPONENT_FRONTEND)
    errors = await state.adapter_sync.unload(adapter.ref.namespace, adapter.engine, adapter.name,
                                             frontends=frontend_urls(pods))
    if errors:
        events.emit(state.reconciler.kube, adapter.ref, events.WARNING, "UnloadFailed",
                    "; ".join(errors))
