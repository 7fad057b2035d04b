"""`spec.frontend.routing: kv-aware` rendered: rank 0 publishes KV events on the ports the
frontends subscribe to, and every frontend carries the model's tokenizer. The rendered command
lines and environment are fed to the engine's and the router's own parsers."""

from __future__ import annotations

import pytest
from shoal.contract import model_fetch as mf
from shoal.contract import routing
from shoal.operator import render
from shoal.operator.model_source import OCI_MOUNT_DIR, PVC_MOUNT_DIR
from shoal.operator.settings import OperatorSettings
from shoal.operator.spec import ROUTER_IMAGE, EngineSpec, parse
from shoal.operator.validation import spec_problems
from support.builders import engine

KV = {"routing": "kv-aware"}
HOST_MODEL = {"hostPath": {"path": "/srv/m"}}


def _kv_engine(**fields):
    return (engine("chat", "team").set(frontend=KV, **fields)
            .model_volume("/models", HOST_MODEL).set(model="/models/m"))


def _container(pod):
    return pod["spec"]["containers"][0]


def _env(container) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


def _frontend_pod(body, opts: OperatorSettings | None = None) -> dict:
    ref, spec = parse(body, opts)
    assert spec_problems(ref.name, spec) == []
    return render.frontend_deployment(ref, spec)["spec"]["template"]


@pytest.mark.parametrize("nodes", [1, 2])
def test_rank0_publishes_kv_events_that_shoal_serve_reads_as_vllms_config(nodes):
    from shoal.engine.entrypoints import serve

    ref, spec = parse(_kv_engine().ranks(nodes).obj())
    rank0 = _container(render.engine_pod(ref, spec, 0, 0))
    parsed = serve.build_parser().parse_args(rank0["args"][1:])
    config = parsed.kv_events_config
    assert config.publishes
    assert (config.endpoint, config.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    ports = {p["name"]: p["containerPort"] for p in rank0["ports"]}
    assert ports["kv-events"] == 5557 and ports["kv-replay"] == 5558
    for rank in range(1, nodes):  # headless ranks schedule nothing: no events
        c = _container(render.engine_pod(ref, spec, 0, rank))
        assert "--kv-events-config" not in c["args"]
        assert not {"kv-events", "kv-replay"} & {p["name"] for p in c["ports"]}


@pytest.mark.parametrize("routing_", ["least-outstanding", "prefix-affinity"])
def test_other_routings_render_no_events_and_no_tokenizer(routing_):
    body = _kv_engine().set(frontend={"routing": routing_}).obj()
    ref, spec = parse(body)
    c = _container(render.engine_pod(ref, spec, 0, 0))
    assert "--kv-events-config" not in c["args"]
    pod = _frontend_pod(body)
    assert "initContainers" not in pod["spec"]
    assert routing.KV_TOKENIZER_ENV not in _env(_container(pod))


def test_the_frontends_subscribe_where_rank0_publishes(monkeypatch):
    """The frontend's rendered args and environment through the router's own parser, and the
    endpoints it derives from the discovery document the operator writes."""
    from shoal.contract import discovery
    from shoal.router.discovery import parse_discovery
    from shoal.router.kv_subscriber import endpoints_from_ports
    from shoal.router.main import build_parser, routing_from_env

    body = _kv_engine().obj()
    ref, spec = parse(body)
    c = _container(_frontend_pod(body))
    for var in c["env"]:
        if "value" in var:
            monkeypatch.setenv(var["name"], var["value"])
    assert routing_from_env()[0] == routing.KV_AWARE
    args = build_parser().parse_args(c["args"][1:])
    assert args.kv_tokenizer == "/models/m"
    doc = render.discovery_data(ref, spec, [1])[discovery.KEY]
    (group,) = parse_discovery(doc).groups
    ep = endpoints_from_ports(args.kv_events_port, args.kv_replay_port)(group)
    rank0 = _container(render.engine_pod(ref, spec, 1, 0))
    ports = {p["name"]: p["containerPort"] for p in rank0["ports"]}
    host = "chat-g1-r0.chat-ranks.team.svc"
    assert ep.events == f"tcp://{host}:{ports['kv-events']}"
    assert ep.replay == f"tcp://{host}:{ports['kv-replay']}"


@pytest.mark.parametrize("cache", [None, {"persistentVolumeClaim": {"claimName": "models"}}])
def test_an_hf_model_gives_each_frontend_its_own_tokenizer_fetch(cache):
    body = (engine("chat", "team").set(model="hf://Org/Model-7B@v1.2", frontend=KV,
                                       modelAuth={"secretName": "hf"},
                                       **({"modelCache": cache} if cache else {})).obj())
    pod = _frontend_pod(body)
    (fetch,) = pod["spec"]["initContainers"]
    assert fetch["name"] == mf.FETCH_CONTAINER and fetch["image"] == ROUTER_IMAGE
    assert fetch["command"] == ["shoal", "fetch", "hf://Org/Model-7B@v1.2", "--cache-dir",
                                mf.CACHE_DIR, "--files", "tokenizer"]
    ref, spec = parse(body)
    (engine_fetch,) = [c for c in render.engine_pod(ref, spec, 0, 0)["spec"]["initContainers"]
                       if c["name"] == mf.FETCH_CONTAINER]
    assert _env(fetch) == _env(engine_fetch)  # the same Secret and hub as the engines'
    assert _env(fetch)[mf.TOKEN_ENV]["secretKeyRef"]["name"] == "hf"
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols[mf.CACHE_VOLUME] == {"name": mf.CACHE_VOLUME, "emptyDir": {}}  # never shared
    c = _container(pod)
    assert {"name": mf.CACHE_VOLUME, "mountPath": mf.CACHE_MOUNT, "readOnly": True} in \
        c["volumeMounts"]
    env = _env(c)
    assert env[routing.KV_TOKENIZER_ENV] == "hf://Org/Model-7B@v1.2"
    assert env["HF_HUB_CACHE"] == mf.CACHE_DIR


@pytest.mark.parametrize(("model", "opts", "volume", "tokenizer"), [
    ("oci://reg.local/models/m:1", OperatorSettings(image_volumes=True),
     {"image": {"reference": "reg.local/models/m:1", "pullPolicy": "IfNotPresent"}},
     OCI_MOUNT_DIR),
    ("oci://reg.local/models/m:1", None, {"emptyDir": {}}, OCI_MOUNT_DIR),
    ("pvc://models/llama", None, {"persistentVolumeClaim": {"claimName": "models",
                                                            "readOnly": True}},
     f"{PVC_MOUNT_DIR}/llama"),
])
def test_a_volume_model_is_mounted_read_only_in_the_frontends(model, opts, volume, tokenizer):
    body = engine("chat", "team").set(model=model, frontend=KV).obj()
    ref, spec = parse(body, opts)
    engine_pod = render.engine_pod(ref, spec, 0, 0)
    pod = _frontend_pod(body, opts)
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert {k: v for k, v in vols["model"].items() if k != "name"} == volume
    engine_mounts = [m for m in _container(engine_pod)["volumeMounts"] if m["name"] == "model"]
    front_mounts = [m for m in _container(pod)["volumeMounts"] if m["name"] == "model"]
    assert front_mounts == engine_mounts and all(m["readOnly"] for m in front_mounts)
    assert _env(_container(pod))[routing.KV_TOKENIZER_ENV] == tokenizer
    # The copy mode's init container is the engine pod's own.
    assert pod["spec"].get("initContainers", []) == [
        c for c in engine_pod["spec"].get("initContainers", []) if c["name"] == "model-image"]


@pytest.mark.parametrize(("fields", "problem"), [
    ({"model": "served-in-the-image"}, "cannot read 'served-in-the-image' inside the engine"),
    ({"engine": {"extraArgs": ["--tokenizer", "/other"]}}, "--tokenizer cannot be used"),
    ({"engine": {"extraArgs": ["--kv-events-config={}"]}}, "the operator sets it"),
    ({"engine": {"extraArgs": ["--no-enable-prefix-caching"]}}, "publish no KV events"),
])
def test_what_kv_aware_cannot_work_with_is_refused_by_name(fields, problem):
    body = engine("chat", "team").set(frontend=KV, **fields)
    if "model" not in fields:
        body = body.model_volume("/models", HOST_MODEL).set(model="/models/m")
    problems = spec_problems("chat", EngineSpec.of(body.obj()))
    assert any(problem in p for p in problems), problems


def test_a_kv_aware_spec_with_a_readable_model_is_valid():
    assert spec_problems("chat", EngineSpec.of(_kv_engine().obj())) == []
