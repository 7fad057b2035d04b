"""Pure functions: an InferenceEngine's identity and typed spec in, Kubernetes manifests out
(dask-kubernetes style). Every function takes the `EngineRef` and `EngineSpec` a pass parsed once
(`spec.parse`), never the raw body.

Nothing here talks to the API server, so every manifest is testable without a cluster and the
chart work can validate `render_children()` against Kubernetes' own schemas.

Children of one InferenceEngine `NAME` in namespace `NS`:
- Deployment `NAME-frontend` running `shoal router`, Service `NAME` (ClusterIP, port 8000): the
  in-cluster OpenAI endpoint.
- ConfigMap `NAME-engines`: the ready groups' rank-0 addresses, mounted into every frontend
  (the discovery file; see docs/operator.md, "Frontend discovery").
- ServiceAccount, Role, RoleBinding `NAME-frontend`: the frontends may read that ConfigMap (and,
  when the engine scales to zero, renew its wake Lease).
- Lease `NAME-wake` (coordination.k8s.io, only with `spec.autoscaling.minReplicas: 0`): a router
  holding a request for the engine at zero renews it; the operator starts a group.
- Headless Service `NAME-ranks` and the engine pods `NAME-gG-rR`: render_engine.py.
- PodDisruptionBudget `NAME-engines` (policy/v1, or policy/v1beta1 on old servers).
"""

from __future__ import annotations

from shoal.contract import discovery
from shoal.contract.routing import ROUTING_ENV
from shoal.operator import kv_parts, template
from shoal.operator import labels as L
from shoal.operator.render_common import (
    SHUTDOWN_MARGIN_SECONDS,
    common_labels,
    engine_selector,
    grace_seconds,
    metadata,
    selector_string,
    with_hash,
)
from shoal.operator.render_engine import (
    engine_args,
    engine_command,
    engine_env,
    engine_pod,
    group_pods,
    operator_pod,
    rank0_probes,
    ranks_service,
)
from shoal.operator.spec import EngineRef, EngineSpec

__all__ = [
    "SHUTDOWN_MARGIN_SECONDS", "common_labels", "discovery_configmap", "discovery_data",
    "engine_args", "engine_command", "engine_env", "engine_pod", "engine_selector",
    "frontend_args", "frontend_deployment", "frontend_operator_template", "frontend_role",
    "frontend_role_binding", "frontend_service", "frontend_service_account", "grace_seconds",
    "group_pods", "operator_pod", "pod_disruption_budget", "rank0_probes",
    "ranks_service", "render_children", "selector_string", "wake_lease",
]

# ---- frontend -------------------------------------------------------------------------------


def frontend_args(spec: EngineSpec) -> list[str]:
    """`shoal router`: no EngineCore, it routes to the groups listed in the discovery file and
    follows that file as the operator rewrites it."""
    return ["router", "--model", spec.source.arg, "--served-model-name", spec.served_model_name,
            "--host", "0.0.0.0", "--port", str(L.HTTP_PORT),
            "--engine-discovery-file", f"{discovery.MOUNT_DIR}/{discovery.KEY}"]


def _frontend_container(ref: EngineRef, spec: EngineSpec) -> dict:
    container = {
        "name": L.FRONTEND_CONTAINER,
        "image": spec.frontend_image,
        "imagePullPolicy": spec.image_pull_policy,
        # No `command`: the image's entrypoint (`tini -g -- shoal`) must stay PID 1 so that
        # signals reach the server and its exit code reaches the kubelet.
        "args": frontend_args(spec),
        "ports": [{"name": "http", "containerPort": L.HTTP_PORT, "protocol": "TCP"}],
        # Ready = can serve: /health answers 503 while no engine group is reachable.
        "readinessProbe": {"httpGet": {"path": "/health", "port": L.HTTP_PORT},
                           "periodSeconds": 5, "failureThreshold": 2},
        # Alive = the process listens; engines being down is not a reason to restart a frontend.
        "livenessProbe": {"tcpSocket": {"port": L.HTTP_PORT}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "volumeMounts": [{"name": "discovery", "mountPath": discovery.MOUNT_DIR,
                          "readOnly": True}],
        # The frontend also watches the discovery ConfigMap through the API (its own
        # ServiceAccount may read only that ConfigMap): the kubelet refreshes the mounted file
        # up to a minute late, the watch within a second.
        "env": [{"name": discovery.CONFIGMAP_ENV, "value": discovery.configmap_name(ref.name)},
                {"name": discovery.NAMESPACE_ENV,
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                # the wake Lease's holderIdentity (k8s_wake.py)
                {"name": discovery.POD_ENV,
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": ROUTING_ENV, "value": spec.frontend_routing}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    kv = kv_parts.frontend_parts(spec)  # kv-aware: the model's tokenizer, the events' ports
    container["volumeMounts"] += kv.mounts
    container["env"] += kv.env
    if spec.frontend_resources:
        container["resources"] = spec.frontend_resources
    return container


# The taints the node controller puts on a node that stops answering or reports NotReady.
LOST_NODE_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


def frontend_placement(spec: EngineSpec, labels: dict) -> dict:
    """One lost node must not take the Service down while another could serve: the frontends
    spread over nodes (preferred, so one node still runs them all), and a frontend on a node lost
    for restartPolicy.nodeLostSeconds is evicted and replaced then, not after Kubernetes' default
    5 minutes (a template's tolerations and constraints are added to these)."""
    return {
        "tolerations": [{"key": key, "operator": "Exists", "effect": "NoExecute",
                         "tolerationSeconds": spec.restart.node_lost_seconds}
                        for key in LOST_NODE_TAINTS],
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": dict(labels)}}],
    }


def frontend_operator_template(ref: EngineRef, spec: EngineSpec) -> dict:
    """The frontends' pod template before spec.frontend.template: validation checks a template
    against it."""
    volume = {"name": "discovery", "configMap": {"name": discovery.configmap_name(ref.name)}}
    kv = kv_parts.frontend_parts(spec)
    labels = common_labels(ref.name, L.COMPONENT_FRONTEND)
    return {
        "metadata": {"labels": labels},
        "spec": {
            **frontend_placement(spec, labels),
            "serviceAccountName": L.frontend_name(ref.name),
            **({"initContainers": kv.init_containers} if kv.init_containers else {}),
            "containers": [_frontend_container(ref, spec)],
            "volumes": [volume, *kv.volumes],
            "terminationGracePeriodSeconds": grace_seconds(spec),
        },
    }


def frontend_deployment(ref: EngineRef, spec: EngineSpec) -> dict:
    pod_labels = common_labels(ref.name, L.COMPONENT_FRONTEND)
    rolling = {"maxUnavailable": 0, "maxSurge": 1}
    pod = template.merge(frontend_operator_template(ref, spec), spec.frontend_template)
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(ref, L.frontend_name(ref.name), L.COMPONENT_FRONTEND),
        "spec": {
            "replicas": spec.frontend_replicas,
            "selector": {"matchLabels": pod_labels},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "template": pod,
        },
    }
    return with_hash(dep, dep["spec"])


def frontend_service_account(ref: EngineRef) -> dict:
    """The frontends' identity: it may read the discovery ConfigMap and nothing else."""
    sa = {"apiVersion": "v1", "kind": "ServiceAccount",
          "metadata": metadata(ref, L.frontend_name(ref.name), L.COMPONENT_FRONTEND)}
    return with_hash(sa, {})


def frontend_role(ref: EngineRef, spec: EngineSpec) -> dict:
    """Read the discovery ConfigMap; renew the wake Lease of an engine that scales to zero (a
    Lease, not the InferenceEngine: a frontend that may patch its engine could change its spec)."""
    rules = [{"apiGroups": [""], "resources": ["configmaps"],
              "resourceNames": [discovery.configmap_name(ref.name)],
              "verbs": ["get", "list", "watch"]}]
    if spec.wakeable:
        rules.append({"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                      "resourceNames": [discovery.wake_lease_name(ref.name)],
                      "verbs": ["get", "patch"]})
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": metadata(ref, L.frontend_name(ref.name), L.COMPONENT_FRONTEND),
            "rules": rules}
    return with_hash(role, rules)


def frontend_role_binding(ref: EngineRef) -> dict:
    name = L.frontend_name(ref.name)
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": metadata(ref, name, L.COMPONENT_FRONTEND),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ref.namespace}],
    }
    return with_hash(binding, {"roleRef": binding["roleRef"], "subjects": binding["subjects"]})


def wake_lease(ref: EngineRef) -> dict:
    """The engine's wake Lease: created empty, then only renewed by the routers (its hash covers
    nothing, so the operator never writes it again); the operator reads `spec.renewTime`."""
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": metadata(ref, discovery.wake_lease_name(ref.name),
                                  L.COMPONENT_FRONTEND),
             "spec": {}}
    return with_hash(lease, {})


def frontend_service(ref: EngineRef) -> dict:
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(ref, L.service_name(ref.name), L.COMPONENT_FRONTEND),
        "spec": {
            "type": "ClusterIP",
            "selector": common_labels(ref.name, L.COMPONENT_FRONTEND),
            "ports": [{"name": "http", "port": L.HTTP_PORT, "targetPort": L.HTTP_PORT,
                       "protocol": "TCP"}],
        },
    }
    return with_hash(svc, svc["spec"])


# ---- discovery and disruption budget --------------------------------------------------------


def discovery_data(ref: EngineRef, spec: EngineSpec, ready_groups: list[int]) -> dict:
    """The file frontends route by: only groups whose every rank is ready and that are not
    draining, so frontends never send to a dead or stopping engine."""
    groups = {g: f"http://{L.rank_host(ref.name, ref.namespace, g, 0)}:{L.HTTP_PORT}"
              for g in ready_groups}
    return {discovery.KEY: discovery.encode(spec.served_model_name, groups,
                                            wakeable=spec.wakeable)}


def discovery_configmap(ref: EngineRef, spec: EngineSpec, ready_groups: list[int]) -> dict:
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(ref, discovery.configmap_name(ref.name), L.COMPONENT_FRONTEND),
        "data": discovery_data(ref, spec, ready_groups),
    }
    return with_hash(cm, cm["data"])


def pod_disruption_budget(ref: EngineRef, api_version: str = "policy/v1") -> dict:
    """Voluntary evictions take down at most one rank (so one group) at a time."""
    pdb = {
        "apiVersion": api_version,
        "kind": "PodDisruptionBudget",
        "metadata": metadata(ref, L.pdb_name(ref.name), L.COMPONENT_ENGINE),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": engine_selector(ref.name)}},
    }
    return with_hash(pdb, pdb["spec"])


# ---- everything -----------------------------------------------------------------------------


def singletons(ref: EngineRef, spec: EngineSpec, serving: list[int],
               pdb_api_version: str | None) -> list[dict]:
    """The children that are not engine pods, in dependency order: what the frontend pods
    mount and read (ServiceAccount, Role, the discovery ConfigMap) comes before the Deployment
    that creates them. `pdb_api_version=None` leaves the PDB out."""
    out = [frontend_service_account(ref), frontend_role(ref, spec), frontend_role_binding(ref),
           discovery_configmap(ref, spec, serving), ranks_service(ref, spec)]
    if spec.wakeable:
        out.append(wake_lease(ref))
    out += [frontend_deployment(ref, spec), frontend_service(ref)]
    if pdb_api_version:
        out.append(pod_disruption_budget(ref, pdb_api_version))
    return out


def render_children(ref: EngineRef, spec: EngineSpec, *,
                    pdb_api_version: str | None = "policy/v1",
                    ready_groups: list[int] | None = None) -> list[dict]:
    """Every child object at the current spec, all groups at the current revision.
    `pdb_api_version=None` leaves the PDB out (a server without the policy API)."""
    out = singletons(ref, spec, ready_groups or [], pdb_api_version)
    for g in range(spec.replicas):
        out += group_pods(ref, spec, g)
    return out
