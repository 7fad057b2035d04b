{{/* The operator's command line (shoal-operator, a thin wrapper over `kopf run`). */}}
{{- define "shoal.operatorArgs" -}}
- --standalone
- --liveness=http://0.0.0.0:{{ .Values.healthPort }}/healthz
{{- if .Values.watchNamespaces }}
{{- range .Values.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
{{- if eq .Values.logLevel "debug" }}
- --debug
{{- else if or (eq .Values.logLevel "warning") (eq .Values.logLevel "error") }}
- --quiet
{{- end }}
{{- end -}}
