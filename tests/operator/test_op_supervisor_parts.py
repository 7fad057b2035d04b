"""Shoal's supervisor injected into stock vLLM engine pods (supervisor_parts.py), pure tables:
which pods get it, what it adds, in which order, and what a template may not name."""

from __future__ import annotations

import kubernetes_validate
import pytest
from kubernetes_validate import utils
from packaging.version import Version
from shoal.contract import model_fetch as mf
from shoal.contract import supervisor as sv
from shoal.operator import labels as L
from shoal.operator import render
from shoal.operator.model_volumes import FETCH_RESOURCES, OCI_COPY_CONTAINER
from shoal.operator.settings import OperatorSettings
from shoal.operator.spec import ROUTER_IMAGE, parse
from shoal.operator.supervisor_parts import INSTALL_RESOURCES
from shoal.operator.validation import spec_problems
from support.builders import engine

VLLM = {"runtime": "VLLM", "image": "vllm/vllm-openai:v0.32.0"}
COPY = OperatorSettings(image_volumes=False)
IMAGE_VOLUMES = OperatorSettings(image_volumes=True)


def _pod(body: dict, opts: OperatorSettings | None = None, rank: int = 0) -> dict:
    ref, spec = parse(body, opts)
    assert spec_problems(ref.name, spec) == []
    return render.engine_pod(ref, spec, 0, rank)


def _engine(pod: dict) -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == L.ENGINE_CONTAINER)


def _inits(pod: dict) -> list[str]:
    return [c["name"] for c in pod["spec"].get("initContainers") or []]


def _init(pod: dict, name: str) -> dict:
    return next(c for c in pod["spec"]["initContainers"] if c["name"] == name)


# (runtime fields, model, settings, rank) -> the init containers, in order. The supervisor's
# install runs first: a router image without the bundle fails before a download or a pull.
ORDER = [
    (VLLM, "/models/tiny", None, 0, [sv.INIT_CONTAINER]),
    (VLLM, "hf://Org/M@v1", None, 0, [sv.INIT_CONTAINER, mf.FETCH_CONTAINER]),
    (VLLM, "oci://reg.local/models/m:1", COPY, 0, [sv.INIT_CONTAINER, OCI_COPY_CONTAINER]),
    (VLLM, "oci://reg.local/models/m:1", IMAGE_VOLUMES, 0, [sv.INIT_CONTAINER]),
    (VLLM, "pvc://claim/m", None, 0, [sv.INIT_CONTAINER]),
    ({"runtime": "Shoal"}, "/models/tiny", None, 0, []),
    ({"runtime": "Shoal"}, "hf://Org/M@v1", None, 0, [mf.FETCH_CONTAINER]),
    ({"runtime": "Shoal"}, "oci://reg.local/models/m:1", COPY, 0, [OCI_COPY_CONTAINER]),
]


@pytest.mark.parametrize("fields, model, opts, rank, inits", ORDER)
def test_only_stock_vllm_pods_get_the_supervisor_and_it_installs_first(fields, model, opts,
                                                                       rank, inits):
    body = engine().set(model=model, servedModelName="m", **fields).obj()
    pod = _pod(body, opts, rank)
    assert _inits(pod) == inits
    supervised = fields["runtime"] == "VLLM"
    volumes = [v["name"] for v in pod["spec"]["volumes"]]
    mounts = {m["mountPath"]: m for m in _engine(pod)["volumeMounts"]}
    assert (sv.VOLUME in volumes) is supervised
    assert (sv.MOUNT in mounts) is supervised
    if supervised:
        assert {"name": sv.VOLUME, "emptyDir": {}} in pod["spec"]["volumes"]
        assert mounts[sv.MOUNT] == {"name": sv.VOLUME, "mountPath": sv.MOUNT, "readOnly": True}
        assert _engine(pod)["command"] == sv.command(["vllm"])
    else:  # Shoal's image keeps its entrypoint (tini -> shoal): it writes its own message
        assert "command" not in _engine(pod)


@pytest.mark.parametrize("nodes, rank", [(2, 0), (2, 1), (4, 3)])
def test_every_rank_of_a_multi_node_group_runs_under_the_supervisor(nodes, rank):
    body = engine().ranks(nodes, tp=nodes).set(**VLLM).obj()
    pod = _pod(body, rank=rank)
    assert _inits(pod) == [sv.INIT_CONTAINER]
    c = _engine(pod)
    # The supervisor, then vLLM's own command line (`serve MODEL ...`, as before).
    assert c["command"] + c["args"][:2] == [sv.PYTHON, sv.bundle_path(), sv.SEPARATOR,
                                            "vllm", "serve", "/models/tiny"]
    assert ("--headless" in c["args"]) is (rank > 0)


@pytest.mark.parametrize("opts, image", [
    (None, ROUTER_IMAGE),
    (OperatorSettings(fetch_image="reg.local/shoal-router:dev"), "reg.local/shoal-router:dev"),
])
@pytest.mark.parametrize("policy", ["IfNotPresent", "Always", "Never"])
def test_the_install_runs_the_model_fetch_image_and_pull_policy(opts, image, policy):
    """One setting (SHOAL_FETCH_IMAGE) names the Shoal router image of both init containers."""
    body = engine().set(model="hf://Org/M@v1", imagePullPolicy=policy, **VLLM).obj()
    pod = _pod(body, opts)
    install, fetch = _init(pod, sv.INIT_CONTAINER), _init(pod, mf.FETCH_CONTAINER)
    assert install["image"] == fetch["image"] == image
    assert install["imagePullPolicy"] == fetch["imagePullPolicy"] == policy


def test_the_install_is_a_small_copy_into_the_volume_the_engine_reads():
    pod = _pod(engine().set(**VLLM).obj())
    install, c = _init(pod, sv.INIT_CONTAINER), _engine(pod)
    assert install["command"] == ["cp", sv.BUNDLE_IN_IMAGE, sv.bundle_path()]
    assert install["volumeMounts"] == [{"name": sv.VOLUME, "mountPath": sv.MOUNT}]
    # What the init container writes is what the engine's command runs.
    assert install["command"][-1] == c["command"][1]
    assert c["command"][1].startswith(sv.MOUNT + "/")
    # Smaller than the model fetch's, which already is small beside an engine.
    assert install["resources"] == INSTALL_RESOURCES
    assert _mib(INSTALL_RESOURCES["limits"]["memory"]) < _mib(FETCH_RESOURCES["limits"]["memory"])
    assert "env" not in install  # it needs nothing: no token, no endpoint
    # A failed copy's message is cp's own line, read like any init container's.
    assert install["terminationMessagePolicy"] == "FallbackToLogsOnError"


def _mib(q: str) -> int:
    return int(q[:-2]) * (1024 if q.endswith("Gi") else 1)


# A template that names the operator's parts is refused, the field named.
REFUSED = [
    ({"initContainers": [{"name": sv.INIT_CONTAINER, "image": "x"}]},
     f"spec.engine.template.spec.initContainers[{sv.INIT_CONTAINER}] is set by the operator: "
     "it installs Shoal's supervisor"),
    ({"containers": [{"name": sv.INIT_CONTAINER, "image": "x"}]},
     f"spec.engine.template.spec.containers[{sv.INIT_CONTAINER}] is set by the operator"),
    ({"volumes": [{"name": sv.VOLUME, "emptyDir": {}}]},
     f"spec.engine.template.spec.volumes[{sv.VOLUME}] is a volume of the operator's"),
    ({"containers": [{"name": "engine", "volumeMounts": [{"name": "x",
                                                          "mountPath": sv.MOUNT}]}]},
     f"spec.engine.template.spec.containers[engine].volumeMounts[{sv.MOUNT}] is a mount of "
     "the operator's"),
    ({"containers": [{"name": "engine", "command": ["vllm"]}]},
     "spec.engine.template.spec.containers[engine].command is set by the operator: "
     "spec.runtime picks it"),
]


@pytest.mark.parametrize("template, problem", REFUSED)
def test_a_template_may_not_name_the_supervisors_parts(template, problem):
    ref, spec = parse(engine().set(**VLLM).engine(template={"spec": template}).obj())
    problems = spec_problems(ref.name, spec)
    assert any(p.startswith(problem) for p in problems), problems


@pytest.mark.parametrize("template", [t for t, _ in REFUSED[:4]])
def test_shoals_own_runtime_leaves_those_names_to_the_template(template):
    ref, spec = parse(engine().engine(template={"spec": template}).obj())
    assert spec_problems(ref.name, spec) == []


def test_a_templates_init_containers_run_after_the_operators():
    warm = {"name": "warm", "image": "busybox"}
    body = engine().set(model="hf://o/m", **VLLM).engine(
        template={"spec": {"initContainers": [warm]}})
    assert _inits(_pod(body.obj())) == [sv.INIT_CONTAINER, mf.FETCH_CONTAINER, "warm"]


@pytest.mark.parametrize("model, opts", [("hf://Org/M@v1", None),
                                         ("oci://reg.local/models/m:1", COPY)])
def test_a_supervised_pod_is_a_valid_pod_for_kubernetes(model, opts):
    """Schema-checked as the API server of every release from 1.27 would (names, fields, the
    volume's mounts in both containers)."""
    pod = _pod(engine().ranks(2).set(model=model, servedModelName="m", **VLLM).obj(), opts, 1)
    names = {v["name"] for v in pod["spec"]["volumes"]}
    for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
        assert {m["name"] for m in c.get("volumeMounts") or []} <= names, c["name"]
    versions = sorted({v for v in utils.all_versions() if Version(v) >= Version("1.27")},
                      key=Version)
    for v in versions:
        kubernetes_validate.validate(pod, v, strict=True)
