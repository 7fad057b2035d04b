{{/*
The operator's API permissions, exactly shoal.operator.rbac.RULES split by scope.
Keep in sync with operator/shoal/operator/rbac.py: tests/packaging/test_chart.py fails on any
difference and prints the YAML to paste here.
*/}}

{{- define "shoal.rules.namespaced" -}}
- apiGroups: ["shoal.dev"]
  resources: ["inferenceengines"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["shoal.dev"]
  resources: ["inferenceengines/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}

{{- define "shoal.rules.cluster" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end -}}
