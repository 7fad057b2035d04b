"""Cross-field checks the CRD schema cannot express on a 1.20 API server (no CEL rules).

A spec that fails here gets condition SpecValid=False with every problem listed, and the
operator creates nothing for it; existing children are left as they are.
"""

from __future__ import annotations

from shoal.operator import labels as L
from shoal.operator import model_source, template, vllm_version
from shoal.operator.render import frontend_operator_template, operator_pod
from shoal.operator.spec import EngineRef, EngineSpec

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
    problems += model_source.problems(spec.model)
    if spec.source.is_pvc and spec.model_volume is not None:
        problems.append("spec.modelVolume must not be set with a pvc:// model: the claim is "
                        "mounted as the model volume")
    return problems + template_problems(name, spec) + vllm_version.problems(spec)


def template_problems(name: str, spec: EngineSpec) -> list[str]:
    """Every field of the two pod templates that the operator owns or does not support."""
    ref = EngineRef(name=name, namespace="")
    engine = operator_pod(ref, spec, 0, 0)
    return (template.problems("spec.engine.template", spec.engine_template, engine,
                              L.ENGINE_CONTAINER, {})
            + template.problems("spec.frontend.template", spec.frontend_template,
                                frontend_operator_template(ref, spec), L.FRONTEND_CONTAINER,
                                template.FRONTEND_OWNED_POD))


def _volume_problems(volume: dict) -> list[str]:
    sources = [k for k in volume if k in VOLUME_SOURCES]
    out = []
    if len(sources) != 1:
        out.append("spec.modelVolume.volume must name exactly one volume source "
                   f"(e.g. persistentVolumeClaim, hostPath); found {sources or 'none'}")
    if "name" in volume:
        out.append("spec.modelVolume.volume must not set `name`: the operator names it `model`")
    return out
