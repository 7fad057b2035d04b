"""Pure functions: an InferenceEngine body in, Kubernetes manifests out (dask-kubernetes style).

Nothing here talks to the API server, so every manifest is testable without a cluster and the
chart work can validate `render_children()` against Kubernetes' own schemas.

Children of one InferenceEngine `NAME` in namespace `NS`:
- Deployment `NAME-frontend` running `shoal serve --frontend-only`, Service `NAME` (ClusterIP,
  port 8000): the in-cluster OpenAI endpoint.
- ConfigMap `NAME-engines`: the ready groups' rank-0 addresses, mounted into every frontend
  (the discovery file; see docs/operator.md, "Frontend discovery").
- Headless Service `NAME-ranks`: stable DNS for every rank, `NAME-gG-rR.NAME-ranks.NS.svc`.
- Pods `NAME-gG-rR`, owned directly by the InferenceEngine (no StatefulSet): group G, rank R.
- PodDisruptionBudget `NAME-engines` (policy/v1, or policy/v1beta1 on old servers).
"""

from __future__ import annotations

import hashlib
import json
import math

from shoal.contract import discovery
from shoal.contract.routing import ROUTING_ENV
from shoal.operator import labels as L
from shoal.operator import vllm_version
from shoal.operator.spec import EngineSpec

SHUTDOWN_MARGIN_SECONDS = 15  # SIGTERM -> SIGKILL slack beyond the drain: abort outputs, cleanup
STARTUP_PROBE_PERIOD = 10


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:10]


def spec_of(body: dict) -> dict:
    return body.get("spec") or {}


def engine_revision(spec: dict) -> str:
    """Hash of everything that shapes an engine pod; a change rolls the groups one by one.
    Replicas, frontends and the restart policy are excluded: changing them restarts nothing.
    runtimeVersion counts only when set, so that adding the field rolled no existing group."""
    keys = ("model", "servedModelName", "image", "imagePullPolicy", "runtime", "tensorParallelSize",
            "nodesPerGroup", "masterPort", "engine", "modelVolume", "shutdown")
    shaped = {k: spec.get(k) for k in keys}
    if spec.get("runtimeVersion"):
        shaped["runtimeVersion"] = spec["runtimeVersion"]
    return _hash(shaped)


def common_labels(name: str, component: str) -> dict:
    return {L.LABEL_ENGINE: name, L.LABEL_COMPONENT: component, L.LABEL_MANAGED_BY: L.MANAGED_BY}


def engine_selector(name: str) -> dict:
    return {L.LABEL_ENGINE: name, L.LABEL_COMPONENT: L.COMPONENT_ENGINE}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in engine_selector(name).items())


def owner_reference(body: dict) -> dict:
    meta = body["metadata"]
    return {"apiVersion": L.API_VERSION, "kind": L.KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _meta(body: dict, name: str, component: str, extra_labels: dict | None = None) -> dict:
    return {
        "name": name,
        "namespace": body["metadata"]["namespace"],
        "labels": {**common_labels(body["metadata"]["name"], component), **(extra_labels or {})},
        "ownerReferences": [owner_reference(body)],
    }


def _with_hash(obj: dict, payload) -> dict:
    obj["metadata"].setdefault("annotations", {})[L.ANNOTATION_SPEC_HASH] = _hash(payload)
    return obj


def served_name(spec: dict) -> str:
    return spec.get("servedModelName") or spec["model"]


def _typed(spec: dict) -> EngineSpec:
    return EngineSpec.of({"spec": spec})


def grace_seconds(spec: dict) -> int:
    """terminationGracePeriodSeconds >= drain time + margin: the drain is never cut short."""
    return _typed(spec).shutdown_timeout_seconds + SHUTDOWN_MARGIN_SECONDS


# ---- frontend -------------------------------------------------------------------------------


def frontend_args(spec: dict) -> list[str]:
    """`shoal router`: no EngineCore, it routes to the groups listed in the discovery file and
    follows that file as the operator rewrites it."""
    return ["router", "--model", spec["model"], "--served-model-name", served_name(spec),
            "--host", "0.0.0.0", "--port", str(L.HTTP_PORT),
            "--engine-discovery-file", f"{discovery.MOUNT_DIR}/{discovery.KEY}"]


def frontend_replicas(spec: dict) -> int:
    return _typed(spec).frontend_replicas


def frontend_deployment(body: dict) -> dict:
    name, spec = body["metadata"]["name"], spec_of(body)
    fe = spec.get("frontend") or {}
    pod_labels = common_labels(name, L.COMPONENT_FRONTEND)
    container = {
        "name": L.FRONTEND_CONTAINER,
        "image": _typed(spec).frontend_image,
        "imagePullPolicy": _typed(spec).image_pull_policy,
        # No `command`: the image's entrypoint (`tini -g -- shoal`) must stay PID 1 so that
        # signals reach the server and its exit code reaches the kubelet.
        "args": frontend_args(spec),
        "ports": [{"name": "http", "containerPort": L.HTTP_PORT, "protocol": "TCP"}],
        # Ready = can serve: /health answers 503 while no engine group is reachable.
        "readinessProbe": {"httpGet": {"path": "/health", "port": L.HTTP_PORT}, "periodSeconds": 5,
                           "failureThreshold": 2},
        # Alive = the process listens; engines being down is not a reason to restart a frontend.
        "livenessProbe": {"tcpSocket": {"port": L.HTTP_PORT}, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [{"name": "discovery", "mountPath": discovery.MOUNT_DIR, "readOnly": True}],
        # The frontend also watches the discovery ConfigMap through the API (its own
        # ServiceAccount may read only that ConfigMap): the kubelet refreshes the mounted file
        # up to a minute late, the watch within a second.
        "env": [{"name": discovery.CONFIGMAP_ENV, "value": discovery.configmap_name(name)},
                {"name": discovery.NAMESPACE_ENV,
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": ROUTING_ENV, "value": _typed(spec).frontend_routing}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if fe.get("resources"):
        container["resources"] = fe["resources"]
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(body, L.frontend_name(name), L.COMPONENT_FRONTEND),
        "spec": {
            "replicas": frontend_replicas(spec),
            "selector": {"matchLabels": pod_labels},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "serviceAccountName": L.frontend_name(name),
                    "containers": [container],
                    "volumes": [{"name": "discovery", "configMap": {"name": discovery.configmap_name(name)}}],
                    "terminationGracePeriodSeconds": grace_seconds(spec),
                },
            },
        },
    }
    return _with_hash(dep, dep["spec"])


def frontend_service_account(body: dict) -> dict:
    """The frontends' identity: it may read the discovery ConfigMap and nothing else."""
    name = body["metadata"]["name"]
    sa = {"apiVersion": "v1", "kind": "ServiceAccount",
          "metadata": _meta(body, L.frontend_name(name), L.COMPONENT_FRONTEND)}
    return _with_hash(sa, {})


def frontend_role(body: dict) -> dict:
    name = body["metadata"]["name"]
    rules = [{"apiGroups": [""], "resources": ["configmaps"],
              "resourceNames": [discovery.configmap_name(name)], "verbs": ["get", "list", "watch"]}]
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _meta(body, L.frontend_name(name), L.COMPONENT_FRONTEND), "rules": rules}
    return _with_hash(role, rules)


def frontend_role_binding(body: dict) -> dict:
    name, ns = body["metadata"]["name"], body["metadata"]["namespace"]
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": _meta(body, L.frontend_name(name), L.COMPONENT_FRONTEND),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": L.frontend_name(name)},
        "subjects": [{"kind": "ServiceAccount", "name": L.frontend_name(name), "namespace": ns}],
    }
    return _with_hash(binding, {"roleRef": binding["roleRef"], "subjects": binding["subjects"]})


def frontend_service(body: dict) -> dict:
    name = body["metadata"]["name"]
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(body, L.service_name(name), L.COMPONENT_FRONTEND),
        "spec": {
            "type": "ClusterIP",
            "selector": common_labels(name, L.COMPONENT_FRONTEND),
            "ports": [{"name": "http", "port": L.HTTP_PORT, "targetPort": L.HTTP_PORT, "protocol": "TCP"}],
        },
    }
    return _with_hash(svc, svc["spec"])


def discovery_data(body: dict, ready_groups: list[int]) -> dict:
    """The file frontends route by: only groups whose every rank is ready and that are not
    draining, so frontends never send to a dead or stopping engine."""
    name, ns = body["metadata"]["name"], body["metadata"]["namespace"]
    groups = {g: f"http://{L.rank_host(name, ns, g, 0)}:{L.HTTP_PORT}" for g in ready_groups}
    return {discovery.KEY: discovery.encode(served_name(spec_of(body)), groups)}


def discovery_configmap(body: dict, ready_groups: list[int]) -> dict:
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(body, discovery.configmap_name(body["metadata"]["name"]), L.COMPONENT_FRONTEND),
        "data": discovery_data(body, ready_groups),
    }
    return _with_hash(cm, cm["data"])


# ---- engine groups --------------------------------------------------------------------------


def ranks_service(body: dict) -> dict:
    """Headless Service: gives every rank the stable name `pod.NAME-ranks.NS.svc`. Not-ready
    addresses are published, because ranks must find rank 0 before anything is ready."""
    name, spec = body["metadata"]["name"], spec_of(body)
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(body, L.ranks_service_name(name), L.COMPONENT_ENGINE),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": engine_selector(name),
            "ports": [
                {"name": "http", "port": L.HTTP_PORT, "targetPort": L.HTTP_PORT, "protocol": "TCP"},
                {"name": "dist", "port": _typed(spec).master_port,
                 "targetPort": _typed(spec).master_port, "protocol": "TCP"},
            ],
        },
    }
    return _with_hash(svc, svc["spec"])


def engine_command(spec: dict) -> list[str] | None:
    """Shoal's image: None, keeping its entrypoint (`tini -g -- shoal`) as PID 1 so signals
    reach the engine and its exit code propagates. Stock vLLM images: run `vllm` explicitly."""
    return ["vllm"] if spec.get("runtime") == "VLLM" else None


def engine_args(body: dict, group: int, rank: int) -> list[str]:
    """The command line contract with `shoal serve` / `vllm serve` (vLLM's flag names). A stock
    vLLM gets only the flags its release accepts (vllm_version.FLAG_SINCE): a release before
    0.18 gets no `--shutdown-timeout` (it aborts in-flight requests on SIGTERM; see
    docs/vllm-runtime.md)."""
    name, ns, spec = body["metadata"]["name"], body["metadata"]["namespace"], spec_of(body)
    es = EngineSpec.of(body)
    nodes = es.nodes_per_group
    args = ["serve", spec["model"], "--served-model-name", served_name(spec),
            "--tensor-parallel-size", str(es.tensor_parallel_size)]
    if vllm_version.accepts(es, "--shutdown-timeout"):
        args += ["--shutdown-timeout", str(es.shutdown_timeout_seconds)]
    if rank == 0:
        args += ["--host", "0.0.0.0", "--port", str(L.HTTP_PORT)]
    if nodes > 1:
        if rank > 0:
            args.append("--headless")
        args += ["--nnodes", str(nodes), "--node-rank", str(rank),
                 "--master-addr", L.rank_host(name, ns, group, 0),
                 "--master-port", str(es.master_port)]
    return args + list((spec.get("engine") or {}).get("extraArgs") or [])


def engine_env(body: dict, group: int, rank: int) -> list[dict]:
    name, ns, spec = body["metadata"]["name"], body["metadata"]["namespace"], spec_of(body)
    field = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
    env = [
        {"name": "SHOAL_ENGINE", "value": name},
        {"name": "SHOAL_GROUP", "value": str(group)},
        {"name": "SHOAL_RANK", "value": str(rank)},
        {"name": "SHOAL_GROUP_SIZE", "value": str(_typed(spec).nodes_per_group)},
        {"name": "SHOAL_MASTER_ADDR", "value": L.rank_host(name, ns, group, 0)},
        {"name": "SHOAL_MASTER_PORT", "value": str(_typed(spec).master_port)},
        {"name": "SHOAL_TERMINATION_LOG", "value": "/dev/termination-log"},
        {"name": "POD_NAME", **field("metadata.name")},
        {"name": "POD_NAMESPACE", **field("metadata.namespace")},
        {"name": "NODE_NAME", **field("spec.nodeName")},
    ]
    return env + list((spec.get("engine") or {}).get("env") or [])


def rank0_probes(spec: dict) -> dict:
    """Only rank 0 serves HTTP. Startup covers weight loading (no fixed initialDelaySeconds);
    liveness after start turns a dead or hung EngineCore into a container exit the operator sees."""
    timeout = _typed(spec).startup_timeout_seconds
    health = {"httpGet": {"path": "/health", "port": L.HTTP_PORT}}
    return {
        "startupProbe": {**health, "periodSeconds": STARTUP_PROBE_PERIOD,
                         "failureThreshold": max(1, math.ceil(timeout / STARTUP_PROBE_PERIOD))},
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 5},
    }


def engine_pod(body: dict, group: int, rank: int) -> dict:
    name, spec = body["metadata"]["name"], spec_of(body)
    eng = spec.get("engine") or {}
    container = {
        "name": L.ENGINE_CONTAINER,
        "image": _typed(spec).image,
        "imagePullPolicy": _typed(spec).image_pull_policy,
        **({"command": cmd} if (cmd := engine_command(spec)) else {}),
        "args": engine_args(body, group, rank),
        "env": engine_env(body, group, rank),
        "ports": ([{"name": "http", "containerPort": L.HTTP_PORT, "protocol": "TCP"}] if rank == 0 else [])
        + [{"name": "dist", "containerPort": _typed(spec).master_port, "protocol": "TCP"}],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if rank == 0:
        container.update(rank0_probes(spec))  # headless ranks: no HTTP server, so no probes
    if eng.get("resources"):
        container["resources"] = eng["resources"]
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mv = spec.get("modelVolume")
    if mv:
        volumes.append({"name": "model", **(mv.get("volume") or {})})
        container["volumeMounts"].append({"name": "model", "mountPath": _typed(spec).model_mount_path,
                                          "readOnly": True})
    extra = {L.LABEL_GROUP: str(group), L.LABEL_RANK: str(rank), L.LABEL_REVISION: engine_revision(spec)}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(body, L.pod_name(name, group, rank), L.COMPONENT_ENGINE, extra),
        "spec": {
            "hostname": L.pod_name(name, group, rank),
            "subdomain": L.ranks_service_name(name),
            # The operator, not the kubelet, restarts: a dead rank must take its whole group
            # down, and an in-place restart would hide the death from everyone.
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": grace_seconds(spec),
            "containers": [container],
            "volumes": volumes,
        },
    }
    if _typed(spec).nodes_per_group > 1:
        # One rank per node: the ranks of a group split the model over nodes (and their
        # devices); two on one node would share what each expects to have alone.
        pod["spec"]["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {**engine_selector(name), L.LABEL_GROUP: str(group)}},
            "topologyKey": "kubernetes.io/hostname"}]}}
    return pod


def group_pods(body: dict, group: int) -> list[dict]:
    return [engine_pod(body, group, r) for r in range(EngineSpec.of(body).nodes_per_group)]


def pod_disruption_budget(body: dict, api_version: str = "policy/v1") -> dict:
    """Voluntary evictions take down at most one rank (so one group) at a time."""
    name = body["metadata"]["name"]
    pdb = {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": _meta(body, L.pdb_name(name), L.COMPONENT_ENGINE),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": engine_selector(name)}},
    }
    return _with_hash(pdb, pdb["spec"])


def render_children(body: dict, *, pdb_api_version: str | None = "policy/v1",
                    ready_groups: list[int] | None = None) -> list[dict]:
    """Every child object for `body` at its current spec, all groups at the current revision.
    `pdb_api_version=None` leaves the PDB out (a server without the policy API)."""
    replicas = EngineSpec.of(body).replicas
    out = [frontend_service_account(body), frontend_role(body), frontend_role_binding(body),
           frontend_deployment(body), frontend_service(body),
           discovery_configmap(body, ready_groups or []), ranks_service(body)]
    if pdb_api_version:
        out.append(pod_disruption_budget(body, pdb_api_version))
    for g in range(replicas):
        out += group_pods(body, g)
    return out
