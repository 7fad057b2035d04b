"""Rendering is pure: table-driven checks of the manifests, no cluster needed."""

from __future__ import annotations

import json

import pytest
from shoal.contract import discovery, supervisor
from shoal.contract.env import TERMINATION_LOG
from shoal.operator import labels as L
from shoal.operator import render
from shoal.operator.spec import ROUTER_IMAGE, EngineRef, EngineSpec, parse
from shoal.operator.validation import spec_problems
from support.builders import engine


def _problems(name: str, spec: dict) -> list[str]:
    return spec_problems(name, EngineSpec.of({"spec": spec}))


def _by_kind(objs):
    out = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o)
    return out


def _container(pod):
    return pod["spec"]["containers"][0]


def _flag(args, name):
    return args[args.index(name) + 1] if name in args else None


def test_every_child_is_owned_by_the_engine_and_labelled():
    body = engine().groups(2).ranks(2).obj()
    for obj in render.render_children(*parse(body)):
        meta = obj["metadata"]
        assert meta["ownerReferences"] == [{
            "apiVersion": L.API_VERSION, "kind": L.KIND, "name": "llm",
            "uid": body["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"][L.LABEL_ENGINE] == "llm" and meta["namespace"] == "ns"


def test_one_pod_per_rank_per_group_with_stable_names():
    kinds = _by_kind(render.render_children(*parse(engine().groups(3).ranks(2).obj())))
    names = sorted(p["metadata"]["name"] for p in kinds["Pod"])
    assert names == [f"llm-g{g}-r{r}" for g in range(3) for r in range(2)]
    assert {k: len(v) for k, v in kinds.items() if k != "Pod"} == {
        "Deployment": 1, "Service": 2, "ConfigMap": 1, "PodDisruptionBudget": 1,
        "ServiceAccount": 1, "Role": 1, "RoleBinding": 1}


@pytest.mark.parametrize(
    "rank, headless, has_http, probes",
    [
        (0, False, True, {"startupProbe", "readinessProbe", "livenessProbe"}),
        (1, True, False, set()),
        (3, True, False, set()),
    ],
)
def test_rank_command_lines_and_probes(rank, headless, has_http, probes):
    body = engine("llm", "team").ranks(4, tp=8).drain(45).set(masterPort=29600).obj()
    pod = render.engine_pod(*parse(body), group=1, rank=rank)
    c = _container(pod)
    args = c["args"]
    # No command: the image entrypoint (tini -> shoal) stays PID 1.
    assert "command" not in c and args[:2] == ["serve", "/models/tiny"]
    assert ("--headless" in args) is headless
    assert _flag(args, "--nnodes") == "4" and _flag(args, "--node-rank") == str(rank)
    assert _flag(args, "--master-addr") == "llm-g1-r0.llm-ranks.team.svc"
    assert _flag(args, "--master-port") == "29600"
    assert _flag(args, "--tensor-parallel-size") == "8"
    assert _flag(args, "--shutdown-timeout") == "45"
    assert (_flag(args, "--port") == "8000") is has_http
    assert probes == {k for k in c if k.endswith("Probe")}
    assert pod["spec"]["hostname"] == f"llm-g1-r{rank}" and pod["spec"]["subdomain"] == "llm-ranks"
    assert pod["spec"]["restartPolicy"] == "Never"
    # A Service named `vllm` would otherwise set VLLM_PORT=tcp://..., which vLLM refuses.
    assert pod["spec"]["enableServiceLinks"] is False
    assert c["terminationMessagePath"] == "/dev/termination-log"
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # A rank's place in its group is its command line (above); the environment holds only
    # what the engine reads (shoal.contract.env) and the pod's downward-API identity.
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert set(env) == {TERMINATION_LOG, "POD_NAME", "POD_NAMESPACE", "NODE_NAME"}
    assert env[TERMINATION_LOG] == c["terminationMessagePath"]


def test_a_single_rank_group_gets_no_multi_node_flags():
    args = _container(render.engine_pod(*parse(engine().obj()), 0, 0))["args"]
    assert not {"--headless", "--nnodes", "--node-rank", "--master-addr"} & set(args)


@pytest.mark.parametrize("timeout, grace", [(0, 15), (30, 45), (600, 615)])
def test_grace_period_covers_the_drain_plus_a_margin(timeout, grace):
    body = engine().drain(timeout).obj()
    assert render.engine_pod(*parse(body), 0, 0)["spec"]["terminationGracePeriodSeconds"] == grace
    frontend = render.frontend_deployment(*parse(body))["spec"]["template"]["spec"]
    assert frontend["terminationGracePeriodSeconds"] == grace


def test_startup_probe_budget_follows_the_startup_timeout_not_a_fixed_delay():
    body = engine().set(engine={"startupTimeoutSeconds": 1805}).obj()
    probe = _container(render.engine_pod(*parse(body), 0, 0))["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 1805
    assert "initialDelaySeconds" not in probe


def test_stock_vllm_runtime_uses_the_same_flags():
    body = engine().ranks(2).set(runtime="VLLM", image="vllm/vllm-openai:v0.32.0").obj()
    c = _container(render.engine_pod(*parse(body), 0, 1))
    # vLLM runs under Shoal's supervisor (tests/operator/test_op_supervisor_parts.py).
    assert c["command"] == supervisor.command(["vllm"]) and "--headless" in c["args"]
    # (tests/operator/test_op_vllm_cli.py feeds these command lines to vLLM's own parser)


@pytest.mark.parametrize(
    "fields, drains",
    [
        ({"image": "vllm/vllm-openai:v0.11.0"}, False),  # vLLM < 0.18: no --shutdown-timeout
        ({"image": "vllm/vllm-openai:v0.17.1"}, False),
        ({"image": "vllm/vllm-openai:v0.18.0"}, True),
        ({"image": "vllm/vllm-openai:v0.32.0"}, True),
        ({"image": "vllm/vllm-openai:latest", "runtimeVersion": "0.19.1"}, True),
        ({"image": "registry.local:5000/vllm@sha256:" + "0" * 64, "runtimeVersion": "v0.17.0"},
         False),
    ],
)
def test_vllm_gets_the_drain_flag_only_from_the_release_that_has_it(fields, drains):
    body = engine().drain(60).set(runtime="VLLM", **fields).obj()
    args = _container(render.engine_pod(*parse(body), 0, 0))["args"]
    assert (_flag(args, "--shutdown-timeout") == "60") is drains
    assert ("--shutdown-timeout" in args) is drains
    # The drain is bounded by the grace period either way.
    grace = render.engine_pod(*parse(body), 0, 0)["spec"]["terminationGracePeriodSeconds"]
    assert grace == 60 + render.SHUTDOWN_MARGIN_SECONDS


def test_frontends_run_the_router_image_whatever_the_runtime():
    def image(body):
        (c,) = render.frontend_deployment(*parse(body))["spec"]["template"]["spec"]["containers"]
        return c["image"]

    vllm = engine().set(runtime="VLLM", image="vllm/vllm-openai:v0.32.0").obj()
    assert image(vllm) == ROUTER_IMAGE
    vllm["spec"]["frontend"] = {"image": "shoal:fe"}
    assert image(vllm) == "shoal:fe"
    assert image(engine().obj()) == ROUTER_IMAGE, "a Shoal runtime's frontends run the router"


def test_user_args_env_resources_and_model_volume_reach_every_rank():
    body = engine().ranks(2).set(
        engine={"extraArgs": ["--max-model-len", "4096"],
                "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                "resources": {"limits": {"nvidia.com/gpu": 8}}},
        modelVolume={"mountPath": "/weights",
                     "volume": {"persistentVolumeClaim": {"claimName": "w"}}},
    ).obj()
    for pod in render.group_pods(*parse(body), 0):
        c = _container(pod)
        assert c["args"][-2:] == ["--max-model-len", "4096"]
        assert {"name": "NCCL_DEBUG", "value": "INFO"} in c["env"]
        assert c["resources"] == {"limits": {"nvidia.com/gpu": 8}}
        assert {"name": "model", "mountPath": "/weights", "readOnly": True} in c["volumeMounts"]
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": "w"}}
        assert volume in pod["spec"]["volumes"]


def test_frontend_serves_port_8000_and_reads_the_discovery_file():
    body = engine().set(frontend={"replicas": 3}).obj()
    dep = render.frontend_deployment(*parse(body))
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert dep["spec"]["replicas"] == 3
    assert _flag(c["args"], "--engine-discovery-file") == f"{discovery.MOUNT_DIR}/{discovery.KEY}"
    svc = render.frontend_service(EngineRef.of(body))
    assert svc["spec"]["ports"][0]["port"] == 8000 and svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]


def test_discovery_lists_only_the_ready_groups_by_stable_rank0_address():
    body = engine("llm", "prod").groups(3).obj()
    data = json.loads(render.discovery_configmap(*parse(body), [2, 0])["data"][discovery.KEY])
    assert data == {"model": "tiny", "groups": [
        {"group": 0, "url": "http://llm-g0-r0.llm-ranks.prod.svc:8000"},
        {"group": 2, "url": "http://llm-g2-r0.llm-ranks.prod.svc:8000"}]}


def test_headless_service_publishes_not_ready_ranks():
    svc = render.ranks_service(*parse(engine().obj()))
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True


@pytest.mark.parametrize("api", ["policy/v1", "policy/v1beta1"])
def test_pdb_follows_the_discovered_api_version(api):
    kinds = _by_kind(render.render_children(*parse(engine().obj()), pdb_api_version=api))
    assert kinds["PodDisruptionBudget"][0]["apiVersion"] == api


def test_no_pdb_when_the_server_has_no_policy_api():
    children = render.render_children(*parse(engine().obj()), pdb_api_version=None)
    assert "PodDisruptionBudget" not in _by_kind(children)


@pytest.mark.parametrize(
    "change, rolls",
    [
        ({"replicas": 7}, False),
        ({"frontend": {"replicas": 4}}, False),
        ({"restartPolicy": {"maxRestarts": 1}}, False),
        ({"image": "shoal:v2"}, True),
        ({"engine": {"extraArgs": ["--enforce-eager"]}}, True),
        ({"shutdown": {"timeoutSeconds": 99}}, True),
        ({"runtimeVersion": "0.32.0"}, True),
    ],
)
def test_only_engine_fields_change_the_revision(change, rolls):
    before = engine().obj()
    after = engine().set(**change).obj()
    assert (EngineSpec.of(before).revision != EngineSpec.of(after).revision) is rolls


def test_rendering_is_deterministic():
    body = engine().groups(2).ranks(2).obj()
    assert render.render_children(*parse(body)) == render.render_children(*parse(body))


@pytest.mark.parametrize(
    "name, spec, problem",
    [
        ("llm", {"model": "m", "tensorParallelSize": 3, "nodesPerGroup": 2},
         "multiple of spec.nodesPerGroup"),
        ("x" * 50, {"model": "m"}, "at most 45"),
        ("llm", {"model": "m", "restartPolicy": {"backoffBaseSeconds": 60, "backoffMaxSeconds": 5}},
         "backoffMaxSeconds"),
        ("llm", {"model": "m", "modelVolume": {"volume": {}}}, "exactly one volume source"),
        ("llm", {"model": "m",
                 "modelVolume": {"volume": {"hostPath": {"path": "/m"}, "name": "x"}}},
         "must not set `name`"),
        ("llm", {"model": "m", "runtime": "VLLM"},
         "spec.image is ghcr.io/shoal-dev/shoal:0.1.0, a Shoal image"),
        ("llm", {"model": "m", "runtime": "VLLM", "image": "vllm/vllm-openai:latest"},
         "spec.runtimeVersion must say"),
        ("llm", {"model": "m", "runtime": "VLLM", "image": "vllm/vllm-openai@sha256:" + "0" * 64},
         "spec.runtimeVersion must say"),
        ("llm", {"model": "m", "runtime": "VLLM", "image": "vllm/vllm-openai:v0.19.1",
                 "runtimeVersion": "0.20.0"},
         "contradicts the release in spec.image"),
        ("llm", {"model": "m", "runtime": "VLLM", "image": "vllm/vllm-openai:v0.10.2"},
         "older than 0.11.0"),
        ("llm", {"model": "m", "runtime": "VLLM", "image": "vllm/vllm-openai:v0.11.0",
                 "nodesPerGroup": 2, "tensorParallelSize": 2},
         "spec.nodesPerGroup 2 needs vLLM >= 0.11.1"),
        ("llm", {"model": "m", "frontend": {"routing": "kv-aware"}},
         "kv-aware needs the model's tokenizer in the frontends"),
    ],
)
def test_cross_field_problems_say_what_to_fix(name, spec, problem):
    problems = _problems(name, spec)
    assert any(problem in p for p in problems), problems


def test_a_valid_spec_has_no_problems():
    assert _problems("llm", engine().ranks(2, tp=8).obj()["spec"]) == []


@pytest.mark.parametrize("fields", [
    {"image": "vllm/vllm-openai:v0.11.0"},  # one node: 0.11.0 runs it (without the drain flag)
    {"image": "vllm/vllm-openai:v0.11.1", "nodesPerGroup": 2, "tensorParallelSize": 2},
    {"image": "vllm/vllm-openai:v0.32.0", "nodesPerGroup": 2, "tensorParallelSize": 2},
    {"image": "vllm/vllm-openai:latest", "runtimeVersion": "0.32.0"},
    {"image": "vllm/vllm-openai:v0.32.0", "runtimeVersion": "v0.32.0"},
    {"image": "localhost:5000/vllm-openai", "runtimeVersion": "0.18.1"},
])
def test_a_vllm_image_with_a_known_release_is_valid(fields):
    assert _problems("llm", {"model": "m", "runtime": "VLLM", **fields}) == []


@pytest.mark.parametrize("nodes, rank", [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_shoal_serve_accepts_every_rank_command_line(nodes, rank):
    """The operator's contract with the engine is the command line: `shoal serve`'s own parser
    must accept what we render (multi-rank execution itself is the engine's business)."""
    from shoal.engine.entrypoints import serve

    body = engine().ranks(nodes).drain(30).engine(extraArgs=["--max-model-len", "512"]).obj()
    args = _container(render.engine_pod(*parse(body), 0, rank))["args"]
    assert args[0] == "serve"
    parsed = serve.build_parser().parse_args(args[1:])
    assert (parsed.nnodes, parsed.node_rank, parsed.headless) == (nodes, rank, rank > 0)
    assert parsed.shutdown_timeout == 30 and parsed.max_model_len == 512
    if nodes == 1:
        assert serve._check_parallelism(parsed) is None


def test_ranks_of_a_multi_node_group_repel_each_other_single_node_groups_do_not():
    multi = _by_kind(render.render_children(*parse(engine().groups(2).ranks(2).obj())))["Pod"]
    for pod in multi:
        anti = pod["spec"]["affinity"]["podAntiAffinity"]
        (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        group = pod["metadata"]["labels"][L.LABEL_GROUP]
        assert term["labelSelector"]["matchLabels"][L.LABEL_GROUP] == group
    single = _by_kind(render.render_children(*parse(engine().groups(2).ranks(1).obj())))["Pod"]
    assert all("affinity" not in p["spec"] for p in single)


def test_the_frontends_routing_reaches_the_router_as_it_reads_it(monkeypatch):
    """spec.frontend.routing is rendered into the frontend's environment; the router's own
    reader accepts it (render's output fed to the router, not a copy of the variable's name)."""
    from shoal.operator import render
    from shoal.router.main import routing_from_env

    for routing in ("least-outstanding", "prefix-affinity"):
        body = engine("fr", "ns").set(frontend={"routing": routing}).obj()
        (c,) = render.frontend_deployment(*parse(body))["spec"]["template"]["spec"]["containers"]
        for var in c["env"]:
            if "value" in var:
                monkeypatch.setenv(var["name"], var["value"])
        assert routing_from_env()[0] == routing
