"""A child the API server refuses is SpecValid=False naming the spec field (refusals.py), as a
table: a spec, the rendered child the server refused, the field and words of the server's
Status (as a 1.20 server wrote them for the fuzzed specs of test_op_fuzz_k8s.py), and the spec
field the problem must name. Then the applier: a refusal stops the pass's writes and comes back
as problems, never as an exception; anything else still raises."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from kubernetes.client.exceptions import ApiException
from shoal.operator import refusals, render
from shoal.operator.actions import ApplyChildren, CreatePods, WriteDiscovery
from shoal.operator.apply import Applier
from shoal.operator.spec import parse
from support.builders import engine

SIDECAR = {"name": "shipper", "image": "fluent-bit:3.2"}
TEMPLATE = {"metadata": {"labels": {"team": "search"}},
            "spec": {"containers": [{"name": "engine", "env": [{"name": "HF_HOME",
                                                                 "value": "/c"}],
                                     "volumeMounts": [{"name": "cache", "mountPath": "/c"}]},
                                    SIDECAR],
                     "initContainers": [{"name": "warm", "image": "busybox"}],
                     "volumes": [{"name": "cache", "emptyDir": {}}]}}
SPEC = (engine("llm", "ns").engine(env=[{"name": "1X", "value": "v"}], template=TEMPLATE,
                                   resources={"limits": {"cpu": "1"}})
        .frontend(template={"metadata": {"labels": {"team": "a b"}}}))


def status(field: str | None, message: str, code: int = 422, reason: str = "Invalid") -> str:
    causes = [{"reason": "FieldValueInvalid", "message": message, "field": field}] if field else []
    return json.dumps({"kind": "Status", "status": "Failure", "reason": reason, "code": code,
                       "message": f"refused: {message}", "details": {"causes": causes}})


@dataclass
class Refusal:
    name: str
    child: str  # "pod", "deployment", "service"
    field: str | None  # the server's field in the child
    want: str  # the spec field the problem names
    code: int = 422
    message: str = "Invalid value"
    builder: object = SPEC


def _child(case: Refusal) -> dict:
    ref, spec = parse(case.builder.obj())
    if case.child == "pod":
        return render.group_pods(ref, spec, 0)[0]
    if case.child == "deployment":
        return render.frontend_deployment(ref, spec)
    return render.ranks_service(ref, spec)


HF = engine("llm", "ns").set(model="hf://org/m", modelAuth={"secretName": "tok", "key": "k"})
CASES = [
    Refusal("a variable of spec.engine.env is named by its name", "pod",
            "spec.containers[0].env[4].name", "spec.engine.env[1X].name"),
    Refusal("a variable the template adds to the engine container is the template's", "pod",
            "spec.containers[0].env[5].valueFrom",
            "spec.engine.template.spec.containers[engine].env[HF_HOME].valueFrom"),
    Refusal("a resource quantity is spec.engine.resources", "pod",
            "spec.containers[0].resources.limits[cpu]", "spec.engine.resources.limits[cpu]"),
    Refusal("the engine image is spec.image", "pod", "spec.containers[0].image", "spec.image"),
    Refusal("a sidecar's field is the template's container, by name", "pod",
            "spec.containers[1].image", "spec.engine.template.spec.containers[shipper].image"),
    Refusal("a template's init container, by name", "pod", "spec.initContainers[0].name",
            "spec.engine.template.spec.initContainers[warm].name"),
    Refusal("a template's volume, by name", "pod", "spec.volumes[1].emptyDir",
            "spec.engine.template.spec.volumes[cache].emptyDir"),
    Refusal("a mount of the engine container the template adds", "pod",
            "spec.containers[0].volumeMounts[1].name",
            "spec.engine.template.spec.containers[engine].volumeMounts[/c].name"),
    Refusal("a pod label is the template's labels", "pod", "metadata.labels",
            "spec.engine.template.metadata.labels"),
    Refusal("a pod field the template sets", "pod", "spec.tolerations[0].key",
            "spec.engine.template.spec.tolerations[0].key"),
    Refusal("the hostname is the resource's name", "pod", "spec.hostname", "metadata.name"),
    Refusal("the Deployment's template labels are the frontend template's", "deployment",
            "spec.template.labels", "spec.frontend.template.metadata.labels"),
    Refusal("the frontend container's resources", "deployment",
            "spec.template.spec.containers[0].resources.requests",
            "spec.frontend.resources.requests"),
    Refusal("the token's Secret name in model-fetch is spec.modelAuth.secretName", "pod",
            "spec.initContainers[0].env[2].valueFrom.secretKeyRef.name",
            "spec.modelAuth.secretName", builder=HF),
    Refusal("a Service's port is spec.masterPort", "service", "spec.ports[1].port",
            "spec.masterPort"),
    Refusal("a Service's name is the resource's", "service", "metadata.name", "metadata.name"),
    Refusal("a PriorityClass admission does not find: the template's priorityClassName", "pod",
            None, "spec.engine.template.spec.priorityClassName", code=403,
            message='pods "llm-g0-r0" is forbidden: no PriorityClass with name x was found'),
    Refusal("a RuntimeClass admission does not find: the template's runtimeClassName", "pod",
            None, "spec.engine.template.spec.runtimeClassName", code=403,
            message='pod rejected: RuntimeClass "x" not found'),
    Refusal("a refusal without a field names the part of the spec the pod comes from", "pod",
            None, "spec.engine", code=400, message="v1.Pod.Spec: ReadString: expects \""),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_refused_child_names_the_spec_field_it_came_from(case):
    child = _child(case)
    _, spec = parse(case.builder.obj())
    problems = refusals.problems(child, case.code, status(case.field, case.message, case.code),
                                 spec)
    assert len(problems) == 1
    assert problems[0].startswith(f"{case.want}: the API server refused "
                                  f"{child['kind']} {child['metadata']['name']}")
    assert case.message in problems[0]


def test_huge_values_are_cut_in_the_message():
    child = _child(CASES[0])
    _, spec = parse(SPEC.obj())
    [problem] = refusals.problems(child, 422, status("metadata.labels", "x" * 100_000), spec)
    assert len(problem) < 1000


class RefusingKube:
    """Creating an object of `kind` fails with `code` and `body`; everything else succeeds."""

    def __init__(self, kind: str, code: int, body: str = "{}"):
        self.kind, self.code, self.body, self.created = kind, code, body, []

    def get(self, *args):
        return None

    def resources(self, gv):
        return set()

    def create(self, obj):
        if obj["kind"] == self.kind:
            raise _error(self.code, self.body)
        self.created.append(obj["kind"])
        return obj


def _error(code: int, body: str) -> ApiException:
    e = ApiException(status=code, reason="refused")
    e.body = body
    return e


def _apply(kube) -> list[str]:
    ref, spec = parse(SPEC.obj())
    actions = (ApplyChildren(()), CreatePods(0, (0,)), WriteDiscovery(()))
    return Applier(kube, pdb_api_version=None).apply(ref, spec, actions)


@pytest.mark.parametrize("code", [400, 403, 422])
def test_the_applier_reports_a_refusal_and_writes_nothing_after_it(code):
    kube = RefusingKube("Deployment", code, status("spec.template.labels", "Invalid value", code))
    problems = _apply(kube)
    assert problems and problems[0].startswith("spec.frontend.template.metadata.labels: ")
    assert "Deployment" not in kube.created and "Pod" not in kube.created
    assert kube.created == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service"]


def test_other_api_errors_still_raise():
    with pytest.raises(ApiException):
        _apply(RefusingKube("Pod", 500, "{}"))


def test_a_pass_without_refusal_returns_no_problem():
    kube = RefusingKube("Nothing", 422)
    assert _apply(kube) == [] and "Pod" in kube.created
