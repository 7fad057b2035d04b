{{- /*
Shoal's Prometheus alerting rules: the one definition (docs/packaging.md, "Alerts"). Rendered as
a plain Prometheus rule file (`groups:`) into a PrometheusRule's spec and/or a ConfigMap
(templates/alerts.yaml); thresholds and durations are monitoring.alerts values.

What they read, as the chart's scrape configurations label it (PodMonitors in monitoring.yaml,
or examples/autoscaling/prometheus-scrape.yaml):
- the operator's shoal_engine_* series (operator/shoal/operator/metrics.py), labelled namespace,
  inference_engine, engine_group by the operator itself;
- every group's rank 0 (vLLM's vllm:* series), with namespace, pod, inference_engine and
  engine_group from the scrape; `inference_engine!=""` keeps the gateway's fleet sums out;
- the frontends' shoal_router_* series, with namespace, pod and inference_engine.
Series are aggregated by those labels, so an operator or engine pod that is replaced (a new
`instance`) does not restart an alert's `for`.

Prometheus' own templates ({{ $labels.x }}, {{ $value }}) are written as Helm raw strings.
*/ -}}
{{- define "shoal.alertRules" -}}
{{- $a := .Values.monitoring.alerts -}}
groups:
  - name: shoal-engine-groups
    rules:
      - alert: ShoalEngineGroupDown
        # A group that died (consecutive restarts > 0, or Failed) and is not Ready again.
        expr: |
          max by (namespace, inference_engine, engine_group) (shoal_engine_group_ready) == 0
          and on (namespace, inference_engine, engine_group)
          (
            max by (namespace, inference_engine, engine_group) (shoal_engine_group_consecutive_restarts) > 0
            or
            max by (namespace, inference_engine, engine_group) (shoal_engine_group_phase{phase="Failed"}) == 1
          )
        for: {{ $a.groupDownFor }}
        labels:
          severity: warning
        annotations:
          summary: {{ `'Engine group {{ $labels.engine_group }} of {{ $labels.namespace }}/{{ $labels.inference_engine }} is down'` }}
          description: {{ printf "'It died and has not been Ready again for %s: the operator restarts it with its back-off, or it failed for good. Why: kubectl describe ie -n {{ $labels.namespace }} {{ $labels.inference_engine }} (lastFailure, EngineDied Events).'" $a.groupDownFor }}
      - alert: ShoalEngineGroupRestartLoop
        expr: |
          max by (namespace, inference_engine, engine_group) (shoal_engine_group_consecutive_restarts) >= {{ $a.restartLoopRestarts }}
        labels:
          severity: warning
        annotations:
          summary: {{ `'Engine group {{ $labels.engine_group }} of {{ $labels.namespace }}/{{ $labels.inference_engine }} is restarting in a loop'` }}
          description: {{ `'{{ $value }} restarts without staying Ready for restartPolicy.resetAfterSeconds. The cause: kubectl describe ie -n {{ $labels.namespace }} {{ $labels.inference_engine }} (lastFailure).'` }}
      - alert: ShoalEngineGroupNotReady
        # Not Ready for longer than the engine's start-up bound (engine.startupTimeoutSeconds +
        # the stall margin), across the operator's own restarts of it.
        expr: |
          time() - min by (namespace, inference_engine, engine_group) (shoal_engine_group_not_ready_since_timestamp_seconds)
          > on (namespace, inference_engine) group_left ()
          max by (namespace, inference_engine) (shoal_engine_startup_bound_seconds)
        labels:
          severity: warning
        annotations:
          summary: {{ `'Engine group {{ $labels.engine_group }} of {{ $labels.namespace }}/{{ $labels.inference_engine }} is not Ready past its start-up bound'` }}
          description: {{ `'Not Ready for {{ $value | humanizeDuration }}, longer than engine.startupTimeoutSeconds + 120s. What it waits for: kubectl get ie -n {{ $labels.namespace }} {{ $labels.inference_engine }} -o yaml (status.groups[].message, stage).'` }}
  - name: shoal-serving
    rules:
      - alert: ShoalKVCacheNearFull
        expr: |
          max by (namespace, inference_engine, engine_group) (vllm:kv_cache_usage_perc{inference_engine!=""}) > {{ $a.kvCacheUsage }}
        for: {{ $a.kvCacheFor }}
        labels:
          severity: warning
        annotations:
          summary: {{ `'KV cache of {{ $labels.namespace }}/{{ $labels.inference_engine }} group {{ $labels.engine_group }} is near full'` }}
          description: {{ `'KV-cache usage {{ $value | humanizePercentage }}: requests wait or are preempted. Add groups (spec.replicas, spec.autoscaling) or memory (--gpu-memory-utilization, --max-model-len).'` }}
      - alert: ShoalWaitingRequestsGrowing
        expr: |
          sum by (namespace, inference_engine) (vllm:num_requests_waiting{inference_engine!=""}) > {{ $a.waitingRequests }}
          and on (namespace, inference_engine)
          sum by (namespace, inference_engine) (deriv(vllm:num_requests_waiting{inference_engine!=""}[5m])) > 0
        for: {{ $a.waitingFor }}
        labels:
          severity: warning
        annotations:
          summary: {{ `'Waiting requests of {{ $labels.namespace }}/{{ $labels.inference_engine }} keep growing'` }}
          description: {{ `'{{ $value }} requests wait and the queue grows: the groups cannot keep up. Add groups (spec.replicas, spec.autoscaling).'` }}
      - alert: ShoalTTFTAboveObjective
        expr: |
          histogram_quantile(0.9, sum by (namespace, inference_engine, le) (rate(vllm:time_to_first_token_seconds_bucket{inference_engine!=""}[5m]))) > {{ $a.ttftP90ObjectiveSeconds }}
        for: {{ $a.ttftFor }}
        labels:
          severity: warning
        annotations:
          summary: {{ `'Time to first token of {{ $labels.namespace }}/{{ $labels.inference_engine }} is above its objective'` }}
          description: {{ printf "'p90 over 5 minutes is {{ $value | humanizeDuration }}; the objective is %vs.'" $a.ttftP90ObjectiveSeconds }}
      - alert: ShoalFrontendNoReadyGroup
        # A frontend that can route to no group: every request through it fails (503). Not
        # while the engine is scaled to zero on purpose (0 desired groups).
        expr: |
          max by (namespace, inference_engine, pod) (shoal_router_groups_usable{inference_engine!=""}) == 0
          unless on (namespace, inference_engine)
          (max by (namespace, inference_engine) (shoal_engine_groups_desired) == 0)
        for: {{ $a.frontendNoGroupFor }}
        labels:
          severity: critical
        annotations:
          summary: {{ `'Frontend {{ $labels.pod }} of {{ $labels.namespace }}/{{ $labels.inference_engine }} has no ready engine group'` }}
          description: {{ `'Its discovery list names no usable group: requests through it are refused. The groups: kubectl get ie -n {{ $labels.namespace }} {{ $labels.inference_engine }}.'` }}
  - name: shoal-operator
    rules:
      - alert: ShoalOperatorDown
        expr: |
          absent(shoal_operator_build_info)
        for: {{ $a.operatorDownFor }}
        labels:
          severity: critical
        annotations:
          summary: 'No Shoal operator is running'
          description: 'No operator has been scraped: engines keep serving, but no group is restarted, scaled or updated. kubectl -n {{ .Release.Namespace }} get pods -l app.kubernetes.io/component=operator'
{{- end -}}
