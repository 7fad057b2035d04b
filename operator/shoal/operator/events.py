"""Kubernetes Events on the InferenceEngine: engine deaths, restarts, drains. One per fact."""

from __future__ import annotations

import datetime as dt
import logging
import uuid

from shoal.operator import labels as L
from shoal.operator.kube import Kube

log = logging.getLogger("shoal.operator.events")

NORMAL, WARNING = "Normal", "Warning"


def emit(kube: Kube, body: dict, type_: str, reason: str, message: str) -> None:
    """Post a core/v1 Event (readable by `kubectl describe ie` and `kubectl get events` on
    every server version). Never raises: an Event is a report, not a step of the reconcile."""
    meta = body["metadata"]
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": L.API_VERSION, "kind": L.KIND, "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta.get("uid")},
        "type": type_, "reason": reason, "message": message[:1024],
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        "source": {"component": L.MANAGED_BY},
        "reportingComponent": L.MANAGED_BY,
    }
    log.info("%s/%s %s %s: %s", meta["namespace"], meta["name"], type_, reason, message)
    try:
        kube.create(event)
    except Exception as e:  # noqa: BLE001
        log.warning("could not post event %s for %s/%s: %s", reason, meta["namespace"], meta["name"], e)
