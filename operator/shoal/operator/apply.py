"""Carries out a plan's actions against the API server, in order. The only module that writes
children: creates are idempotent (deterministic names, 409 is success), deletes carry a uid
precondition, and a singleton whose rendered hash did not change is not written (a short-lived
cache of hashes spares a GET per singleton on a quiet pass). A child the API server refuses
(400, 403, 422) ends the pass's writes and comes back as spec problems (refusals.py), never as
an exception."""

from __future__ import annotations

import logging
import time

from kubernetes.client.exceptions import ApiException
from shoal.operator import events, refusals, render, template
from shoal.operator import labels as L
from shoal.operator.actions import (
    Action,
    ApplyChildren,
    CreatePods,
    DeletePod,
    EmitEvent,
    WriteDiscovery,
)
from shoal.operator.kube import PLURALS, Kube
from shoal.operator.spec import EngineRef, EngineSpec

log = logging.getLogger("shoal.operator.apply")

SINGLETON_CACHE_SECONDS = 60.0
# A pass reading pods from the index may not see its own delete of a moment ago yet (the watch
# event is on its way): the same delete is not sent again within this time.
RECENT_DELETE_SECONDS = 10.0
# What a changed singleton's patch carries besides its labels and annotations.
PATCHED_PARTS = ("spec", "data", "rules", "subjects")


class ChildRefused(Exception):
    """The API server refused to create or patch `obj`: the same spec is refused again."""

    def __init__(self, obj: dict, status: int, body: str):
        super().__init__(f"{obj.get('kind')} {obj['metadata'].get('name')}: {status}")
        self.obj, self.status, self.body = obj, status, body


def _refused(obj: dict, write):
    """Run one write of `obj`; a refusal becomes ChildRefused, anything else propagates."""
    try:
        return write()
    except ApiException as e:
        if e.status in refusals.REFUSED:
            raise ChildRefused(obj, e.status, e.body or "") from None
        raise


class Applier:
    """Holds the API client, the PDB API version found by discovery and the singleton hashes."""

    def __init__(self, kube: Kube, *, pdb_api_version: str | None | bool = True):
        self.kube = kube
        self._pdb = pdb_api_version
        self._applied: dict[tuple, tuple[str, float]] = {}
        self._deleted: dict[tuple, float] = {}

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

    def apply(self, ref: EngineRef, spec: EngineSpec, actions: tuple[Action, ...]) -> list[str]:
        """Every action in order; [] when all were carried out. A child the API server refuses
        stops the rest (they come from the same spec) and returns its spec problems."""
        for action in actions:
            try:
                self.one(ref, spec, action)
            except ChildRefused as e:
                found = refusals.problems(e.obj, e.status, e.body, spec)
                log.warning("%s: %s", ref, "; ".join(found))
                return found
        return []

    def one(self, ref: EngineRef, spec: EngineSpec, action: Action) -> None:
        if isinstance(action, ApplyChildren):
            for obj in render.singletons(ref, spec, list(action.serving), self.pdb_api_version()):
                self._object(ref, obj)
        elif isinstance(action, WriteDiscovery):
            self._object(ref, render.discovery_configmap(ref, spec, list(action.groups)))
        elif isinstance(action, CreatePods):
            for pod in render.group_pods(ref, spec, action.group):
                if int(pod["metadata"]["labels"][L.LABEL_RANK]) in action.ranks:
                    _refused(pod, lambda pod=pod: self.kube.create(pod))
            log.info("%s group %d: created ranks %s at revision %s", ref, action.group,
                     ",".join(map(str, action.ranks)), spec.revision)
        elif isinstance(action, DeletePod):
            self._delete(ref, action)
        elif isinstance(action, EmitEvent):
            events.emit(self.kube, ref, action.type, action.reason, action.message)
        else:  # pragma: no cover - a new action type without its writer
            raise TypeError(f"no writer for {action!r}")

    def _delete(self, ref: EngineRef, action: DeletePod) -> None:
        now, key = time.monotonic(), (action.uid or action.pod, action.grace)
        if now - self._deleted.get(key, float("-inf")) < RECENT_DELETE_SECONDS:
            return
        self.kube.delete("v1", "pods", ref.namespace, action.pod, grace_seconds=action.grace,
                         uid=action.uid)
        self._deleted = {k: t for k, t in self._deleted.items()
                         if now - t < RECENT_DELETE_SECONDS}
        self._deleted[key] = now

    def _object(self, ref: EngineRef, obj: dict) -> None:
        """Create when absent; merge-patch when the rendered hash changed; else write nothing."""
        meta = obj["metadata"]
        want = meta["annotations"][L.ANNOTATION_SPEC_HASH]
        key = (obj["kind"], meta["namespace"], meta["name"], ref.uid)
        cached = self._applied.get(key)
        if cached and cached[0] == want and time.monotonic() - cached[1] < SINGLETON_CACHE_SECONDS:
            return
        plural = PLURALS[obj["kind"]]
        have = self.kube.get(obj["apiVersion"], plural, meta["namespace"], meta["name"])
        if have is None:
            _refused(obj, lambda: self.kube.create(obj))
        elif (have["metadata"].get("annotations") or {}).get(L.ANNOTATION_SPEC_HASH) != want:
            patch = {"metadata": {"labels": meta["labels"], "annotations": meta["annotations"]}}
            patch.update({k: v for k, v in obj.items() if k in PATCHED_PARTS})
            if obj["kind"] == "Deployment":  # what a frontend template no longer sets goes
                have_pod = (have.get("spec") or {}).get("template") or {}
                patch["spec"] = {**obj["spec"], "template": template.with_removals(
                    have_pod, obj["spec"]["template"])}
            _refused(obj, lambda: self.kube.patch(obj["apiVersion"], plural, meta["namespace"],
                                                  meta["name"], patch))
        self._applied[key] = (want, time.monotonic())
