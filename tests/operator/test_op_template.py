"""Pod templates (spec.engine.template, spec.frontend.template) as tables: `template.merge` on
small pods (the exact pod it must produce), `template.problems` through spec validation (the
exact fields it names), and one template using every supported field rendered into real engine
and frontend pods, each field found there and the pods valid Kubernetes."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import kubernetes_validate
import pytest
from kubernetes_validate import utils
from packaging.version import Version
from shoal.operator import labels as L
from shoal.operator import render, template
from shoal.operator.spec import parse
from shoal.operator.validation import spec_problems
from support.builders import engine

# ---- merge: the pod the operator renders, a template, the exact pod that comes out ----------

ENGINE = {"name": "engine", "image": "shoal:test", "args": ["serve", "/m"],
          "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
          "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}
ANTI = {"labelSelector": {"matchLabels": {"shoal.dev/group": "0"}},
        "topologyKey": "kubernetes.io/hostname"}
BASE = {"metadata": {"name": "llm-g0-r0", "labels": {"shoal.dev/rank": "0"}},
        "spec": {"restartPolicy": "Never", "containers": [ENGINE],
                 "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                 "affinity": {"podAntiAffinity": {
                     "requiredDuringSchedulingIgnoredDuringExecution": [ANTI]}}}}


def base_with(**spec) -> dict:
    out = copy.deepcopy(BASE)
    out["spec"].update(spec)
    return out


def engine_with(**fields) -> dict:
    return {**copy.deepcopy(ENGINE), **fields}


@dataclass
class Merge:
    name: str
    template: dict | None
    want: dict


ZONE = {"topologyKey": "topology.kubernetes.io/zone", "labelSelector": {}}
NODE_AFFINITY = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}
SIDECAR = {"name": "shipper", "image": "fluent-bit:3.2"}

MERGES = [
    Merge("no template leaves the operator's pod as it is", None, BASE),
    Merge("an empty template too", {}, BASE),
    Merge("labels and annotations are added beside the operator's",
          {"metadata": {"labels": {"team": "a"}, "annotations": {"note": "x"}}},
          {**BASE, "metadata": {"name": "llm-g0-r0",
                                "labels": {"shoal.dev/rank": "0", "team": "a"},
                                "annotations": {"note": "x"}}}),
    Merge("the operator's label stays where the template sets it too",
          {"metadata": {"labels": {"shoal.dev/rank": "7"}}}, BASE),
    Merge("scheduling fields the operator does not set are taken as written",
          {"spec": {"nodeSelector": {"pool": "gpu"}, "priorityClassName": "high",
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}},
          base_with(nodeSelector={"pool": "gpu"}, priorityClassName="high",
                    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}])),
    Merge("anti-affinity terms are added to the operator's one-rank-per-node term",
          {"spec": {"affinity": {
              "nodeAffinity": NODE_AFFINITY,
              "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [ZONE]}}}},
          base_with(affinity={
              "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [ANTI, ZONE]},
              "nodeAffinity": NODE_AFFINITY})),
    Merge("the operator's container takes env, mounts and a security context, after its own",
          {"spec": {"containers": [{
              "name": "engine", "env": [{"name": "HF_HOME", "value": "/cache"}],
              "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
              "securityContext": {"runAsNonRoot": True}}]}},
          base_with(containers=[engine_with(
              env=ENGINE["env"] + [{"name": "HF_HOME", "value": "/cache"}],
              volumeMounts=ENGINE["volumeMounts"] + [{"name": "cache", "mountPath": "/cache"}],
              securityContext={"runAsNonRoot": True})])),
    Merge("a container of another name is a sidecar after the operator's",
          {"spec": {"containers": [SIDECAR], "initContainers": [SIDECAR]}},
          base_with(containers=[ENGINE, SIDECAR], initContainers=[SIDECAR])),
    Merge("volumes merge by name: a new one is added, the operator's own stays",
          {"spec": {"volumes": [{"name": "dshm", "hostPath": {"path": "/x"}},
                                {"name": "cache", "emptyDir": {}}]}},
          base_with(volumes=BASE["spec"]["volumes"] + [{"name": "cache", "emptyDir": {}}])),
    Merge("a variable or mount path the operator sets stays the operator's",
          {"spec": {"containers": [{"name": "engine",
                                    "env": [{"name": "POD_NAME", "value": "x"}],
                                    "volumeMounts": [{"name": "c", "mountPath": "/dev/shm"}]}]}},
          BASE),
    Merge("an owned scalar stays the operator's (problems() names it)",
          {"spec": {"restartPolicy": "Always",
                    "containers": [{"name": "engine", "args": ["serve", "/other"]}]}},
          BASE),
]


@pytest.mark.parametrize("case", MERGES, ids=lambda c: c.name)
def test_merge(case):
    before = copy.deepcopy(case.template)
    assert template.merge(copy.deepcopy(BASE), case.template) == case.want
    assert case.template == before, "the template is not modified"


# ---- problems: every field a template may not set, named with its path ----------------------


@dataclass
class Refused:
    name: str
    engine: dict | None = None  # spec.engine.template
    frontend: dict | None = None  # spec.frontend.template
    want: tuple[str, ...] = ()  # the exact problems, in order


def container(name: str = "engine", **fields) -> dict:
    return {"spec": {"containers": [{"name": name, **fields}]}}


ET, FT = "spec.engine.template", "spec.frontend.template"
REFUSED = [
    Refused("a template of supported fields is valid",
            engine={"metadata": {"labels": {"team": "a"}},
                    "spec": {"nodeSelector": {"pool": "gpu"}, "serviceAccountName": "inference",
                             "containers": [{"name": "engine", "env": [{"name": "A"}]}]}},
            frontend={"spec": {"tolerations": [{"operator": "Exists"}]}}),
    Refused("the engine's command line is the operator's",
            engine=container(command=["python"], args=["-m", "x"]),
            want=(f"{ET}.spec.containers[engine].command is set by the operator: "
                  + template.OWNED_CONTAINER["command"],
                  f"{ET}.spec.containers[engine].args is set by the operator: "
                  + template.OWNED_CONTAINER["args"])),
    Refused("ports, probes and the termination message are the operator's",
            engine=container(ports=[{"containerPort": 9000}], livenessProbe={},
                             terminationMessagePath="/tmp/x"),
            want=tuple(f"{ET}.spec.containers[engine].{k} is set by the operator: "
                       + template.OWNED_CONTAINER[k]
                       for k in ("ports", "livenessProbe", "terminationMessagePath"))),
    Refused("image and resources have their own spec fields",
            engine=container(image="other", resources={}),
            want=tuple(f"{ET}.spec.containers[engine].{k} is set by the operator: "
                       + template.OWNED_CONTAINER[k] for k in ("image", "resources"))),
    Refused("the operator's env, its mounts (the model's too) and its volumes",
            engine={"spec": {"volumes": [{"name": "model", "emptyDir": {}}],
                             "containers": [{"name": "engine",
                                             "env": [{"name": "POD_NAME", "value": "x"},
                                                     {"name": "NCCL_DEBUG", "value": "x"}],
                                             "volumeMounts": [{"name": "x",
                                                               "mountPath": "/weights"}]}]}},
            want=(f"{ET}.spec.volumes[model] is a volume of the operator's",
                  f"{ET}.spec.containers[engine].env[POD_NAME] is a variable the operator (or "
                  "spec.engine.env) sets",
                  f"{ET}.spec.containers[engine].env[NCCL_DEBUG] is a variable the operator (or "
                  "spec.engine.env) sets",
                  f"{ET}.spec.containers[engine].volumeMounts[/weights] is a mount of the "
                  "operator's")),
    Refused("rank labels, any shoal.dev/ key, and the pod's name",
            engine={"metadata": {"name": "x", "labels": {"shoal.dev/rank": "1"},
                                 "annotations": {"shoal.dev/anything": "y"}}},
            want=(f"{ET}.metadata.name is set by the operator: only labels and annotations may "
                  "be added",
                  f"{ET}.metadata.labels[shoal.dev/rank] is set by the operator (the shoal.dev/ "
                  "keys are its own)",
                  f"{ET}.metadata.annotations[shoal.dev/anything] is set by the operator (the "
                  "shoal.dev/ keys are its own)")),
    Refused("pod fields the operator owns, and one no template supports",
            engine={"spec": {"restartPolicy": "Always", "terminationGracePeriodSeconds": 1,
                             "hostNetwork": True}},
            want=(f"{ET}.spec.restartPolicy is set by the operator: "
                  + template.OWNED_POD["restartPolicy"],
                  f"{ET}.spec.terminationGracePeriodSeconds is set by the operator: "
                  + template.OWNED_POD["terminationGracePeriodSeconds"],
                  f"{ET}.spec.hostNetwork is not supported in a template (supported: "
                  + ", ".join(template.POD_FIELDS) + ")")),
    Refused("a sidecar may not take the engine's port; container names are unique",
            engine={"spec": {"containers": [{"name": "s", "image": "x",
                                             "ports": [{"containerPort": 8000}]}],
                             "initContainers": [{"name": "s", "image": "x"}]}},
            want=(f"{ET}.spec: container name 's' is used twice",
                  f"{ET}.spec.containers[s].ports: 8000 is a port of the engine container")),
    Refused("the frontends' ServiceAccount and discovery volume are the operator's",
            frontend={"spec": {"serviceAccountName": "mine",
                               "volumes": [{"name": "discovery", "emptyDir": {}}],
                               "containers": [{"name": "frontend", "args": []}]}},
            want=(f"{FT}.spec.serviceAccountName is set by the operator: "
                  + template.FRONTEND_OWNED_POD["serviceAccountName"],
                  f"{FT}.spec.volumes[discovery] is a volume of the operator's",
                  f"{FT}.spec.containers[frontend].args is set by the operator: "
                  + template.OWNED_CONTAINER["args"])),
    Refused("a container needs its name", engine={"spec": {"containers": [{"image": "x"}]}},
            want=(f"{ET}.spec.containers[0] needs a name (containers merge by name)",)),
]


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.name)
def test_problems(case):
    body = engine().ranks(2).model_volume("/weights", {"hostPath": {"path": "/w"}})
    body = body.engine(env=[{"name": "NCCL_DEBUG", "value": "INFO"}], template=case.engine)
    body = body.frontend(template=case.frontend).obj()
    assert spec_problems("llm", parse(body)[1]) == list(case.want)


# ---- every supported field, rendered: nothing the user wrote is dropped ----------------------

EVERY = {
    "metadata": {"labels": {"team": "search"}, "annotations": {"example.com/owner": "ml"}},
    "spec": {
        "nodeSelector": {"pool": "gpu-h100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": NODE_AFFINITY,
                     "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                         {"weight": 10, "podAffinityTerm": ZONE}]}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": {"team": "search"}}}],
        "priorityClassName": "inference-high",
        "runtimeClassName": "nvidia",
        "schedulerName": "volcano",
        "imagePullSecrets": [{"name": "registry-creds"}],
        "serviceAccountName": "inference",
        "securityContext": {"runAsNonRoot": True, "fsGroup": 10001},
        "volumes": [{"name": "cache", "emptyDir": {}}],
        "initContainers": [{"name": "warm", "image": "busybox:1.36", "command": ["true"]}],
        "containers": [
            {"name": "MAIN", "env": [{"name": "HF_HOME", "value": "/cache"}],
             "envFrom": [{"secretRef": {"name": "hf-token"}}],
             "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
             "securityContext": {"allowPrivilegeEscalation": False}},
            {"name": "shipper", "image": "fluent/fluent-bit:3.2"},
        ],
    },
}


def every(main: str, frontend: bool = False) -> dict:
    out = copy.deepcopy(EVERY)
    out["spec"]["containers"][0]["name"] = main
    if frontend:
        del out["spec"]["serviceAccountName"]  # the frontends' is the operator's
    return out


def _found(written, rendered, path: str) -> list[str]:
    """Every leaf of `written` at the same place in `rendered` (list items matched by value or
    by name, since the operator's own come first); the paths of those not found."""
    if isinstance(written, dict):
        if not isinstance(rendered, dict):
            return [path]
        return [p for k, v in written.items() for p in _found(v, rendered.get(k), f"{path}.{k}")]
    if isinstance(written, list):
        out = []
        for i, item in enumerate(written):
            named = isinstance(item, dict) and "name" in item
            match = [r for r in rendered or [] if (r.get("name") == item["name"] if named
                                                   else r == item)]
            out += _found(item, match[0], f"{path}[{i}]") if match else [f"{path}[{i}]"]
        return out
    return [] if written == rendered else [path]


def _kube_problems(obj: dict) -> list[str]:
    versions = sorted({v for v in utils.all_versions() if Version(v) >= Version("1.27")},
                      key=Version)
    out = []
    for v in versions:
        try:
            kubernetes_validate.validate(obj, v, strict=True)
        except utils.ValidationError as e:
            out.append(f"{obj['kind']} against {v}: {'.'.join(map(str, e.path))}: {e.message}")
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_every_supported_field_reaches_the_engine_pods(rank):
    body = engine().ranks(2).engine(template=every(L.ENGINE_CONTAINER)).obj()
    ref, spec = parse(body)
    assert spec_problems("llm", spec) == []
    pod = render.engine_pod(ref, spec, 0, rank)
    assert _found(every(L.ENGINE_CONTAINER), pod, "pod") == []
    # The operator's own parts are all still there (its one-rank-per-node term among them).
    assert _found(render.operator_pod(ref, spec, 0, rank), pod, "pod") == []
    assert "requiredDuringSchedulingIgnoredDuringExecution" in pod["spec"]["affinity"][
        "podAntiAffinity"]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["engine", "shipper"]
    assert _kube_problems(pod) == []


def test_every_supported_field_reaches_the_frontend_pods():
    body = engine().frontend(template=every(L.FRONTEND_CONTAINER, frontend=True)).obj()
    ref, spec = parse(body)
    assert spec_problems("llm", spec) == []
    dep = render.frontend_deployment(ref, spec)
    pod = dep["spec"]["template"]
    assert _found(every(L.FRONTEND_CONTAINER, frontend=True), pod, "template") == []
    assert _found(render.frontend_operator_template(ref, spec), pod, "template") == []
    assert pod["spec"]["serviceAccountName"] == L.frontend_name("llm")
    assert _kube_problems(dep) == []


def test_every_supported_field_is_documented_in_the_crd():
    from shoal.operator import crd

    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for part in ("engine", "frontend"):
        tmpl = spec["properties"][part]["properties"]["template"]
        assert set(tmpl["properties"]["spec"]["properties"]) == set(template.POD_FIELDS)
        assert set(tmpl["properties"]["metadata"]["properties"]) == {"labels", "annotations"}
        # Kept, never pruned: the operator sees every field a user wrote, and names it.
        assert tmpl["x-kubernetes-preserve-unknown-fields"] is True
        assert tmpl["properties"]["spec"]["x-kubernetes-preserve-unknown-fields"] is True
        for owned, why in {**template.OWNED_POD, **template.OWNED_CONTAINER}.items():
            assert f"`{owned}` ({why})" in str(tmpl), (part, owned)


def test_the_template_is_part_of_the_engine_revision_and_the_frontend_hash():
    plain = engine().obj()
    placed = engine().engine(template={"spec": {"nodeSelector": {"pool": "gpu"}}}).obj()
    assert parse(plain)[1].revision != parse(placed)[1].revision, "a template change rolls groups"
    fronted = engine().frontend(template={"spec": {"nodeSelector": {"pool": "cpu"}}}).obj()
    assert parse(plain)[1].revision == parse(fronted)[1].revision
    hashes = [render.frontend_deployment(*parse(b))["metadata"]["annotations"][
        L.ANNOTATION_SPEC_HASH] for b in (plain, fronted)]
    assert hashes[0] != hashes[1], "a frontend template change rewrites the Deployment"


@pytest.mark.parametrize(
    "have, want, patch",
    [
        ({"metadata": {"labels": {"a": "1"}}, "spec": {"nodeSelector": {"p": "g"}}},
         {"metadata": {"labels": {"a": "1"}}, "spec": {}},
         {"metadata": {"labels": {"a": "1"}}, "spec": {"nodeSelector": None}}),
        ({"metadata": {"labels": {"a": "1", "team": "x"}, "annotations": {"n": "y"}},
          "spec": {"tolerations": [], "schedulerName": "default-scheduler", "dnsPolicy": "C"}},
         {"metadata": {"labels": {"a": "1"}}, "spec": {"priorityClassName": "high"}},
         {"metadata": {"labels": {"a": "1", "team": None}, "annotations": {"n": None}},
          "spec": {"priorityClassName": "high", "tolerations": None, "schedulerName": None}}),
        ({}, {"metadata": {"labels": {"a": "1"}}, "spec": {"volumes": []}},
         {"metadata": {"labels": {"a": "1"}}, "spec": {"volumes": []}}),
    ],
    ids=["a field taken out of the template is nulled",
         "labels, annotations and supported fields only (dnsPolicy is the server's)",
         "nothing to remove from a new Deployment"],
)
def test_a_frontend_patch_removes_what_the_template_no_longer_sets(have, want, patch):
    assert template.with_removals(have, want) == patch
