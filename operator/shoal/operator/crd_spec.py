"""The InferenceEngine's `spec` schema. Descriptions follow LeaderWorkerSet's style: field name
first, what it means, an example, the default (from spec.DEFAULTS, the one place defaults are
defined). Enums come from the str enums the operator reads the fields as."""

from __future__ import annotations

from shoal.contract import model_fetch as mf
from shoal.contract.routing import ROUTINGS
from shoal.operator import labels as L
from shoal.operator.crd_template import template_schema
from shoal.operator.model_source import (
    MODEL_PATTERN,
    OCI_MODEL_DIR,
    OCI_MOUNT_DIR,
    PVC_MOUNT_DIR,
)
from shoal.operator.openapi import obj, opaque, typed, values
from shoal.operator.spec import DEFAULTS, AutoscaleMetric, RestartPolicyType, Runtime
from shoal.operator.template import FRONTEND_OWNED_POD

# Kubernetes' quantity without the minus sign: a pod refuses negative requests and limits, and
# the schema says so at apply (found by fuzzing: "-1" passed here and failed every pod).
QUANTITY_PATTERN = (r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
# The names the spec passes on, as what they name requires (1.20 and every later release): a
# Secret's or a claim's name (a DNS-1123 subdomain; a pod takes any claimName, and then waits
# for a claim that cannot exist) and a key in a Secret.
SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
CONFIG_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"


def _int(description: str, path: str, minimum: int, maximum: int) -> dict:
    return typed("integer", description, minimum=minimum, maximum=maximum,
                 default=DEFAULTS[path], format="int32")


def _resources(who: str) -> dict:
    # (`minimum` here, not in anyOf: there only the bare types keep the schema structural)
    quantity = {"x-kubernetes-int-or-string": True,
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                "pattern": QUANTITY_PATTERN, "minimum": 0}
    return obj(
        f"resources are the compute resources of each {who} container, as in a Pod's "
        "`resources`. Example: `{limits: {nvidia.com/gpu: 8}, requests: {cpu: 16, memory: "
        "64Gi}}`. Default: none (best effort).",
        {
            "limits": typed("object", "limits is the most the container may use. Example: "
                            "`{nvidia.com/gpu: 8}`.", additionalProperties=quantity),
            "requests": typed("object", "requests is what the scheduler reserves. Example: "
                              "`{cpu: 4, memory: 16Gi}`.", additionalProperties=quantity),
        },
    )


def _env() -> dict:
    variable = obj(
        "One environment variable.",
        {
            "name": typed("string", "name of the variable. Example: `NCCL_DEBUG`.", minLength=1),
            "value": typed("string", "value of the variable. Example: `INFO`."),
            "valueFrom": opaque("valueFrom takes the value from a Secret, ConfigMap or field, "
                                "as in a Pod."),
        },
        required=["name"],
    )
    return typed(
        "array",
        "env lists extra environment variables for every engine container, as in a Pod's `env` "
        "(`valueFrom` is passed through unchanged). Example: `[{name: NCCL_DEBUG, value: "
        "INFO}]`. Default: none.",
        items=variable,
    )


def _image_fields() -> dict:
    return {
        "image": typed("string", "image is the container image of the engine pods. Example: "
                       f"`{DEFAULTS['image']}`. Default: `{DEFAULTS['image']}`.",
                       default=DEFAULTS["image"], minLength=1),
        "imagePullPolicy": typed("string", "imagePullPolicy as in a Pod. Example: `Always`. "
                                 "Default: `IfNotPresent`.",
                                 enum=["Always", "IfNotPresent", "Never"],
                                 default=DEFAULTS["imagePullPolicy"]),
        "runtime": typed("string", "runtime says which command line the engine pods run: "
                         "`Shoal` runs `shoal serve`, `VLLM` runs stock `vllm serve` from "
                         "`image` with the same vLLM flag names, only those its release accepts "
                         "(see `runtimeVersion`); frontends run `frontend.image` either way. "
                         f"Example: `VLLM`. Default: `{DEFAULTS['runtime']}`.",
                         enum=values(Runtime), default=DEFAULTS["runtime"]),
        "runtimeVersion": typed("string", "runtimeVersion is the vLLM release that `image` runs "
                                "when `runtime` is `VLLM`: the operator passes only the flags "
                                "that release accepts (`--shutdown-timeout` from 0.18.0, "
                                "multi-node flags from 0.11.1). Example: `0.32.0`. Default: the "
                                "image tag when it is a release (`vllm/vllm-openai:v0.32.0`); "
                                "required otherwise (`latest`, a digest). Ignored when "
                                "`runtime` is `Shoal`.", pattern=r"^v?[0-9]+\.[0-9]+"),
    }


def _shape_fields() -> dict:
    return {
        "replicas": _int("replicas is the number of engine groups; each group is one complete "
                         "model instance (one EngineCore) made of `nodesPerGroup` pods. Driven "
                         "by the scale subresource (HPA/KEDA). With `autoscaling` set it is only "
                         "the count the operator's autoscaler starts from (clamped to its "
                         "bounds); afterwards it is ignored, `kubectl scale` included (the "
                         "`Autoscaling` condition says so). Example: `3`. Default: `1`.",
                         "replicas", 0, 1000),
        "tensorParallelSize": _int("tensorParallelSize is the tensor-parallel degree of one "
                                   "group, over all its pods (vLLM's `--tensor-parallel-size`); "
                                   "it must be a multiple of `nodesPerGroup`. Example: `16` for "
                                   "two pods of eight GPUs. Default: `1`.",
                                   "tensorParallelSize", 1, 1024),
        "nodesPerGroup": _int("nodesPerGroup is the number of pods (ranks) per group: rank 0 "
                              "runs the EngineCore and its local workers, ranks 1..N-1 run "
                              "`--headless` workers. Example: `2`. Default: `1`.",
                              "nodesPerGroup", 1, 64),
        "masterPort": _int("masterPort is the torch.distributed port on rank 0 that the other "
                           "ranks join (vLLM's `--master-port`). Example: `29500`. Default: "
                           f"`{DEFAULTS['masterPort']}`.", "masterPort", 1024, 65535),
    }


def _frontend() -> dict:
    image = DEFAULTS["frontend.image"]
    return obj(
        "frontend configures the OpenAI-compatible HTTP frontends (a Deployment behind the "
        "ClusterIP Service on port 8000) that route requests to ready engine groups. "
        "Default: one frontend.",
        {
            "replicas": _int("replicas is the number of frontend pods. Example: `2`. Default: "
                             "`1`.", "frontend.replicas", 0, 100),
            "image": typed("string", "image of the frontend pods (they run `shoal router`, "
                           f"whatever the `runtime`). Example: `{image}`. Default: `{image}`.",
                           default=image),
            "routing": typed("string", "routing is how a frontend picks a group for a request: "
                             "`least-outstanding` (fewest requests in flight), "
                             "`prefix-affinity` (requests sharing a prompt prefix go to the "
                             "group that served it, so its prefix cache is reused, while its "
                             "load stays within a bound) or `kv-aware` (by what each group's "
                             "KV cache holds, from the engines' KV events: rank 0 publishes "
                             "them on ports 5557 and 5558, and each frontend reads the model's "
                             "tokenizer, so the model must be hf://, oci://, pvc:// or on "
                             "`modelVolume`). Example: `kv-aware`. Default: "
                             f"`{DEFAULTS['frontend.routing']}`.",
                             enum=list(ROUTINGS), default=DEFAULTS["frontend.routing"]),
            "resources": _resources("frontend"),
            "template": template_schema("frontend", L.FRONTEND_CONTAINER, FRONTEND_OWNED_POD),
        },
        default={},
    )


def _engine() -> dict:
    return obj(
        "engine configures the engine pods of every group.",
        {
            "resources": _resources("engine"),
            "extraArgs": typed(
                "array",
                "extraArgs are appended to the engine command line after "
                "the operator's own flags. Example: `[--max-model-len, '8192']`. "
                "Default: none.",
                items={"type": "string", "description": "One command-line argument."},
            ),
            "env": _env(),
            "startupTimeoutSeconds": _int(
                "startupTimeoutSeconds is how long rank 0 may take to "
                "load weights and answer /health before the group "
                "counts as failed. Example: `1800`. Default: `1200`.",
                "engine.startupTimeoutSeconds",
                10,
                86400,
            ),
            "template": template_schema("engine", L.ENGINE_CONTAINER, {}),
        },
        default={},
    )


def _model_volume() -> dict:
    return obj(
        "modelVolume is the volume that holds the model, mounted read-only into every engine "
        "pod. Example: `{mountPath: /models, volume: {persistentVolumeClaim: {claimName: "
        "models}}}`. Default: none (the model is in the image or fetched by name).",
        {
            "mountPath": typed("string", "mountPath is where the volume appears in the engine "
                               "containers. Example: `/models`. Default: `/models`.",
                               default=DEFAULTS["modelVolume.mountPath"], pattern="^/"),
            "volume": opaque("volume is a Kubernetes volume source (any of "
                             "`persistentVolumeClaim`, `hostPath`, `nfs`, `csi`, ...), as in a "
                             "Pod's `volumes[]` without `name`. Example: "
                             "`{persistentVolumeClaim: {claimName: models}}`."),
        },
        required=["volume"],
    )


def _model_cache() -> dict:
    return obj(
        "modelCache is where an hf:// model is downloaded to and read from, mounted at "
        f"`{mf.CACHE_MOUNT}` (read-write in the `model-fetch` init container, read-only in the "
        "engine) and laid out as the Hugging Face cache (`hub/models--ORG--NAME`). Name one of "
        "`persistentVolumeClaim` (one cache every group shares: ReadWriteMany, or "
        "ReadWriteOnce with every engine pod on one node; N ranks of M groups download the "
        "model once, the others wait on its lock) or `hostPath` (a directory on each node: "
        "one download per node). The fetcher runs as UID 10001: the cache must be writable "
        "by it (`engine.template.spec.securityContext.fsGroup: 10001` for most claims; a "
        "hostPath directory owned by or writable for 10001). Only with an hf:// model. "
        "Example: `{persistentVolumeClaim: {claimName: model-cache}}`. Default: an emptyDir "
        "per pod (every pod downloads the model itself).",
        {
            "persistentVolumeClaim": obj(
                "persistentVolumeClaim: a claim in the InferenceEngine's namespace that every "
                "engine pod mounts. Example: `{claimName: model-cache}`.",
                {"claimName": typed("string", "claimName of the PersistentVolumeClaim. "
                                    "Example: `model-cache`.", minLength=1, maxLength=253,
                                    pattern=SUBDOMAIN_PATTERN)},
                required=["claimName"]),
            "hostPath": obj(
                "hostPath: a directory on every node (created if missing). Example: "
                "`{path: /var/cache/shoal-models}`.",
                {"path": typed("string", "path of the directory on the node. Example: "
                               "`/var/cache/shoal-models`.", pattern="^/")},
                required=["path"]),
        },
    )


def _model_auth() -> dict:
    return obj(
        "modelAuth names the Secret holding the hub token of an hf:// model (gated or private "
        f"repositories), passed to `model-fetch` as `{mf.TOKEN_ENV}`. A missing Secret keeps "
        "the pods waiting (the group's message names it); a token the hub refuses fails the "
        "group for good (`model_access_denied`, naming the repository). Only with an hf:// "
        "model. Example: `{secretName: hf-token}`. Default: none (public repositories).",
        {
            "secretName": typed("string", "secretName is the Secret, in the InferenceEngine's "
                                "namespace. Example: `hf-token`.", minLength=1, maxLength=253,
                                pattern=SUBDOMAIN_PATTERN),
            "key": typed("string", "key of the token in the Secret. Example: `token`. Default: "
                         f"`{DEFAULTS['modelAuth.key']}`.", default=DEFAULTS["modelAuth.key"],
                         minLength=1, maxLength=253, pattern=CONFIG_KEY_PATTERN),
        },
        required=["secretName"],
    )


def _shutdown() -> dict:
    return obj(
        "shutdown says how an engine group stops on scale-down, update and delete: rank 0 "
        "drains first while its headless ranks stay up, then they stop.",
        {
            "timeoutSeconds": _int("timeoutSeconds is how long rank 0 may drain in-flight "
                                   "requests (passed as `--shutdown-timeout`; a stock vLLM "
                                   "before 0.18 has no such flag and aborts them at once on "
                                   "SIGTERM); `0` aborts them at once. "
                                   "terminationGracePeriodSeconds is this plus a margin. "
                                   "Example: `120`. Default: `30`.",
                                   "shutdown.timeoutSeconds", 0, 86400),
        },
        default={},
    )


def _lora() -> dict:
    return obj(
        "lora makes the engines serve LoRA adapters: every rank gets vLLM's `--enable-lora` and "
        "the limits below, and rank 0 answers `/v1/load_lora_adapter` "
        "(`VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`). Adapters are InferenceAdapter objects that "
        "name this engine: the operator loads each on every group, on a new or restarted group "
        "before it counts as Ready. Adding, changing or removing this block rolls the groups. "
        "Example: `{maxLoras: 8, maxLoraRank: 64}`. Default: none (no adapters).",
        {
            "maxLoras": _int("maxLoras is how many adapters a batch may mix (their weights on "
                             "the device; idle ones are evicted least recently used), vLLM's "
                             "`--max-loras`. Example: `8`. Default: `1`.", "lora.maxLoras", 1,
                             256),
            "maxLoraRank": _int("maxLoraRank is the highest adapter rank the engines accept "
                                "(`--max-lora-rank`); an adapter above it fails to load, named "
                                "in its status. Example: `64`. Default: `16`.",
                                "lora.maxLoraRank", 1, 512),
            "maxCpuLoras": typed("integer", "maxCpuLoras is how many adapters are kept in host "
                                 "memory (`--max-cpu-loras`), at least `maxLoras`. Example: "
                                 "`32`. Default: vLLM's (`maxLoras`).", minimum=1,
                                 maximum=4096, format="int32"),
        },
    )


def _autoscaling() -> dict:
    m = AutoscaleMetric
    one_target = [{"required": [t.value]} for t in m]
    return obj(
        "autoscaling turns on the operator's own autoscaler (no Prometheus, adapter or KEDA): "
        "every 15 s it reads rank 0's /metrics of each Ready group and sets the group count "
        "to ceil(readyGroups * value / target) (HPA's rule, 10% tolerance), within "
        "[`minReplicas`, `maxReplicas`], after the stabilization windows below. Scale-down is "
        "the ordered drain of the highest groups. With `minReplicas: 0` an engine with no "
        "request for `scaleDownDelaySeconds` has no group left; the frontends and the "
        "gateway then hold a request for it (up to 120 s) and renew the Lease `NAME-wake`, "
        "which starts a group again. `spec.replicas` is then only the "
        "starting count; an HPA aimed at the resource is reported in the `Autoscaling` "
        "condition. Set exactly one target. Example: `{minReplicas: 0, maxReplicas: 4, "
        "requestsPerGroup: 8}`. Default: none (the count is `spec.replicas`).",
        {
            "minReplicas": _int("minReplicas is the fewest groups; `0` lets an idle engine go "
                                "to zero. Example: `0`. Default: `1`.",
                                "autoscaling.minReplicas", 0, 1000),
            "maxReplicas": typed("integer", "maxReplicas is the most groups; at least "
                                 "`minReplicas` (SpecValid names both otherwise). Required. "
                                 "Example: `4`.", minimum=1, maximum=1000, format="int32"),
            m.REQUESTS_PER_GROUP.value: typed(
                "number", "requestsPerGroup targets the requests running plus waiting per "
                "ready group (vLLM's `vllm:num_requests_running` + `vllm:num_requests_waiting`)."
                " Example: `8`. Default: none.", minimum=0, exclusiveMinimum=True),
            m.KV_CACHE_USAGE.value: typed(
                "number", "kvCacheUsage targets the mean KV-cache usage of the ready groups, "
                "0..1 (`vllm:kv_cache_usage_perc`). Example: `0.7`. Default: none.",
                minimum=0, exclusiveMinimum=True, maximum=1),
            m.TTFT_P90_SECONDS.value: typed(
                "number", "ttftP90Seconds targets the p90 time to first token, in seconds, of "
                "the requests of the last scrape interval over all ready groups (deltas of "
                "`vllm:time_to_first_token_seconds`). Example: `2`. Default: none.",
                minimum=0, exclusiveMinimum=True),
            "scaleUpStabilizationSeconds": _int(
                "scaleUpStabilizationSeconds: more groups only after the wanted count stayed "
                "above the current one this long (then the lowest wanted in that time); a "
                "spike shorter than this adds none. Example: `0`. Default: `30`.",
                "autoscaling.scaleUpStabilizationSeconds", 0, 3600),
            "scaleDownDelaySeconds": _int(
                "scaleDownDelaySeconds: fewer groups only after the wanted count stayed below "
                "the current one this long (then the highest wanted in that time); zero groups "
                "only after this long with no request at all. Example: `600`. Default: `300`.",
                "autoscaling.scaleDownDelaySeconds", 0, 86400),
        },
        required=["maxReplicas"],
        oneOf=one_target,
    )


def _restart_policy() -> dict:
    recreate, never = RestartPolicyType.RECREATE_GROUP_ON_FAILURE, RestartPolicyType.NEVER
    return obj(
        "restartPolicy says what happens when any rank of a group dies: the whole group is "
        "recreated (a tensor-parallel group with a dead rank cannot continue), with "
        "exponential backoff per group; errors a restart cannot fix (bad configuration, "
        "missing model) are never retried.",
        {
            "policy": typed("string", f"policy: `{recreate}` recreates every pod of the group, "
                            f"`{never}` leaves a failed group down. Example: `{never}`. "
                            f"Default: `{DEFAULTS['restartPolicy.policy']}`.",
                            enum=values(RestartPolicyType),
                            default=DEFAULTS["restartPolicy.policy"]),
            "backoffBaseSeconds": _int("backoffBaseSeconds is the delay before the first "
                                       "restart; it doubles on every further restart. Example: "
                                       "`5`. Default: `10`.",
                                       "restartPolicy.backoffBaseSeconds", 0, 3600),
            "backoffMaxSeconds": _int("backoffMaxSeconds caps the delay. Example: `600`. "
                                      "Default: `300`.", "restartPolicy.backoffMaxSeconds",
                                      0, 86400),
            "maxRestarts": _int("maxRestarts is how many consecutive restarts of one group are "
                                "allowed before it is left Failed; `0` means no limit. Example: "
                                "`5`. Default: `10`.", "restartPolicy.maxRestarts", 0, 100000),
            "resetAfterSeconds": _int("resetAfterSeconds: a group that stayed Ready this long "
                                      "has its consecutive-restart count and backoff reset. "
                                      "Example: `3600`. Default: `600`.",
                                      "restartPolicy.resetAfterSeconds", 0, 604800),
            "nodeLostSeconds": _int(
                "nodeLostSeconds: when the node of any rank has been NotReady or Unknown this "
                "long (counted from its Ready condition's last transition), the group is dead "
                "with cause `node_lost` naming the node and rank: the rank pods on that node are "
                "removed at once (grace 0: the node cannot confirm a stop, and an engine holds no "
                "durable state) and the group is recreated on other nodes with the usual backoff. "
                "Frontend pods tolerate such a node for the same time before Kubernetes evicts "
                "and replaces them. Without it, Kubernetes evicts after 5 minutes and the pods "
                "then stay Terminating until the node returns. Example: `60`. Default: `30`.",
                "restartPolicy.nodeLostSeconds", 0, 3600),
        },
        default={},
    )


def spec_schema() -> dict:
    fields = {
        "model": typed("string", "model is the model to serve, one of: a directory inside the "
                       "engine container (usually under `modelVolume.mountPath`) or a model "
                       "name the image can resolve; `pvc://CLAIM/PATH`: the "
                       f"PersistentVolumeClaim CLAIM mounted read-only at `{PVC_MOUNT_DIR}` in "
                       f"every engine pod and the engine started on `{PVC_MOUNT_DIR}/PATH`; "
                       "`hf://ORG/NAME[@REVISION]`: downloaded from the Hugging Face hub (or "
                       "`hfEndpoint`) by the init container `model-fetch` into `modelCache` "
                       "(only the files an engine needs; revision default `main`) and served "
                       "offline from there; `oci://REGISTRY/REPO[:TAG|@DIGEST]`: an image "
                       f"holding the model directory at `{OCI_MODEL_DIR}` (with a `cp`, as "
                       "KServe's modelcars), copied into the pod by an init container, or "
                       "mounted as an image volume where the API server enables them by "
                       f"default (1.35+), at `{OCI_MOUNT_DIR}`. `modelVolume` is for the first "
                       "form only. Any other `scheme://` or a malformed reference is refused at "
                       "apply. Required. Example: `hf://Qwen/Qwen2.5-7B-Instruct@main`.",
                       minLength=1, pattern=MODEL_PATTERN),
        "servedModelName": typed("string", "servedModelName is the name clients put in the "
                                 "OpenAI `model` field. Example: `llama-3-8b`. Default: the "
                                 "repo id `ORG/NAME` for an hf:// model, else the value of "
                                 "`model`."),
        **_image_fields(),
        **_shape_fields(),
        "frontend": _frontend(),
        "engine": _engine(),
        "modelVolume": _model_volume(),
        "modelCache": _model_cache(),
        "modelAuth": _model_auth(),
        "hfEndpoint": typed("string", "hfEndpoint is the hub the `model-fetch` init container "
                            f"downloads an hf:// model from (`{mf.ENDPOINT_ENV}`): a mirror or "
                            "a proxy such as a self-hosted hub. Only with an hf:// model. "
                            "Example: `https://hf-mirror.internal`. Default: the Hugging Face "
                            "hub.", pattern="^https?://"),
        "shutdown": _shutdown(),
        "restartPolicy": _restart_policy(),
        "autoscaling": _autoscaling(),
        "lora": _lora(),
    }
    return obj("spec is the desired state: which model to serve, how many engine groups, how "
               "each group is split over ranks, and how engines stop and restart.",
               fields, required=["model"])
