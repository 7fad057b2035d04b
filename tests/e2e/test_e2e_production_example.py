"""examples/gpu-production.yaml applied on the local cluster's two real nodes, with only its GPU
and cloud parts swapped for what runs here (`for_local_cluster`, a pure function):

- `spec.image`: the local engine image (support.cluster.ENGINE_IMAGE), not the CUDA one;
- `engine.resources`: no `nvidia.com/gpu`, requests 100m CPU / 256Mi (limit 4Gi), and
  `frontend.resources` 50m / 64Mi (limit 1Gi): the nodes share 2 cores;
- `engine.extraArgs`: `--device cuda` dropped (the default `auto` picks the CPU), `--dtype
  float32`, `--max-model-len 256`, `--kv-cache-memory-bytes 64MiB`;
- `replicas` 3 -> 1 and `frontend.replicas` 2 -> 1 (2 cores);
- `model`: `hf://shoal/shoal-tiny@main` (the project's model) with `hfEndpoint` the stand-in hub
  pod (tests/support/hub_pod.py: a stand-in because no real hub is reachable here; `shoal fetch`,
  huggingface_hub and its cache are real), and `servedModelName` `shoal-tiny` to match it;
- the claim `model-cache`: the same name and access mode, bound to a hostPath PersistentVolume
  (a fresh directory under VAR_DIR, mode 0777: the fetcher runs as uid 10001 and `fsGroup`
  does not apply to hostPath) through a storage class of its own (no provisioner here);
- the Secrets the example says are yours to make: `hf-token` (the hub's token) and
  `registry-creds` (a dummy dockerconfigjson; the images are already on the nodes).
Everything else (nodeSelector, tolerations, topologySpreadConstraints, priorityClassName,
securityContext, imagePullSecrets, labels, annotations, env, shutdown, restartPolicy) is the
example's. The first node is made the GPU pool (tainted `nvidia.com/gpu=present:NoSchedule`,
labelled with the GPU product), the second the CPU pool (`node-pool=cpu`), each in a zone; the
engine pods must land only on the first, the frontends only on the second. The taint, the
labels, the PriorityClass and the PersistentVolume are removed at the end, even on failure."""

from __future__ import annotations

import contextlib
import copy
import shutil
import uuid
from pathlib import Path

import pytest
import yaml
from shoal.devcluster.layout import VAR_DIR
from support import hub_pod
from support.cluster import ENGINE_IMAGE

from e2e.e2e_helpers import client, pods, service_url, wait_ready, wait_serving

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpu-production.yaml"
MODEL = f"hf://{hub_pod.ORG}/shoal-tiny@main"
SERVED = "shoal-tiny"
GPU_TAINT = "nvidia.com/gpu=present:NoSchedule"
GPU_LABEL = ("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3")
CPU_LABEL = ("node-pool", "cpu")
ZONE = "topology.kubernetes.io/zone"
ENGINE_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "4Gi"}}
FRONTEND_RESOURCES = {"requests": {"cpu": "50m", "memory": "64Mi"},
                      "limits": {"memory": "1Gi"}}
ARG_VALUES = {"--dtype": "float32", "--max-model-len": "256", "--kv-cache-memory-bytes": "64MiB"}
DROPPED_ARGS = {"--device"}  # with its value: `auto` (the default) picks the CPU here


def example() -> list[dict]:
    with open(EXAMPLE) as f:
        return [o for o in yaml.safe_load_all(f) if o]


def cpu_args(args: list[str]) -> list[str]:
    """The engine's extraArgs with the GPU flags dropped and the sizes made local."""
    out, i = [], 0
    while i < len(args):
        flag = args[i]
        if flag in DROPPED_ARGS:
            i += 2
            continue
        out.append(flag)
        if flag in ARG_VALUES:
            out.append(ARG_VALUES[flag])
            i += 1
        i += 1
    missing = [f for f in ARG_VALUES if f not in out]
    return out + [x for f in missing for x in (f, ARG_VALUES[f])]


def cache_volume(name: str, ns: str, claim: str, path: Path) -> dict:
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": name,
                     "hostPath": {"path": str(path), "type": "Directory"},
                     "claimRef": {"namespace": ns, "name": claim}}}


def for_local_cluster(objs: list[dict], *, ns: str, hub_endpoint: str, cache_dir: Path,
                      pv: str) -> list[dict]:
    """The example's objects with the swaps of the module docstring; nothing else changes.
    The PersistentVolume for the cache claim comes first (cluster-scoped, named `pv`)."""
    out = []
    for obj in copy.deepcopy(objs):
        kind = obj["kind"]
        if kind != "PriorityClass":
            obj["metadata"]["namespace"] = ns
        if kind == "PersistentVolumeClaim":
            out.append(cache_volume(pv, ns, obj["metadata"]["name"], cache_dir))
            obj["spec"]["storageClassName"] = pv
            obj["spec"]["resources"]["requests"]["storage"] = "1Gi"
        elif kind == "InferenceEngine":
            spec = obj["spec"]
            spec.update(image=ENGINE_IMAGE, model=MODEL, hfEndpoint=hub_endpoint,
                        servedModelName=SERVED, replicas=1)
            spec["engine"].update(extraArgs=cpu_args(spec["engine"]["extraArgs"]),
                                  resources=copy.deepcopy(ENGINE_RESOURCES))
            spec["frontend"].update(replicas=1, resources=copy.deepcopy(FRONTEND_RESOURCES))
        out.append(obj)
    return out


def test_the_swap_changes_only_the_gpu_and_cloud_parts():
    """What the e2e case below applies is the example but for the listed swaps."""
    objs = example()
    got = for_local_cluster(objs, ns="ns", hub_endpoint="http://hub:8080",
                            cache_dir=Path("/c"), pv="pv")
    assert [o["kind"] for o in got] == ["PriorityClass", "PersistentVolume",
                                       "PersistentVolumeClaim", "InferenceEngine"]
    assert got[0] == objs[0]
    (ie_in,), (ie_out,) = ([o for o in x if o["kind"] == "InferenceEngine"] for x in (objs, got))
    spec_in, spec_out = ie_in["spec"], ie_out["spec"]
    assert spec_out["engine"]["extraArgs"] == ["--dtype", "float32", "--max-model-len", "256",
                                               "--kv-cache-memory-bytes", "64MiB"]
    assert "nvidia.com/gpu" not in str(spec_out["engine"]["resources"])
    swapped = {"image", "model", "hfEndpoint", "servedModelName", "replicas"}
    assert {k: v for k, v in spec_in.items() if k not in swapped | {"engine", "frontend"}} == \
        {k: v for k, v in spec_out.items() if k not in swapped | {"engine", "frontend"}}
    for part in ("engine", "frontend"):
        kept = {k for k in spec_in[part] if k not in {"extraArgs", "resources", "replicas"}}
        assert {k: spec_out[part][k] for k in kept} == {k: spec_in[part][k] for k in kept}
    assert spec_in["engine"]["template"]["spec"]["priorityClassName"] == "inference-high"


@contextlib.contextmanager
def _pools(cluster):
    """The first node the tainted GPU pool, the second the CPU pool, one zone each; the labels
    a node had before are put back, the ones it did not have are removed."""
    nodes = sorted(cluster.get("nodes")["items"], key=lambda n: n["metadata"]["name"])
    assert len(nodes) == 2, [n["metadata"]["name"] for n in nodes]
    gpu, cpu = (n["metadata"]["name"] for n in nodes)
    wanted = {gpu: dict([GPU_LABEL, (ZONE, "zone-a")]), cpu: dict([CPU_LABEL, (ZONE, "zone-b")])}
    before = {n["metadata"]["name"]: n["metadata"].get("labels") or {} for n in nodes}
    try:
        cluster.kubectl("taint", "nodes", gpu, GPU_TAINT)
        for node, labels in wanted.items():
            cluster.kubectl("label", "--overwrite", "nodes", node,
                            *(f"{k}={v}" for k, v in labels.items()))
        yield gpu, cpu
    finally:
        cluster.kubectl("taint", "nodes", gpu, GPU_TAINT.split("=")[0] + ":NoSchedule-",
                        check=False)
        for node, labels in wanted.items():
            back = [f"{k}={before[node][k]}" if k in before[node] else f"{k}-" for k in labels]
            cluster.kubectl("label", "--overwrite", "nodes", node, *back, check=False)


def _pods(cluster, ns: str, component: str) -> list[dict]:
    return pods(cluster, ns, f"shoal.dev/engine=qwen-7b,shoal.dev/component={component}")


def test_the_production_example_runs_with_its_gpu_parts_swapped(cluster, new_ns):
    ns = new_ns("e2e-prod")
    pv = f"shoal-model-cache-{ns}"
    cache_dir = VAR_DIR / f"e2e-prod-cache-{uuid.uuid4().hex[:6]}"
    cache_dir.mkdir(parents=True)
    cache_dir.chmod(0o777)  # the fetcher runs as uid 10001; fsGroup does not apply to hostPath
    objs = example()
    (priority,) = [o for o in objs if o["kind"] == "PriorityClass"]
    (ie,) = [o for o in objs if o["kind"] == "InferenceEngine"]
    template = ie["spec"]["engine"]["template"]
    try:
        hub = hub_pod.start(cluster, ns)
        cluster.kubectl("create", "secret", "generic", ie["spec"]["modelAuth"]["secretName"],
                        "-n", ns, f"--from-literal=HF_TOKEN={hub_pod.TOKEN}")
        cluster.kubectl("create", "secret", "docker-registry", "registry-creds", "-n", ns,
                        "--docker-server=registry.invalid", "--docker-username=shoal",
                        "--docker-password=unused")
        with _pools(cluster) as (gpu_node, cpu_node):
            for obj in for_local_cluster(objs, ns=ns, hub_endpoint=hub["endpoint"],
                                         cache_dir=cache_dir, pv=pv):
                cluster.apply(obj)
            wait_ready(cluster, ns, "qwen-7b", "1/1", timeout=600)
            url = service_url(cluster, ns, "qwen-7b")
            wait_serving(url)
            out = client(url).completions.create(model=SERVED, prompt="The weather today",
                                                 max_tokens=8)
            assert out.choices and out.choices[0].text, out

            engines, frontends = _pods(cluster, ns, "engine"), _pods(cluster, ns, "frontend")
            assert engines and {p["spec"]["nodeName"] for p in engines} == {gpu_node}, engines
            assert frontends and {p["spec"]["nodeName"] for p in frontends} == {cpu_node}
            for pod in engines:
                meta, pspec = pod["metadata"], pod["spec"]
                assert pspec["priorityClassName"] == priority["metadata"]["name"]
                assert pspec.get("priority") == priority["value"], pspec.get("priority")
                for k, v in template["metadata"]["labels"].items():
                    assert meta["labels"].get(k) == v, meta["labels"]
                for k, v in template["metadata"]["annotations"].items():
                    assert meta["annotations"].get(k) == v, meta["annotations"]
                for tol in template["spec"]["tolerations"]:
                    assert tol in pspec["tolerations"], pspec["tolerations"]
                assert pspec["nodeSelector"] == template["spec"]["nodeSelector"]
                assert pspec["topologySpreadConstraints"] == \
                    template["spec"]["topologySpreadConstraints"]
                assert pspec["securityContext"]["fsGroup"] == 10001
                assert {"name": "registry-creds"} in pspec["imagePullSecrets"]
                (engine,) = [c for c in pspec["containers"] if c["name"] == "engine"]
                for env in template["spec"]["containers"][0]["env"]:
                    assert env in engine["env"], engine["env"]
            for pod in frontends:
                assert pod["spec"]["priorityClassName"] == priority["metadata"]["name"]

            pdb = cluster.get("pdb", "qwen-7b-engines", "-n", ns)
            assert pdb["spec"]["maxUnavailable"] == 1, pdb["spec"]
            assert pdb["spec"]["selector"]["matchLabels"]["shoal.dev/engine"] == "qwen-7b"
            assert (cache_dir / "hub" / "models--shoal--shoal-tiny").is_dir()
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)
        cluster.kubectl("delete", "priorityclass", priority["metadata"]["name"],
                        "--wait=false", check=False)
        shutil.rmtree(cache_dir, ignore_errors=True)
