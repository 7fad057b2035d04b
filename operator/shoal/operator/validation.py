"""Cross-field checks the CRD schema cannot express on a 1.20 API server (no CEL rules).

A spec that fails here gets condition SpecValid=False with every problem listed, and the
operator creates nothing for it; existing children are left as they are.
"""

from __future__ import annotations

from shoal.operator import labels as L
from shoal.operator import vllm_version
from shoal.operator.spec import EngineSpec

VOLUME_SOURCES = {
    "persistentVolumeClaim", "hostPath", "nfs", "csi", "emptyDir", "configMap", "secret",
    "ephemeral", "image", "iscsi", "cephfs", "rbd", "glusterfs", "projected", "awsElasticBlockStore",
    "gcePersistentDisk", "azureDisk", "azureFile", "fc", "flexVolume", "downwardAPI",
}


def spec_problems(name: str, spec: dict) -> list[str]:
    """Every reason the spec cannot be reconciled, each saying what to fix; [] when valid."""
    problems = []
    if len(name) > L.MAX_NAME_LENGTH:
        problems.append(f"metadata.name is {len(name)} characters; at most {L.MAX_NAME_LENGTH} are "
                        "allowed, because pod names NAME-gG-rR become DNS hostnames (63 characters)")
    es = EngineSpec.of({"spec": spec})
    tp, nodes = es.tensor_parallel_size, es.nodes_per_group
    if tp % nodes:
        problems.append(f"spec.tensorParallelSize ({tp}) must be a multiple of spec.nodesPerGroup "
                        f"({nodes}): every pod of a group holds the same number of TP ranks")
    base, cap = es.restart.backoff_base_seconds, es.restart.backoff_max_seconds
    if cap < base:
        problems.append(f"spec.restartPolicy.backoffMaxSeconds ({cap}) must be >= backoffBaseSeconds ({base})")
    mv = spec.get("modelVolume")
    if mv is not None:
        sources = [k for k in (mv.get("volume") or {}) if k in VOLUME_SOURCES]
        others = [k for k in (mv.get("volume") or {}) if k not in VOLUME_SOURCES]
        if len(sources) != 1:
            problems.append("spec.modelVolume.volume must name exactly one volume source "
                            f"(e.g. persistentVolumeClaim, hostPath); found {sources or 'none'}")
        if "name" in others:
            problems.append("spec.modelVolume.volume must not set `name`: the operator names it `model`")
    return problems + vllm_version.problems(es)
