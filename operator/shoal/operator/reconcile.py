"""One reconcile pass for one InferenceEngine: observe -> plan -> apply -> status.

- observe: the resource afresh (its status is the operator's memory) and its pods;
- plan: `plan.plan()`, pure, decides the actions and the time of the next look;
- apply: `apply.Applier` carries the actions out in order;
- status: patched only if it changed.

The operator's memory lives in `status.groups` (restarts, backoff deadline, the death already
handled), so a restarted operator continues where the last one stopped. Every name is
deterministic, so a second pass, or two operators racing, never duplicate an object.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.operator import labels as L
from shoal.operator.apply import Applier
from shoal.operator.kube import Kube
from shoal.operator.observed import iso, owned_by, pod_ready, ref, status_differs
from shoal.operator.phases import GroupPhase
from shoal.operator.plan import Memory, Observed, Plan, plan
from shoal.operator.spec import EngineSpec
from shoal.operator.status import engine_status

log = logging.getLogger("shoal.operator.reconcile")

# (namespace, engine name, component) -> that engine's pods of the component, as the API or an
# index holds them.
PodSource = Callable[[str, str, str], list[dict]]
# (namespace, engine name) -> draining group -> rank 0's requests in flight, as last read.
InFlight = Callable[[str, str], dict[int, int]]


@dataclass
class Outcome:
    """What a pass leaves behind: used by the delete handler (done?) and by tests."""

    pods_left: int = 0
    requeue_after: float | None = None
    status: dict = field(default_factory=dict)
    drain_probes: dict = field(default_factory=dict)  # draining group -> rank 0's /metrics URL


class Reconciler:
    """Holds the API client, a clock, where pods are read from (a LIST per pass unless the
    handlers give their kopf index), where drain counts are read from (none unless the handlers
    run drain probes) and the applier; one lock per resource serialises passes."""

    def __init__(self, kube: Kube, *, clock=None, pdb_api_version: str | None | bool = True,
                 pods: PodSource | None = None, in_flight: InFlight | None = None):
        self.kube = kube
        self.applier = Applier(kube, pdb_api_version=pdb_api_version)
        self.clock = clock or (lambda: dt.datetime.now(dt.timezone.utc))
        self.pods = pods or listed_pods(kube)
        self.in_flight = in_flight or (lambda namespace, name: {})
        self._locks: dict[tuple, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._last_pass: dict[tuple, float] = {}
        self._passes: dict[tuple, int] = {}

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def reconcile(self, body: dict) -> Outcome:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        with self.lock(*key):
            # Work on the freshest copy: handlers may hand us a body that is a few events old.
            fresh = self.kube.get(L.API_VERSION, L.PLURAL, *key)
            if fresh is None or (meta.get("uid") and fresh["metadata"].get("uid") != meta["uid"]):
                return Outcome()
            self._last_pass[key] = time.monotonic()
            try:
                return self._pass(fresh)
            finally:
                with self._locks_guard:
                    self._passes[key] = self._passes.get(key, 0) + 1

    def passes(self, namespace: str, name: str) -> int:
        """How many passes of this resource have finished (in this process)."""
        with self._locks_guard:
            return self._passes.get((namespace, name), 0)

    def seconds_since_pass(self, namespace: str, name: str) -> float:
        last = self._last_pass.get((namespace, name))
        return float("inf") if last is None else time.monotonic() - last

    def pdb_api_version(self) -> str | None:
        return self.applier.pdb_api_version()

    def _pass(self, body: dict) -> Outcome:
        now = self.clock()
        old = body.get("status") or {}
        spec, observed, memory = EngineSpec.of(body), self._observe(body), Memory.of(old)
        p = plan(spec, observed, memory, now)
        self.applier.apply(body, p.actions)
        self._log_changes(body, memory, p)
        status = self._report(body, spec, p, observed, old, now)
        return Outcome(pods_left=sum(len(g) for g in observed.pods.values()), requeue_after=p.requeue_after,
                       status=status, drain_probes=dict(p.drain_probes))

    def _observe(self, body: dict) -> Observed:
        meta = body["metadata"]
        by_group: dict[int, dict[int, dict]] = {}
        for p in self.pods(meta["namespace"], meta["name"], L.COMPONENT_ENGINE):
            if owned_by(p, meta.get("uid")):
                lbl = p["metadata"]["labels"]
                by_group.setdefault(int(lbl[L.LABEL_GROUP]), {})[int(lbl[L.LABEL_RANK])] = p
        return Observed(body=body, pods=by_group, in_flight=self.in_flight(meta["namespace"], meta["name"]))

    def _report(self, body: dict, spec: EngineSpec, p: Plan, observed: Observed, old: dict,
                now: dt.datetime) -> dict:
        meta = body["metadata"]
        frontends = [] if observed.deleting else self.pods(meta["namespace"], meta["name"], L.COMPONENT_FRONTEND)
        status = engine_status(body=body, plan=p, frontends_ready=sum(1 for f in frontends if pod_ready(f)),
                               frontends_desired=spec.frontend_replicas,
                               pods_left=sum(len(g) for g in observed.pods.values()),
                               previous=old.get("conditions") or [], now=iso(now))
        if status_differs(old, status):
            patch = dict(status)
            if old.get("lastFailure") and p.last_failure:  # merge-patch: clear stale keys
                patch["lastFailure"] = {k: None for k in old["lastFailure"]} | p.last_failure
            self.kube.patch(L.API_VERSION, L.PLURAL, meta["namespace"], meta["name"], {"status": patch}, sub="status")
        return status

    @staticmethod
    def _log_changes(body: dict, memory: Memory, p: Plan) -> None:
        """One line per group that became Ready."""
        for g in p.groups:
            if g["phase"] == GroupPhase.READY and (memory.groups.get(g["index"]) or {}).get("phase") != GroupPhase.READY:
                log.info("%s group %d ready (%d ranks)", ref(body), g["index"], len(g.get("ranks") or []))


def listed_pods(kube: Kube) -> PodSource:
    """Pods read with a LIST (what a pass does without the operator's index)."""
    def source(namespace: str, name: str, component: str) -> list[dict]:
        return kube.list("v1", "pods", namespace, f"{L.LABEL_ENGINE}={name},{L.LABEL_COMPONENT}={component}")
    return source
