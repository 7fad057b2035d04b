"""spec.model's forms as a table: the CRD's pattern and the operator's own reading agree on
every reference, and a pvc:// model is rendered as its claim mounted read-only."""

from __future__ import annotations

import re

import pytest
from shoal.operator import model_source, render
from shoal.operator.model_source import PVC_MOUNT_DIR
from shoal.operator.spec import parse
from shoal.operator.validation import spec_problems
from support.builders import engine

NOT_YET = "is not implemented yet"
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
        ("hf://Qwen/Qwen2.5-7B", None, None, NOT_YET),
        ("oci://ghcr.io/org/model:1", None, None, NOT_YET),
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


def test_a_pvc_model_takes_no_model_volume_and_other_schemes_are_refused():
    both = engine().set(model="pvc://w/m").model_volume("/models", {"hostPath": {"path": "/m"}})
    assert spec_problems("llm", parse(both.obj())[1]) == [
        "spec.modelVolume must not be set with a pvc:// model: the claim is mounted as the "
        "model volume"]
    (hf,) = spec_problems("llm", parse(engine().set(model="hf://org/name").obj())[1])
    assert hf.startswith("spec.model 'hf://org/name': hf:// is not implemented yet")


def test_the_crd_refuses_what_the_operator_refuses():
    from shoal.operator import crd

    props = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    model = props["spec"]["properties"]["model"]
    assert model["pattern"] == model_source.MODEL_PATTERN
    assert "`hf://`, `oci://` are not implemented yet" in model["description"]
