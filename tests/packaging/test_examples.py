"""The examples: every InferenceEngine is valid against the CRD's own schema, every built-in
object and every child the operator renders from an example is valid Kubernetes (1.27..newest)."""

from __future__ import annotations

import copy

import jsonschema
import pytest
from kube_schemas import problems
from packaging_support import DATA, EXAMPLES, example_engines, load_all

ENGINE_FILES = example_engines()


def crd_schema() -> dict:
    from shoal.operator import crd

    (version,) = crd.crd()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def schema_errors(obj: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(crd_schema())
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]


def with_defaults(obj, schema: dict):
    """What the API server stores: the schema's defaults filled in, recursively (structural
    schemas default only object properties, which is all this needs)."""
    if isinstance(obj, dict) and schema.get("type") == "object":
        out = dict(obj)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = with_defaults(out[key], sub)
        return out
    return obj


def stored(obj: dict, namespace: str = "default") -> dict:
    """The object as the operator receives it: defaulted, with a namespace and a uid."""
    body = with_defaults(obj, crd_schema())
    body["metadata"] = {**body["metadata"], "namespace": namespace,
                        "uid": "6f1c1a52-0000-4000-8000-000000000001", "generation": 1}
    return body


def engines_in(path) -> list[dict]:
    """The InferenceEngines of an example file (some also hold the built-in objects they use)."""
    return [o for o in load_all(path) if o.get("kind") == "InferenceEngine"]


def test_examples_cover_the_documented_cases():
    names = {p.name for p in ENGINE_FILES}
    assert {"cpu-single.yaml", "tp2-two-nodes.yaml", "drain.yaml", "gpu.yaml",
            "gpu-production.yaml"} <= names
    by_name = {p.name: engines_in(p)[0]["spec"] for p in ENGINE_FILES}
    assert by_name["tp2-two-nodes.yaml"]["tensorParallelSize"] == 2
    assert by_name["tp2-two-nodes.yaml"]["nodesPerGroup"] == 2
    assert by_name["drain.yaml"]["shutdown"]["timeoutSeconds"] > 0
    assert "nvidia.com/gpu" in by_name["gpu.yaml"]["engine"]["resources"]["limits"]
    for gpu in ("gpu.yaml", "tp2-two-nodes.yaml", "gpu-production.yaml"):  # GPU pools: tainted
        assert by_name[gpu]["engine"]["template"]["spec"]["tolerations"], gpu


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: p.name)
def test_example_inferenceengine_matches_the_crd_schema(path):
    for obj in engines_in(path):
        assert obj["apiVersion"] == "shoal.dev/v1alpha1"
        assert schema_errors(obj) == []
        assert schema_errors(with_defaults(obj, crd_schema())) == []


def test_the_crd_schema_rejects_the_broken_example():
    (broken,) = load_all(DATA / "broken-inferenceengine.yaml")
    errors = schema_errors(broken)
    assert any(e.startswith("spec.replicas:") and "minimum of 0" in e for e in errors), errors


def test_the_crd_schema_rejects_out_of_bound_and_mistyped_fields():
    (ie,) = load_all(EXAMPLES / "tp2-two-nodes.yaml")
    for path, value, expected in [
        (("spec", "tensorParallelSize"), 0, "minimum of 1"),
        (("spec", "shutdown", "timeoutSeconds"), "soon", "is not of type 'integer'"),
        (("spec", "restartPolicy", "policy"), "Always", "is not one of"),
    ]:
        bad = copy.deepcopy(ie)
        bad[path[0]] = dict(bad[path[0]])
        node = bad
        for key in path[:-1]:
            node[key] = copy.deepcopy(node.get(key, {}))
            node = node[key]
        node[path[-1]] = value
        errors = schema_errors(bad)
        assert any(expected in e for e in errors), (path, errors)
    missing = copy.deepcopy(ie)
    del missing["spec"]["model"]
    assert any("'model' is a required property" in e for e in schema_errors(missing))


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_built_in_objects_in_examples_are_valid_kubernetes(path):
    objs = [o for o in load_all(path)
            if "apiVersion" in o and not o["apiVersion"].startswith("shoal.dev/")]
    errors = [line for o in objs for line in problems(o, f"{path.name}: {o['kind']}")]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: p.name)
def test_children_rendered_from_example_are_valid_kubernetes(path):
    from shoal.operator.render import render_children
    from shoal.operator.spec import parse

    for obj in engines_in(path):
        body = stored(obj)
        children = render_children(*parse(body))
        spec = body["spec"]
        pods = [c for c in children if c["kind"] == "Pod"]
        assert len(pods) == spec["replicas"] * spec["nodesPerGroup"]
        assert {"Deployment", "Service"} <= {c["kind"] for c in children}
        errors = [line for c in children for line in problems(c)]
        assert not errors, "\n".join(errors)
        for c in children:
            refs = c["metadata"].get("ownerReferences") or []
            assert [r["uid"] for r in refs] == [body["metadata"]["uid"]], c["metadata"]["name"]


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: p.name)
def test_engine_command_lines_from_examples_are_accepted_by_shoal_serve(path):
    """The operator renders `shoal serve` command lines from each example's spec (extraArgs
    included); the engine's own argument parser must accept every one of them."""
    from shoal.engine.entrypoints.serve import build_parser
    from shoal.operator.render import render_children
    from shoal.operator.spec import parse

    for obj in engines_in(path):
        body = stored(obj)
        if body["spec"]["runtime"] != "Shoal":
            continue  # stock `vllm serve` parses these
        for pod in (c for c in render_children(*parse(body)) if c["kind"] == "Pod"):
            (container,) = pod["spec"]["containers"]
            args = container["args"]
            assert args[0] == "serve", args
            try:
                build_parser().parse_args(args[1:])
            except SystemExit:
                pytest.fail(f"{path.name}: `shoal {' '.join(args)}` is refused by shoal serve")


def test_the_production_example_places_its_pods_and_keeps_the_operators_parts():
    """examples/gpu-production.yaml: the GPU pool's label and taint, zone spreading and the
    hf:// model (its fetch with the token Secret, the shared cache claim) reach every engine pod;
    the operator's own PodDisruptionBudget is rendered (the example has none of its own); and
    its spec has no problem the operator would report."""
    from shoal.operator.render import render_children
    from shoal.operator.spec import parse
    from shoal.operator.validation import spec_problems

    (obj,) = engines_in(EXAMPLES / "gpu-production.yaml")
    body = stored(obj)
    ref, spec = parse(body)
    assert spec_problems(ref.name, spec) == []
    children = render_children(ref, spec)
    assert [c["kind"] for c in children].count("PodDisruptionBudget") == 1
    written = obj["spec"]["engine"]["template"]["spec"]
    for pod in (c for c in children if c["kind"] == "Pod"):
        pod_spec = pod["spec"]
        assert pod_spec["nodeSelector"] == written["nodeSelector"]
        assert pod_spec["tolerations"] == written["tolerations"]
        assert pod_spec["topologySpreadConstraints"] == written["topologySpreadConstraints"]
        assert pod_spec["priorityClassName"] == "inference-high"
        assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}} \
            in pod_spec["volumes"]
        (fetch,) = pod_spec["initContainers"]
        assert fetch["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
        (engine,) = pod_spec["containers"]
        assert engine["args"][:2] == ["serve", "Qwen/Qwen2.5-7B-Instruct"]
    (dep,) = [c for c in children if c["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["nodeSelector"] == {"node-pool": "cpu"}


def test_every_example_adapter_is_valid_and_names_an_engine_with_lora():
    from shoal.operator import crd_adapter

    (version,) = crd_adapter.crd()["spec"]["versions"]
    validator = jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"])
    seen = 0
    for path in sorted(EXAMPLES.glob("*.yaml")):
        objs = load_all(path)
        engines = {o["metadata"]["name"]: o for o in objs if o.get("kind") == "InferenceEngine"}
        for a in (o for o in objs if o.get("kind") == "InferenceAdapter"):
            seen += 1
            errors = [f"{'.'.join(map(str, e.path))}: {e.message}"
                      for e in validator.iter_errors(a)]
            assert errors == [], f"{path.name} {a['metadata']['name']}: {errors}"
            assert "lora" in engines[a["spec"]["engine"]]["spec"], path.name
    assert seen >= 2
