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
from dataclasses import dataclass, field, replace

from shoal.contract import discovery
from shoal.contract.model_fetch import FETCH_CONTAINER
from shoal.operator import fetch_progress
from shoal.operator import labels as L
from shoal.operator.adapter_pass import AdapterPass, AdapterSource
from shoal.operator.adapter_sync import AdapterSync
from shoal.operator.apply import Applier
from shoal.operator.autoscale_hpa import HPALister, HPAs
from shoal.operator.autoscale_scrape import Scrape, Scraper
from shoal.operator.kube import Kube
from shoal.operator.metrics import OperatorMetrics
from shoal.operator.node_index import NodeIndex, listed_node
from shoal.operator.observed import iso, metrics_url, owned_by, pod_ready, status_differs
from shoal.operator.phases import GroupPhase
from shoal.operator.plan import Memory, Observed, Plan, plan
from shoal.operator.settings import OperatorSettings
from shoal.operator.spec import EngineRef, EngineSpec, parse
from shoal.operator.status import engine_status

log = logging.getLogger("shoal.operator.reconcile")

# (namespace, engine name, component) -> that engine's pods of the component, as the API or an
# index holds them.
PodSource = Callable[[str, str, str], list[dict]]
# (namespace, engine name) -> draining group -> rank 0's requests in flight, as last read.
InFlight = Callable[[str, str], dict[int, int]]
# (namespace, engine name) -> the HPAs aimed at it (spec.autoscaling only).
HPASource = Callable[[str, str], HPAs]


@dataclass
class Outcome:
    """What a pass leaves behind: used by the handlers (the next look, the drain probes, the
    end of a delete) and by tests."""

    uid: str | None = None  # the resource the pass ran on; None when it ran on none
    pods_left: int = 0
    requeue_after: float | None = None
    status: dict = field(default_factory=dict)
    drain_probes: dict = field(default_factory=dict)  # draining group -> rank 0's /metrics URL
    stopped: bool = False  # being deleted and no engine pod left: the finalizer may go


class Reconciler:
    """Holds the API client, a clock, where pods are read from (a LIST per pass unless the
    handlers give their kopf index), where drain counts are read from (none unless the handlers
    run drain probes), the autoscaler's reads (rank 0's /metrics, the HPAs) and the applier;
    one lock per resource serialises passes."""

    def __init__(self, kube: Kube, *, clock=None, pdb_api_version: str | None | bool = True,
                 pods: PodSource | None = None, in_flight: InFlight | None = None,
                 settings: OperatorSettings | None = None, scrape: Scrape | None = None,
                 hpas: HPASource | None = None, adapters: AdapterSource | None = None,
                 adapter_sync: AdapterSync | None = None, nodes: NodeIndex | None = None,
                 metrics: OperatorMetrics | None = None):
        self.kube = kube
        self.settings = settings or OperatorSettings()
        self.applier = Applier(kube, pdb_api_version=pdb_api_version)
        self.clock = clock or (lambda: dt.datetime.now(dt.timezone.utc))
        self.pods = pods or listed_pods(kube)
        self.in_flight = in_flight or (lambda namespace, name: {})
        self.scrape = scrape or Scraper()
        self.hpas = hpas or HPALister(kube)
        self.adapters = AdapterPass(kube, adapters, adapter_sync)
        self.nodes = nodes or NodeIndex(listed_node(kube))
        self.metrics = metrics or OperatorMetrics()  # the operator's /metrics (metrics.py)
        self._locks: dict[tuple, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._last_pass: dict[tuple, float] = {}

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
            return self._pass(fresh)

    def seconds_since_pass(self, namespace: str, name: str) -> float:
        last = self._last_pass.get((namespace, name))
        return float("inf") if last is None else time.monotonic() - last

    def pdb_api_version(self) -> str | None:
        return self.applier.pdb_api_version()

    def _pass(self, body: dict) -> Outcome:
        """The one place a body is parsed: everything after takes its identity and spec."""
        now = self.clock()
        old = body.get("status") or {}
        ref, spec = parse(body, self.settings)
        observed, memory = self._observe(ref, spec, body), Memory.of(old)
        adapters = self.adapters.observe(ref, spec, observed.pods, observed.deleting)
        observed = replace(observed, adapters_pending=adapters.pending)
        p = plan(spec, observed, memory, now)
        refused = self.applier.apply(ref, spec, p.actions)
        if refused:  # a child the API server refused: SpecValid=False naming it (refusals.py)
            p = replace(p, problems=(*p.problems, *refused))
        self._log_changes(ref, memory, p)
        status = self._report(observed, spec, p, old, now)
        self.adapters.report(ref, spec, adapters, iso(now))
        left = sum(len(g) for g in observed.pods.values())
        return Outcome(uid=ref.uid, pods_left=left, requeue_after=p.requeue_after,
                       status=status, drain_probes=dict(p.drain_probes),
                       stopped=observed.deleting and not left)

    def _observe(self, ref: EngineRef, spec: EngineSpec, body: dict) -> Observed:
        by_group: dict[int, dict[int, dict]] = {}
        for p in self.pods(ref.namespace, ref.name, L.COMPONENT_ENGINE):
            if owned_by(p, ref.uid):
                lbl = p["metadata"]["labels"]
                by_group.setdefault(int(lbl[L.LABEL_GROUP]), {})[int(lbl[L.LABEL_RANK])] = p
        meta = body["metadata"]
        deleting = bool(meta.get("deletionTimestamp"))
        autoscaled = bool((body.get("spec") or {}).get("autoscaling")) and not deleting
        nodes = self.nodes.health((p.get("spec") or {}).get("nodeName") or ""
                                  for pods in by_group.values() for p in pods.values())
        return Observed(ref=ref, pods=by_group, in_flight=self.in_flight(ref.namespace, ref.name),
                        fetch_logs=self._fetch_logs(ref, by_group), nodes=nodes,
                        deleting=deleting, generation=meta.get("generation", 0),
                        samples=self._scrape(ref, by_group) if autoscaled else None,
                        wake=self._wake(ref) if spec.wakeable and not by_group else None,
                        hpas=self.hpas(ref.namespace, ref.name) if autoscaled else None)

    def _wake(self, ref: EngineRef) -> str | None:
        """The wake Lease's renewTime (a router holding a request renews it), read only while
        the engine has no pod at all; a failed read wakes nothing this pass."""
        lease = discovery.wake_lease_name(ref.name)
        try:
            obj = self.kube.get("coordination.k8s.io/v1", "leases", ref.namespace, lease)
        except Exception as e:  # noqa: BLE001
            log.warning("%s: could not read the wake Lease %s: %s", ref, lease, e)
            return None
        return ((obj or {}).get("spec") or {}).get("renewTime")

    def _scrape(self, ref: EngineRef, by_group: dict) -> dict | None:
        """Rank 0's /metrics of every group whose rank 0 is Ready (None: no read due now)."""
        targets = {g: url for g, pods in by_group.items()
                   if 0 in pods and pod_ready(pods[0]) and (url := metrics_url(pods[0]))}
        return self.scrape(ref.namespace, ref.name, targets)

    def _fetch_logs(self, ref: EngineRef, by_group: dict) -> dict[int, dict[int, str]]:
        """The log tail of every running model-fetch container (its download progress). A read
        that fails shows no progress this pass; it is never a reason to fail the pass."""
        out: dict[int, dict[int, str]] = {}
        for g, pods in by_group.items():
            for r, p in pods.items():
                if not fetch_progress.fetching(p):
                    continue
                try:
                    tail = self.kube.log_tail(ref.namespace, p["metadata"]["name"],
                                              FETCH_CONTAINER, fetch_progress.LOG_TAIL_LINES)
                except Exception as e:  # noqa: BLE001
                    log.warning("%s: could not read the %s log of %s: %s", ref,
                                FETCH_CONTAINER, p["metadata"]["name"], e)
                    continue
                out.setdefault(g, {})[r] = tail
        return out

    def _report(self, observed: Observed, spec: EngineSpec, p: Plan, old: dict,
                now: dt.datetime) -> dict:
        ref = observed.ref
        frontends = ([] if observed.deleting
                     else self.pods(ref.namespace, ref.name, L.COMPONENT_FRONTEND))
        status = engine_status(ref=ref, generation=observed.generation,
                               deleting=observed.deleting, plan=p,
                               frontends_ready=sum(1 for f in frontends if pod_ready(f)),
                               frontends_desired=spec.frontend_replicas,
                               pods_left=sum(len(g) for g in observed.pods.values()),
                               previous=old.get("conditions") or [], now=iso(now))
        dropped = "autoscaling" in old and "autoscaling" not in status
        if status_differs(old, status) or dropped:
            patch = dict(status)
            if dropped:  # spec.autoscaling removed: merge-patch the block away
                patch["autoscaling"] = None
            elif old.get("autoscaling") and "autoscaling" in status:
                # merge-patch: a key the decision dropped (a closed window) must go too, or the
                # next pass reads it back (found on pods: a 3 -> 1 window kept saying "1 -> 1")
                patch["autoscaling"] = ({k: None for k in old["autoscaling"]}
                                        | status["autoscaling"])
            if old.get("lastFailure") and p.last_failure:  # merge-patch: clear stale keys
                patch["lastFailure"] = {k: None for k in old["lastFailure"]} | p.last_failure
            self.kube.patch(L.API_VERSION, L.PLURAL, ref.namespace, ref.name, {"status": patch},
                            sub="status")
        self.metrics.report(ref, spec, status, now)
        return status

    @staticmethod
    def _log_changes(ref: EngineRef, memory: Memory, p: Plan) -> None:
        """One line per group that became Ready."""
        for g in p.groups:
            before = (memory.groups.get(g["index"]) or {}).get("phase")
            if g["phase"] == GroupPhase.READY and before != GroupPhase.READY:
                log.info("%s group %d ready (%d ranks)", ref, g["index"],
                         len(g.get("ranks") or []))


def listed_pods(kube: Kube) -> PodSource:
    """Pods read with a LIST (what a pass does without the operator's index)."""
    def source(namespace: str, name: str, component: str) -> list[dict]:
        selector = f"{L.LABEL_ENGINE}={name},{L.LABEL_COMPONENT}={component}"
        return kube.list("v1", "pods", namespace, selector)
    return source
