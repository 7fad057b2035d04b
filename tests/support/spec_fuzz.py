"""InferenceEngine specs drawn from the CRD's own openAPIV3Schema (issue 29, item 5): the schema
as generated into crds/ (or as the API server serves it) is read the way a 1.20 API server
checks it, and hypothesis draws specs from it. Mutations outside the schema: spec_mutations.py.

`drawable()` is that reading, as plain JSON Schema:
- a string is never "" (the 1.20 server decodes "" in a custom resource as null and refuses it);
- an object with properties holds no other key (the server would prune it; the mutations try
  unknown fields), and an object that keeps unknown fields holds either none or a few;
- an integer stays within its format (int32, int64); OpenAPI's boolean `exclusiveMinimum`
  becomes JSON Schema's number;
- the counts that make pods are bounded (BOUNDS), so that a served spec creates a few pods.

`specs()` draws from it: objects with properties and arrays are composed here, field by field,
and every other node (a string and its pattern, a number and its bounds, an opaque object, a
oneOf) is hypothesis-jsonschema's: given the whole spec schema at once it re-canonicalises the
nested schemas on every draw (0.4 s a spec here). Drawing is deterministic (`derandomize`, no
example database): one hypothesis version draws the same specs, so the counts are stable in CI.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "inferenceengines.shoal.dev.yaml"
KEEP = "x-kubernetes-preserve-unknown-fields"
INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
# Dotted spec path -> the largest value drawn: at most 2 groups x 2 ranks and 1 frontend per
# served spec (the schema allows 1000 groups of 64 ranks: a scale test, not a fuzz case).
BOUNDS = {"replicas": 2, "nodesPerGroup": 2, "tensorParallelSize": 4, "frontend.replicas": 1,
          "autoscaling.minReplicas": 2, "autoscaling.maxReplicas": 2}
MAX_ITEMS = 3  # per array, map and set of unknown fields


def installed_crd(kube=None) -> dict:
    """The InferenceEngine CRD: as the API server serves it when `kube` is given, else as
    generated into crds/ (what the chart and the tests install)."""
    if kube is not None:
        return kube.get("apiextensions.k8s.io/v1", "customresourcedefinitions", None,
                        "inferenceengines.shoal.dev")
    return yaml.safe_load(CRD_FILE.read_text())


def spec_schema(crd: dict) -> dict:
    """The `spec` node of the stored version's openAPIV3Schema."""
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def drawable(node: dict, path: str = "", bounds: dict | None = None) -> dict:
    """The JSON Schema of what the API server accepts at `node` (see the module's docstring)."""
    bounds = BOUNDS if bounds is None else bounds
    out = {k: v for k, v in node.items()
           if k not in ("description", "default", "format", KEEP, "x-kubernetes-int-or-string",
                        "properties", "items", "additionalProperties", "anyOf", "oneOf")}
    kind = node.get("type")
    if kind == "integer":
        low, high = INT_RANGES.get(node.get("format", "int64"), INT_RANGES["int64"])
        out["minimum"] = max(node.get("minimum", low), low)
        out["maximum"] = min(node.get("maximum", high), high, bounds.get(path, high))
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if node.get(exclusive) is True:  # OpenAPI v3's boolean form; JSON Schema's is the bound
            out[exclusive] = out.pop(bound)
    if kind == "string":
        out["minLength"] = max(node.get("minLength", 0), 1)
    if kind == "array":
        out["items"] = drawable(node["items"], f"{path}[]", bounds)
        out["maxItems"] = MAX_ITEMS
    for key in ("anyOf", "oneOf"):
        if key in node:
            out[key] = [drawable(n, path, bounds) for n in node[key]]
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = drawable(node["additionalProperties"], f"{path}{{}}",
                                               bounds)
        out["maxProperties"] = MAX_ITEMS
    if "properties" in node:
        join = f"{path}." if path else ""
        out["properties"] = {k: drawable(v, f"{join}{k}", bounds)
                             for k, v in node["properties"].items()}
    if kind == "object" and "additionalProperties" not in node:
        if node.get(KEEP):  # unknown fields kept: up to MAX_ITEMS of them
            out["maxProperties"] = len(out.get("properties", {})) + MAX_ITEMS
        else:
            out["additionalProperties"] = False
    return out


def _strategy(node: dict) -> st.SearchStrategy:
    """Draws what `node` (a `drawable()` schema) accepts."""
    if node.get("type") == "array" and "items" in node:
        return st.lists(_strategy(node["items"]), min_size=node.get("minItems", 0),
                        max_size=node["maxItems"])
    if node.get("type") != "object" or "properties" not in node or "oneOf" in node:
        return from_schema(node)
    props = {k: _strategy(v) for k, v in node["properties"].items()}
    required = set(node.get("required", ()))
    known = st.fixed_dictionaries({k: s for k, s in props.items() if k in required},
                                  optional={k: s for k, s in props.items() if k not in required})
    if node.get("additionalProperties") is False:
        return known
    unknown = st.dictionaries(st.text(min_size=1).filter(lambda k: k not in props),
                              from_schema({}), max_size=MAX_ITEMS)
    return st.builds(lambda a, b: {**b, **a}, known, st.just({}) | unknown)


def specs(schema: dict, bounds: dict | None = None) -> st.SearchStrategy[dict]:
    """Specs the schema (a CRD's spec node) admits, for a property test's @given."""
    return _strategy(drawable(schema, "", bounds))


class DrawnSpecs:
    """`count` draws of `specs(schema)`, duplicates dropped, made in a fresh interpreter that
    starts at once (`result()` waits for it): hypothesis also draws constants it collects from
    every local module loaded (all of shoal in a test session), so in-process draws would
    depend on what else the session imported."""

    def __init__(self, schema: dict, count: int, bounds: dict | None = None):
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({"schema": schema, "bounds": bounds}, f)
        self.request = Path(f.name)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "support.spec_fuzz", str(count), str(self.request)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO / "tests",
            env={**os.environ, "PYTHONPATH": str(REPO / "tests")})

    def result(self, timeout: float = 300) -> list[dict]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            self.request.unlink(missing_ok=True)
        if self.proc.returncode:
            raise RuntimeError(f"drawing specs failed:\n{err[-3000:]}")
        return json.loads(out)

    def close(self) -> None:
        """Stop a drawing nobody will wait for (a test that failed early)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.request.unlink(missing_ok=True)


def drawn_specs(schema: dict, count: int, bounds: dict | None = None) -> list[dict]:
    """DrawnSpecs(...).result(): the draws, deterministic for one schema and hypothesis."""
    return DrawnSpecs(schema, count, bounds).result()


def _drawn_here(schema: dict, count: int, bounds: dict | None = None) -> list[dict]:
    found: dict[str, dict] = {}

    @settings(max_examples=count, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(specs(schema, bounds))
    def collect(spec):
        found.setdefault(json.dumps(spec, sort_keys=True), copy.deepcopy(spec))

    collect()
    return list(found.values())


if __name__ == "__main__":  # DrawnSpecs' fresh interpreter: COUNT, a file of {schema, bounds}
    asked = json.loads(Path(sys.argv[2]).read_text())
    json.dump(_drawn_here(asked["schema"], int(sys.argv[1]), asked["bounds"]), sys.stdout)
