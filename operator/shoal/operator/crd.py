"""The InferenceEngine CustomResourceDefinition, defined once, here, in Python.

`python -m shoal.operator.crd --write` renders it into `crds/` and `charts/shoal/crds/`; a test
fails when either file differs from `crd()`. The schema is structural (every field typed), so
the API server prunes unknown fields, applies the defaults and rejects out-of-bound values at
`kubectl apply` time. Every description follows LeaderWorkerSet's style: field name first, what
it means, an example, the default.

Only `apiextensions.k8s.io/v1` features that a 1.20 API server already has are used (no CEL
validation rules, no `x-kubernetes-validations`): cross-field checks live in `validation.py`
and surface as a status condition.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import yaml
from shoal.contract.routing import ROUTINGS
from shoal.operator.labels import API_VERSION, GROUP, KIND, PLURAL, VERSION
from shoal.operator.phases import GroupPhase, GroupStage, Phase
from shoal.operator.spec import DEFAULTS

CRD_NAME = f"{PLURAL}.{GROUP}"
FILE_NAME = f"{CRD_NAME}.yaml"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
OUTPUTS = (REPO_ROOT / "crds" / FILE_NAME, REPO_ROOT / "charts" / "shoal" / "crds" / FILE_NAME)

# Enums named by behaviour (LWS style).
RESTART_POLICIES = ["RecreateGroupOnFailure", "Never"]
RUNTIMES = ["Shoal", "VLLM"]
PHASES = [p.value for p in Phase]
GROUP_PHASES = [p.value for p in GroupPhase]
GROUP_STAGES = [s.value for s in GroupStage]
CONDITION_TYPES = ["Ready", "Progressing", "Degraded", "EngineDead", "SpecValid"]


def _s(type_: str, description: str, **extra) -> dict:
    return {"type": type_, "description": description, **extra}


def _obj(description: str, properties: dict, *, required: list[str] | None = None, **extra) -> dict:
    out = {"type": "object", "description": description, "properties": properties, **extra}
    if required:
        out["required"] = required
    return out


def _resources(who: str) -> dict:
    quantity = {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
                "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"}
    return _obj(
        f"resources are the compute resources of each {who} container, as in a Pod's "
        "`resources`. Example: `{limits: {nvidia.com/gpu: 8}, requests: {cpu: 16, memory: 64Gi}}`. "
        "Default: none (best effort).",
        {
            "limits": _s("object", "limits is the most the container may use. Example: `{nvidia.com/gpu: 8}`.",
                         additionalProperties=quantity),
            "requests": _s("object", "requests is what the scheduler reserves. Example: `{cpu: 4, memory: 16Gi}`.",
                           additionalProperties=quantity),
        },
    )


def _env() -> dict:
    return _s(
        "array",
        "env lists extra environment variables for every engine container, as in a Pod's `env` "
        "(`valueFrom` is passed through unchanged). Example: `[{name: NCCL_DEBUG, value: INFO}]`. "
        "Default: none.",
        items=_obj(
            "One environment variable.",
            {
                "name": _s("string", "name of the variable. Example: `NCCL_DEBUG`.", minLength=1),
                "value": _s("string", "value of the variable. Example: `INFO`."),
                "valueFrom": _obj("valueFrom takes the value from a Secret, ConfigMap or field, as in a Pod.",
                                  {}, **{"x-kubernetes-preserve-unknown-fields": True}),
            },
            required=["name"],
        ),
    )


def spec_schema() -> dict:
    return _obj(
        "spec is the desired state: which model to serve, how many engine groups, how each group is "
        "split over ranks, and how engines stop and restart.",
        {
            "model": _s("string", "model is the path of the model directory inside the engine "
                        "container (usually under `modelVolume.mountPath`) or a model name the image "
                        "can resolve. Required. Example: `/models/llama-3-8b`.", minLength=1),
            "servedModelName": _s("string", "servedModelName is the name clients put in the OpenAI "
                                  "`model` field. Example: `llama-3-8b`. Default: the value of `model`."),
            "image": _s("string", "image is the container image of engines and frontends. Example: "
                        "`ghcr.io/shoal-dev/shoal:0.1.0`. Default: `ghcr.io/shoal-dev/shoal:0.1.0`.",
                        default=DEFAULTS["image"], minLength=1),
            "imagePullPolicy": _s("string", "imagePullPolicy as in a Pod. Example: `Always`. "
                                  "Default: `IfNotPresent`.", enum=["Always", "IfNotPresent", "Never"],
                                  default=DEFAULTS["imagePullPolicy"]),
            "runtime": _s("string", "runtime says which command line the pods run: `Shoal` runs "
                          "`shoal serve`, `VLLM` runs stock `vllm serve` from `image` with the same vLLM "
                          "flag names, only those its release accepts (see `runtimeVersion`); frontends "
                          "keep running a Shoal image. Example: `VLLM`. Default: `Shoal`.",
                          enum=RUNTIMES, default=DEFAULTS["runtime"]),
            "runtimeVersion": _s("string", "runtimeVersion is the vLLM release that `image` runs when "
                                 "`runtime` is `VLLM`: the operator passes only the flags that release "
                                 "accepts (`--shutdown-timeout` from 0.18.0, multi-node flags from "
                                 "0.11.1). Example: `0.32.0`. Default: the image tag when it is a release "
                                 "(`vllm/vllm-openai:v0.32.0`); required otherwise (`latest`, a digest). "
                                 "Ignored when `runtime` is `Shoal`.", pattern=r"^v?[0-9]+\.[0-9]+"),
            "replicas": _s("integer", "replicas is the number of engine groups; each group is one "
                           "complete model instance (one EngineCore) made of `nodesPerGroup` pods. "
                           "Driven by the scale subresource (HPA/KEDA). Example: `3`. Default: `1`.",
                           minimum=0, maximum=1000, default=DEFAULTS["replicas"], format="int32"),
            "tensorParallelSize": _s("integer", "tensorParallelSize is the tensor-parallel degree of "
                                     "one group, over all its pods (vLLM's `--tensor-parallel-size`); it "
                                     "must be a multiple of `nodesPerGroup`. Example: `16` for two pods "
                                     "of eight GPUs. Default: `1`.", minimum=1, maximum=1024, default=DEFAULTS["tensorParallelSize"],
                                     format="int32"),
            "nodesPerGroup": _s("integer", "nodesPerGroup is the number of pods (ranks) per group: rank "
                                "0 runs the EngineCore and its local workers, ranks 1..N-1 run "
                                "`--headless` workers. Example: `2`. Default: `1`.", minimum=1,
                                maximum=64, default=DEFAULTS["nodesPerGroup"], format="int32"),
            "masterPort": _s("integer", "masterPort is the torch.distributed port on rank 0 that the "
                             "other ranks join (vLLM's `--master-port`). Example: `29500`. Default: "
                             "`29500`.", minimum=1024, maximum=65535, default=DEFAULTS["masterPort"], format="int32"),
            "frontend": _obj(
                "frontend configures the OpenAI-compatible HTTP frontends (a Deployment behind the "
                "ClusterIP Service on port 8000) that route requests to ready engine groups. "
                "Default: one frontend.",
                {
                    "replicas": _s("integer", "replicas is the number of frontend pods. Example: `2`. "
                                   "Default: `1`.", minimum=0, maximum=100, default=DEFAULTS["frontend.replicas"], format="int32"),
                    "image": _s("string", "image of the frontend pods (they run `shoal serve`). "
                                "Example: `ghcr.io/shoal-dev/shoal:0.1.0`. Default: `spec.image`, or "
                                "`" + str(DEFAULTS["image"]) + "` when `runtime` is `VLLM`."),
                    "routing": _s("string", "routing is how a frontend picks a group for a request: "
                                  "`least-outstanding` (fewest requests in flight) or `prefix-affinity` "
                                  "(requests sharing a prompt prefix go to the group that served it, "
                                  "so its prefix cache is reused, while its load stays within a bound). "
                                  "Example: `prefix-affinity`. Default: `least-outstanding`.",
                                  enum=list(ROUTINGS), default=DEFAULTS["frontend.routing"]),
                    "resources": _resources("frontend"),
                },
                default={},
            ),
            "engine": _obj(
                "engine configures the engine pods of every group.",
                {
                    "resources": _resources("engine"),
                    "extraArgs": _s("array", "extraArgs are appended to the engine command line "
                                    "after the operator's own flags. Example: `[--max-model-len, "
                                    "'8192']`. Default: none.", items={"type": "string", "description": "One command-line argument."}),
                    "env": _env(),
                    "startupTimeoutSeconds": _s("integer", "startupTimeoutSeconds is how long rank 0 "
                                                "may take to load weights and answer /health before "
                                                "the group counts as failed. Example: `1800`. Default: "
                                                "`1200`.", minimum=10, maximum=86400, default=DEFAULTS["engine.startupTimeoutSeconds"],
                                                format="int32"),
                },
                default={},
            ),
            "modelVolume": _obj(
                "modelVolume is the volume that holds the model, mounted read-only into every engine "
                "pod. Example: `{mountPath: /models, volume: {persistentVolumeClaim: {claimName: "
                "models}}}`. Default: none (the model is in the image or fetched by name).",
                {
                    "mountPath": _s("string", "mountPath is where the volume appears in the engine "
                                    "containers. Example: `/models`. Default: `/models`.",
                                    default=DEFAULTS["modelVolume.mountPath"], pattern="^/"),
                    "volume": _obj("volume is a Kubernetes volume source (any of `persistentVolumeClaim`, "
                                   "`hostPath`, `nfs`, `csi`, ...), as in a Pod's `volumes[]` without "
                                   "`name`. Example: `{persistentVolumeClaim: {claimName: models}}`.",
                                   {}, **{"x-kubernetes-preserve-unknown-fields": True}),
                },
                required=["volume"],
            ),
            "shutdown": _obj(
                "shutdown says how an engine group stops on scale-down, update and delete: rank 0 "
                "drains first while its headless ranks stay up, then they stop.",
                {
                    "timeoutSeconds": _s("integer", "timeoutSeconds is how long rank 0 may drain "
                                         "in-flight requests (passed as `--shutdown-timeout`; a "
                                         "stock vLLM before 0.18 has no such flag and aborts them "
                                         "at once on SIGTERM); `0` aborts them at once. terminationGracePeriodSeconds is this "
                                         "plus a margin. Example: `120`. Default: `30`.", minimum=0,
                                         maximum=86400, default=DEFAULTS["shutdown.timeoutSeconds"], format="int32"),
                },
                default={},
            ),
            "restartPolicy": _obj(
                "restartPolicy says what happens when any rank of a group dies: the whole group is "
                "recreated (a tensor-parallel group with a dead rank cannot continue), with "
                "exponential backoff per group; errors a restart cannot fix (bad configuration, "
                "missing model) are never retried.",
                {
                    "policy": _s("string", "policy: `RecreateGroupOnFailure` recreates every pod of "
                                 "the group, `Never` leaves a failed group down. Example: `Never`. "
                                 "Default: `RecreateGroupOnFailure`.", enum=RESTART_POLICIES,
                                 default=DEFAULTS["restartPolicy.policy"]),
                    "backoffBaseSeconds": _s("integer", "backoffBaseSeconds is the delay before the "
                                             "first restart; it doubles on every further restart. "
                                             "Example: `5`. Default: `10`.", minimum=0, maximum=3600,
                                             default=DEFAULTS["restartPolicy.backoffBaseSeconds"], format="int32"),
                    "backoffMaxSeconds": _s("integer", "backoffMaxSeconds caps the delay. Example: "
                                            "`600`. Default: `300`.", minimum=0, maximum=86400,
                                            default=DEFAULTS["restartPolicy.backoffMaxSeconds"], format="int32"),
                    "maxRestarts": _s("integer", "maxRestarts is how many consecutive restarts of one "
                                      "group are allowed before it is left Failed; `0` means no limit. "
                                      "Example: `5`. Default: `10`.", minimum=0, maximum=100000,
                                      default=DEFAULTS["restartPolicy.maxRestarts"], format="int32"),
                    "resetAfterSeconds": _s("integer", "resetAfterSeconds: a group that stayed Ready "
                                            "this long has its consecutive-restart count and backoff "
                                            "reset. Example: `3600`. Default: `600`.", minimum=0,
                                            maximum=604800, default=DEFAULTS["restartPolicy.resetAfterSeconds"], format="int32"),
                },
                default={},
            ),
        },
        required=["model"],
    )


def _condition() -> dict:
    return _obj(
        "One condition, in the Kubernetes API conventions.",
        {
            "type": _s("string", f"type of the condition: one of {', '.join(CONDITION_TYPES)}."),
            "status": _s("string", "status: `True`, `False` or `Unknown`.", enum=["True", "False", "Unknown"]),
            "reason": _s("string", "reason is a CamelCase word for machines. Example: `GroupRestarting`."),
            "message": _s("string", "message is for humans: what happened and what to do."),
            "lastTransitionTime": _s("string", "lastTransitionTime is when status last changed.", format="date-time"),
            "observedGeneration": _s("integer", "observedGeneration is the spec generation this condition describes.", format="int64"),
        },
        required=["type", "status"],
    )


def _failure() -> dict:
    return _obj(
        "lastFailure is the root cause of the most recent engine death: the rank that failed "
        "first, how its container ended and the engine's own message.",
        {
            "group": _s("integer", "group is the engine group index. Example: `1`.", format="int32"),
            "rank": _s("integer", "rank is the rank that failed first (the root cause; later ranks "
                       "fail as a consequence). Example: `0`.", format="int32"),
            "pod": _s("string", "pod is the failed pod's name. Example: `llm-g1-r0`."),
            "node": _s("string", "node is the node the pod ran on."),
            "exitCode": _s("integer", "exitCode of the engine container. Example: `1`.", format="int32"),
            "signal": _s("integer", "signal that killed the container, if any. Example: `9`.", format="int32"),
            "reason": _s("string", "reason as the kubelet reported it. Example: `OOMKilled`, `Error`, `Completed`."),
            "cause": _s("string", "cause is the class of the failure, from the engine's termination "
                        "message or the container state. Example: `out_of_memory`."),
            "permanent": _s("boolean", "permanent is true when a restart cannot fix the cause "
                            "(configuration error, missing model): the group is not restarted."),
            "message": _s("string", "message is the engine's own termination message (or the log tail)."),
            "time": _s("string", "time the container finished.", format="date-time"),
        },
    )


def status_schema() -> dict:
    rank = _obj(
        "One rank of a group: its pod and the node it runs on.",
        {
            "rank": _s("integer", "rank within the group; 0 runs the EngineCore.", format="int32"),
            "pod": _s("string", "pod is the rank's pod name. Example: `llm-g0-r1`."),
            "node": _s("string", "node the pod is scheduled on; empty while pending."),
            "phase": _s("string", "phase of the pod. Example: `Running`."),
            "ready": _s("boolean", "ready is the pod's Ready condition."),
        },
    )
    group = _obj(
        "The observed state of one engine group.",
        {
            "index": _s("integer", "index of the group. Example: `0`.", format="int32"),
            "phase": _s("string", f"phase of the group: one of {', '.join(GROUP_PHASES)}.", enum=GROUP_PHASES),
            "stage": _s("string", "stage is where a Starting or Ready group is in its start-up: one of "
                                  f"{', '.join(GROUP_STAGES)}. Absent in other phases.", enum=GROUP_STAGES),
            "revision": _s("string", "revision is the hash of the engine spec the group runs."),
            "restarts": _s("integer", "restarts is the number of consecutive restarts of this group.", format="int32"),
            "nextRestartTime": _s("string", "nextRestartTime is when a backing-off group is recreated.", format="date-time"),
            "readySince": _s("string", "readySince is when every rank of the group last became ready.", format="date-time"),
            "message": _s("string", "message explains the phase."),
            "failureKey": _s("string", "failureKey identifies the last death acted on (pod uid/time), so each is handled once."),
            "drainStartTime": _s("string", "drainStartTime is when rank 0 was asked to drain.", format="date-time"),
            "stopReason": _s("string", "stopReason says why the group is stopping: scale-down, update, delete."),
            "ranks": _s("array", "ranks lists every rank's pod and node.", items=rank),
        },
    )
    return _obj(
        "status is the observed state, written by the operator only.",
        {
            "observedGeneration": _s("integer", "observedGeneration is the spec generation the status describes.", format="int64"),
            "phase": _s("string", f"phase summarises the resource: one of {', '.join(PHASES)}.", enum=PHASES),
            "replicas": _s("integer", "replicas is the number of engine groups that exist (scale subresource).", format="int32"),
            "readyReplicas": _s("integer", "readyReplicas is the number of groups with every rank ready.", format="int32"),
            "updatedReplicas": _s("integer", "updatedReplicas is the number of groups at the current revision.", format="int32"),
            "ready": _s("string", "ready is `readyReplicas/spec.replicas`, for `kubectl get`. Example: `2/3`."),
            "selector": _s("string", "selector is the label selector of the engine pods (scale subresource)."),
            "endpoint": _s("string", "endpoint is the in-cluster OpenAI base URL. Example: `http://llm.default.svc:8000/v1`."),
            "restartCount": _s("integer", "restartCount is the total number of group restarts since creation.", format="int32"),
            "revision": _s("string", "revision is the hash of the current engine spec."),
            "conditions": _s("array", "conditions: Ready, Serving, Progressing, Degraded, EngineDead, SpecValid.",
                             items=_condition(), **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}),
            "groups": _s("array", "groups is the state of every engine group, rank by rank.", items=group),
            "lastFailure": _failure(),
        },
    )


def crd() -> dict:
    """The CustomResourceDefinition as plain data."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "shoal"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": "inferenceengine", "kind": KIND,
                      "listKind": f"{KIND}List", "shortNames": ["ie"], "categories": ["all", "shoal"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": _obj(
                    "InferenceEngine runs one model as a fleet of engine groups behind "
                    "OpenAI-compatible frontends, with per-rank failure reporting.",
                    {
                        "apiVersion": _s("string", "APIVersion of this object: `" + API_VERSION + "`."),
                        "kind": _s("string", "Kind of this object: `" + KIND + "`."),
                        "metadata": {"type": "object"},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    },
                    required=["spec"],
                )},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas",
                              "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": [
                    {"name": "Ready", "type": "string", "jsonPath": ".status.ready",
                     "description": "Ready engine groups / desired."},
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase",
                     "description": "Summary phase."},
                    {"name": "Model", "type": "string", "jsonPath": ".spec.model",
                     "description": "Model path or name."},
                    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint",
                     "description": "In-cluster OpenAI base URL."},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            }],
        },
    }


HEADER = ("# Generated by `python -m shoal.operator.crd --write` from operator/shoal/operator/crd.py.\n"
          "# Do not edit: change crd.py and regenerate (a test fails when this file is stale).\n")


def render_yaml() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shoal.operator.crd", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the generated files")
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale")
    args = parser.parse_args(argv)
    text = render_yaml()
    if args.write:
        for path in OUTPUTS:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO_ROOT)}")
        return 0
    if args.check:
        stale = [p for p in OUTPUTS if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"stale: {p.relative_to(REPO_ROOT)}; run python -m shoal.operator.crd --write", file=sys.stderr)
        return 1 if stale else 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
