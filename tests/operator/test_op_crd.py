"""The CRD is generated from crd.py; the checked-in files must match, and the schema must be
structural and documented field by field (so `kubectl explain ie.spec...` is useful)."""

from __future__ import annotations

import yaml
from shoal.operator import crd


def test_generated_files_are_up_to_date():
    files = crd.outputs()
    assert set(crd.OUTPUTS) < set(files) and len(files) == 2 * len(crd.crds())
    for path, text in files.items():
        assert path.exists(), f"{path} is missing: run python -m shoal.operator.crd --write"
        assert path.read_text() == text, (
            f"{path} is stale: run python -m shoal.operator.crd --write"
        )
    assert crd.main(["--check"]) == 0


def _walk(node, path="openAPIV3Schema"):
    yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def _schema():
    return yaml.safe_load(crd.render_yaml())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_every_field_is_typed_and_described():
    for path, node in _walk(_schema()):
        if path.endswith(".metadata") or path.endswith("{}"):
            continue
        assert node.get("type") or node.get("x-kubernetes-int-or-string"), (
            f"{path} has no type (not structural)"
        )
        assert len(node.get("description", "")) > 10, f"{path} has no description"


def test_spec_descriptions_start_with_the_field_name_and_give_an_example():
    spec = _schema()["properties"]["spec"]
    for path, node in _walk(spec, "spec"):
        leaf = path.rsplit(".", 1)[-1]
        if node.get("type") in ("string", "integer", "boolean") and "[]" not in path \
                and not path.endswith("{}"):  # a map's values (labels) are no field
            assert node["description"].startswith(leaf), (
                f"{path}: description must start with {leaf!r}"
            )
            assert "Example" in node["description"], f"{path}: description needs an example"


def test_defaults_and_bounds_are_in_the_schema():
    spec = _schema()["properties"]["spec"]["properties"]
    assert spec["replicas"]["default"] == 1 and spec["replicas"]["minimum"] == 0
    assert spec["shutdown"]["properties"]["timeoutSeconds"]["minimum"] == 0
    policy = spec["restartPolicy"]["properties"]["policy"]
    assert policy["enum"] == ["RecreateGroupOnFailure", "Never"]
    assert spec["frontend"]["default"] == {} and spec["restartPolicy"]["default"] == {}


def test_scale_and_status_subresources_and_printer_columns():
    version = yaml.safe_load(crd.render_yaml())["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Phase", "Model", "Endpoint", "Age"]


def test_every_default_is_defined_once_in_spec_py():
    """The schema's defaults are spec.DEFAULTS (what the operator falls back on), and each
    field's description names the same value."""
    from shoal.operator.spec import DEFAULTS, EngineSpec

    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    props = schema["properties"]["spec"]["properties"]
    for path, value in DEFAULTS.items():
        node = props
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]["properties"]
        assert node[leaf]["default"] == value, path
        assert f"Default: `{value}`" in node[leaf]["description"], path
    empty = EngineSpec.of({"spec": {"model": "/m"}})
    assert (empty.replicas, empty.shutdown_timeout_seconds, empty.restart.backoff_base_seconds,
            empty.served_model_name) == (DEFAULTS["replicas"], DEFAULTS["shutdown.timeoutSeconds"],
                                         DEFAULTS["restartPolicy.backoffBaseSeconds"], "/m")
