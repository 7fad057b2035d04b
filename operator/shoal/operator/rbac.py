"""Least privilege: exactly the API groups, resources and verbs the operator uses.

The chart turns RULES into a ClusterRole (with --all-namespaces) or a Role per watched
namespace. NAMESPACE_RULES is needed in namespaced mode: kopf lists and watches namespaces
whenever it is given --namespace (to follow globs), and never with --all-namespaces; without it
kopf retries a forbidden namespace list for ~20 s at start (found by test_rbac_enforced.py).
Each rule says who uses it.
"""

from __future__ import annotations

RULES: list[dict] = [
    # kopf watches the resources; kopf patches finalizers and its annotations (metadata only).
    {
        "apiGroups": ["shoal.dev"],
        "resources": ["inferenceengines"],
        "verbs": ["get", "list", "watch", "patch"],
    },
    # reconcile.py writes status through the status subresource only.
    {"apiGroups": ["shoal.dev"], "resources": ["inferenceengines/status"], "verbs": ["patch"]},
    # Owner references with blockOwnerDeletion need update on the owner's finalizers.
    {"apiGroups": ["shoal.dev"], "resources": ["inferenceengines/finalizers"], "verbs": ["update"]},
    # InferenceAdapters: watched (kopf), their finalizer (unload before delete), their status
    # (adapter_pass.py).
    {
        "apiGroups": ["shoal.dev"],
        "resources": ["inferenceadapters"],
        "verbs": ["get", "list", "watch", "patch"],
    },
    {"apiGroups": ["shoal.dev"], "resources": ["inferenceadapters/status"], "verbs": ["patch"]},
    # The frontends' API key, where spec.frontend.template takes it from a Secret: the adapter
    # probe through the Service sends it (adapter_pass.py). Read, never listed.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
    # Engine pods are owned directly: listed and watched, created, deleted (never updated).
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "create", "delete"]},
    # The tail of a running `model-fetch` init container's log: its download progress, shown
    # in the group's status (fetch_progress.py).
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    # Frontend Service, headless ranks Service: created, then patched on change.
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "create", "patch"]},
    # The discovery ConfigMap: created, then patched; list/watch only because the frontends' Role
    # grants them on it, and RBAC lets the operator grant only what it holds.
    {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "verbs": ["get", "list", "watch", "create", "patch"],
    },
    # The frontends' ServiceAccount, and its Role and RoleBinding (read the discovery ConfigMap).
    {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["get", "create", "patch"]},
    {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["roles", "rolebindings"],
        "verbs": ["get", "create", "patch"],
    },
    # spec.autoscaling.minReplicas 0: the wake Lease `NAME-wake` is created with the engine and
    # read at zero (a renewTime newer than the scale-down starts a group); get and patch only
    # because the frontends' Role grants them on it (RBAC lets the operator grant what it holds).
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "patch"],
    },
    # Engine deaths, restarts and drains as Events (ours and kopf's own error reports).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # The frontend Deployment.
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "create", "patch"]},
    # The engines' PodDisruptionBudget (policy/v1, or v1beta1 on 1.20: same group).
    {
        "apiGroups": ["policy"],
        "resources": ["poddisruptionbudgets"],
        "verbs": ["get", "create", "patch"],
    },
    # spec.autoscaling: an HPA aimed at an autoscaled InferenceEngine is reported in its
    # Autoscaling condition (autoscale_hpa.py lists them, at most once a minute per namespace).
    {
        "apiGroups": ["autoscaling"],
        "resources": ["horizontalpodautoscalers"],
        "verbs": ["list"],
    },
    # Node health (node_index.py): a rank on a node NotReady past restartPolicy.nodeLostSeconds
    # is a dead group (cluster-scoped: needs a ClusterRole even for a namespaced operator).
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
    # kopf follows CRDs so that a CRD installed after the operator started is still served
    # (cluster-scoped: needs a ClusterRole even for a namespaced operator).
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
]

NAMESPACE_RULES: list[dict] = [
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
]
