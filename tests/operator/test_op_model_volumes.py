"""Every model source x model cache x runtime rendered into engine pods (model_volumes.py):
which volumes, init containers, mounts, environment and command line each pod gets."""

from __future__ import annotations

import pytest
from shoal.contract import model_fetch as mf
from shoal.contract import supervisor as sv
from shoal.operator import render, settings
from shoal.operator.model_source import OCI_MOUNT_DIR, PVC_MOUNT_DIR
from shoal.operator.model_volumes import FETCH_RESOURCES
from shoal.operator.settings import OperatorSettings
from shoal.operator.spec import ROUTER_IMAGE, parse
from shoal.operator.validation import spec_problems
from support.builders import engine

PVC_CACHE = {"persistentVolumeClaim": {"claimName": "models"}}
HOST_CACHE = {"hostPath": {"path": "/var/cache/m"}}
CACHE_VOLUMES = {
    None: {"name": mf.CACHE_VOLUME, "emptyDir": {}},
    "pvc": {"name": mf.CACHE_VOLUME, "persistentVolumeClaim": {"claimName": "models"}},
    "host": {"name": mf.CACHE_VOLUME, "hostPath": {"path": "/var/cache/m",
                                                    "type": "DirectoryOrCreate"}},
}
CACHES = {None: None, "pvc": PVC_CACHE, "host": HOST_CACHE}
HOST_MODEL = {"hostPath": {"path": "/srv/m"}}


def _pods(body, opts: OperatorSettings | None = None):
    ref, spec = parse(body, opts)
    assert spec_problems(ref.name, spec) == []
    return render.group_pods(ref, spec, 0)


def _engine(pod):
    (c,) = pod["spec"]["containers"]
    return c


def _env(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


def _model_inits(pod):
    """The init containers besides the supervisor's (runtime VLLM: test_op_supervisor_parts)."""
    return [c for c in pod["spec"].get("initContainers") or [] if c["name"] != sv.INIT_CONTAINER]


def _model_parts(pod):
    """(volumes, init container names, engine mounts) besides /dev/shm and the supervisor's."""
    vols = [v for v in pod["spec"]["volumes"] if v["name"] not in ("dshm", sv.VOLUME)]
    inits = [c["name"] for c in _model_inits(pod)]
    mounts = [m for m in _engine(pod)["volumeMounts"] if m["name"] not in ("dshm", sv.VOLUME)]
    return vols, inits, mounts


@pytest.mark.parametrize("runtime", ["Shoal", "VLLM"])
@pytest.mark.parametrize("cache", [None, "pvc", "host"])
def test_hf_fetches_into_the_cache_and_serves_offline_from_it(runtime, cache):
    body = (engine().ranks(2).set(model="hf://Org/Model-7B@v1.2", runtime=runtime,
                                  runtimeVersion="0.32.0", modelCache=CACHES[cache],
                                  modelAuth={"secretName": "hf-token"},
                                  hfEndpoint="http://hub.mirror:8080", servedModelName=None)
            .obj())
    pods = _pods(body)
    assert len(pods) == 2
    for pod in pods:  # every rank fetches (the cache's lock makes the others wait)
        vols, inits, mounts = _model_parts(pod)
        assert vols == [CACHE_VOLUMES[cache]] and inits == [mf.FETCH_CONTAINER]
        assert mounts == [{"name": mf.CACHE_VOLUME, "mountPath": mf.CACHE_MOUNT,
                           "readOnly": True}]
        (fetch,) = _model_inits(pod)
        assert fetch["command"] == ["shoal", "fetch", "hf://Org/Model-7B@v1.2", "--cache-dir",
                                    mf.CACHE_DIR]
        assert fetch["image"] == ROUTER_IMAGE and fetch["resources"] == FETCH_RESOURCES
        assert fetch["volumeMounts"] == [{"name": mf.CACHE_VOLUME, "mountPath": mf.CACHE_MOUNT}]
        assert fetch["terminationMessagePath"] == "/dev/termination-log"
        assert _env(fetch) == {
            mf.TOKEN_ENV: {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}},
            mf.ENDPOINT_ENV: "http://hub.mirror:8080"}
        c = _engine(pod)
        assert c["args"][:7] == ["serve", "Org/Model-7B", "--revision", "v1.2", "--download-dir",
                                 mf.CACHE_DIR, "--served-model-name"]
        assert c["args"][7] == "Org/Model-7B"
        assert c["args"][0:1] == ["serve"] and (c.get("command") == sv.command(["vllm"])) == (
            runtime == "VLLM")
        env = _env(c)
        assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HUB_CACHE"] == mf.CACHE_DIR
        assert mf.TOKEN_ENV not in env, "the token stays in the fetch container"


def test_hf_defaults_public_main_and_the_operators_fetch_image():
    body = engine().set(model="hf://o/m").obj()
    (pod,) = _pods(body, OperatorSettings(fetch_image="reg.local/fetch:1"))
    (fetch,) = pod["spec"]["initContainers"]
    assert fetch["image"] == "reg.local/fetch:1" and fetch["env"] == []
    assert fetch["command"][2] == "hf://o/m@main"
    assert _engine(pod)["args"][:4] == ["serve", "o/m", "--revision", "main"]
    key = engine().set(model="hf://o/m", modelAuth={"secretName": "s", "key": "token"}).obj()
    (pod,) = _pods(key)
    assert pod["spec"]["initContainers"][0]["env"][0]["valueFrom"] == {
        "secretKeyRef": {"name": "s", "key": "token"}}


@pytest.mark.parametrize("image_volumes", [False, True])
@pytest.mark.parametrize("runtime", ["Shoal", "VLLM"])
def test_oci_copies_or_mounts_the_model_image(image_volumes, runtime):
    body = engine().set(model="oci://reg.io/org/tiny:1", runtime=runtime,
                        runtimeVersion="0.32.0", imagePullPolicy="Always").obj()
    (pod,) = _pods(body, OperatorSettings(image_volumes=image_volumes))
    vols, inits, mounts = _model_parts(pod)
    if image_volumes:
        assert vols == [{"name": "model", "image": {"reference": "reg.io/org/tiny:1",
                                                    "pullPolicy": "Always"}}]
        assert inits == []
        assert mounts == [{"name": "model", "mountPath": OCI_MOUNT_DIR, "readOnly": True,
                           "subPath": "models"}]
    else:
        assert vols == [{"name": "model", "emptyDir": {}}] and inits == ["model-image"]
        (copy,) = _model_inits(pod)
        assert copy["image"] == "reg.io/org/tiny:1" and copy["imagePullPolicy"] == "Always"
        assert copy["command"] == ["cp", "-a", "/models/.", OCI_MOUNT_DIR]
        assert copy["volumeMounts"] == [{"name": "model", "mountPath": OCI_MOUNT_DIR}]
        assert mounts == [{"name": "model", "mountPath": OCI_MOUNT_DIR, "readOnly": True}]
    assert _engine(pod)["args"][:2] == ["serve", OCI_MOUNT_DIR]
    assert "HF_HUB_OFFLINE" not in _env(_engine(pod))


@pytest.mark.parametrize("model, volume, want_vols, want_mounts", [
    ("/models/x", None, [], []),
    ("/models/x", HOST_MODEL, [{"name": "model", **HOST_MODEL}],
     [{"name": "model", "mountPath": "/models", "readOnly": True}]),
    ("pvc://w/m", None, [{"name": "model", "persistentVolumeClaim": {"claimName": "w",
                                                                     "readOnly": True}}],
     [{"name": "model", "mountPath": PVC_MOUNT_DIR, "readOnly": True}]),
])
def test_paths_and_claims_mount_read_only_without_an_init_container(model, volume, want_vols,
                                                                    want_mounts):
    b = engine().set(model=model)
    if volume:
        b = b.model_volume("/models", volume)
    (pod,) = _pods(b.obj())
    assert _model_parts(pod) == (want_vols, [], want_mounts)


@pytest.mark.parametrize("template, field", [
    ({"initContainers": [{"name": "model-fetch", "image": "x"}]},
     "spec.engine.template.spec.initContainers[model-fetch] is set by the operator"),
    ({"containers": [{"name": "model-fetch", "image": "x"}]},
     "spec.engine.template.spec.containers[model-fetch] is set by the operator"),
    ({"volumes": [{"name": "model-cache", "emptyDir": {}}]},
     "spec.engine.template.spec.volumes[model-cache] is a volume of the operator's"),
    ({"containers": [{"name": "engine", "volumeMounts": [{"name": "x",
                                                          "mountPath": mf.CACHE_MOUNT}]}]},
     f"spec.engine.template.spec.containers[engine].volumeMounts[{mf.CACHE_MOUNT}] is a mount "
     "of the operator's"),
])
def test_a_template_may_not_name_the_model_parts(template, field):
    body = engine().set(model="hf://o/m").engine(template={"spec": template}).obj()
    ref, spec = parse(body)
    assert any(p.startswith(field) for p in spec_problems(ref.name, spec)), \
        spec_problems(ref.name, spec)


def test_a_templates_init_containers_run_after_the_fetch():
    warm = {"name": "warm", "image": "busybox"}
    body = engine().set(model="hf://o/m").engine(template={"spec": {"initContainers": [warm]}})
    (pod,) = _pods(body.obj())
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["model-fetch", "warm"]


@pytest.mark.parametrize("mode, info, want", [
    ("auto", {"major": "1", "minor": "35"}, True),
    ("auto", {"major": "1", "minor": "36+"}, True),
    ("auto", {"major": "1", "minor": "34"}, False),  # beta but off by default
    ("auto", {"major": "1", "minor": "31"}, False),  # alpha
    ("auto", {"major": "1", "minor": "20"}, False),
    ("auto", None, False),  # unknown: copy, which every server runs
    ("auto", {"major": "", "minor": ""}, False),
    ("copy", {"major": "1", "minor": "35"}, False),
    ("image-volume", {"major": "1", "minor": "33"}, True),
])
def test_oci_mode_is_chosen_from_the_servers_version(mode, info, want):
    env = {settings.OCI_MODE_ENV: mode}
    assert settings.from_env(info, env).image_volumes is want


def test_an_unknown_oci_mode_is_refused_naming_it():
    with pytest.raises(ValueError, match="SHOAL_OCI_MODE='sometimes'"):
        settings.from_env(None, {settings.OCI_MODE_ENV: "sometimes"})


def test_the_rendered_fetch_command_is_what_shoal_fetch_parses():
    """Contract: the operator's command line fed into the real `shoal fetch` parser."""
    from shoal.contract.model_fetch import parse_hf
    from shoal.fetch.cli import parser

    body = engine().set(model="hf://Org/Model-7B@refs/pr/3").obj()
    (pod,) = _pods(body)
    command = pod["spec"]["initContainers"][0]["command"]
    assert command[:2] == ["shoal", "fetch"]
    args = parser().parse_args(command[2:])
    assert parse_hf(args.model) == mf.HubRef("Org/Model-7B", "refs/pr/3")
    assert args.cache_dir == mf.CACHE_DIR
