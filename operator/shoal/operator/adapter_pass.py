"""The InferenceAdapters' part of an engine's pass (reconcile.py calls both halves):
- `observe`, before the plan: the engine's adapters (kopf's index, or a LIST), where each one's
  files are in the pods or why nothing is loaded, the groups whose ranks are all Ready (rank 0's
  URL), and which of those have not answered for an adapter yet (the plan holds such a group
  in LoadingAdapters unless it was Ready already);
- `report`, after: hand the groups and adapters to the sync task (adapter_sync.py), then patch
  each adapter's status and post its Events when they changed.

The API keys, if any, are what the calls send: the engine container's SHOAL_API_KEY or
VLLM_API_KEY to rank 0, the frontend container's to the Service, written in the spec or read
from their Secret.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.contract.auth import ENV_KEYS
from shoal.operator import events, render
from shoal.operator import labels as L
from shoal.operator.adapter_spec import Adapter, engine_path
from shoal.operator.adapter_status import adapter_events, adapter_status
from shoal.operator.adapter_sync import AdapterSync, View, Want
from shoal.operator.kube import Kube
from shoal.operator.observed import no_empty_strings, pod_ready
from shoal.operator.spec import EngineRef, EngineSpec

log = logging.getLogger("shoal.operator.adapters")

KEYS_SECONDS = 60.0  # a rotated key in a Secret is picked up within this

# (namespace, engine name) -> the InferenceAdapters naming it, as the API or an index holds them
AdapterSource = Callable[[str, str], list[dict]]


def listed_adapters(kube: Kube) -> AdapterSource:
    def source(namespace: str, name: str) -> list[dict]:
        return [a for a in kube.list(L.API_VERSION, L.ADAPTER_PLURAL, namespace, None)
                if (a.get("spec") or {}).get("engine") == name]
    return source


INDEX = "adapters_by_engine"  # the kopf index handler's name (handlers.py)


def index_key(namespace: str, spec) -> tuple[str, str] | None:
    engine = (spec or {}).get("engine")
    return (namespace, str(engine)) if engine else None


class AdapterIndex:
    """An `AdapterSource` over kopf's index once a handler handed it over; a LIST until then
    (as pod_index.PodIndex)."""

    def __init__(self, fallback: AdapterSource):
        self._index, self._fallback = None, fallback

    def attach(self, index) -> None:
        self._index = index

    def __call__(self, namespace: str, name: str) -> list[dict]:
        if self._index is None:
            return self._fallback(namespace, name)
        store = self._index.get((namespace, name))
        return list(store) if store is not None else []


@dataclass
class Seen:
    """What `observe` read, for the plan (`pending`) and for `report`."""

    adapters: list[Adapter] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)  # followed adapter -> its path
    problems: dict[str, str] = field(default_factory=dict)  # adapter -> why nothing loads
    serving: dict[int, str] = field(default_factory=dict)  # group -> rank 0's base URL
    view: View = field(default_factory=View)
    pending: dict[int, tuple[str, ...]] = field(default_factory=dict)


def serving_groups(by_group: dict[int, dict[int, dict]], nodes: int) -> dict[int, str]:
    """Groups with every rank's pod Ready: rank 0's base URL."""
    out = {}
    for g, pods in by_group.items():
        ip = ((pods.get(0) or {}).get("status") or {}).get("podIP")
        if ip and len(pods) >= nodes and all(pod_ready(p) for p in pods.values()):
            out[g] = f"http://{ip}:{L.HTTP_PORT}"
    return out


class AdapterPass:
    def __init__(self, kube: Kube, source: AdapterSource | None, sync: AdapterSync | None):
        self.kube, self.sync = kube, sync
        self.source = source or listed_adapters(kube)
        self._written: dict[str, dict] = {}  # adapter uid -> the status this operator wrote
        self._key_memo: dict[tuple, tuple] = {}  # engine -> (spec key, read at, keys)

    def observe(self, ref: EngineRef, spec: EngineSpec, by_group: dict,
                deleting: bool) -> Seen:
        try:
            bodies = self.source(ref.namespace, ref.name)
        except Exception as e:  # noqa: BLE001 - no adapter read: the engine's pass goes on
            log.warning("%s: could not list InferenceAdapters: %s", ref, e)
            return Seen()
        seen = Seen(adapters=[Adapter.of(b) for b in bodies])
        for a in seen.adapters:
            if a.deleting:
                continue
            path, problem = engine_path(a, spec)
            if spec.lora is None:
                problem = (f"InferenceEngine {ref.name!r} has no spec.lora: its engines do not "
                           "serve adapters")
            elif deleting:
                problem = f"InferenceEngine {ref.name!r} is being deleted"
            if problem:
                seen.problems[a.name] = problem
            else:
                seen.paths[a.name] = path or ""
        if self.sync is None or not seen.paths:
            return seen
        seen.serving = serving_groups(by_group, spec.nodes_per_group)
        seen.view = self.sync.view(ref.namespace, ref.name).of(seen.serving)
        if self.sync.bound:
            for g in seen.serving:
                left = tuple(n for n in sorted(seen.paths) if not seen.view.answered(g, n))
                if left:
                    seen.pending[g] = left
        return seen

    def report(self, ref: EngineRef, spec: EngineSpec, seen: Seen, now: str) -> None:
        if self.sync is not None:
            want = None
            if seen.paths and seen.serving:
                want = Want(groups=dict(seen.serving), adapters=dict(seen.paths),
                            service=(f"http://{L.service_name(ref.name)}.{ref.namespace}.svc:"
                                     f"{L.HTTP_PORT}"),
                            **self._keys(ref, spec))
            self.sync.follow(ref.namespace, ref.name, want)
        for a in seen.adapters:
            if not a.deleting:
                self._write(a, seen, now)

    def engine_missing(self, a: Adapter, now: str) -> None:
        """An adapter whose engine is not there: a waiting reason naming it."""
        problem = (f"InferenceEngine {a.engine!r} not found in namespace {a.ref.namespace!r}")
        self._write(a, Seen(adapters=[a], problems={a.name: problem}), now)

    def _write(self, a: Adapter, seen: Seen, now: str) -> None:
        new = no_empty_strings(adapter_status(
            a, problem=seen.problems.get(a.name, ""), path=seen.paths.get(a.name, ""),
            serving=sorted(seen.serving), view=seen.view, now=now))
        old = self._written.get(a.ref.uid) or a.status
        if _same(old, new):
            return
        try:
            patch = {k: None for k in old if k not in new} | new  # merge patch: drop the rest
            if old.get("lastError") and "lastError" in new:
                patch["lastError"] = {k: None for k in old["lastError"]} | new["lastError"]
            self.kube.patch(L.API_VERSION, L.ADAPTER_PLURAL, a.ref.namespace, a.ref.name,
                            {"status": patch}, sub="status")
        except Exception as e:  # noqa: BLE001 - the next pass writes it again
            log.warning("%s: could not write the status of InferenceAdapter %s: %s",
                        a.engine, a.ref, e)
            return
        self._written[a.ref.uid] = new
        for type_, reason, message in adapter_events(old, new):
            events.emit(self.kube, a.ref, type_, reason, message)

    def _keys(self, ref: EngineRef, spec: EngineSpec) -> dict:
        """api_key and engine_key for the sync, read at most every KEYS_SECONDS per engine
        and spec (rendering the pods and a Secret GET are not work for every pass)."""
        memo_key = (ref.namespace, ref.name, spec.revision, repr(spec.frontend_template))
        now = time.monotonic()
        hit = self._key_memo.get((ref.namespace, ref.name))
        if hit is not None and hit[0] == memo_key and now - hit[1] < KEYS_SECONDS:
            return hit[2]
        keys = {"api_key": self._api_key(
                    ref, render.frontend_deployment(ref, spec)["spec"]["template"],
                    L.FRONTEND_CONTAINER),
                "engine_key": self._api_key(ref, render.engine_pod(ref, spec, 0, 0),
                                            L.ENGINE_CONTAINER)}
        self._key_memo[(ref.namespace, ref.name)] = (memo_key, now, keys)
        return keys

    def _api_key(self, ref: EngineRef, pod: dict, container: str) -> str | None:
        """The first key a rendered container checks (SHOAL_API_KEY, VLLM_API_KEY), written in
        the spec or read from its Secret; None when it checks none."""
        found = next(c for c in pod["spec"]["containers"] if c["name"] == container)
        env = {e.get("name"): e for e in found.get("env") or []}
        for name in ENV_KEYS:
            e = env.get(name)
            if e is None:
                continue
            if e.get("value"):
                return str(e["value"])
            secret_ref = (e.get("valueFrom") or {}).get("secretKeyRef") or {}
            if secret_ref.get("name") and secret_ref.get("key"):
                try:
                    secret = self.kube.get("v1", "secrets", ref.namespace,
                                           secret_ref["name"]) or {}
                except Exception as err:  # noqa: BLE001 - the calls then say they were refused
                    log.warning("%s: could not read the API key Secret %s: %s", ref,
                                secret_ref["name"], err)
                    return None
                data = (secret.get("data") or {}).get(secret_ref["key"])
                return base64.b64decode(data).decode() if data else None
        return None


def _same(old: dict, new: dict) -> bool:
    """Equal but for the conditions' transition times."""
    def strip(st: dict) -> dict:
        return {**st, "conditions": [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                                     for c in st.get("conditions") or []]}
    return strip(old) == strip(new)
