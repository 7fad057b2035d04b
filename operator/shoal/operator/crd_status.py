"""The InferenceEngine's `status` schema: what the operator writes (status.py). Phases, stages
and condition types are listed from their enums (phases.py), the ones the operator sets."""

from __future__ import annotations

from shoal.operator.openapi import obj, typed, values
from shoal.operator.phases import ConditionType, GroupPhase, GroupStage, Phase


def _one_of(enum) -> str:
    return ", ".join(values(enum))


def _condition() -> dict:
    return obj(
        "One condition, in the Kubernetes API conventions.",
        {
            "type": typed("string", f"type of the condition: one of {_one_of(ConditionType)}."),
            "status": typed("string", "status: `True`, `False` or `Unknown`.",
                            enum=["True", "False", "Unknown"]),
            "reason": typed("string", "reason is a CamelCase word for machines. Example: "
                            "`GroupRestarting`."),
            "message": typed("string", "message is for humans: what happened and what to do."),
            "lastTransitionTime": typed("string", "lastTransitionTime is when status last "
                                        "changed.", format="date-time"),
            "observedGeneration": typed("integer", "observedGeneration is the spec generation "
                                        "this condition describes.", format="int64"),
        },
        required=["type", "status"],
    )


def _failure() -> dict:
    return obj(
        "lastFailure is the root cause of the most recent engine death: the rank that failed "
        "first, how its container ended and the engine's own message.",
        {
            "group": typed("integer", "group is the engine group index. Example: `1`.",
                           format="int32"),
            "rank": typed("integer", "rank is the rank that failed first (the root cause; later "
                          "ranks fail as a consequence). Example: `0`.", format="int32"),
            "pod": typed("string", "pod is the failed pod's name. Example: `llm-g1-r0`."),
            "node": typed("string", "node is the node the pod ran on."),
            "exitCode": typed("integer", "exitCode of the engine container. Example: `1`.",
                              format="int32"),
            "signal": typed("integer", "signal that killed the container, if any. Example: `9`.",
                            format="int32"),
            "reason": typed("string", "reason as the kubelet reported it. Example: `OOMKilled`, "
                            "`Error`, `Completed`."),
            "cause": typed("string", "cause is the class of the failure, from the engine's "
                           "termination message or the container state. Example: "
                           "`out_of_memory`."),
            "permanent": typed("boolean", "permanent is true when a restart cannot fix the cause "
                               "(configuration error, missing model): the group is not "
                               "restarted."),
            "message": typed("string", "message is the engine's own termination message (or the "
                             "log tail)."),
            "time": typed("string", "time the container finished.", format="date-time"),
            "process": typed("string", "process is the engine process that died first, when "
                             "the termination message names it: Shoal's supervisor in front "
                             "of a stock vLLM (runtime VLLM) names vLLM's process title. "
                             "Example: `EngineCore_DP0`, `Worker_TP1`, `APIServer`."),
        },
    )


def _rank() -> dict:
    return obj(
        "One rank of a group: its pod and the node it runs on.",
        {
            "rank": typed("integer", "rank within the group; 0 runs the EngineCore.",
                          format="int32"),
            "pod": typed("string", "pod is the rank's pod name. Example: `llm-g0-r1`."),
            "node": typed("string", "node the pod is scheduled on; empty while pending."),
            "phase": typed("string", "phase of the pod. Example: `Running`."),
            "ready": typed("boolean", "ready is the pod's Ready condition."),
        },
    )


def _time(description: str) -> dict:
    return typed("string", description, format="date-time")


def _group() -> dict:
    return obj(
        "The observed state of one engine group.",
        {
            "index": typed("integer", "index of the group. Example: `0`.", format="int32"),
            "phase": typed("string", f"phase of the group: one of {_one_of(GroupPhase)}.",
                           enum=values(GroupPhase)),
            "stage": typed("string", "stage is where a Starting or Ready group is in its "
                           f"start-up: one of {_one_of(GroupStage)}. Absent in other phases.",
                           enum=values(GroupStage)),
            "revision": typed("string", "revision is the hash of the engine spec the group runs."),
            "restarts": typed("integer", "restarts is the number of consecutive restarts of this "
                              "group.", format="int32"),
            "nextRestartTime": _time("nextRestartTime is when a backing-off group is recreated."),
            "readySince": _time("readySince is when every rank of the group last became ready."),
            "message": typed("string", "message explains the phase."),
            "failureKey": typed("string", "failureKey identifies the last death acted on (pod "
                                "uid/time), so each is handled once."),
            "drainStartTime": _time("drainStartTime is when rank 0 was asked to drain."),
            "stopReason": typed("string", "stopReason says why the group is stopping: "
                                "scale-down, update, delete."),
            "ranks": typed("array", "ranks lists every rank's pod and node.", items=_rank()),
            "download": _download(),
        },
    )


def _download() -> dict:
    return obj(
        "download is the hf:// model download of a Starting group while a rank's `model-fetch` "
        "init container runs (the lowest rank's last progress line); absent otherwise.",
        {
            "message": typed("string", "message is the progress. Example: `downloading 1.2 of "
                             "4.5 GiB (Qwen/Qwen2.5-7B-Instruct@main)`."),
            "percent": typed("integer", "percent downloaded. Example: `26`.", format="int32"),
            "eventPercent": typed("integer", "eventPercent is the percent of the last "
                                  "ModelDownloading Event (one per 10% or minute).",
                                  format="int32"),
            "eventTime": _time("eventTime is when the last ModelDownloading Event was posted."),
        },
    )


def _count(description: str) -> dict:
    return typed("integer", description, format="int32")


def _autoscaling() -> dict:
    return obj(
        "autoscaling is the operator's autoscaler's last decision (spec.autoscaling only), and "
        "what it remembers between passes.",
        {
            "currentGroups": _count("currentGroups is the number of Ready groups the decision "
                                    "measured. Example: `2`."),
            "desiredGroups": _count("desiredGroups is the group count the autoscaler set "
                                    "(what the operator runs, instead of spec.replicas). "
                                    "Example: `3`."),
            "metric": typed("string", "metric is the target's name. Example: "
                            "`requestsPerGroup`."),
            "value": typed("number", "value is the metric as last measured (absent when none "
                           "was). Example: `11.5`."),
            "target": typed("number", "target is the metric's target. Example: `8`."),
            "reason": typed("string", "reason says why the count is what it is, with the "
                            "numbers."),
            "lastScaleTime": _time("lastScaleTime is when the autoscaler last changed the "
                                   "count."),
            "lastScaleDirection": typed("string", "lastScaleDirection of that change: `Up` or "
                                        "`Down`.", enum=["Up", "Down"]),
            "upSince": _time("upSince is since when more groups are wanted (scale-up "
                             "stabilization)."),
            "upTo": _count("upTo is the fewest groups wanted since upSince."),
            "downSince": _time("downSince is since when fewer groups are wanted (scale-down "
                               "delay)."),
            "downTo": _count("downTo is the most groups wanted since downSince."),
        },
    )


def status_schema() -> dict:
    conditions = typed("array", f"conditions: {_one_of(ConditionType)}; and Autoscaling while "
                       "spec.autoscaling is set (False, HPAConflict, when an HPA targets the "
                       "resource).", items=_condition(),
                       **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    return obj(
        "status is the observed state, written by the operator only.",
        {
            "observedGeneration": typed("integer", "observedGeneration is the spec generation "
                                        "the status describes.", format="int64"),
            "phase": typed("string", f"phase summarises the resource: one of {_one_of(Phase)}.",
                           enum=values(Phase)),
            "replicas": _count("replicas is the number of engine groups that exist (scale "
                               "subresource)."),
            "readyReplicas": _count("readyReplicas is the number of groups with every rank "
                                    "ready."),
            "updatedReplicas": _count("updatedReplicas is the number of groups at the current "
                                      "revision."),
            "ready": typed("string", "ready is `readyReplicas/spec.replicas`, for `kubectl get`. "
                           "Example: `2/3`."),
            "selector": typed("string", "selector is the label selector of the engine pods "
                              "(scale subresource)."),
            "endpoint": typed("string", "endpoint is the in-cluster OpenAI base URL. Example: "
                              "`http://llm.default.svc:8000/v1`."),
            "restartCount": _count("restartCount is the total number of group restarts since "
                                   "creation."),
            "revision": typed("string", "revision is the hash of the current engine spec."),
            "conditions": conditions,
            "groups": typed("array", "groups is the state of every engine group, rank by rank.",
                            items=_group()),
            "lastFailure": _failure(),
            "autoscaling": _autoscaling(),
        },
    )
