{{/* The operator's command line (`shoal-operator`, operator/shoal/operator/__main__.py). */}}
{{- define "shoal.operatorArgs" -}}
- --liveness=http://0.0.0.0:{{ .Values.healthPort }}/healthz
- --metrics-port={{ .Values.metricsPort }}
- --log-level={{ .Values.logLevel }}
{{- if .Values.watchNamespaces }}
{{- range .Values.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
{{- end -}}
