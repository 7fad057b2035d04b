{{/*
The operator's API permissions: exactly shoal.operator.rbac.RULES (operator/shoal/operator/rbac.py),
split by scope. tests/packaging/test_chart.py fails on any difference and prints what to paste here.
Namespaced rules go into the ClusterRole (cluster-wide mode) or into a Role per watched namespace;
cluster-scoped rules always need the ClusterRole.
*/}}

{{- define "shoal.rules.namespaced" -}}
# kopf watches the resources and patches finalizers and its annotations.
- apiGroups: ["shoal.dev"]
  resources: ["inferenceengines"]
  verbs: ["get", "list", "watch", "patch"]
# Status is written through the status subresource only.
- apiGroups: ["shoal.dev"]
  resources: ["inferenceengines/status"]
  verbs: ["patch"]
# Owner references with blockOwnerDeletion need update on the owner's finalizers.
- apiGroups: ["shoal.dev"]
  resources: ["inferenceengines/finalizers"]
  verbs: ["update"]
# InferenceAdapters: watched, their finalizer (unload before delete), their status.
- apiGroups: ["shoal.dev"]
  resources: ["inferenceadapters"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["shoal.dev"]
  resources: ["inferenceadapters/status"]
  verbs: ["patch"]
# The frontends' API key from its Secret, sent by the adapter probe through the Service.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
# Engine pods are owned directly: listed, watched, created and deleted (never updated).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "delete"]
# The tail of a running model-fetch init container's log: download progress in the status.
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# Frontend Service, headless ranks Service.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
# The discovery ConfigMap; list/watch because the frontends' Role grants them on it (RBAC lets
# the operator grant only what it holds).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
# The frontends' ServiceAccount, Role and RoleBinding (they read the discovery ConfigMap).
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch"]
# minReplicas 0: the wake Lease NAME-wake, created with the engine and read at zero; get and
# patch because the frontends' Role grants them on it.
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "create", "patch"]
# Engine deaths, restarts and drains as Events.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# The frontend Deployment.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch"]
# The engines' PodDisruptionBudget (policy/v1, or v1beta1 on old servers).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
# spec.autoscaling: an HPA aimed at an autoscaled InferenceEngine is reported in a condition.
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["list"]
{{- end -}}

{{- define "shoal.rules.cluster" -}}
# Node health: a rank on a node NotReady past restartPolicy.nodeLostSeconds is a dead group.
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
# kopf follows CRDs, so a CRD installed after the operator started is still served.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end -}}

{{- /*
shoal.operator.rbac.NAMESPACE_RULES, namespaced mode only: kopf lists and watches namespaces
whenever it is given --namespace (to follow namespaces that come and go); without this grant it
retries the forbidden list for ~20 s at start and then assumes the listed namespaces exist.
Cluster-wide (--all-namespaces) kopf never reads namespaces.
*/ -}}
{{- define "shoal.rules.namespaceObserver" -}}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
{{- end -}}
