"""An HPA (or KEDA's, which is one) aimed at an InferenceEngine whose spec.autoscaling is set
would fight the operator's autoscaler over spec.replicas; the operator ignores spec.replicas
then, so the HPA does nothing, and the Autoscaling condition names it. HPAs are listed at most
once per LIST_EVERY_SECONDS per namespace (autoscaling/v1: every server has it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shoal.operator import labels as L
from shoal.operator.kube import Kube

LIST_EVERY_SECONDS = 60.0
HPA_API = "autoscaling/v1"


@dataclass(frozen=True)
class HPAs:
    names: tuple[str, ...] = ()  # HPAs aimed at the engine
    error: str = ""  # why they could not be listed ("" when they were)


def aimed_at(hpas: list[dict], name: str) -> tuple[str, ...]:
    """Names of the HPAs whose scaleTargetRef is this InferenceEngine."""
    out = []
    for h in hpas:
        ref = (h.get("spec") or {}).get("scaleTargetRef") or {}
        group = str(ref.get("apiVersion") or "").split("/")[0]
        if ref.get("kind") == L.KIND and ref.get("name") == name and group in ("", L.GROUP):
            out.append(h["metadata"]["name"])
    return tuple(sorted(out))


class HPALister:
    def __init__(self, kube: Kube, clock: Callable[[], float] = time.monotonic):
        self.kube, self._clock = kube, clock
        self._cache: dict[str, tuple[float, list[dict] | None, str]] = {}
        self._lock = threading.Lock()

    def __call__(self, namespace: str, name: str) -> HPAs:
        now = self._clock()
        with self._lock:
            at, items, error = self._cache.get(namespace, (None, None, ""))
        if at is None or now - at >= LIST_EVERY_SECONDS:
            try:
                items, error = self.kube.list(HPA_API, "horizontalpodautoscalers",
                                              namespace), ""
            except Exception as e:  # noqa: BLE001 - a report, never a reason to fail a pass
                items, error = None, f"could not list HorizontalPodAutoscalers: {e}"[:300]
            with self._lock:
                self._cache[namespace] = (now, items, error)
        return HPAs(names=aimed_at(items or [], name), error=error)
