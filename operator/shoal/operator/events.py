"""Kubernetes Events on the InferenceEngine: engine deaths, restarts, drains. One per fact."""

from __future__ import annotations

import datetime as dt
import logging
import uuid

from shoal.operator import labels as L
from shoal.operator.kube import Kube
from shoal.operator.spec import EngineRef

log = logging.getLogger("shoal.operator.events")

NORMAL, WARNING = "Normal", "Warning"


def emit(kube: Kube, ref: EngineRef, type_: str, reason: str, message: str) -> None:
    """Post a core/v1 Event (readable by `kubectl describe ie` and `kubectl get events` on
    every server version). Never raises: an Event is a report, not a step of the reconcile."""
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{ref.name}.{uuid.uuid4().hex[:12]}", "namespace": ref.namespace},
        "involvedObject": {"apiVersion": ref.api_version, "kind": ref.kind, "name": ref.name,
                           "namespace": ref.namespace, "uid": ref.uid},
        "type": type_, "reason": reason, "message": message[:1024],
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        "source": {"component": L.MANAGED_BY},
        "reportingComponent": L.MANAGED_BY,
    }
    log.info("%s %s %s: %s", ref, type_, reason, message)
    try:
        kube.create(event)
    except Exception as e:  # noqa: BLE001
        log.warning("could not post event %s for %s: %s", reason, ref, e)
