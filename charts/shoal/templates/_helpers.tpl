{{/* Names, labels and the operator's RBAC rules, shared by every template. */}}

{{- define "shoal.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "shoal.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "shoal.operatorName" -}}
{{- printf "%s-operator" (include "shoal.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "shoal.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shoal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "shoal.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "shoal.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: shoal
{{- end -}}

{{- define "shoal.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "shoal.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "shoal.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "shoal.fetchImage" -}}
{{- $img := .Values.modelFetch.image -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{- define "shoal.namespaced" -}}
{{- if .Values.watchNamespaces }}true{{ end -}}
{{- end -}}

{{- define "shoal.gatewayName" -}}
{{- printf "%s-gateway" (include "shoal.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "shoal.gatewaySelectorLabels" -}}
app.kubernetes.io/name: {{ include "shoal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "shoal.gatewayLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "shoal.gatewaySelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: shoal
{{- end -}}

{{- define "shoal.gatewayImage" -}}
{{- $tag := default .Chart.AppVersion .Values.gateway.image.tag -}}
{{- if .Values.gateway.image.digest -}}
{{- printf "%s@%s" .Values.gateway.image.repository .Values.gateway.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.gateway.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The namespaces whose InferenceEngines the gateway serves: gateway.namespaces, else the release's. */}}
{{- define "shoal.gatewayNamespaces" -}}
{{- if .Values.gateway.namespaces -}}
{{- toJson .Values.gateway.namespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/*
A pod on a node that stopped answering (or reports NotReady) is evicted after
lostNodeTolerationSeconds instead of Kubernetes' default 300 s, so the Deployment replaces it on
another node sooner (issue 29: a lost node). Empty when the value is null.
*/}}
{{- define "shoal.lostNodeTolerations" -}}
{{- if kindIs "float64" .Values.lostNodeTolerationSeconds }}
- key: node.kubernetes.io/unreachable
  operator: Exists
  effect: NoExecute
  tolerationSeconds: {{ int .Values.lostNodeTolerationSeconds }}
- key: node.kubernetes.io/not-ready
  operator: Exists
  effect: NoExecute
  tolerationSeconds: {{ int .Values.lostNodeTolerationSeconds }}
{{- else }}
[]
{{- end }}
{{- end -}}
