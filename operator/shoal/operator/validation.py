"""Cross-field checks the CRD schema cannot express on a 1.20 API server (no CEL rules).

A spec that fails here gets condition SpecValid=False with every problem listed, and the
operator creates nothing for it; existing children are left as they are.
"""

from __future__ import annotations

from shoal.operator import (
    kv_parts,
    model_source,
    model_volumes,
    supervisor_parts,
    template,
    vllm_version,
)
from shoal.operator import labels as L
from shoal.operator.render import frontend_operator_template, operator_pod
from shoal.operator.spec import EngineRef, EngineSpec, Runtime

VOLUME_SOURCES = {
    "persistentVolumeClaim",
    "hostPath",
    "nfs",
    "csi",
    "emptyDir",
    "configMap",
    "secret",
    "ephemeral",
    "image",
    "iscsi",
    "cephfs",
    "rbd",
    "glusterfs",
    "projected",
    "awsElasticBlockStore",
    "gcePersistentDisk",
    "azureDisk",
    "azureFile",
    "fc",
    "flexVolume",
    "downwardAPI",
}


def spec_problems(name: str, spec: EngineSpec) -> list[str]:
    """Every reason the spec cannot be reconciled, each saying what to fix; [] when valid."""
    problems = []
    if len(name) > L.MAX_NAME_LENGTH:
        problems.append(f"metadata.name is {len(name)} characters; at most {L.MAX_NAME_LENGTH} "
                        "are allowed, because pod names NAME-gG-rR become DNS hostnames "
                        "(63 characters)")
    tp, nodes = spec.tensor_parallel_size, spec.nodes_per_group
    if tp % nodes:
        problems.append(f"spec.tensorParallelSize ({tp}) must be a multiple of "
                        f"spec.nodesPerGroup ({nodes}): every pod of a group holds the same "
                        "number of TP ranks")
    base, cap = spec.restart.backoff_base_seconds, spec.restart.backoff_max_seconds
    if cap < base:
        problems.append(f"spec.restartPolicy.backoffMaxSeconds ({cap}) must be >= "
                        f"backoffBaseSeconds ({base})")
    if spec.model_volume is not None:
        problems += _volume_problems(spec.model_volume.get("volume") or {})
    problems += model_source.problems(spec.model) + source_problems(spec)
    problems += kv_parts.problems(spec) + autoscaling_problems(spec) + lora_problems(spec)
    return problems + template_problems(name, spec) + vllm_version.problems(spec)


LORA_FLAGS = ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras",
              "--lora-modules")


def lora_problems(spec: EngineSpec) -> list[str]:
    """vLLM's own rule (max_cpu_loras >= max_loras), and one place for the LoRA flags: with
    spec.lora, the same flags in extraArgs would be given twice."""
    out = []
    lora = spec.lora
    if lora is not None and lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
        out.append(f"spec.lora.maxCpuLoras ({lora.max_cpu_loras}) must be >= maxLoras "
                   f"({lora.max_loras}), as vLLM requires")
    if lora is not None and spec.tensor_parallel_size > 1 and spec.runtime == Runtime.SHOAL:
        out.append(f"spec.lora with spec.tensorParallelSize {spec.tensor_parallel_size}: the "
                   "Shoal engine serves adapters without tensor parallelism only (A and B are "
                   "not sharded; its --enable-lora exits 2 there); use tensorParallelSize 1, or "
                   "runtime: VLLM")
    given = sorted({a.split("=", 1)[0] for a in spec.extra_args} & set(LORA_FLAGS[:4]))
    if lora is not None and given:
        out.append(f"spec.engine.extraArgs sets {', '.join(given)}: with spec.lora the operator "
                   "sets them; set spec.lora's fields instead")
    return out


def autoscaling_problems(spec: EngineSpec) -> list[str]:
    """What the schema cannot say about spec.autoscaling on a 1.20 server (no CEL): min <= max.
    Exactly one target is the schema's oneOf; checked here too for a body it did not see."""
    a = spec.autoscaling
    if a is None:
        return []
    out = []
    if a.max_replicas < max(a.min_replicas, 1):
        out.append(f"spec.autoscaling.maxReplicas ({a.max_replicas}) must be >= "
                   f"spec.autoscaling.minReplicas ({a.min_replicas}) and >= 1")
    if len(a.targets_given) != 1:
        out.append("spec.autoscaling must set exactly one target of requestsPerGroup, "
                   f"kvCacheUsage, ttftP90Seconds; found {list(a.targets_given) or 'none'}")
    elif a.target <= 0:
        out.append(f"spec.autoscaling.{a.metric} must be > 0 (is {a.target:g})")
    return out


# Fields that only an hf:// model uses, and what they are for.
HF_ONLY = {"modelCache": "model_cache", "modelAuth": "model_auth", "hfEndpoint": "hf_endpoint"}
CACHE_SOURCES = ("persistentVolumeClaim", "hostPath")


def source_problems(spec: EngineSpec) -> list[str]:
    """The model source's fields agree with spec.model: each is refused, named, where the source
    would not use it."""
    source, out = spec.source, []
    if source.fetched and spec.model_volume is not None:
        out.append(f"spec.modelVolume must not be set with a {source.scheme}:// model: the "
                   "operator mounts the model's volume itself")
    if not source.is_hf:
        out += [f"spec.{name} is used only with an hf:// model (spec.model is {spec.model!r})"
                for name, attr in HF_ONLY.items() if getattr(spec, attr) not in (None, "")]
        return out
    cache = spec.model_cache or {}
    given = [k for k in cache if k in CACHE_SOURCES]
    if spec.model_cache is not None and len(given) != 1:
        out.append("spec.modelCache must name exactly one of persistentVolumeClaim.claimName "
                   f"or hostPath.path; found {given or 'none'}")
    for k in given:
        leaf = "claimName" if k == "persistentVolumeClaim" else "path"
        if not (cache.get(k) or {}).get(leaf):
            out.append(f"spec.modelCache.{k}.{leaf} is required")
    if spec.model_auth is not None and not spec.model_auth.get("secretName"):
        out.append("spec.modelAuth.secretName is required: the Secret that holds the hub token")
    return out


def template_problems(name: str, spec: EngineSpec) -> list[str]:
    """Every field of the two pod templates that the operator owns or does not support."""
    ref = EngineRef(name=name, namespace="")
    engine = operator_pod(ref, spec, 0, 0)
    owned_inits = {**model_volumes.OWNED_INIT_CONTAINERS,
                   **supervisor_parts.OWNED_INIT_CONTAINERS}
    return (template.problems("spec.engine.template", spec.engine_template, engine,
                              L.ENGINE_CONTAINER, {}, owned_inits)
            + template.problems("spec.frontend.template", spec.frontend_template,
                                frontend_operator_template(ref, spec), L.FRONTEND_CONTAINER,
                                template.FRONTEND_OWNED_POD, model_volumes.OWNED_INIT_CONTAINERS))


def _volume_problems(volume: dict) -> list[str]:
    sources = [k for k in volume if k in VOLUME_SOURCES]
    out = []
    if len(sources) != 1:
        out.append("spec.modelVolume.volume must name exactly one volume source "
                   f"(e.g. persistentVolumeClaim, hostPath); found {sources or 'none'}")
    if "name" in volume:
        out.append("spec.modelVolume.volume must not set `name`: the operator names it `model`")
    return out
