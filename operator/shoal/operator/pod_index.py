"""Engine and frontend pods read from kopf's in-memory index instead of a LIST per pass.

kopf keeps the index from its own pod watch (filled before any handler runs, updated before the
handlers of the same event), so a pass triggered by a pod event already sees that event. The
InferenceEngine itself is still read with a GET: its status is the operator's memory, and an
index would lag behind the status patch of the pass before (a death acted on twice).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from shoal.operator import labels as L

INDEX = "pods_by_engine"  # the handler's name: kopf passes the index under it


def key_of(namespace: str, labels: Mapping) -> tuple[str, str, str] | None:
    engine, component = labels.get(L.LABEL_ENGINE), labels.get(L.LABEL_COMPONENT)
    return (namespace, engine, component) if engine and component else None


def snapshot(body: Mapping) -> dict:
    """The parts of a pod a pass reads, copied: kopf's body is a view of its own event data."""
    meta = body["metadata"]
    keep = ("name", "namespace", "uid", "labels", "ownerReferences", "creationTimestamp",
            "deletionTimestamp", "deletionGracePeriodSeconds")
    return copy.deepcopy({"metadata": {k: meta[k] for k in keep if k in meta},
                          "spec": {"nodeName": (body.get("spec") or {}).get("nodeName")},
                          "status": dict(body.get("status") or {})})


class PodIndex:
    """A `PodSource` over kopf's index once a handler handed it over; a LIST until then (the
    planned-pass thread can run before any handler after a start)."""

    def __init__(self, fallback):
        self._index = None
        self._fallback = fallback

    def attach(self, index) -> None:
        self._index = index

    def __call__(self, namespace: str, name: str, component: str) -> list[dict]:
        if self._index is None:
            return self._fallback(namespace, name, component)
        store = self._index.get((namespace, name, component))
        # list() over a dict's values runs in C under the GIL: a consistent copy even while the
        # event loop updates the index.
        return list(store) if store is not None else []
