"""spec.model's forms as a table: the CRD's pattern and the operator's own reading agree on
every reference, and a pvc:// model is rendered as its claim mounted read-only (the other
sources' pods: test_op_model_volumes.py)."""

from __future__ import annotations

import re

import pytest
from shoal.operator import model_source, render
from shoal.operator.model_source import OCI_MOUNT_DIR, PVC_MOUNT_DIR
from shoal.operator.spec import parse
from shoal.operator.validation import spec_problems
from support.builders import engine

UNKNOWN = "unknown scheme"
MALFORMED = "is malformed"


@pytest.mark.parametrize(
    "model, arg, claim, problem",
    [
        ("/models/shoal-tiny", "/models/shoal-tiny", "", None),  # a path, as always
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "", None),  # a name
        ("name:tag", "name:tag", "", None),
        ("pvc://llm-weights/Qwen2.5-7B", f"{PVC_MOUNT_DIR}/Qwen2.5-7B", "llm-weights", None),
        ("pvc://w.team-a/org/model/v1", f"{PVC_MOUNT_DIR}/org/model/v1", "w.team-a", None),
        ("pvc://w/.hidden", f"{PVC_MOUNT_DIR}/.hidden", "w", None),
        ("hf://Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B", "", None),
        ("hf://Qwen/Qwen2.5-7B@v1.0", "Qwen/Qwen2.5-7B", "", None),
        ("hf://org/m@refs/pr/3", "org/m", "", None),
        ("hf://a.b-c_d/e.f", "a.b-c_d/e.f", "", None),
        ("oci://ghcr.io/org/model:1", OCI_MOUNT_DIR, "", None),
        ("oci://registry:5000/org/sub/model", OCI_MOUNT_DIR, "", None),
        ("oci://r.io/m@sha256:" + "a" * 64, OCI_MOUNT_DIR, "", None),
        ("hf://Qwen", None, None, MALFORMED),  # no NAME
        ("hf://org/name@", None, None, MALFORMED),
        ("hf://org/na me", None, None, MALFORMED),
        ("hf://org/name/extra", None, None, MALFORMED),
        ("hf://-org/name", None, None, MALFORMED),
        ("oci://GHCR.io/org/m", None, None, MALFORMED),  # uppercase registry
        ("oci://ghcr.io", None, None, MALFORMED),  # no repository
        ("oci://ghcr.io/m:", None, None, MALFORMED),
        ("oci://ghcr.io/m@sha256:abc", None, None, MALFORMED),
        ("s3://bucket/key", None, None, UNKNOWN),
        ("HTTPS://x/y", None, None, UNKNOWN),
        ("pvc://w", None, None, MALFORMED),  # no path
        ("pvc://w/", None, None, MALFORMED),
        ("pvc://Weights/m", None, None, MALFORMED),  # not a DNS name
        ("pvc://-w/m", None, None, MALFORMED),
        ("pvc://w/../etc", None, None, MALFORMED),  # out of the claim
        ("pvc://w/a/./b", None, None, MALFORMED),
        ("pvc://w/a//b", None, None, MALFORMED),
    ],
)
def test_model_references(model, arg, claim, problem):
    valid = problem is None
    assert bool(re.fullmatch(model_source.MODEL_PATTERN, model)) is valid, \
        "the CRD's pattern and the operator must agree"
    problems = model_source.problems(model)
    if valid:
        source = model_source.parse(model)
        assert (problems, source.arg, source.claim) == ([], arg, claim)
    else:
        (one,) = problems
        assert problem in one and repr(model) in one


def test_a_pvc_model_mounts_its_claim_read_only_and_starts_the_engine_inside_it():
    body = engine().ranks(2).set(model="pvc://llm-weights/Qwen2.5-7B",
                                 servedModelName="qwen").obj()
    ref, spec = parse(body)
    assert spec_problems("llm", spec) == []
    for pod in render.group_pods(ref, spec, 0):
        (c,) = pod["spec"]["containers"]
        assert c["args"][:2] == ["serve", f"{PVC_MOUNT_DIR}/Qwen2.5-7B"]
        assert {"name": "model", "mountPath": PVC_MOUNT_DIR, "readOnly": True} in c["volumeMounts"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "llm-weights",
                                                           "readOnly": True}} \
            in pod["spec"]["volumes"]
    (fc,) = render.frontend_deployment(ref, spec)["spec"]["template"]["spec"]["containers"]
    assert fc["args"][fc["args"].index("--model") + 1] == f"{PVC_MOUNT_DIR}/Qwen2.5-7B"


def test_sources_refuse_fields_they_do_not_use():
    both = engine().set(model="pvc://w/m").model_volume("/models", {"hostPath": {"path": "/m"}})
    assert spec_problems("llm", parse(both.obj())[1]) == [
        "spec.modelVolume must not be set with a pvc:// model: the operator mounts the "
        "model's volume itself"]
    hf_only = {"modelCache": {"hostPath": {"path": "/c"}}, "modelAuth": {"secretName": "t"},
               "hfEndpoint": "https://mirror"}
    for model in ("/models/x", "pvc://w/m", "oci://r.io/m:1"):
        got = spec_problems("llm", parse(engine().set(model=model, **hf_only).obj())[1])
        assert got == [f"spec.{k} is used only with an hf:// model (spec.model is {model!r})"
                       for k in hf_only]
    ok = engine().set(model="hf://org/m", **hf_only).obj()
    assert spec_problems("llm", parse(ok)[1]) == []


@pytest.mark.parametrize("cache, problem", [
    ({}, "spec.modelCache must name exactly one of persistentVolumeClaim.claimName or "
         "hostPath.path; found none"),
    ({"hostPath": {"path": "/c"}, "persistentVolumeClaim": {"claimName": "c"}},
     "spec.modelCache must name exactly one"),
    ({"persistentVolumeClaim": {}}, "spec.modelCache.persistentVolumeClaim.claimName is required"),
])
def test_a_model_cache_names_one_place(cache, problem):
    body = engine().set(model="hf://o/m", modelCache=cache).obj()
    (one,) = spec_problems("llm", parse(body)[1])
    assert one.startswith(problem)


def test_an_hf_model_is_served_under_its_repo_id_unless_named():
    unnamed = engine().set(servedModelName=None)
    assert parse(unnamed.set(model="hf://o/m@v2").obj())[1].served_model_name == "o/m"
    named = engine().set(model="hf://o/m", servedModelName="mine").obj()
    assert parse(named)[1].served_model_name == "mine"
    assert parse(unnamed.set(model="oci://r.io/m:1").obj())[1].served_model_name == \
        "oci://r.io/m:1"


def test_the_crd_refuses_what_the_operator_refuses():
    from shoal.operator import crd

    props = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    model = props["spec"]["properties"]["model"]
    assert model["pattern"] == model_source.MODEL_PATTERN
    assert "Any other `scheme://` or a malformed reference is refused at apply" in \
        model["description"]
