"""What a pass parses once from an InferenceEngine body: its identity (`EngineRef`) and its spec
as one typed, frozen object (`EngineSpec`). Render, plan and status take these two, never the
body, so a pass reads the body exactly once (`parse`).

Every default is defined here once: crd.py writes the same values into the schema (so the API
server fills them in), and the operator falls back on them for a body the API server did not
default (an object from before a field existed, a test's plain dict).

Pass-through parts (resources, env, extraArgs, the model volume source, the pod templates) are
kept as the body has them: the operator copies them into pods without reading them (a template
is merged by template.py and checked by validation.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from shoal.operator import labels as L
from shoal.operator import model_source
from shoal.operator.model_source import ModelSource
from shoal.operator.phases import WireEnum
from shoal.operator.settings import OperatorSettings

# The images of a release: the engine (the Dockerfile's `engine` target) and the slim router
# that runs the frontends (`router` target: `shoal router`, no torch). One registry and version.
IMAGE_REGISTRY = "ghcr.io/shoal-dev"
RELEASE = "0.1.0"
ENGINE_IMAGE = f"{IMAGE_REGISTRY}/shoal:{RELEASE}"
ROUTER_IMAGE = f"{IMAGE_REGISTRY}/shoal-router:{RELEASE}"


class Runtime(WireEnum):
    """spec.runtime: which command line the engine pods run."""

    SHOAL = "Shoal"  # `shoal serve` from a Shoal image (its entrypoint)
    VLLM = "VLLM"  # stock `vllm serve`, only the flags its release accepts (vllm_version.py)


class RestartPolicyType(WireEnum):
    """spec.restartPolicy.policy: what a group does when one of its ranks dies."""

    RECREATE_GROUP_ON_FAILURE = "RecreateGroupOnFailure"  # every rank recreated, with backoff
    NEVER = "Never"  # the group stays Failed


# Dotted path under `spec` -> default. The CRD schema's `default:` values come from here.
DEFAULTS: dict[str, object] = {
    "image": ENGINE_IMAGE,
    "imagePullPolicy": "IfNotPresent",
    "runtime": Runtime.SHOAL.value,
    "replicas": 1,
    "tensorParallelSize": 1,
    "nodesPerGroup": 1,
    "masterPort": L.DEFAULT_MASTER_PORT,
    "frontend.replicas": 1,
    "frontend.image": ROUTER_IMAGE,
    "frontend.routing": "least-outstanding",
    "engine.startupTimeoutSeconds": 1200,
    "modelVolume.mountPath": "/models",
    "shutdown.timeoutSeconds": 30,
    "restartPolicy.policy": RestartPolicyType.RECREATE_GROUP_ON_FAILURE.value,
    "restartPolicy.backoffBaseSeconds": 10,
    "restartPolicy.backoffMaxSeconds": 300,
    "restartPolicy.maxRestarts": 10,
    "restartPolicy.resetAfterSeconds": 600,
    "restartPolicy.nodeLostSeconds": 30,
    "modelAuth.key": "HF_TOKEN",
    "autoscaling.minReplicas": 1,
    "lora.maxLoras": 1,  # vLLM's defaults
    "lora.maxLoraRank": 16,
    "autoscaling.scaleUpStabilizationSeconds": 30,
    "autoscaling.scaleDownDelaySeconds": 300,
}

# The fields that shape an engine pod: a change rolls the groups one by one. Replicas,
# frontends and the restart policy are left out: changing them restarts nothing.
REVISION_FIELDS = ("model", "servedModelName", "image", "imagePullPolicy", "runtime",
                   "tensorParallelSize", "nodesPerGroup", "masterPort", "engine", "modelVolume",
                   "shutdown")
# Added later: they count only when set, so that adding them rolled no existing group.
OPTIONAL_REVISION_FIELDS = ("runtimeVersion", "modelCache", "modelAuth", "hfEndpoint")
# Added later too, and counted whenever present: an empty block already changes the pods
# (`lora: {}` turns LoRA on with vLLM's defaults).
PRESENT_REVISION_FIELDS = ("lora",)


def content_hash(obj) -> str:
    """A short, stable hash of JSON-able data (the revision, a rendered child's spec)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def engine_revision(spec: dict) -> str:
    """Hash of the REVISION_FIELDS of a body's spec, of the OPTIONAL_REVISION_FIELDS that are
    set and of the PRESENT_REVISION_FIELDS that are there."""
    shaped = {k: spec.get(k) for k in REVISION_FIELDS}
    shaped.update({k: spec[k] for k in OPTIONAL_REVISION_FIELDS if spec.get(k)})
    shaped.update({k: spec[k] for k in PRESENT_REVISION_FIELDS if spec.get(k) is not None})
    return content_hash(shaped)


def _get(spec: dict, path: str):
    node = spec
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.get(key) or {}
    value = node.get(leaf)
    return DEFAULTS[path] if value is None else value


@dataclass(frozen=True)
class EngineRef:
    """Which InferenceEngine: what every child's metadata, owner reference and Event names."""

    name: str
    namespace: str
    uid: str | None = None
    api_version: str = L.API_VERSION
    kind: str = L.KIND

    @classmethod
    def of(cls, body: dict) -> EngineRef:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid"),
                   api_version=body.get("apiVersion") or L.API_VERSION,
                   kind=body.get("kind") or L.KIND)

    def owner_reference(self) -> dict:
        return {"apiVersion": self.api_version, "kind": self.kind, "name": self.name,
                "uid": self.uid, "controller": True, "blockOwnerDeletion": True}

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class RestartPolicy:
    policy: RestartPolicyType
    backoff_base_seconds: int
    backoff_max_seconds: int
    max_restarts: int  # 0 = no limit
    reset_after_seconds: int
    # how long a rank's node may be NotReady/Unknown before its group is dead (node_loss.py)
    node_lost_seconds: int = 30

    @property
    def never(self) -> bool:
        return self.policy is RestartPolicyType.NEVER


class AutoscaleMetric(WireEnum):
    """spec.autoscaling's target: which engine metric the group count follows."""

    REQUESTS_PER_GROUP = "requestsPerGroup"  # running + waiting, per ready group
    KV_CACHE_USAGE = "kvCacheUsage"  # vllm:kv_cache_usage_perc, averaged over ready groups
    TTFT_P90_SECONDS = "ttftP90Seconds"  # p90 of vllm:time_to_first_token_seconds, per scrape


@dataclass(frozen=True)
class AutoscalingSpec:
    """spec.autoscaling: the operator's own autoscaler (autoscale.py) decides the group count."""

    min_replicas: int  # 0 = scale to zero when idle
    max_replicas: int
    metric: AutoscaleMetric
    target: float
    scale_up_stabilization_seconds: int
    scale_down_delay_seconds: int
    targets_given: tuple[str, ...] = ()  # every target field set (validation wants exactly one)

    @classmethod
    def of(cls, spec: dict) -> AutoscalingSpec | None:
        a = spec.get("autoscaling")
        if a is None:
            return None
        given = tuple(m.value for m in AutoscaleMetric if a.get(m.value) is not None)
        metric = AutoscaleMetric(given[0]) if given else AutoscaleMetric.REQUESTS_PER_GROUP
        return cls(
            min_replicas=int(_get(spec, "autoscaling.minReplicas")),
            max_replicas=int(a.get("maxReplicas") or 0),
            metric=metric,
            target=float(a.get(metric.value) or 0),
            scale_up_stabilization_seconds=int(_get(spec,
                                                    "autoscaling.scaleUpStabilizationSeconds")),
            scale_down_delay_seconds=int(_get(spec, "autoscaling.scaleDownDelaySeconds")),
            targets_given=given,
        )


@dataclass(frozen=True)
class LoRASpec:
    """spec.lora: the engines serve LoRA adapters (vLLM's flags), loaded at runtime from the
    InferenceAdapters that name the engine (adapter_sync.py)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None

    @classmethod
    def of(cls, spec: dict) -> LoRASpec | None:
        lora = spec.get("lora")
        if lora is None:
            return None
        cpu = lora.get("maxCpuLoras")
        return cls(max_loras=int(_get(spec, "lora.maxLoras")),
                   max_lora_rank=int(_get(spec, "lora.maxLoraRank")),
                   max_cpu_loras=None if cpu is None else int(cpu))

    def args(self) -> list[str]:
        out = ["--enable-lora", "--max-loras", str(self.max_loras),
               "--max-lora-rank", str(self.max_lora_rank)]
        return out + ([] if self.max_cpu_loras is None
                      else ["--max-cpu-loras", str(self.max_cpu_loras)])


@dataclass(frozen=True)
class EngineSpec:
    model: str
    source: ModelSource  # what `model` names: a path or name, or a pvc:// claim
    served_model_name: str
    image: str
    image_pull_policy: str
    runtime: Runtime
    runtime_version: str  # "" = unset (a VLLM group then reads its release from the image tag)
    replicas: int
    tensor_parallel_size: int
    nodes_per_group: int
    master_port: int
    frontend_replicas: int
    frontend_image: str
    frontend_routing: str  # least-outstanding | prefix-affinity
    frontend_resources: dict | None  # pass-through
    frontend_template: dict | None  # pass-through: spec.frontend.template
    startup_timeout_seconds: int
    extra_args: tuple[str, ...]  # pass-through, after the operator's own flags
    engine_env: tuple[dict, ...]  # pass-through
    engine_resources: dict | None  # pass-through
    engine_template: dict | None  # pass-through: spec.engine.template
    model_volume: dict | None  # spec.modelVolume as given (validation reads its keys)
    model_mount_path: str
    model_cache: dict | None  # spec.modelCache as given (hf://: where fetched models are kept)
    model_auth: dict | None  # spec.modelAuth as given (hf://: the token Secret)
    hf_endpoint: str  # "" = the hub's default
    shutdown_timeout_seconds: int  # 0 = abort at once
    restart: RestartPolicy
    revision: str  # engine_revision() of the body's spec
    settings: OperatorSettings = OperatorSettings()  # the operator's own, not the body's
    autoscaling: AutoscalingSpec | None = None  # set: the autoscaler decides the group count
    lora: LoRASpec | None = None  # set: adapters are served (InferenceAdapter)

    @property
    def wakeable(self) -> bool:
        """Scaled to zero on purpose when idle: the routers hold a request and renew the wake
        Lease (render.wake_lease) instead of failing it."""
        return self.autoscaling is not None and self.autoscaling.min_replicas == 0

    @property
    def token_key(self) -> str:
        return str((self.model_auth or {}).get("key") or DEFAULTS["modelAuth.key"])

    @classmethod
    def of(cls, body: dict, settings: OperatorSettings | None = None) -> EngineSpec:
        spec = body.get("spec") or {}
        frontend, engine = spec.get("frontend") or {}, spec.get("engine") or {}
        source = model_source.parse(str(spec.get("model") or ""))
        return cls(
            model=str(spec.get("model") or ""),
            source=source,
            served_model_name=str(spec.get("servedModelName")
                                  or (source.arg if source.is_hf else spec.get("model")) or ""),
            image=str(_get(spec, "image")),
            image_pull_policy=str(_get(spec, "imagePullPolicy")),
            runtime=Runtime(_get(spec, "runtime")),
            runtime_version=str(spec.get("runtimeVersion") or ""),
            replicas=int(_get(spec, "replicas")),
            tensor_parallel_size=int(_get(spec, "tensorParallelSize")),
            nodes_per_group=int(_get(spec, "nodesPerGroup")),
            master_port=int(_get(spec, "masterPort")),
            frontend_replicas=int(_get(spec, "frontend.replicas")),
            frontend_image=str(_get(spec, "frontend.image")),
            frontend_routing=str(_get(spec, "frontend.routing")),
            frontend_resources=frontend.get("resources") or None,
            frontend_template=frontend.get("template") or None,
            startup_timeout_seconds=int(_get(spec, "engine.startupTimeoutSeconds")),
            extra_args=tuple(str(a) for a in engine.get("extraArgs") or ()),
            engine_env=tuple(engine.get("env") or ()),
            engine_resources=engine.get("resources") or None,
            engine_template=engine.get("template") or None,
            model_volume=spec.get("modelVolume"),
            model_mount_path=str(_get(spec, "modelVolume.mountPath")),
            model_cache=spec.get("modelCache"),
            model_auth=spec.get("modelAuth"),
            hf_endpoint=str(spec.get("hfEndpoint") or ""),
            shutdown_timeout_seconds=int(_get(spec, "shutdown.timeoutSeconds")),
            restart=RestartPolicy(
                policy=RestartPolicyType(_get(spec, "restartPolicy.policy")),
                backoff_base_seconds=int(_get(spec, "restartPolicy.backoffBaseSeconds")),
                backoff_max_seconds=int(_get(spec, "restartPolicy.backoffMaxSeconds")),
                max_restarts=int(_get(spec, "restartPolicy.maxRestarts")),
                reset_after_seconds=int(_get(spec, "restartPolicy.resetAfterSeconds")),
                node_lost_seconds=int(_get(spec, "restartPolicy.nodeLostSeconds")),
            ),
            revision=engine_revision(spec),
            settings=settings or OperatorSettings(),
            autoscaling=AutoscalingSpec.of(spec),
            lora=LoRASpec.of(spec),
        )


def parse(body: dict, settings: OperatorSettings | None = None) -> tuple[EngineRef, EngineSpec]:
    """The body's identity and typed spec: what a pass (or a test) hands to render and plan."""
    return EngineRef.of(body), EngineSpec.of(body, settings or OperatorSettings())
