"""Engine groups rendered: the headless Service that names every rank, and one pod per rank
(`NAME-gG-rR`, owned directly by the InferenceEngine, no StatefulSet) with its command line,
environment and probes, the model's volumes and init container (model_volumes.py, per model
source), rank 0's KV events for kv-aware routing (kv_parts.py), Shoal's supervisor in front of
a stock vLLM (supervisor_parts.py), and the user's `spec.engine.template` merged over it
(template.py). Pure, like render.py."""

from __future__ import annotations

import math

from shoal.contract import env as engine_env_names
from shoal.contract import lora as lora_contract
from shoal.contract.termination import DEFAULT_PATH as TERMINATION_MESSAGE_PATH
from shoal.operator import kv_parts, template, vllm_version
from shoal.operator import labels as L
from shoal.operator.model_volumes import model_parts
from shoal.operator.render_common import engine_selector, grace_seconds, metadata, with_hash
from shoal.operator.spec import EngineRef, EngineSpec
from shoal.operator.supervisor_parts import supervisor_parts

# The startup probe's period is the wait between an engine that serves and a Ready pod: 2 s
# (benchmarks/cold_start.py measured 10 s leaving pods unready for 4-9 s after `ready:`).
STARTUP_PROBE_PERIOD = 2


def ranks_service(ref: EngineRef, spec: EngineSpec) -> dict:
    """Headless Service: gives every rank the stable name `pod.NAME-ranks.NS.svc`. Not-ready
    addresses are published, because ranks must find rank 0 before anything is ready."""
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ref, L.ranks_service_name(ref.name), L.COMPONENT_ENGINE),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": engine_selector(ref.name),
            "ports": [
                {"name": "http", "port": L.HTTP_PORT, "targetPort": L.HTTP_PORT,
                 "protocol": "TCP"},
                {"name": "dist", "port": spec.master_port, "targetPort": spec.master_port,
                 "protocol": "TCP"},
            ],
        },
    }
    return with_hash(svc, svc["spec"])


def engine_command(spec: EngineSpec) -> list[str] | None:
    """Shoal's image: None, keeping its entrypoint (`tini -g -- shoal`) as PID 1 so signals
    reach the engine and its exit code propagates. Stock vLLM images: Shoal's supervisor as
    PID 1 running `vllm` (supervisor_parts.py), so that a death names its process."""
    return supervisor_parts(spec).command


def engine_args(ref: EngineRef, spec: EngineSpec, group: int, rank: int) -> list[str]:
    """The command line contract with `shoal serve` / `vllm serve` (vLLM's flag names). A stock
    vLLM gets only the flags its release accepts (vllm_version.FLAG_SINCE): a release before
    0.18 gets no `--shutdown-timeout` (it aborts in-flight requests on SIGTERM; see
    docs/vllm-runtime.md)."""
    nodes = spec.nodes_per_group
    model = model_parts(spec)
    args = ["serve", model.arg, *model.args, "--served-model-name", spec.served_model_name,
            "--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if vllm_version.accepts(spec, "--shutdown-timeout"):
        args += ["--shutdown-timeout", str(spec.shutdown_timeout_seconds)]
    if rank == 0:
        args += ["--host", "0.0.0.0", "--port", str(L.HTTP_PORT)]
    args += kv_parts.engine_args(spec, rank)  # routing kv-aware: rank 0 publishes KV events
    if spec.lora is not None:  # every rank: under tensor parallelism each holds its shards
        args += spec.lora.args()
    if nodes > 1:
        if rank > 0:
            args.append("--headless")
        args += ["--nnodes", str(nodes), "--node-rank", str(rank),
                 "--master-addr", L.rank_host(ref.name, ref.namespace, group, 0),
                 "--master-port", str(spec.master_port)]
    return args + list(spec.extra_args)


def engine_env(spec: EngineSpec) -> list[dict]:
    """What the engine reads (shoal.contract.env), the pod's identity from the downward API
    (for logs, and for `$(POD_NAME)` in engine.extraArgs), the model source's (hf://: offline
    from the cache), then the user's variables."""
    def field(path: str) -> dict:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env = [
        {"name": engine_env_names.TERMINATION_LOG, "value": TERMINATION_MESSAGE_PATH},
        {"name": "POD_NAME", **field("metadata.name")},
        {"name": "POD_NAMESPACE", **field("metadata.namespace")},
        {"name": "NODE_NAME", **field("spec.nodeName")},
    ]
    if spec.lora is not None:  # the operator loads InferenceAdapters at runtime
        env.append({"name": lora_contract.RUNTIME_UPDATES_ENV, "value": "true"})
        if not spec.source.is_hf:  # the image is offline; an hf:// adapter is downloaded
            env.append({"name": "HF_HUB_OFFLINE", "value": "0"})
    return env + model_parts(spec).env + list(spec.engine_env)


def rank0_probes(spec: EngineSpec) -> dict:
    """Only rank 0 serves HTTP. Startup covers weight loading (no fixed initialDelaySeconds);
    liveness after start turns a dead or hung EngineCore into a container exit the operator
    sees."""
    health = {"httpGet": {"path": "/health", "port": L.HTTP_PORT}}
    budget = max(1, math.ceil(spec.startup_timeout_seconds / STARTUP_PROBE_PERIOD))
    return {
        "startupProbe": {**health, "periodSeconds": STARTUP_PROBE_PERIOD,
                         "failureThreshold": budget},
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 3,
                          "timeoutSeconds": 5},
    }


def _engine_container(ref: EngineRef, spec: EngineSpec, group: int, rank: int) -> dict:
    ports = [{"name": "http", "containerPort": L.HTTP_PORT, "protocol": "TCP"}] if rank == 0 else []
    container = {
        "name": L.ENGINE_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        **({"command": cmd} if (cmd := engine_command(spec)) else {}),
        "args": engine_args(ref, spec, group, rank),
        "env": engine_env(spec),
        "ports": ports + kv_parts.engine_ports(spec, rank)
        + [{"name": "dist", "containerPort": spec.master_port, "protocol": "TCP"}],
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if rank == 0:
        container.update(rank0_probes(spec))  # headless ranks: no HTTP server, so no probes
    if spec.engine_resources:
        container["resources"] = spec.engine_resources
    container["volumeMounts"] += supervisor_parts(spec).mounts + model_parts(spec).mounts
    return container


def _one_rank_per_node(name: str, group: int) -> dict:
    """The ranks of a group split the model over nodes (and their devices); two on one node
    would share what each expects to have alone."""
    term = {"labelSelector": {"matchLabels": {**engine_selector(name), L.LABEL_GROUP: str(group)}},
            "topologyKey": "kubernetes.io/hostname"}
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}


def engine_pod(ref: EngineRef, spec: EngineSpec, group: int, rank: int) -> dict:
    """One rank's pod: the operator's (`operator_pod`) with spec.engine.template merged in."""
    pod = operator_pod(ref, spec, group, rank)
    merged = template.merge({"metadata": pod["metadata"], "spec": pod["spec"]},
                            spec.engine_template)
    return {**pod, **merged}


def operator_pod(ref: EngineRef, spec: EngineSpec, group: int, rank: int) -> dict:
    """What the operator renders before the template: validation checks a template against
    it."""
    model, sup = model_parts(spec), supervisor_parts(spec)
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, *sup.volumes, *model.volumes]
    # The supervisor's install first: seconds, and a bad router image fails before a download.
    inits = sup.init_containers + model.init_containers
    name = L.pod_name(ref.name, group, rank)
    extra = {L.LABEL_GROUP: str(group), L.LABEL_RANK: str(rank), L.LABEL_REVISION: spec.revision}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata(ref, name, L.COMPONENT_ENGINE, extra),
        "spec": {
            "hostname": name,
            "subdomain": L.ranks_service_name(ref.name),
            # The operator, not the kubelet, restarts: a dead rank must take its whole group
            # down, and an in-place restart would hide the death from everyone.
            "restartPolicy": "Never",
            # No service-link variables: a Service named `vllm` in the namespace would set
            # VLLM_PORT=tcp://IP:PORT, which vLLM refuses at start (seen on real pods, e2e);
            # engines find everything by DNS.
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": grace_seconds(spec),
            **({"initContainers": inits} if inits else {}),
            "containers": [_engine_container(ref, spec, group, rank)],
            "volumes": volumes,
        },
    }
    if spec.nodes_per_group > 1:
        pod["spec"]["affinity"] = _one_rank_per_node(ref.name, group)
    return pod


def group_pods(ref: EngineRef, spec: EngineSpec, group: int) -> list[dict]:
    return [engine_pod(ref, spec, group, r) for r in range(spec.nodes_per_group)]
