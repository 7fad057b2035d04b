"""Mutations outside the InferenceEngine's schema (issue 29, item 5), made by walking the same
CRD schema spec_fuzz.py draws from: for every node, values of the wrong type, out of range,
outside the enum or pattern, huge, empty or null, missing when required, and fields the schema
does not know; plus names the API server takes but pods and Services may not.

Each mutation changes one field of a valid base spec (BASES: every optional block set, so that
every node of the schema is there to mutate) and says which field it is, so that a refusal can
be checked for naming it. A field is found in the base that sets its top-level block (`hf://`
fields in HF, `autoscaling` in AUTOSCALED, the rest in PLAIN).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

KEEP = "x-kubernetes-preserve-unknown-fields"
HUGE = 64 * 1024  # characters: far above any name or label, well under the 1.5 MiB object limit
UNKNOWN = "fuzzUnknownField"


def _template(main: str, *, engine: bool) -> dict:
    """A pod template setting every field the CRD lists, each to a value pods accept."""
    spec = {
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "gpu", "operator": "Equal", "value": "yes",
                         "effect": "NoExecute", "tolerationSeconds": 60}],
        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": {"matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a"]}]}}]}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": {"team": "search"}}}],
        "priorityClassName": "fuzz-high",  # made by the k8s test (admission checks it exists)
        "schedulerName": "default-scheduler",
        "imagePullSecrets": [{"name": "registry-creds"}],
        "securityContext": {"fsGroup": 10001},
        "volumes": [{"name": "cache", "emptyDir": {}}],
        "initContainers": [{"name": "warm", "image": "busybox:1.36", "command": ["true"]}],
        "containers": [{"name": main, "env": [{"name": "HF_HOME", "value": "/cache"}],
                        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]},
                       {"name": "sidecar", "image": "busybox:1.36"}],
    }
    if engine:
        spec["serviceAccountName"] = "default"
    return {"metadata": {"labels": {"team": "search"}, "annotations": {"note": "fuzz"}},
            "spec": spec}


def _resources() -> dict:
    return {"limits": {"cpu": "2", "memory": "2Gi"}, "requests": {"cpu": "100m", "memory": 64}}


PLAIN = {
    "model": "/models/tiny", "servedModelName": "tiny", "image": "shoal:test",
    "imagePullPolicy": "IfNotPresent", "runtime": "Shoal", "runtimeVersion": "0.32.0",
    "replicas": 1, "tensorParallelSize": 1, "nodesPerGroup": 1, "masterPort": 29500,
    # no frontend pod: the Deployment (and its pod template) is what the operator writes
    "frontend": {"replicas": 0, "image": "shoal-router:test", "routing": "prefix-affinity",
                 "resources": _resources(), "template": _template("frontend", engine=False)},
    "engine": {"resources": _resources(), "extraArgs": ["--max-model-len", "512"],
               "env": [{"name": "NCCL_DEBUG", "value": "INFO"},
                       {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
               "startupTimeoutSeconds": 600, "template": _template("engine", engine=True)},
    "modelVolume": {"mountPath": "/models", "volume": {"emptyDir": {}}},
    "shutdown": {"timeoutSeconds": 5},
    "restartPolicy": {"policy": "RecreateGroupOnFailure", "backoffBaseSeconds": 1,
                      "backoffMaxSeconds": 10, "maxRestarts": 3, "resetAfterSeconds": 60},
    "lora": {"maxLoras": 2, "maxLoraRank": 8, "maxCpuLoras": 4},
}
HF = {"model": "hf://org/tiny@main", "image": "shoal:test",
      "modelCache": {"persistentVolumeClaim": {"claimName": "model-cache"}},
      "modelAuth": {"secretName": "hf-token", "key": "token"},
      "hfEndpoint": "https://hf-mirror.internal"}
AUTOSCALED = {"model": "/models/tiny", "image": "shoal:test", "replicas": 1,
              "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "requestsPerGroup": 8,
                              "scaleUpStabilizationSeconds": 0, "scaleDownDelaySeconds": 60}}
BASES = {"modelCache": HF, "modelAuth": HF, "hfEndpoint": HF, "autoscaling": AUTOSCALED}
# A valid spec names one of each: the one a mutation is about replaces the base's.
ONE_OF = {("modelCache", "hostPath"): {"path": "/var/cache/models"},
          ("autoscaling", "kvCacheUsage"): 0.7, ("autoscaling", "ttftP90Seconds"): 2}


@dataclass(frozen=True)
class Case:
    """One InferenceEngine to create: `field` is what a refusal must name (None: any field,
    for a drawn spec)."""

    label: str  # what was done, e.g. "spec.replicas: above maximum"
    spec: dict
    field: str | None = None
    name: str | None = None  # the resource's name when the mutation is the name itself


def base_for(path: tuple) -> dict:
    """The valid spec a mutation of `path` (spec keys and indices) starts from."""
    spec = copy.deepcopy(BASES.get(path[0], PLAIN) if path else PLAIN)
    if tuple(path[:2]) in ONE_OF:
        spec[path[0]] = {k: v for k, v in spec[path[0]].items()
                         if k not in ("persistentVolumeClaim", "requestsPerGroup")}
        spec[path[0]][path[1]] = copy.deepcopy(ONE_OF[tuple(path[:2])])
    return spec


class Key(str):
    """A map's key in a path (resources' `cpu`, a label's key): written in brackets."""


def field_name(path: tuple) -> str:
    """`spec.engine.env[0].name` for ("engine", "env", 0, "name")."""
    out = "spec"
    for p in path:
        out += f"[{p}]" if isinstance(p, (int, Key)) else f".{p}"
    return out


def normalized(text: str) -> str:
    """A field path, or a message naming one, without indices and keys, as the API server and
    the operator write them (`spec.engine.env[0].name`, `spec.engine.env.name`,
    `limits[cpu]`); a bracket holding `field: message` pairs (the server's list) stays."""
    return re.sub(r"\[([^\[\]]*)\]", lambda m: m.group(0) if ": " in m.group(1) else "", text)


def _set(spec: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(spec)
    node = out
    for p in path[:-1]:
        node = node[p]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


_DELETE = object()
_WRONG = {"string": 7, "integer": "7", "number": "seven", "boolean": "yes", "object": "x",
          "array": {"a": 1}}
_PATTERN_MISSES = ("relative/path", "s3://bucket/m", " padded ", "UPPER:/x", "a\nb", "")


def _values(node: dict, base) -> list[tuple[str, object]]:
    """(what, value) of one node: the mutations its type, bounds, enum and pattern suggest."""
    kind = node.get("type")
    # null is pruned: taking out a field the spec need not set is the base without it, so only
    # where the API server then defaults it or refuses it (required, `_values` of its parent)
    out: list[tuple[str, object]] = [(REMOVED, None)] if "default" in node else []
    if node.get("x-kubernetes-int-or-string"):
        return out + [("float", 1.5), ("negative", "-1"), ("negative integer", -1),
                      ("not a quantity", "1 GB"),
                      ("boolean", True), ("huge", "9" * 400), ("object", {"a": 1})]
    out.append(("wrong type", _WRONG.get(kind, 7)))
    if kind == "integer":
        out += [("float", 1.5), ("beyond int64", 2**64)]
        if "minimum" in node:
            out.append(("below minimum", node["minimum"] - 1))
        if "maximum" in node:
            out.append(("above maximum", node["maximum"] + 1))
    if kind == "number":
        out += [("zero", 0), ("negative", -1), ("above maximum", node.get("maximum", 1e307) * 10),
                ("smallest positive", 5e-324)]
    if kind == "string":
        out += [("empty", ""), ("unicode", "mödel ✓ \u0000 end")]
        if "enum" in node:
            out.append(("not in enum", "Sometimes"))
        else:
            start = base if isinstance(base, str) and base else "x"
            out.append(("huge", start + "a" * HUGE))
        if "pattern" in node:
            miss = next(m for m in _PATTERN_MISSES if not re.search(node["pattern"], m))
            out.append(("outside pattern", miss))
    if kind == "object":
        out += [("empty object", {}), ("list", [])]
    if kind == "array":
        out += [(EMPTIED, []), ("item of another type", [{"a": [1]}]), ("null item", [None])]
    return out


# Mutations that take a field's content away: what breaks is whatever in the enclosing object
# depended on it (a required sibling, a mount of a removed volume), so naming the enclosing
# object is naming it.
REMOVED, EMPTIED = "null (pruned by the API server)", "empty list"


def _object_mutations(node: dict, path: tuple, base: dict) -> list[Case]:
    """Required fields taken out; an unknown field added (pruned by the API server, or kept
    where the schema keeps unknown fields and judged by the operator)."""
    value = _at(base, path)
    if not isinstance(value, dict):
        return []
    out = [Case(f"{field_name(path)}: missing required {k}", _set(base, path + (k,), _DELETE),
                field_name(path + (k,))) for k in node.get("required", ()) if k in value]
    if node.get(KEEP) or not path[1:]:  # kept for the operator; pruned: top-level blocks only
        extra = {**value, UNKNOWN: {"nested": [1, "two"]}}
        out.append(Case(f"{field_name(path)}: unknown field", _set(base, path, extra),
                        field_name(path + (UNKNOWN,))))
    return out


def _at(spec, path: tuple):
    node = spec
    for p in path:
        if isinstance(node, dict) and p in node:
            node = node[p]
        elif isinstance(node, list) and isinstance(p, int) and p < len(node):
            node = node[p]
        else:
            return _MISSING
    return node


_MISSING = object()


def _walk(node: dict, path: tuple = ()):
    yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from _walk(child, path + (key,))
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], path + (0,))
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], path + ("*",))


def _concrete(path: tuple, base: dict) -> tuple | None:
    """`path` with a map's `*` replaced by a key the base has there (None: it has none)."""
    out: tuple = ()
    for p in path:
        if p == "*":
            here = _at(base, out)
            if not isinstance(here, dict) or not here:
                return None
            p = Key(sorted(here)[0])
        out += (p,)
    return out


def mutations(schema: dict) -> list[Case]:
    """Every mutation of every node of `schema` (a CRD's spec node), bodies deduplicated."""
    cases: list[Case] = []
    for abstract, node in _walk(schema):
        if not abstract:
            continue
        path = _concrete(abstract, base_for(abstract))
        if path is None:
            continue
        base = base_for(path)
        current = _at(base, path)
        for what, value in _values(node, current):
            named = path[:-1] if what in (REMOVED, EMPTIED) else path
            cases.append(Case(f"{field_name(path)}: {what}", _set(base, path, value),
                              field_name(named)))
        cases += _object_mutations(node, path, base)
    cases += _map_key_mutations(schema) + name_mutations()
    seen, out = set(), []
    for c in cases:
        key = json.dumps([c.name, c.spec], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _map_key_mutations(schema: dict) -> list[Case]:
    """Keys of the maps (resources, labels, nodeSelector) that Kubernetes does not allow."""
    out = []
    for abstract, _node in _walk(schema):
        if not abstract or abstract[-1] != "*":
            continue
        path = _concrete(abstract[:-1], base_for(abstract))
        if path is None or not isinstance(_at(base_for(path), path), dict):
            continue
        base = base_for(path)
        value = next(iter(_at(base, path).values()), "1")
        for what, key in (("key with a space", "bad key"), ("key of 300 characters", "k" * 300),
                          ("key with a slash too many", "a/b/c")):
            out.append(Case(f"{field_name(path)}: {what}",
                            _set(base, path, {**_at(base, path), key: value}), field_name(path)))
    return out


def name_mutations() -> list[Case]:
    """metadata.name values a custom resource takes (a DNS subdomain) that its children's
    names may not carry: too long for a pod's hostname, a dot, a leading digit."""
    return [Case(f"metadata.name: {what}", copy.deepcopy(PLAIN), "metadata.name", name=name)
            for what, name in (("46 characters", "n" * 46), ("63 characters", "n" * 63),
                               ("253 characters", "n" * 253), ("a dot", "fuzz.engine"),
                               ("a leading digit", "0fuzz"), ("upper case", "Fuzz"))]
