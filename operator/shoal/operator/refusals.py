"""A child the API server refuses is a spec problem, reported and never raised.

What a 1.20 API server checks only when the operator creates or patches a child (the
Kubernetes types a template carries as written: a sidecar, a volume, an affinity, an env
`valueFrom`; names it resolves at admission, such as a PriorityClass) comes back as a 400, 403 or
422. Found by fuzzing (tests/operator/test_op_fuzz_k8s.py): each one was a kopf traceback and a
retry every 60 s, with nothing in status. Now it is SpecValid=False naming the spec field the
refused field was rendered from, with the server's own words, e.g.

    spec.engine.env: the API server refused Pod llm-g0-r0: spec.containers[0].env[4].name:
    Invalid value: "1X": a valid environment variable name must consist of ...

`problems()` is pure: the rendered object and the server's Status in, the SpecValid lines out.
"""

from __future__ import annotations

import json
import re

from shoal.contract.model_fetch import CACHE_VOLUME
from shoal.operator import labels as L
from shoal.operator.model_volumes import MODEL_VOLUME
from shoal.operator.spec import EngineSpec

REFUSED = (400, 403, 422)  # the request itself is refused: the same request is refused again
MAX_CAUSES = 3
MAX_MESSAGE = 400
# Fields of the operator's own container and where the spec says them.
ENGINE_FIELDS = {"image": "spec.image", "imagePullPolicy": "spec.imagePullPolicy",
                 "resources": "spec.engine.resources", "args": "spec.engine.extraArgs",
                 "ports": "spec.masterPort"}
FRONTEND_FIELDS = {"image": "spec.frontend.image", "imagePullPolicy": "spec.imagePullPolicy",
                   "resources": "spec.frontend.resources", "args": "spec.servedModelName"}
# Pod fields the operator sets from the spec (the rest of a pod's spec is the template's).
POD_FIELDS = {"hostname": "metadata.name", "subdomain": "metadata.name",
              "terminationGracePeriodSeconds": "spec.shutdown.timeoutSeconds"}
# The operator's init containers: what in the spec they come from.
INIT_SOURCES = {"model-fetch": "spec.model", "model-image": "spec.model",
                "install-supervisor": "spec.runtime"}
# What admission refuses without a field (a name that does not exist) and the pod field it is.
ADMISSION_FIELDS = {"PriorityClass": "priorityClassName", "RuntimeClass": "runtimeClassName"}


def problems(obj: dict, status: int, body: str, spec: EngineSpec) -> list[str]:
    """One line per cause the server gave (at most MAX_CAUSES), each naming the spec field."""
    try:
        found = json.loads(body or "{}")
    except ValueError:
        found = {}
    kind, name = obj.get("kind", "object"), obj["metadata"].get("name", "")
    what = f"the API server refused {kind} {name}"
    causes = [c for c in (found.get("details") or {}).get("causes") or [] if c.get("field")]
    if not causes:
        message = _short(found.get("message") or body)
        return [f"{_fallback(obj, message)}: {what} ({status} {found.get('reason', '')}): "
                f"{message}"]
    return [f"{source(obj, c['field'], spec)}: {what}: {c['field']}: {_short(c.get('message'))}"
            for c in causes[:MAX_CAUSES]]


def _short(text) -> str:
    text = str(text or "")
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "..."


class _Key(str):
    """A map key or list item name in a field path: written in brackets."""


def _tokens(field: str) -> list:
    """`spec.containers[0].resources.limits[cpu]` ->
    ["spec", "containers", 0, "resources", "limits", _Key("cpu")]."""
    out: list = []
    for part in re.findall(r"[^.\[\]]+|\[[^\]]*\]", field):
        inner = part[1:-1] if part.startswith("[") else None
        out.append(part if inner is None else int(inner) if inner.isdigit() else _Key(inner))
    return out


def _path(tokens: list) -> str:
    """The inverse of _tokens: names dotted, keys and indices in brackets."""
    out = ""
    for t in tokens:
        out += f"[{_key(t)}]" if isinstance(t, (int, _Key)) else f".{t}" if out else str(t)
    return out


def _key(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _join(at: str, rest: list) -> str:
    tail = _path(rest)
    return at if not tail else f"{at}{tail}" if tail.startswith("[") else f"{at}.{tail}"


def _pod_of(obj: dict) -> tuple[str, dict, str] | None:
    """(spec part, pod, main container) of an engine pod or the frontends' Deployment."""
    if obj.get("kind") == "Pod":
        return "spec.engine", obj, L.ENGINE_CONTAINER
    if obj.get("kind") == "Deployment":
        return "spec.frontend", obj["spec"]["template"], L.FRONTEND_CONTAINER
    return None


def _fallback(obj: dict, message: str) -> str:
    """A refusal without a field (admission: a PriorityClass or RuntimeClass that does not
    exist, a quota): the pod field it is about, else the part of the spec the object is."""
    pod = _pod_of(obj)
    if pod is None:
        return "metadata.name"
    for kind, field in ADMISSION_FIELDS.items():
        if kind in message:
            return f"{pod[0]}.template.spec.{field}"
    return pod[0]


def source(obj: dict, field: str, spec: EngineSpec) -> str:
    """The spec field that `field` of the rendered `obj` was rendered from."""
    tokens = _tokens(field)
    pod = _pod_of(obj)
    if pod is None:  # Services, ConfigMaps, ...: named after the resource
        return "spec.masterPort" if "ports" in tokens else "metadata.name"
    where, body, main = pod
    if obj["kind"] == "Deployment":
        if tokens[:2] != ["spec", "template"]:
            return where
        tokens = tokens[2:]
        if tokens[:1] in (["labels"], ["annotations"]):  # how a template's are named there
            tokens = ["metadata", *tokens]
    template = f"{where}.template"
    if tokens[:1] == ["metadata"]:
        if tokens[1:2] == ["name"]:
            return "metadata.name"
        return _join(template, tokens)
    part = tokens[1] if tokens[:1] == ["spec"] and len(tokens) > 1 else None
    if part is None:
        return where
    if part in POD_FIELDS:
        return POD_FIELDS[part]
    item = _item(body["spec"].get(part), tokens[2:3])
    if part in ("containers", "initContainers") and item is not None:
        return _container(where, part, item, tokens[3:], main, spec)
    if part == "volumes" and item is not None:
        name = item.get("name")
        own = {MODEL_VOLUME: "spec.modelVolume.volume" if spec.model_volume else "spec.model",
               CACHE_VOLUME: "spec.modelCache"}
        return own.get(name) or _join(f"{template}.spec.volumes[{_key(name)}]", tokens[3:])
    return _join(f"{template}.spec", tokens[1:])


def _item(items, index: list) -> dict | None:
    if isinstance(items, list) and index and isinstance(index[0], int) and index[0] < len(items):
        return items[index[0]] if isinstance(items[index[0]], dict) else None
    return None


def _container(where: str, part: str, container: dict, rest: list, main: str,
               spec: EngineSpec) -> str:
    """A field of one container: the operator's own (from spec fields), an init container of
    the operator's (from the model source), or a template's sidecar or init container."""
    name = container.get("name")
    at = f"{where}.template.spec.{part}[{_key(name)}]"
    if part == "initContainers" and name in INIT_SOURCES:
        if name == "model-fetch" and rest[:1] == ["env"]:  # the token's secretKeyRef
            return "spec.modelAuth" + {"name": ".secretName", "key": ".key"}.get(
                str(rest[-1]), "")
        return INIT_SOURCES[name]
    field = rest[0] if rest else ""
    if name == main and field in ("env", "volumeMounts"):
        key = "name" if field == "env" else "mountPath"
        entry = _item(container.get(field), rest[1:2]) or {}
        tail = [field, _Key(entry.get(key)), *rest[2:]]
        if field == "env" and where == "spec.engine" and any(
                e.get("name") == entry.get("name") for e in spec.engine_env
                if isinstance(e, dict)):
            return _join("spec.engine", tail)
        if field == "volumeMounts" and entry.get("name") == MODEL_VOLUME:
            return "spec.modelVolume.mountPath"
        return _join(at, tail)
    own = ENGINE_FIELDS if where == "spec.engine" else FRONTEND_FIELDS
    if name == main and field in own:
        return _join(own[field], rest[1:])
    return _join(at, rest)
